"""quant_linear on GGUF blocks as stored (``ggml_type``: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K,
Q6_K): ``dequantize_blocks`` against the file reader's dequantizer, bit for bit; the C++
kernel against decode_linear on those weights, bit for bit on each ISA path (AVX-512 with
VBMI, AVX2, portable), on random blocks and odd shapes; the GEMM path past 64 rows to
float rounding (tiles per thread, strided rows, bias, norm, inference mode); rows
independent of each other; QuantLinear holding the file's blocks and
stacking fused projections; bad input; opcheck."""

import numpy as np
import pytest
import torch

import osd_kernels
from osd.models.gguf import GGMLType, dequantize
from osd.models.quant import STORED_FORMATS, QuantLinear, _fused
from osd_kernels.quant_linear import STORED_TYPES, dequantize_blocks
from tests.test_gguf_blocks import random_blocks
from tests.test_quant_linear import FUSED_MAX_ROWS, _isa

TYPES = [GGMLType(t) for t in STORED_TYPES]
# (M, K / weights a block, N): odd row and weight-row counts, one and several passes of 12
SHAPES = [(1, 1, 1), (1, 3, 37), (2, 2, 7), (3, 1, 13), (5, 2, 4), (7, 1, 5), (12, 2, 26)]
SHAPES += [(13, 1, 9), (16, 3, 3), (25, 1, 11), (64, 1, 6)]


def _blocks(t, n, k, seed, scale=None):
    """Random blocks ``[n, bytes a row]`` of type ``t`` for rows of ``k`` weights; with
    ``scale``, the fp16 scale fields drawn in [-scale, scale] (moderate products)."""
    weights, size = STORED_TYPES[int(t)]
    count = n * k // weights
    b = random_blocks(t, count, seed=seed).reshape(count, size)
    if scale is not None:
        rng = np.random.default_rng(seed + 1)
        at = {
            GGMLType.Q4_0: (0,),
            GGMLType.Q4_1: (0,),
            GGMLType.Q5_0: (0,),
            GGMLType.Q8_0: (0,),
            GGMLType.Q4_K: (0, 2),
            GGMLType.Q6_K: (208,),
        }[t]
        for a in at:
            half = (rng.uniform(-1, 1, count) * scale).astype(np.float16)
            b[:, a : a + 2] = half.view(np.uint8).reshape(count, 2)
    return torch.from_numpy(b.reshape(n, -1).copy())


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_blocks_is_the_file_readers(t):
    weights = STORED_TYPES[int(t)][0]
    raw = _blocks(t, 9, 3 * weights, seed=int(t))
    want = dequantize(raw.reshape(-1), t, (9, 3 * weights))
    got = dequantize_blocks(raw, int(t))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bits, signed zeros too


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_native_equals_decode_linear_on_dequantized_weights(monkeypatch, t, isa):
    _isa(monkeypatch, isa)
    weights = STORED_TYPES[int(t)][0]
    for i, (m, units, n) in enumerate(SHAPES):
        k = units * weights
        raw = _blocks(t, n, k, seed=100 * int(t) + i, scale=0.05)
        g = torch.Generator().manual_seed(i)
        x = torch.randn(m, k, generator=g)
        extras = i % 2 == 0
        b = torch.randn(n, generator=g) if extras else None
        norm = torch.rand(k, generator=g) + 0.5 if extras else None
        e = torch.empty(n, 0)
        got = osd_kernels.quant_linear(
            x, raw, e, None, b, norm_weight=norm, backend="native", ggml_type=int(t)
        )
        w = dequantize_blocks(raw, int(t))
        want = osd_kernels.decode_linear(x, w, b, norm_weight=norm, backend="native")
        assert torch.equal(got, want), (m, k, n)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_isa_paths_agree_and_prefill_rows_round_alike(monkeypatch, t):
    weights = STORED_TYPES[int(t)][0]
    k = 2 * max(weights, 64)
    raw = _blocks(t, 45, k, seed=int(t), scale=0.05)
    x = torch.randn(FUSED_MAX_ROWS + 11, k, generator=torch.Generator().manual_seed(3))
    e = torch.empty(45, 0)
    out = {}
    for isa in ("avx512", "avx2", "portable"):
        with monkeypatch.context() as mp:
            _isa(mp, isa)
            out[isa] = osd_kernels.quant_linear(x[:5], raw, e, backend="native", ggml_type=int(t))
    assert torch.equal(out["avx512"], out["avx2"])
    torch.testing.assert_close(out["avx2"], out["portable"], rtol=1e-5, atol=1e-4)
    # past the few-row kernels: dequantized tiles and a GEMM, float rounding
    got = osd_kernels.quant_linear(x, raw, e, backend="native", ggml_type=int(t))
    want = x @ dequantize_blocks(raw, int(t)).T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_prefill_tiles_are_the_gemm_on_dequantized_weights(monkeypatch, t, isa):
    """Past the few-row kernels each thread dequantizes tiles of weight rows and multiplies
    them: several tiles a thread and a short last one (n), x rows a stride apart, bias and
    norm, inference mode (the GEMMs run on the worker threads), one thread and two."""
    _isa(monkeypatch, isa)
    weights = STORED_TYPES[int(t)][0]
    k, n, m = 2 * max(weights, 256), 1101, FUSED_MAX_ROWS + 7
    raw = _blocks(t, n, k, seed=int(t) + 50, scale=0.05)
    w = dequantize_blocks(raw, int(t))
    g = torch.Generator().manual_seed(int(t))
    wide = torch.randn(m, k + 5, generator=g)
    x = wide[:, 3 : 3 + k]  # rows k + 5 apart
    b, norm = torch.randn(n, generator=g), torch.rand(k, generator=g) + 0.5
    e = torch.empty(n, 0)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            with torch.inference_mode():
                got = osd_kernels.quant_linear(
                    x, raw, e, None, b, backend="native", ggml_type=int(t)
                )
                normed = osd_kernels.quant_linear(
                    x, raw, e, None, None, norm_weight=norm, backend="native", ggml_type=int(t)
                )
            want = x @ w.T + b
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
            xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
            want = xn @ w.T
            torch.testing.assert_close(normed, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_a_row_does_not_depend_on_the_others(monkeypatch, isa):
    _isa(monkeypatch, isa)
    for t in (GGMLType.Q5_0, GGMLType.Q4_K, GGMLType.Q6_K):
        raw = _blocks(t, 23, 256, seed=int(t), scale=0.05)
        x = torch.randn(FUSED_MAX_ROWS, 256, generator=torch.Generator().manual_seed(5))
        e = torch.empty(23, 0)

        def run(rows):
            return osd_kernels.quant_linear(rows, raw, e, backend="native", ggml_type=int(t))

        alone = torch.cat([run(x[i : i + 1]) for i in range(FUSED_MAX_ROWS)])
        for m in (2, 5, 12, 16, 40, FUSED_MAX_ROWS):
            assert torch.equal(run(x[:m]), alone[:m])


def test_quant_linear_holds_the_files_blocks():
    for name in STORED_FORMATS:
        t = GGMLType[name]
        weights = STORED_TYPES[int(t)][0]
        raw = _blocks(t, 6, 2 * weights, seed=int(t))
        layer = QuantLinear.from_gguf_blocks(raw.reshape(-1), name, (6, 2 * weights))
        assert layer.ggml_type == int(t) and torch.equal(layer.qweight, raw)
        assert layer.in_features == 2 * weights and layer.out_features == 6
        codes = QuantLinear.from_gguf_blocks(raw.reshape(-1), name, (6, 2 * weights), stored=False)
        assert codes.ggml_type == 0 and torch.equal(codes.dequantize(), layer.dequantize())
        rows = layer.select_rows(torch.tensor([4, 1]))
        assert torch.equal(rows.dequantize(), layer.dequantize()[[4, 1]])


def test_fused_parts_stack_as_stored_blocks_where_they_can():
    def part(name, n, seed):
        t = GGMLType[name]
        raw = _blocks(t, n, 256, seed=seed, scale=0.05)
        return QuantLinear.from_gguf_blocks(raw.reshape(-1), name, (n, 256))

    def check(parts, ggml_type, fmt):
        fused = _fused(parts, None)
        assert (fused.ggml_type, fused.fmt) == (ggml_type, fmt)
        want = torch.cat([p.dequantize() for p in parts])
        assert torch.equal(fused.dequantize(), want)
        x = torch.randn(3, 256)
        assert torch.equal(fused(x), osd_kernels.decode_linear(x, want))

    check([part("Q4_K", 5, 1), part("Q4_K", 3, 2)], int(GGMLType.Q4_K), "Q4_K")
    # Q5_0 and Q4_0 blocks are Q8_0 blocks of the same weights
    check([part("Q5_0", 4, 3), part("Q4_0", 2, 4), part("Q8_0", 2, 5)], 8, "Q5_0+Q4_0+Q8_0")
    # no common stored form: codes and factors, widened
    check([part("Q4_K", 4, 6), part("Q6_K", 2, 7)], 0, "Q4_K+Q6_K")


def test_auto_takes_the_reference_in_autograd():
    raw = _blocks(GGMLType.Q6_K, 4, 256, seed=9, scale=0.05)
    x = torch.randn(2, 256, requires_grad=True)
    y = osd_kernels.quant_linear(x, raw, torch.empty(4, 0), ggml_type=14)
    y.sum().backward()
    torch.testing.assert_close(x.grad, dequantize_blocks(raw, 14).sum(0).expand(2, -1))


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_bad_input_names_the_problem(backend):
    raw = _blocks(GGMLType.Q4_K, 4, 256, seed=10)
    e = torch.empty(4, 0)
    with pytest.raises(ValueError, match="ggml_type must be"):
        osd_kernels.quant_linear(torch.randn(2, 256), raw, e, backend=backend, ggml_type=13)
    with pytest.raises(ValueError, match="qweight uint8 blocks"):
        osd_kernels.quant_linear(torch.randn(2, 512), raw, e, backend=backend, ggml_type=12)
    with pytest.raises(ValueError, match="qweight uint8 blocks"):
        osd_kernels.quant_linear(torch.randn(2, 256), raw[:, 1:], e, backend=backend, ggml_type=12)


def test_native_op_checks_its_arguments():
    raw = _blocks(GGMLType.Q8_0, 4, 64, seed=11)
    op = torch.ops.osd.quant_linear
    e = torch.empty(4, 0)
    with pytest.raises(RuntimeError, match="reads GGUF blocks of types"):
        op(torch.randn(2, 64), raw, e, None, None, None, 1e-6, 7)
    with pytest.raises(RuntimeError, match="whole blocks of 256"):
        op(torch.randn(2, 64), raw, e, None, None, None, 1e-6, 12)
    with pytest.raises(RuntimeError, match="must be contiguous uint8 blocks"):
        op(torch.randn(2, 64), raw[:, :60].contiguous(), e, None, None, None, 1e-6, 8)


def test_opcheck():
    for t in (GGMLType.Q5_0, GGMLType.Q4_K):
        weights = STORED_TYPES[int(t)][0]
        raw = _blocks(t, 6, weights, seed=12, scale=0.05)
        x, e = torch.randn(3, weights), torch.empty(6, 0)
        op = torch.ops.osd.quant_linear.default
        torch.library.opcheck(op, (x, raw, e, None, None, None, 1e-6, int(t)))
        args = (x, raw, e, None, torch.randn(6), torch.rand(weights), 1e-5, int(t))
        torch.library.opcheck(op, args)
