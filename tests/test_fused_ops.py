"""The fused decode-layer ops (add_rms_norm, silu_mul, rope_kv_write): the Triton kernels,
run by the interpreter on CPU tensors (and compiled on CUDA, marked gpu), against the
PyTorch references on random inputs of
odd shapes (odd hidden sizes, B = 1..5, T = 1..7), in float32 and bfloat16.

Tolerances. float32: the residual sum and copied values exactly; normed, SiLU and rotated
values within 1e-5 relative / 1e-6 absolute (a different summation order, float32 exp).
bfloat16: the interpreter rounds float32 to bfloat16 toward zero (a GPU rounds to
nearest), so each rounding may differ by one bfloat16 ulp (2^-8 to 2^-7 relative): one
rounding (the residual sum) within 2^-7 relative, a chain of two or three within 2^-6
relative and absolute on values of order 1. Values copied are still exact.
"""

import pytest
import torch

from osd_kernels import (
    add_rms_norm,
    add_rms_norm_reference,
    rope_kv_write,
    rope_kv_write_reference,
    silu_mul,
    silu_mul_reference,
)

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2**-6, atol=2**-6)}
SUM_TOL = {torch.float32: dict(rtol=0, atol=0), torch.bfloat16: dict(rtol=2**-7, atol=2**-7)}
EXACT = dict(rtol=0, atol=0)


def _randn(gen, *shape, dtype, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "B, T, H, scale",
    [(1, 1, 37, 1.0), (2, 7, 64, 0.22), (5, 3, 129, 1.0), (3, 5, 999, 1.0), (4, 2, 1537, 0.5)],
)
def test_add_rms_norm_triton_matches_reference(device, dtype, B, T, H, scale):
    gen = torch.Generator().manual_seed(B * 1000 + T * 100 + H)
    x = _randn(gen, B, T, H, dtype=dtype).to(device)
    residual = _randn(gen, B, T, H, dtype=dtype, scale=3.0).to(device)
    weight = (_randn(gen, H, dtype=dtype, scale=0.1) + 1).to(device)
    h_ref, y_ref = add_rms_norm_reference(x, residual, weight, 1e-5, scale)
    h, y = add_rms_norm(x, residual, weight, 1e-5, scale=scale, backend="triton")
    assert h.dtype == y.dtype == dtype and h.shape == y.shape == x.shape
    torch.testing.assert_close(h, h_ref, **SUM_TOL[dtype])
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


def test_add_rms_norm_strided_rows_and_auto_on_cpu():
    """Rows of a wider tensor (a row stride past H); ``auto`` on CPU is the reference."""
    gen = torch.Generator().manual_seed(3)
    wide = _randn(gen, 3, 4, 90, dtype=torch.float32)
    x, residual = wide[..., :45], wide[..., 45:]
    weight = _randn(gen, 45, dtype=torch.float32) + 1
    h_ref, y_ref = add_rms_norm_reference(x, residual, weight, 1e-6)
    h, y = add_rms_norm(x, residual, weight, 1e-6, backend="triton")
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    torch.testing.assert_close(y, y_ref, **TOL[torch.float32])
    h, y = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(h, h_ref) and torch.equal(y, y_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, inter", [(1, 1, 45), (2, 7, 88), (5, 3, 1500), (3, 1, 2049)])
def test_silu_mul_triton_matches_reference(device, dtype, B, T, inter):
    gen = torch.Generator().manual_seed(B * 1000 + T * 100 + inter)
    gate_up = _randn(gen, B, T, 2 * inter, dtype=dtype, scale=2.0).to(device)
    ref = silu_mul_reference(gate_up)
    got = silu_mul(gate_up, backend="triton")
    assert got.dtype == dtype and got.shape == (B, T, inter)
    torch.testing.assert_close(got, ref, **TOL[dtype])
    if device.type == "cpu":
        assert torch.equal(silu_mul(gate_up), ref)  # auto on CPU: the reference


def _rope_case(gen, B, T, Hq, Hkv, D, R, dtype, B_max=6, S=23):
    """Views of one projection ``[B, T, Hq + 2 Hkv, D]``, tables at tree positions that
    differ from the slots, and a cache with random contents."""
    qkv = _randn(gen, B, T, Hq + 2 * Hkv, D, dtype=dtype)
    q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq : Hq + Hkv], qkv[:, :, Hq + Hkv :]
    if R:
        angles = torch.rand(S, R // 2, generator=gen) * 6.3
        cos_t = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
        sin_t = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
        lens = torch.randint(0, S - T + 1, (B, 1), generator=gen)
        depths = torch.randint(0, T, (B, T), generator=gen)
        positions = lens + depths
        cos, sin = cos_t[positions], sin_t[positions]
    else:
        cos = sin = None
    slots = torch.stack([torch.randperm(S, generator=gen)[:T] for _ in range(B)])
    kv = _randn(gen, 2, B_max, Hkv, S, D, dtype=dtype)
    return q, k, v, cos, sin, kv, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "B, T, Hq, Hkv, D, R",
    [
        (1, 1, 4, 2, 16, 16),  # decode
        (2, 7, 4, 2, 24, 24),  # head width not a power of two (Qwen3's test model)
        (5, 3, 3, 1, 20, 12),  # partial rotary (Phi-4-mini style), odd head counts
        (3, 5, 2, 2, 18, 0),  # a layer without RoPE
        (4, 2, 6, 3, 7, 0),  # odd head width, no RoPE
    ],
)
def test_rope_kv_write_triton_matches_reference(device, dtype, B, T, Hq, Hkv, D, R):
    gen = torch.Generator().manual_seed(B * 10**4 + T * 1000 + D * 10 + R)
    q, k, v, cos, sin, kv, slots = (
        None if t is None else t.to(device) for t in _rope_case(gen, B, T, Hq, Hkv, D, R, dtype)
    )
    kv_ref = kv.clone()
    q_ref = rope_kv_write_reference(q, k, v, cos, sin, kv_ref, slots)
    ptr = kv.data_ptr()
    got = rope_kv_write(q, k, v, cos, sin, kv, slots, backend="triton")
    assert kv.data_ptr() == ptr and got.shape == (B, T, Hq, D) and got.dtype == dtype
    torch.testing.assert_close(got, q_ref, **(TOL[dtype] if R else EXACT))
    # values and every entry not written are exact; keys within the rounding tolerance
    assert torch.equal(kv[1], kv_ref[1])
    written = torch.zeros(kv.shape[1], kv.shape[3], dtype=torch.bool)
    written[torch.arange(B)[:, None], slots.cpu()] = True
    # [B_max, S, Hkv, D]
    keys, keys_ref = kv[0].cpu().transpose(1, 2), kv_ref[0].cpu().transpose(1, 2)
    assert torch.equal(keys[~written], keys_ref[~written])
    torch.testing.assert_close(keys[written], keys_ref[written], **(TOL[dtype] if R else EXACT))


def test_rope_kv_write_auto_on_cpu_is_the_reference():
    gen = torch.Generator().manual_seed(11)
    q, k, v, cos, sin, kv, slots = _rope_case(gen, 2, 3, 4, 2, 16, 16, torch.float32)
    kv_ref = kv.clone()
    q_ref = rope_kv_write_reference(q, k, v, cos, sin, kv_ref, slots)
    assert torch.equal(rope_kv_write(q, k, v, cos, sin, kv, slots), q_ref)
    assert torch.equal(kv, kv_ref)


def test_bad_arguments_raise():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="native"):
        add_rms_norm(x, x, torch.ones(8), backend="native")
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, x, torch.ones(7))
    with pytest.raises(TypeError):
        add_rms_norm(x, x.bfloat16(), torch.ones(8))
    with pytest.raises(ValueError, match="2 I"):
        silu_mul(torch.zeros(2, 7))
    gen = torch.Generator().manual_seed(0)
    q, k, v, cos, sin, kv, slots = _rope_case(gen, 2, 3, 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="slots"):
        rope_kv_write(q, k, v, cos, sin, kv, slots.int())
    with pytest.raises(ValueError, match="R even"):
        rope_kv_write(q, k, v, cos[..., :15], sin[..., :15], kv, slots)
    with pytest.raises(ValueError, match="both"):
        rope_kv_write(q, k, v, cos, None, kv, slots)
    with pytest.raises(ValueError, match="kv must be"):
        rope_kv_write(q, k, v, cos, sin, kv[:, :1], slots)
