"""``quant_linear`` (4-bit Q4_1 and 8-bit Q8_0 weights, and the K-quants' forms with a scale
per 16 weights: 8-bit Q6_K, 4-bit Q2_K / Q3_K) against ``decode_linear`` on the same
weights dequantized to float32, at decode and verify sizes, side by side; and
(``test_quant_linear_blocks``) GGUF blocks read as stored (``ggml_type``: Q4_K, Q6_K,
Q5_0, Q8_0, Q4_1) against the same weights as codes with float32 factors.

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

from osd.models.gguf import GGMLType
from osd.models.quant import QuantLinear
import osd_kernels
from osd_kernels import decode_linear, dequantize_weight, quant_linear
from osd_kernels.quant_x16 import X16_OFFSET, repack_x16
from tests.test_quant_linear_blocks import _blocks

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


BLOCK_SHAPES = {  # name: (N, K, GGUF type), the chat target's shapes in its Q*_K_M files
    "chat-down-q4k": (576, 1536, "Q4_K"),
    "chat-down-q6k": (576, 1536, "Q6_K"),
    "chat-gate-up-q5_0": (3072, 576, "Q5_0"),
    "chat-gate-up-q4_1": (3072, 576, "Q4_1"),
    "chat-gate-up-q8_0": (3072, 576, "Q8_0"),
    "chat-lm-head-q8_0": (49152, 576, "Q8_0"),
}


@pytest.mark.parametrize("rows", (1, 5, 11))
@pytest.mark.parametrize("shape", list(BLOCK_SHAPES))
def test_quant_linear_blocks(benchmark, shape, rows):
    """The file's blocks as stored (``ggml_type``) against the same weights as codes with
    float32 factors (``QuantLinear.from_gguf_blocks(..., stored=False)``), each round of
    the stored form preceded by one timed round of the codes form; outputs bit-equal."""
    n, k, fmt = BLOCK_SHAPES[shape]
    t = GGMLType[fmt]
    raw = _blocks(t, n, k, seed=n + rows, scale=0.01)
    stored = QuantLinear.from_gguf_blocks(raw.reshape(-1), fmt, (n, k), stored=True)
    codes = QuantLinear.from_gguf_blocks(raw.reshape(-1), fmt, (n, k), stored=False)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(stored(x), codes(x))

    def nbytes(layer):
        return sum(b.numel() * b.element_size() for b in layer.buffers() if b is not None)

    copies = max(1, -(-2 * COLD_BYTES // nbytes(codes)))
    stores = [stored] + [
        QuantLinear(stored.qweight.clone(), stored.scales, None, None, fmt, int(t))
        for _ in range(copies - 1)
    ]
    codes_copies = [codes] + [
        QuantLinear(
            codes.qweight.clone(),
            codes.scales.clone(),
            None if codes.mins is None else codes.mins.clone(),
            None,
            fmt,
        )
        for _ in range(copies - 1)
    ]
    best = {"codes": float("inf")}

    def codes_round():
        start = time.perf_counter()
        for i in range(CALLS):
            codes_copies[i % copies](x)
        best["codes"] = min(best["codes"], time.perf_counter() - start)

    def blocks():
        for i in range(CALLS):
            stores[i % copies](x)

    benchmark.pedantic(blocks, setup=codes_round, rounds=8, iterations=1, warmup_rounds=1)
    ours = benchmark.stats.stats.min
    benchmark.extra_info.update(
        N=n,
        K=k,
        M=rows,
        format=fmt,
        threads=torch.get_num_threads(),
        bytes_stored=nbytes(stored),
        bytes_codes=nbytes(codes),
        codes_us=round(best["codes"] / CALLS * 1e6, 2),
        stored_us=round(ours / CALLS * 1e6, 2),
        speedup=round(best["codes"] / ours, 2),
    )


# One decode step's projections of the chat target's 30 layers (qkv, wo, gate-up, down:
# N, K), all in one block format: GB/s of weights read per format shows whether a format's
# kernel streams at the memory's speed or is bound by decoding its codes. The K-quants'
# rows hold whole super-blocks of 256: their 576-wide inputs are 512 wide.
STEP_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30


@pytest.mark.parametrize("act", ["float32", "int8"])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("fmt", ["Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_step_gemvs_per_format(benchmark, fmt, rows, act):
    """The 120 projections of a decode step (``rows`` 1) or a verify of k = 4 (5), each
    weight read from memory once (66-113 MB, past the caches), on the file's blocks with
    float32 activations, or regrouped for int8 ones (``osd_kernels.quant_x16``)."""
    t = GGMLType[fmt]
    if act == "int8" and not osd_kernels.use_vnni():
        pytest.skip("int8 activations need AVX-512 VNNI")
    shapes = [(n, 512 if k == 576 and fmt.endswith("_K") else k) for n, k in STEP_SHAPES]
    weights = [_blocks(t, n, k, seed=i, scale=0.05) for i, (n, k) in enumerate(shapes)]
    kind = int(t)
    if act == "int8":
        weights = [repack_x16(w, int(t))[0] for w in weights]
        kind += X16_OFFSET
    xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
    empty = torch.empty(0)

    def step():
        for w, (_, k) in zip(weights, shapes):
            quant_linear(xs[k], w, empty, ggml_type=kind)

    benchmark.pedantic(step, rounds=5, iterations=1, warmup_rounds=1)
    total = sum(w.numel() for w in weights)
    benchmark.extra_info.update(
        format=fmt,
        activations=act,
        M=rows,
        threads=torch.get_num_threads(),
        megabytes=round(total / 1e6, 1),
        gb_per_s=round(total / benchmark.stats.stats.min / 1e9, 1),
    )


@pytest.mark.parametrize("rows", [5, 40, 128])
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q4_K"])
def test_amx_against_vnni(benchmark, monkeypatch, fmt, rows):
    """The step's 120 projections with int8 activations at verify and prefill sizes
    (``rows`` 5: a chain of 4; 14: the fewest rows that run on tiles; 40: a batch of 8
    verifying 4 drafts each; 128: a prefill piece) on AMX-INT8 tiles against VNNI alone
    (``OSD_NO_AMX``), one round of VNNI before each timed AMX round; outputs equal first.
    ``extra_info``: ``vnni_ms``, ``amx_ms`` and ``speedup`` (best rounds). At 5 rows both
    providers are VNNI (the control)."""
    if not osd_kernels.use_amx():
        pytest.skip("no AMX-INT8 tiles here (the CPU has none, or the OS gives none)")
    t = GGMLType[fmt]
    shapes = [(n, 512 if k == 576 and fmt.endswith("_K") else k) for n, k in STEP_SHAPES]
    weights = [
        repack_x16(_blocks(t, n, k, seed=i, scale=0.05), int(t))[0]
        for i, (n, k) in enumerate(shapes)
    ]
    kind = int(t) + X16_OFFSET
    xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
    empty = torch.empty(0)

    def step():
        return [quant_linear(xs[k], w, empty, ggml_type=kind) for w, (_, k) in zip(weights, shapes)]

    def with_amx(on):
        if on:
            monkeypatch.delenv("OSD_NO_AMX", raising=False)
        else:
            monkeypatch.setenv("OSD_NO_AMX", "1")

    with_amx(False)
    want = step()
    with_amx(True)
    assert all(torch.equal(a, b) for a, b in zip(step(), want))
    vnni = []

    def setup():
        with_amx(False)
        start = time.perf_counter()
        step()
        vnni.append(time.perf_counter() - start)
        with_amx(True)

    benchmark.pedantic(step, setup=setup, rounds=7, iterations=1, warmup_rounds=1)
    with_amx(True)
    amx = benchmark.stats.stats.min
    benchmark.extra_info.update(
        format=fmt,
        M=rows,
        threads=torch.get_num_threads(),
        vnni_ms=round(min(vnni) * 1e3, 2),
        amx_ms=round(amx * 1e3, 2),
        speedup=round(min(vnni) / amx, 2),
    )
