"""Chain verification (``rejection_sample``): time and GB/s per provider.

Drafts come from a draft distribution close to the target (softmax of the target logits
plus noise), so chains are accepted part of the way, as in real use. GB/s counts the
target logits (and the draft probabilities, when given) read once:
``B * (K+1) * V * bytes``. The kernels stop at the first rejection, so GB/s is a
normalised rate, not memory traffic.

Modes: ``greedy`` (temperature 0), ``probs`` (draft probabilities, temperature 1),
``onehot`` (no draft probabilities, temperature 1) and ``warped`` (draft probabilities,
temperature 0.8, top-k 50, top-p 0.9). Providers: ``reference`` and ``cpp`` on CPU
(float32; ``cpp`` takes the split-vocabulary path where it applies, ``cpp-onerow`` the
one-row path: ``OSD_SAMPLER_SPLIT=0``); ``triton``, ``cuda`` (the one-block-per-sequence
kernel, CUDA's default until the split kernels have run on a GPU) and ``cuda-split``
(``OSD_SAMPLER_SPLIT=1``) on GPU (bfloat16 logits), skipped without one; ``flashinfer`` on
GPU (``bench.flashinfer_providers``: FlashInfer's softmax, top-k / top-p renorm and
``chain_speculative_sampling``). Every provider's output is checked to equal the reference
before it is timed (FlashInfer's sampled output for its form only: its random stream is
not our Philox stream).

Default sweep: B in {1, 8}, K = 5, V = 32000. ``OSD_BENCH_FULL=1``: B in {1, 8, 64},
K in {4, 5, 8}, V in {32000, 128256}. ``OSD_BENCH_THREADS`` sets torch's CPU thread count
(default 1: the benchmark machine's 2 cores are shared, and spinning intra-op threads make
both providers erratic).

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_rejection_sample.py
"""

import pytest
import torch

from bench.common import (
    BACKENDS,
    FULL,
    THREADS,
    assert_same,
    gbps,
    provider_device,
    tensor_bytes,
    to_device,
)
from bench.flashinfer_providers import (
    assert_chain_output,
    flashinfer_device,
    flashinfer_rejection_sample,
)
from osd_kernels import rejection_sample, rejection_sample_reference

BATCHES = (1, 8, 64) if FULL else (1, 8)
DRAFTS = (4, 5, 8) if FULL else (5,)
VOCABS = (32000, 128256) if FULL else (32000,)
MODES = ("greedy", "probs", "onehot", "warped")
PROVIDERS = ("reference", "cpp", "cpp-onerow", "triton", "cuda", "cuda-split", "flashinfer")
# providers that are another's kernel with the split-vocabulary path switched on or off
SPLIT_SWITCH = {"cpp-onerow": ("cpp", "0"), "cuda-split": ("cuda", "1")}
SAMPLING = {
    "greedy": dict(),
    "probs": dict(temperature=1.0),
    "onehot": dict(temperature=1.0),
    "warped": dict(temperature=0.8, top_k=50, top_p=0.9),
}

pytestmark = pytest.mark.usefixtures("torch_threads")


def _chain(B: int, K: int, V: int, mode: str, dtype: torch.dtype, device: str):
    """Logits, drafted tokens, draft probs and sampling kwargs of one benchmark case."""
    gen = torch.Generator().manual_seed(B * 100 + K * 10 + V)
    logits = torch.randn(B, K + 1, V, generator=gen) * 4
    q = torch.softmax(logits[:, :K] + torch.randn(B, K, V, generator=gen), dim=-1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(B, K)
    kw = dict(SAMPLING[mode], seed=torch.arange(B), offset=torch.zeros(B, dtype=torch.long))
    draft = q.to(dtype) if mode in ("probs", "warped") else None
    return to_device((logits.to(dtype), drafts, draft, kw), device)


CASES = [
    (B, K, V, mode, provider)
    for provider in PROVIDERS
    for V in VOCABS
    for K in DRAFTS
    for B in BATCHES
    for mode in MODES
]


@pytest.mark.parametrize("B,K,V,mode,provider", CASES)
def test_rejection_sample(benchmark, monkeypatch, B, K, V, mode, provider):
    base, split = SPLIT_SWITCH.get(provider, (provider, None))
    if split is not None:
        monkeypatch.setenv("OSD_SAMPLER_SPLIT", split)
    fi = provider == "flashinfer"
    device, dtype = flashinfer_device() if fi else provider_device(base)
    logits, drafts, draft, kw = _chain(B, K, V, mode, dtype, device)
    backend = BACKENDS.get(base)
    sample = flashinfer_rejection_sample if fi else rejection_sample

    def run():
        out = sample(logits, drafts, draft, backend=backend, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    want = rejection_sample_reference(
        *to_device((logits, drafts, draft), "cpu"), **to_device(kw, "cpu")
    )
    if fi:  # FlashInfer's random stream differs: tokens are equal only when greedy
        assert_chain_output(run(), want, drafts, greedy=mode == "greedy")
    else:
        assert_same(run(), want, provider)
    benchmark.pedantic(run, rounds=3 if provider == "reference" else 10, warmup_rounds=1)
    benchmark.extra_info.update(
        provider=provider,
        mode=mode,
        B=B,
        K=K,
        V=V,
        threads=THREADS,
        accepted_mean=float(want[1].float().mean()),
        gbps=gbps(tensor_bytes(logits, draft), benchmark),
    )
