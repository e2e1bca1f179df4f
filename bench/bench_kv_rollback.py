"""In-place KV rollback (``kv_rollback``): time and GB/s per provider.

A verify step left a tree of T = 8 nodes per row in every layer's cache; the accepted
path keeps 5 of them (nodes 0, 1, 3, 5, 7: three of the five move). GB/s counts the moved
K/V rows read and written once: ``2 * B * L * 2 * H * moved * D * bytes``.

Providers: ``reference`` (gather-then-copy) and ``cpp`` on CPU (float32); ``triton`` and
``cuda`` on GPU (bfloat16), skipped without one. Each provider's result is checked against
the reference before timing; every timed call restores the lengths first (a 2-element copy),
so the same compaction is timed each round. CPU goal (issue 3): cpp at least 3x the
reference (compare the two rows of a shape).

Default sweep: L = 12, H = 12, D = 64, S = 2048, B in {1, 8}, prefix 1000.
``OSD_BENCH_FULL=1``: B in {1, 8, 64}.

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_kv_rollback.py
"""

import pytest
import torch

from bench.common import BACKENDS, FULL, gbps, provider_device
from osd_kernels import kv_rollback, kv_rollback_reference

BATCHES = (1, 8, 64) if FULL else (1, 8)
LAYERS, HEADS, DIM, CAPACITY, PREFIX = 12, 12, 64, 2048, 1000
PATH = [0, 1, 3, 5, 7]
PROVIDERS = ("reference", "cpp", "triton", "cuda")


@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_kv_rollback(benchmark, provider, B):
    device, dtype = provider_device(provider)
    gen = torch.Generator().manual_seed(B)
    kv = torch.randn(LAYERS, 2, B, HEADS, CAPACITY, DIM, generator=gen).to(dtype).to(device)
    lens0 = torch.full((B,), PREFIX, dtype=torch.int32, device=device)
    slots = torch.tensor([PATH] * B, device=device)
    keep = torch.full((B,), len(PATH), dtype=torch.int32, device=device)
    lens = lens0.clone()
    backend = BACKENDS[provider]

    want, want_lens = kv.clone(), lens0.clone()
    kv_rollback_reference(want, want_lens, slots, keep)
    got = kv.clone()
    kv_rollback(got, lens, slots, keep, backend=backend)
    assert torch.equal(got, want) and torch.equal(lens, want_lens), provider
    del got, want

    def run():
        lens.copy_(lens0)
        kv_rollback(kv, lens, slots, keep, backend=backend)
        if device == "cuda":
            torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=10 if provider == "reference" else 50, warmup_rounds=2)
    moved = sum(1 for j, s in enumerate(PATH) if s != j)
    nbytes = 2 * B * LAYERS * 2 * HEADS * moved * DIM * kv.element_size()
    benchmark.extra_info.update(
        provider=provider, B=B, L=LAYERS, H=HEADS, D=DIM, S=CAPACITY, gbps=gbps(nbytes, benchmark)
    )
