"""``quant_linear`` (4-bit Q4_1 and 8-bit Q8_0 weights, and the K-quants' forms with a scale
per 16 weights: 8-bit Q6_K, 4-bit Q2_K / Q3_K) against ``decode_linear`` on the same
weights dequantized to float32, at decode and verify sizes, side by side.

Weight shapes of the chat target (SmolLM2-135M: hidden 576, MLP 1536, vocabulary 49,152;
``osd.zoo.chat_pair``); M rows (1 = decode at batch 1, 3 and 5 = verifies of k = 2 and 4,
11 = a 10-node tree, 16 = two passes). The weights come from memory, as in a whole forward
(each call takes the next of enough copies to fill twice ``COLD_BYTES`` of float32). CPU,
torch on ``OSD_BENCH_THREADS`` threads (default 1). Each round of ``quant`` is preceded by
one timed round of ``decode_linear`` (its ``setup``); both go through ``backend="auto"``
as the model does. ``extra_info`` records both best rounds and ``speedup``; the outputs
are checked to be equal first (bit for bit).

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_quant_linear.py
"""

import time

import pytest
import torch

from osd_kernels import decode_linear, dequantize_weight, quant_linear

pytestmark = pytest.mark.usefixtures("torch_threads")

SHAPES = {  # name: (N, K, bits, weights per scale)
    "chat-qkv-q4": (960, 576, 4, 32),
    "chat-gate-up-q4": (3072, 576, 4, 32),
    "chat-down-q4": (576, 1536, 4, 32),
    "chat-lm-head-q8": (49152, 576, 8, 32),
    "chat-down-q8": (576, 1536, 8, 32),
    "chat-down-q6k": (576, 1536, 8, 16),
    "chat-down-q3k": (576, 1536, 4, 16),
}
ROWS = (1, 3, 5, 11, 16)
CALLS = 60  # calls per timed round
COLD_BYTES = 64 << 20


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_quant_linear(benchmark, shape, rows):
    n, k, bits, group = SHAPES[shape]
    gen = torch.Generator().manual_seed(n + rows)
    if bits == 4:
        q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        mins = (-torch.rand(n, k // group, generator=gen) * 0.05).half().float()
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        mins = None
    scales = (torch.rand(n, k // group, generator=gen) * 0.01).half().float()
    x = torch.randn(rows, k, generator=gen)
    w = dequantize_weight(q, scales, mins)
    assert torch.equal(quant_linear(x, q, scales, mins), decode_linear(x, w))
    copies = max(1, -(-2 * COLD_BYTES // (4 * n * k)))
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    qs = [(q, scales, mins)] + [
        (q.clone(), scales.clone(), None if mins is None else mins.clone())
        for _ in range(copies - 1)
    ]
    best = {"float32": float("inf")}

    def float_round():
        start = time.perf_counter()
        for i in range(CALLS):
            decode_linear(x, ws[i % copies])
        best["float32"] = min(best["float32"], time.perf_counter() - start)

    def quant():
        for i in range(CALLS):
            quant_linear(x, *qs[i % copies])

    benchmark.pedantic(quant, setup=float_round, rounds=8, iterations=1, warmup_rounds=1)
    ours = benchmark.stats.stats.min
    benchmark.extra_info.update(
        N=n,
        K=k,
        M=rows,
        bits=bits,
        group=group,
        threads=torch.get_num_threads(),
        float32_us=round(best["float32"] / CALLS * 1e6, 2),
        quant_us=round(ours / CALLS * 1e6, 2),
        speedup=round(best["float32"] / ours, 2),
    )
