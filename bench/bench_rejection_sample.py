"""Chain verification (``rejection_sample``): time and GB/s per provider.

Drafts come from a draft distribution close to the target (softmax of the target logits
plus noise), so chains are accepted part of the way, as in real use. GB/s counts the
target logits (and the draft probabilities, when given) read once:
``B * (K+1) * V * bytes``. The kernels stop at the first rejection, so GB/s is a
normalised rate, not memory traffic.

Modes: ``greedy`` (temperature 0), ``probs`` (draft probabilities, temperature 1),
``onehot`` (no draft probabilities, temperature 1) and ``warped`` (draft probabilities,
temperature 0.8, top-k 50, top-p 0.9). Providers: ``reference`` and ``cpp`` on CPU
(float32); ``triton`` and ``cuda`` on GPU (bfloat16 logits), skipped without one. Every
provider's output is checked to equal the reference before it is timed.

Default sweep: B in {1, 8}, K = 5, V = 32000. ``OSD_BENCH_FULL=1``: B in {1, 8, 64},
K in {4, 5, 8}, V in {32000, 128256}. ``OSD_BENCH_THREADS`` sets torch's CPU thread count
(default 1: the benchmark machine's 2 cores are shared, and spinning intra-op threads make
both providers erratic).

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_rejection_sample.py
"""
import os

import pytest
import torch

from osd_kernels import rejection_sample, rejection_sample_reference
from osd_kernels._ops import native_available

FULL = os.environ.get("OSD_BENCH_FULL", "0") == "1"
BATCHES = (1, 8, 64) if FULL else (1, 8)
DRAFTS = (4, 5, 8) if FULL else (5,)
VOCABS = (32000, 128256) if FULL else (32000,)
MODES = ("greedy", "probs", "onehot", "warped")
PROVIDERS = ("reference", "cpp", "triton", "cuda")
THREADS = int(os.environ.get("OSD_BENCH_THREADS", "1"))
SAMPLING = {
    "greedy": dict(),
    "probs": dict(temperature=1.0),
    "onehot": dict(temperature=1.0),
    "warped": dict(temperature=0.8, top_k=50, top_p=0.9),
}


@pytest.fixture(scope="module", autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


def _chain(B: int, K: int, V: int, mode: str, dtype: torch.dtype, device: str):
    """Logits, drafted tokens, draft probs and sampling kwargs of one benchmark case."""
    gen = torch.Generator().manual_seed(B * 100 + K * 10 + V)
    logits = torch.randn(B, K + 1, V, generator=gen) * 4
    q = torch.softmax(logits[:, :K] + torch.randn(B, K, V, generator=gen), dim=-1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(B, K)
    kw = dict(SAMPLING[mode], seed=torch.arange(B), offset=torch.zeros(B, dtype=torch.long))
    draft = q.to(dtype) if mode in ("probs", "warped") else None
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return (move(logits.to(dtype)), move(drafts), move(draft),
            {k: move(v) if torch.is_tensor(v) else v for k, v in kw.items()})


CASES = [(B, K, V, mode, provider) for provider in PROVIDERS for V in VOCABS
         for K in DRAFTS for B in BATCHES for mode in MODES]


@pytest.mark.parametrize("B,K,V,mode,provider", CASES)
def test_rejection_sample(benchmark, B, K, V, mode, provider):
    on_gpu = provider in ("triton", "cuda")
    if on_gpu and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if provider in ("cpp", "cuda") and not native_available():
        pytest.skip("osd_kernels._C is not built")
    device = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    logits, drafts, draft, kw = _chain(B, K, V, mode, dtype, device)
    backend = {"reference": "reference", "cpp": "native", "cuda": "native",
               "triton": "triton"}[provider]

    def run():
        out = rejection_sample(logits, drafts, draft, backend=backend, **kw)
        if on_gpu:
            torch.cuda.synchronize()
        return out

    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    want = rejection_sample_reference(cpu(logits), cpu(drafts), cpu(draft),
                                      **{k: cpu(v) if torch.is_tensor(v) else v
                                         for k, v in kw.items()})
    got = run()
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w), provider
    benchmark.pedantic(run, rounds=3 if provider == "reference" else 10, warmup_rounds=1)
    nbytes = logits.numel() * logits.element_size()
    if draft is not None:
        nbytes += draft.numel() * draft.element_size()
    benchmark.extra_info.update(
        provider=provider, mode=mode, B=B, K=K, V=V, threads=THREADS,
        accepted_mean=float(want[1].float().mean()),
        gbps=nbytes / benchmark.stats.stats.median / 1e9)
