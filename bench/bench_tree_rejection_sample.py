"""Tree verification (``tree_rejection_sample``): time and GB/s per provider.

Tree: the root has 4 children and each child heads a chain, so the tree has depth K and
T = 1 + 4K nodes (K = 4: T = 17). Children are drawn from a draft close to the target, so
paths are accepted part of the way, as in real use. GB/s counts the target logits (and
the draft probabilities, when given) read once: ``B * T * V * bytes``.

Modes: ``greedy`` (temperature 0), ``probs`` (draft probabilities, drawn with
replacement, temperature 1) and ``point`` (deterministic children, temperature 1).
Providers: ``reference`` and ``cpp`` on CPU (float32); ``triton`` and ``cuda`` on GPU
(bfloat16 logits), skipped without one. Every provider's output is checked against the
reference before it is timed.

Default sweep: B in {1, 8}, K = 4, V = 32000. ``OSD_BENCH_FULL=1``: B in {1, 8, 64},
K in {4, 8}, V in {32000, 128256}. ``OSD_BENCH_THREADS`` sets torch's CPU thread count
(default 1: the benchmark machine's 2 cores are shared, and spinning intra-op threads make
both providers erratic).

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_tree_rejection_sample.py
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
from osd_kernels import tree_rejection_sample, tree_rejection_sample_reference

BATCHES = (1, 8, 64) if FULL else (1, 8)
DEPTHS = (4, 8) if FULL else (4,)
VOCABS = (32000, 128256) if FULL else (32000,)
MODES = ("greedy", "probs", "point")
WIDTH = 4  # children of the root; each heads a chain
PROVIDERS = ("reference", "cpp", "triton", "cuda")

pytestmark = pytest.mark.usefixtures("torch_threads")


def _tree(B: int, K: int, V: int, mode: str, dtype: torch.dtype, device: str):
    """Logits, tokens, parents, draft probs and sampling kwargs of the benchmark tree."""
    gen = torch.Generator().manual_seed(B * 100 + K * 10 + V)
    T = 1 + WIDTH * K
    parents = torch.tensor(
        [-1] + [0 if i % K == 0 else i for i in range(WIDTH * K)], dtype=torch.int32
    )
    logits = torch.randn(B, T, V, generator=gen) * 4
    q = torch.softmax(logits + torch.randn(B, T, V, generator=gen), dim=-1)
    par = parents.long().clamp(min=0)
    tokens = torch.multinomial(q[:, par].reshape(-1, V), 1, generator=gen).view(B, T)
    tokens[:, 0] = 0
    kw = dict(seed=torch.arange(B), offset=torch.zeros(B, dtype=torch.long), max_depth=K)
    if mode != "greedy":
        kw["temperature"] = torch.ones(B)
    draft = q.to(dtype) if mode == "probs" else None
    return to_device(
        (logits.to(dtype), tokens, parents.expand(B, T).contiguous(), draft, kw), device
    )


CASES = [
    (B, K, V, mode, provider)
    for provider in PROVIDERS
    for V in VOCABS
    for K in DEPTHS
    for B in BATCHES
    for mode in MODES
]


@pytest.mark.parametrize("B,K,V,mode,provider", CASES)
def test_tree_rejection_sample(benchmark, B, K, V, mode, provider):
    device, dtype = provider_device(provider)
    logits, tokens, parents, draft, kw = _tree(B, K, V, mode, dtype, device)
    backend = BACKENDS[provider]

    def run():
        out = tree_rejection_sample(logits, tokens, parents, draft, backend=backend, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    want = tree_rejection_sample_reference(
        *to_device((logits, tokens, parents, draft), "cpu"), **to_device(kw, "cpu")
    )
    assert_same(run(), want, provider)
    benchmark.pedantic(run, rounds=3 if provider == "reference" else 10, warmup_rounds=1)
    benchmark.extra_info.update(
        provider=provider,
        mode=mode,
        B=B,
        K=K,
        V=V,
        threads=THREADS,
        accepted_mean=float(want[2].float().mean()),
        gbps=gbps(tensor_bytes(logits, draft), benchmark),
    )
