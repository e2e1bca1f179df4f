"""quant_linear: the C++ kernel against decode_linear on the dequantized weights (bit for
bit, on each ISA path: AVX-512, AVX2, portable; scales per 32 and per 16 weights) and
against the reference on odd shapes; the GGUF block formats; the auto dispatch rules; bad
input; opcheck."""

import numpy as np
import pytest
import torch

import osd_kernels
from osd.models.gguf import BLOCK_LAYOUT, GGMLType, dequantize, quantize
from osd.models.quant import QuantLinear
from tests.test_gguf_blocks import random_blocks

FUSED_MAX_ROWS = 64  # kFusedMaxRows in csrc/cpu/quant_linear.cpp: more rows take the GEMM
SHAPES = [
    (1, 32, 1),
    (2, 64, 7),
    (3, 96, 13),
    (5, 576, 97),
    (7, 32, 5),
    (11, 160, 33),
    (12, 64, 26),
    (13, 128, 9),
    (16, 96, 25),
    (25, 64, 6),
    (64, 32, 11),
    (65, 64, 300),
    (130, 96, 17),
]  # (M, K, N)


def _inputs(m, k, n, bits, seed, *, mins=True, bias=True, group=32):
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    # scales and mins from float16, as GGUF stores them
    scales = (torch.rand(n, k // group, generator=g) * 0.1).half().float()
    mn = (-torch.rand(n, k // group, generator=g) * 0.5).half().float() if mins else None
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return x, q, scales, mn, b


def _isa(monkeypatch, isa):
    """Force one ISA path (on a CPU without AVX-512 "avx512" runs the AVX2 one)."""
    if isa == "avx2":
        monkeypatch.setenv("OSD_NO_AVX512", "1")
    elif isa == "portable":
        monkeypatch.setenv("OSD_NO_AVX2", "1")


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (4, 16), (8, 16)])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_native_equals_decode_linear_on_dequantized_weights(monkeypatch, m, k, n, bits, group, isa):
    _isa(monkeypatch, isa)
    for seed, extras in ((m * 100 + k, True), (n, False)):
        x, q, s, mn, b = _inputs(m, k, n, bits, seed, mins=extras, bias=extras, group=group)
        norm = torch.rand(k) + 0.5 if extras else None
        got = osd_kernels.quant_linear(x, q, s, mn, b, norm_weight=norm, backend="native")
        w = osd_kernels.dequantize_weight(q, s, mn)
        if m <= FUSED_MAX_ROWS:
            assert torch.equal(
                got, osd_kernels.decode_linear(x, w, b, norm_weight=norm, backend="native")
            )
        want = osd_kernels.quant_linear_reference(x, q, s, mn, b, norm_weight=norm)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * k**0.5)


def test_isa_paths_agree(monkeypatch):
    # AVX-512 and AVX2 bit for bit (the same operations per weight row); portable (no FMA)
    # to rounding
    for bits, group in ((4, 32), (8, 32), (4, 16), (8, 16)):
        x, q, s, mn, b = _inputs(5, 576, 61, bits, 1, group=group)
        out = {}
        for isa in ("avx512", "avx2", "portable"):
            with monkeypatch.context() as m:
                _isa(m, isa)
                out[isa] = osd_kernels.quant_linear(x, q, s, mn, b, backend="native")
        assert torch.equal(out["avx512"], out["avx2"])
        torch.testing.assert_close(out["avx2"], out["portable"], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_a_row_does_not_depend_on_the_others(monkeypatch, isa):
    # greedy speculative decoding equals plain decoding only if a verify row's result is
    # what the same row alone (a decode step) gives
    _isa(monkeypatch, isa)
    for bits, group in ((4, 32), (8, 32), (4, 16), (8, 16)):
        x, q, s, mn, b = _inputs(FUSED_MAX_ROWS, 192, 45, bits, 7, group=group)
        alone = torch.cat(
            [
                osd_kernels.quant_linear(x[i : i + 1], q, s, mn, b, backend="native")
                for i in range(FUSED_MAX_ROWS)
            ]
        )
        for m in (2, 5, 12, 16, 40, FUSED_MAX_ROWS):
            together = osd_kernels.quant_linear(x[:m], q, s, mn, b, backend="native")
            assert torch.equal(together, alone[:m])


K_TYPES = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
FILE_ONLY = [*K_TYPES, GGMLType.IQ4_NL, GGMLType.IQ4_XS]  # random blocks, not quantize()


@pytest.mark.parametrize(
    "t",
    [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q5_1, *FILE_ONLY],
    ids=lambda t: t.name,
)
def test_gguf_blocks_dequantize_like_the_file_reader(t):
    """Every block type a file keeps quantized holds exactly the file reader's weights, and
    the kernel computes on exactly them (random blocks for the types osd only reads)."""
    K = 512 if t in FILE_ONLY else 96
    if t in FILE_ONLY:
        n = 37 * K // BLOCK_LAYOUT[t][0]
        raw = torch.from_numpy(random_blocks(t, n, seed=int(t)).copy())
    else:
        w = torch.randn(37, K, generator=torch.Generator().manual_seed(int(t)))
        raw = torch.from_numpy(np.ascontiguousarray(quantize(w, t)))
    layer = QuantLinear.from_gguf_blocks(raw, t.name, (37, K))
    assert layer.in_features == K and layer.out_features == 37
    assert torch.equal(layer.dequantize(), dequantize(raw, t, (37, K)))
    x = torch.randn(3, K)
    assert torch.equal(layer(x), osd_kernels.decode_linear(x, layer.dequantize()))
    rows = layer.select_rows(torch.tensor([5, 0, 36]))
    assert torch.equal(rows.dequantize(), layer.dequantize()[[5, 0, 36]])


def test_auto_uses_the_kernel_only_where_it_is_meant_to(monkeypatch):
    calls = []
    real = torch.ops.osd.quant_linear

    class Spy:
        def __call__(self, *args):
            calls.append(args[0].shape[0])
            return real(*args)

    monkeypatch.setattr(torch.ops.osd, "quant_linear", Spy())
    x, q, s, mn, b = _inputs(FUSED_MAX_ROWS + 9, 64, 8, 4, 2)
    osd_kernels.quant_linear(x[:16], q, s, mn, b)
    want = osd_kernels.quant_linear_reference(x, q, s, mn, b)
    torch.testing.assert_close(osd_kernels.quant_linear(x, q, s, mn, b), want)  # prefill
    osd_kernels.quant_linear(x[:2].double(), q, s, mn, b.double())  # not float32
    assert calls == [16, FUSED_MAX_ROWS + 9]
    xg = x[:2].clone().requires_grad_()
    osd_kernels.quant_linear(xg, q, s, mn, b).sum().backward()  # autograd
    assert xg.grad is not None and calls == [16, FUSED_MAX_ROWS + 9]


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_bad_input_names_the_problem(backend):
    x, q, s, mn, b = _inputs(2, 64, 4, 4, 3)
    with pytest.raises(ValueError, match="x must be"):
        osd_kernels.quant_linear(torch.randn(2, 63), q, s, mn, backend=backend)
    with pytest.raises(ValueError, match="qweight must be"):
        osd_kernels.quant_linear(x, q.float(), s, mn, backend=backend)
    with pytest.raises(ValueError, match="multiple of 32"):
        osd_kernels.quant_linear(torch.randn(2, 48), q[:, :24], s, mn, backend=backend)
    with pytest.raises(ValueError, match="scales must be"):
        osd_kernels.quant_linear(x, q, s[:, :1], mn, backend=backend)
    with pytest.raises(ValueError, match="mins must be"):
        osd_kernels.quant_linear(x, q, s, mn.double(), backend=backend)
    with pytest.raises(ValueError, match="mins must be"):  # groups of 16 and 32
        osd_kernels.quant_linear(x, q, s.repeat_interleave(2, 1), mn, backend=backend)
    with pytest.raises(ValueError, match="bias must be"):
        osd_kernels.quant_linear(x, q, s, mn, b[:3], backend=backend)
    with pytest.raises(ValueError, match="norm_weight must be"):
        osd_kernels.quant_linear(x, q, s, mn, norm_weight=torch.ones(7), backend=backend)
    with pytest.raises(ValueError, match="eps must be"):
        osd_kernels.quant_linear(x, q, s, mn, norm_weight=torch.ones(64), eps=-1.0, backend=backend)
    with pytest.raises(ValueError, match="unknown backend"):
        osd_kernels.quant_linear(x, q, s, mn, backend="fast")


def test_native_op_checks_its_arguments():
    x, q, s, mn, b = _inputs(2, 64, 4, 8, 4)
    op = torch.ops.osd.quant_linear
    with pytest.raises(RuntimeError, match="x must be Float"):
        op(x.double(), q, s, mn, b)
    with pytest.raises(RuntimeError, match="qweight must be uint8"):
        op(x, q.short(), s, mn, b)
    with pytest.raises(RuntimeError, match="8-bit qweight must be"):
        op(x, q[:, :32].contiguous(), s, mn, b)
    with pytest.raises(RuntimeError, match="scales must be contiguous"):
        op(x, q, s.t().contiguous(), mn, b)


def test_opcheck():
    for bits in (4, 8):
        x, q, s, mn, b = _inputs(3, 96, 10, bits, 5)
        op = torch.ops.osd.quant_linear.default
        torch.library.opcheck(op, (x, q, s, mn, b))
        torch.library.opcheck(op, (x, q, s, None, None))
        torch.library.opcheck(op, (x, q, s, mn, b, torch.rand(96), 1e-5))
