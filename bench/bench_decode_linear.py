"""``decode_linear`` against ``F.linear`` at decode and verify sizes, side by side.

The weight shapes of the built-in target (``osd.zoo``: hidden 320, MLP 864, vocabulary
2048), two of the chat target's (its MLP down projection, K = 1536, and its 49,152-row
head) and of a 1B-class model layer (hidden 2048, MLP 8192); M rows (1 = decode at batch
1, 5 = a k = 4 verify, 9 = a k = 8 verify, 16 = two passes of the kernel, 32 and 64 =
batched verify: several passes tile by tile over the weights, or ``F.linear`` where
``auto`` hands the shape to it). ``hot``: one
weight matrix, which stays in the caches between calls; ``cold``: each call takes the
next of enough copies of it to fill twice ``COLD_BYTES``, so the weights come from memory,
as in a whole forward of a model larger than the last-level cache. CPU, float32, torch on
``OSD_BENCH_THREADS`` threads (default 1). Each round of ``cpp`` is preceded by one timed
round of ``F.linear`` and one of ``decode_linear`` from the weight packed into panels
(``pack_weight``, as an engine's target reads it) on the same inputs (its ``setup``);
``cpp`` calls ``decode_linear`` with ``backend="auto"`` on the weight as given (the C++
kernel at these sizes, plus the wrapper's per-call cost). ``extra_info`` records the three
best rounds, ``speedup`` (F.linear / cpp) and ``packed_speedup`` (F.linear / packed); the
outputs are checked to agree first.

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_decode_linear.py
"""

import time

import pytest
import torch
import torch.nn.functional as F

from bench.common import FULL
from osd_kernels import decode_linear, pack_weight

pytestmark = pytest.mark.usefixtures("torch_threads")

SHAPES = {  # name: (N, K)
    "zoo-qkv": (960, 320),
    "zoo-gate-up": (1728, 320),
    "zoo-down": (320, 864),
    "zoo-lm-head": (2048, 320),
    "chat-down": (576, 1536),
    "chat-lm-head": (49152, 576),  # the chat target's
}
if FULL:
    SHAPES.update({"1b-qkv": (6144, 2048), "1b-down": (2048, 8192)})
ROWS = (1, 2, 5, 9, 16, 32, 64)
CALLS = 200  # calls per timed round, fewer where that reads over ROUND_ELEMENTS weights
ROUND_ELEMENTS = 20_000_000
COLD_BYTES = 32 << 20  # the development machine's last-level cache


@pytest.mark.parametrize("weights", ["hot", "cold"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_linear(benchmark, shape, rows, weights):
    n, k = SHAPES[shape]
    gen = torch.Generator().manual_seed(n + rows)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen)
    torch.testing.assert_close(
        decode_linear(x, w, b, backend="native"), F.linear(x, w, b), rtol=1e-4, atol=1e-4
    )
    copies = 1 if weights == "hot" else -(-2 * COLD_BYTES // (4 * n * k))
    torch.testing.assert_close(
        decode_linear(x, w, b, backend="native", packed=pack_weight(w)),
        F.linear(x, w, b),
        rtol=1e-4,
        atol=1e-4,
    )
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    packs = [pack_weight(v) for v in ws]
    calls = max(10, min(CALLS, ROUND_ELEMENTS // (n * k)))
    best = {"linear": float("inf"), "packed": float("inf")}

    def linear_round():
        start = time.perf_counter()
        for i in range(calls):
            F.linear(x, ws[i % copies], b)
        best["linear"] = min(best["linear"], time.perf_counter() - start)
        start = time.perf_counter()
        for i in range(calls):
            decode_linear(x, ws[i % copies], b, packed=packs[i % copies])
        best["packed"] = min(best["packed"], time.perf_counter() - start)

    def ours():
        for i in range(calls):
            decode_linear(x, ws[i % copies], b)

    benchmark.pedantic(ours, setup=linear_round, rounds=10, iterations=1, warmup_rounds=1)
    cpp = benchmark.stats.stats.min
    benchmark.extra_info.update(
        N=n,
        K=k,
        M=rows,
        weights=weights,
        threads=torch.get_num_threads(),
        linear_us=round(best["linear"] / calls * 1e6, 2),
        cpp_us=round(cpp / calls * 1e6, 2),
        packed_us=round(best["packed"] / calls * 1e6, 2),
        speedup=round(best["linear"] / cpp, 2),
        packed_speedup=round(best["linear"] / best["packed"], 2),
    )
