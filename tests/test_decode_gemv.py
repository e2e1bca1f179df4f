"""decode_gemv: the Triton kernel, run by the interpreter on CPU tensors (and compiled on
CUDA, marked gpu), against the PyTorch reference on random inputs of odd shapes (M = 1..11
rows, so one and two row blocks; odd K and N, so partial tiles), with each prologue /
epilogue.

Tolerances. float32: within 1e-5 absolute and relative on outputs of order 1 (dot products
of up to 1,100 terms summed in another order). bfloat16: within 2^-5 of the largest output
(4 bfloat16 ulps of it): the interpreter rounds float32 to bfloat16 toward zero where a GPU
rounds to nearest, and the result goes through up to five roundings (norm, projection,
SiLU, product or scale, residual add), each of which may differ by one ulp.
"""

import pytest
import torch

from osd_kernels import decode_gemv, decode_gemv_reference

DTYPES = [torch.float32, torch.bfloat16]
VARIANTS = {
    "plain": lambda t: dict(),
    "bias": lambda t: dict(bias=t["bias"]),
    "norm": lambda t: dict(norm_weight=t["norm"], eps=1e-5),
    "norm+gated+bias": lambda t: dict(norm_weight=t["norm"], gated=True, bias=t["bias"]),
    "gated": lambda t: dict(gated=True),
    "residual*scale": lambda t: dict(residual=t["residual"], scale=0.22),
    "norm+residual": lambda t: dict(norm_weight=t["norm"], residual=t["residual"]),
}


def _case(gen, M, K, N, dtype, gated):
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)
    out = N // 2 if gated else N
    return (
        x,
        w,
        dict(
            bias=torch.randn(N, generator=gen).to(dtype),
            norm=(1 + 0.1 * torch.randn(K, generator=gen)).to(dtype),
            residual=torch.randn(M, out, generator=gen).to(dtype),
        ),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "M, K, N", [(1, 37, 14), (3, 515, 46), (5, 64, 30), (8, 257, 18), (11, 1100, 22)]
)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_triton_matches_reference(device, dtype, M, K, N, variant):
    gen = torch.Generator().manual_seed(M * 10**4 + K * 10 + N)
    x, w, t = _case(gen, M, K, N, dtype, "gated" in variant)
    x, w, t = x.to(device), w.to(device), {k: v.to(device) for k, v in t.items()}
    kw = VARIANTS[variant](t)
    ref = decode_gemv_reference(x, w, **kw)
    got = decode_gemv(x, w, backend="triton", **kw)
    assert got.shape == ref.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:
        assert (got.float() - ref.float()).abs().max() <= 2**-5 * ref.float().abs().max()


def test_rows_of_a_batch_and_auto():
    """``[B, T, K]`` input with strided rows; ``auto`` on CPU is the reference."""
    gen = torch.Generator().manual_seed(9)
    wide = torch.randn(2, 3, 2 * 45, generator=gen)
    x = wide[..., :45]
    w = torch.randn(20, 45, generator=gen) / 45**0.5
    ref = decode_gemv_reference(x, w)
    torch.testing.assert_close(decode_gemv(x, w, backend="triton"), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(decode_gemv(x, w), ref)


def test_bad_arguments_raise():
    x, w = torch.zeros(2, 8), torch.zeros(6, 8)
    with pytest.raises(ValueError, match="native"):
        decode_gemv(x, w, backend="native")
    with pytest.raises(ValueError, match="exclusive"):
        decode_gemv(x, w, gated=True, residual=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="2 I"):
        decode_gemv(x, torch.zeros(7, 8), gated=True)
    with pytest.raises(ValueError, match="residual"):
        decode_gemv(x, w, residual=torch.zeros(2, 5))
    with pytest.raises(TypeError):
        decode_gemv(x, w.bfloat16())
