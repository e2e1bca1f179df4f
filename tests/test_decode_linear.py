"""decode_linear: the C++ kernel against F.linear on odd shapes, every ISA path, with the
weight as given and packed into panels, the auto dispatch rules, bad input, opcheck."""

import pytest
import torch
import torch.nn.functional as F

import osd_kernels
from osd_kernels.decode_linear import MAX_ROWS, WIDE_MAX_K, WIDE_MAX_ROWS

SHAPES = [
    (1, 1, 1),
    (1, 7, 3),
    (2, 320, 960),
    (3, 33, 17),
    (5, 257, 131),
    (6, 864, 320),
    (7, 15, 9),
    (8, 64, 2048),
    (12, 96, 11),
    (13, 40, 29),
    (25, 17, 6),
    (37, 700, 83),
    (61, 9, 3001),
]  # (M, K, N)


ISAS = ["avx512", "avx2", "portable"]  # a CPU without AVX-512 runs avx2 twice


def _use_isa(monkeypatch, isa):
    if isa == "portable":
        monkeypatch.setenv("OSD_NO_AVX2", "1")
    elif isa == "avx2":
        monkeypatch.setenv("OSD_NO_AVX512", "1")


def _inputs(m, k, n, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_native_matches_reference(monkeypatch, m, k, n, portable):
    if portable:
        monkeypatch.setenv("OSD_NO_AVX2", "1")
    for seed, bias in ((m * 100 + k, True), (n, False)):
        x, w, b = _inputs(m, k, n, seed, bias)
        got = osd_kernels.decode_linear(x, w, b, backend="native")
        want = osd_kernels.decode_linear_reference(x, w, b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (2, 320, 960), (5, 257, 131), (7, 15, 9)])
def test_fused_rms_norm_matches_reference(monkeypatch, m, k, n, portable):
    if portable:
        monkeypatch.setenv("OSD_NO_AVX2", "1")
    x, w, b = _inputs(m, k, n, m + k + n)
    x = x * 3.0 + 0.5  # rows far from unit RMS
    g = torch.rand(k, generator=torch.Generator().manual_seed(k)) + 0.5
    for eps, bias in ((1e-6, b), (1e-2, None)):
        want = F.linear(F.rms_norm(x, (k,), g, eps), w, bias)
        for backend in ("native", "auto", "reference"):
            got = osd_kernels.decode_linear(x, w, bias, norm_weight=g, eps=eps, backend=backend)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("portable", [False, True])
def test_a_row_does_not_depend_on_the_rows_beside_it(monkeypatch, portable):
    """Each row's result is bit-identical whether it runs alone (a decode step) or in a
    pass with others (a verify forward), which greedy speculative decoding equalling
    plain decoding relies on."""
    if portable:
        monkeypatch.setenv("OSD_NO_AVX2", "1")
    # 300 weight rows of K = 200 span three tiles when the rows take several passes.
    x, w, b = _inputs(40, 200, 300, 6)
    g = torch.rand(200, generator=torch.Generator().manual_seed(7)) + 0.5
    for norm in (None, g):
        alone = torch.cat(
            [
                osd_kernels.decode_linear(x[i : i + 1], w, b, norm_weight=norm, backend="native")
                for i in range(40)
            ]
        )
        for m in (2, 5, 9, 12, 16, 25, 40):
            together = osd_kernels.decode_linear(x[:m], w, b, norm_weight=norm, backend="native")
            assert torch.equal(together, alone[:m]), m


PACKED_SHAPES = [
    (1, 1, 16),
    (1, 37, 48),
    (2, 320, 960),
    (3, 33, 80),
    (4, 576, 112),
    (5, 257, 144),
    (6, 1536, 64),
    (7, 15, 32),
    (9, 100, 176),
    (13, 40, 16),
    (11, 64, 112),
    (16, 577, 96),
    (25, 17, 208),
    (61, 9, 48),
]  # (M, K, N); N % 16 == 0


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m,k,n", PACKED_SHAPES)
def test_packed_matches_reference(monkeypatch, m, k, n, isa):
    _use_isa(monkeypatch, isa)
    for seed, bias in ((m * 100 + k, True), (n, False)):
        x, w, b = _inputs(m, k, n, seed, bias)
        p = osd_kernels.pack_weight(w)
        assert p.shape == (n // 16, k, 16) and torch.equal(
            p[1 % p.shape[0], :, 3], w[16 * (1 % p.shape[0]) + 3]
        )
        g = torch.rand(k, generator=torch.Generator().manual_seed(k)) + 0.5
        for norm in (None, g):
            want = osd_kernels.decode_linear_reference(x, w, b, norm_weight=norm)
            for backend in ("native", "auto", "reference"):
                got = osd_kernels.decode_linear(
                    x, w, b, norm_weight=norm, backend=backend, packed=p
                )
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_packed_row_does_not_depend_on_the_rows_beside_it(monkeypatch, isa):
    """From a packed weight too, a row alone equals the same row among others bit for bit,
    over several tiles and passes (of up to 6 or 12 rows), micro-kernels 1, 2 and 4 panels
    wide, and both thread shares."""
    _use_isa(monkeypatch, isa)
    x, w, b = _inputs(40, 1500, 1040, 8)
    p = osd_kernels.pack_weight(w)
    alone = torch.cat(
        [
            osd_kernels.decode_linear(x[i : i + 1], w, b, packed=p, backend="native")
            for i in range(40)
        ]
    )
    for m in (2, 3, 5, 6, 7, 9, 11, 12, 13, 16, 24, 25, 40):
        together = osd_kernels.decode_linear(x[:m], w, b, packed=p, backend="native")
        assert torch.equal(together, alone[:m]), m


def test_pack_weight_and_packed_input_errors():
    x, w, b = _inputs(2, 8, 32, 3)
    with pytest.raises(ValueError, match="multiple of 16"):
        osd_kernels.pack_weight(w[:30])
    with pytest.raises(ValueError, match="packed must be"):
        osd_kernels.decode_linear(x, w, b, packed=osd_kernels.pack_weight(w)[:1], backend="native")
    with pytest.raises(RuntimeError, match="packed weight must be"):
        torch.ops.osd.decode_linear(x, torch.zeros(2, 8, 8), None)
    torch.library.opcheck(torch.ops.osd.decode_linear.default, (x, osd_kernels.pack_weight(w), b))


def test_fused_rms_norm_under_autograd_takes_the_reference():
    x, w, b = _inputs(3, 16, 8, 9)
    g = torch.ones(16, requires_grad=True)
    osd_kernels.decode_linear(x, w, b, norm_weight=g).sum().backward()
    assert g.grad is not None and g.grad.shape == (16,)


def test_batched_and_strided_inputs():
    x, w, b = _inputs(6, 40, 24, 1)
    x3 = x.view(2, 3, 40)
    torch.testing.assert_close(
        osd_kernels.decode_linear(x3, w, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-5
    )
    wide = torch.randn(6, 80)[:, ::2]  # non-unit stride in the last dim
    torch.testing.assert_close(
        osd_kernels.decode_linear(wide, w, backend="native"),
        F.linear(wide, w),
        rtol=1e-5,
        atol=1e-5,
    )
    rows = torch.randn(12, 40)[::2]  # rows further apart than K
    torch.testing.assert_close(
        osd_kernels.decode_linear(rows, w, b, backend="native"),
        F.linear(rows, w, b),
        rtol=1e-5,
        atol=1e-5,
    )
    empty = torch.zeros(0, 40)
    assert osd_kernels.decode_linear(empty, w, backend="native").shape == (0, 24)


def test_auto_uses_the_kernel_only_where_it_is_meant_to(monkeypatch):
    calls = []
    real = torch.ops.osd.decode_linear

    class Spy:
        def __call__(self, *args):
            calls.append(args[0].shape[0])
            return real(*args)

    monkeypatch.setattr(torch.ops.osd, "decode_linear", Spy())
    x, w, b = _inputs(WIDE_MAX_ROWS + 1, 16, 8, 2)
    xw, ww, bw = _inputs(MAX_ROWS + 1, WIDE_MAX_K + 1, 8, 3)
    osd_kernels.decode_linear(x[:WIDE_MAX_ROWS], w, b)
    osd_kernels.decode_linear(x, w, b)  # too many rows
    osd_kernels.decode_linear(xw[:MAX_ROWS], ww, bw)
    osd_kernels.decode_linear(xw, ww, bw)  # too many rows for this K
    osd_kernels.decode_linear(x[:2].double(), w.double(), None)  # not float32
    with torch.no_grad():
        osd_kernels.decode_linear(x[:2], w.requires_grad_(), b)
    assert calls == [WIDE_MAX_ROWS, MAX_ROWS, 2]
    y = osd_kernels.decode_linear(x[:2], w, b)  # autograd needs F.linear
    y.sum().backward()
    assert w.grad is not None and calls == [WIDE_MAX_ROWS, MAX_ROWS, 2]


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_bad_input_names_the_problem(backend):
    x, w, b = _inputs(2, 8, 4, 3)
    with pytest.raises(ValueError, match="x must be"):
        osd_kernels.decode_linear(torch.randn(2, 7), w, backend=backend)
    with pytest.raises(ValueError, match="weight must be"):
        osd_kernels.decode_linear(x, w[0], backend=backend)
    with pytest.raises(TypeError, match="float dtype"):
        osd_kernels.decode_linear(x.double(), w, backend=backend)
    with pytest.raises(ValueError, match="bias must be"):
        osd_kernels.decode_linear(x, w, b[:3], backend=backend)
    with pytest.raises(ValueError, match="norm_weight must be"):
        osd_kernels.decode_linear(x, w, norm_weight=torch.ones(7), backend=backend)
    with pytest.raises(ValueError, match="eps must be"):
        osd_kernels.decode_linear(x, w, norm_weight=torch.ones(8), eps=-1.0, backend=backend)
    with pytest.raises(ValueError, match="unknown backend"):
        osd_kernels.decode_linear(x, w, backend="fast")


def test_native_rejects_other_dtypes():
    x, w, _ = _inputs(2, 8, 4, 4)
    with pytest.raises(RuntimeError, match="x must be Float"):
        osd_kernels.decode_linear(x.bfloat16(), w.bfloat16(), backend="native")


def test_opcheck():
    x, w, b = _inputs(3, 24, 10, 5)
    torch.library.opcheck(torch.ops.osd.decode_linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.osd.decode_linear.default, (x, w, None))
    torch.library.opcheck(torch.ops.osd.decode_linear.default, (x, w, b, torch.rand(24), 1e-5))
