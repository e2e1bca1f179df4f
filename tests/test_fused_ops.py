"""The fused decode-layer ops (add_rms_norm, silu_mul, rope_kv_write): the Triton kernels,
run by the interpreter on CPU tensors (and compiled on CUDA, marked gpu), and the C++ CPU
kernels (float32, the ``native`` backend), against the PyTorch references on random
inputs of odd shapes (odd hidden sizes, B = 1..5, T = 1..7), in float32 and bfloat16.

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
    native_available,
    add_rms_norm_reference,
    rope_kv_write,
    rope_kv_write_reference,
    silu_mul,
    silu_mul_reference,
    use_avx512,
)
from osd_kernels.rope_kv_write import rope_kv_write_qkv
from tests.conftest import set_isa

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
    """Rows of a wider tensor (a row stride past H); ``auto`` on CPU is the reference
    without the native build, else the C++ kernel (same ``h``, ``y`` to float32 rounding)."""
    gen = torch.Generator().manual_seed(3)
    wide = _randn(gen, 3, 4, 90, dtype=torch.float32)
    x, residual = wide[..., :45], wide[..., 45:]
    weight = _randn(gen, 45, dtype=torch.float32) + 1
    h_ref, y_ref = add_rms_norm_reference(x, residual, weight, 1e-6)
    h, y = add_rms_norm(x, residual, weight, 1e-6, backend="triton")
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    torch.testing.assert_close(y, y_ref, **TOL[torch.float32])
    h, y = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(h, h_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, inter", [(1, 1, 45), (2, 7, 88), (5, 3, 1500), (3, 1, 2049)])
def test_silu_mul_triton_matches_reference(device, dtype, B, T, inter):
    gen = torch.Generator().manual_seed(B * 1000 + T * 100 + inter)
    gate_up = _randn(gen, B, T, 2 * inter, dtype=dtype, scale=2.0).to(device)
    ref = silu_mul_reference(gate_up)
    got = silu_mul(gate_up, backend="triton")
    assert got.dtype == dtype and got.shape == (B, T, inter)
    torch.testing.assert_close(got, ref, **TOL[dtype])
    if device.type == "cpu" and dtype != torch.float32:
        assert torch.equal(silu_mul(gate_up), ref)  # auto on CPU in half precision: the reference


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


def test_rope_kv_write_triton_half_cache(device):
    """Triton writes a float16 cache under float32 operands as the reference does."""
    gen = torch.Generator().manual_seed(12)
    q, k, v, cos, sin, kv, slots = (
        None if t is None else t.to(device)
        for t in _rope_case(gen, 2, 3, 4, 2, 16, 16, torch.float32)
    )
    kv = kv.half()
    kv_ref = kv.clone()
    q_ref = rope_kv_write_reference(q, k, v, cos, sin, kv_ref, slots)
    got = rope_kv_write(q, k, v, cos, sin, kv, slots, backend="triton")
    torch.testing.assert_close(got, q_ref, **TOL[torch.float32])
    torch.testing.assert_close(kv.float(), kv_ref.float(), atol=1e-3, rtol=1e-3)


def test_rope_kv_write_auto_on_cpu_equals_the_reference():
    """The reference, or the C++ kernel, which rounds as it does."""
    gen = torch.Generator().manual_seed(11)
    q, k, v, cos, sin, kv, slots = _rope_case(gen, 2, 3, 4, 2, 16, 16, torch.float32)
    kv_ref = kv.clone()
    q_ref = rope_kv_write_reference(q, k, v, cos, sin, kv_ref, slots)
    assert torch.equal(rope_kv_write(q, k, v, cos, sin, kv, slots), q_ref)
    assert torch.equal(kv, kv_ref)


def test_bad_arguments_raise():
    x = torch.zeros(2, 8)
    if native_available():
        xb = x.bfloat16()
        with pytest.raises(ValueError, match="native add_rms_norm kernel takes float32"):
            add_rms_norm(xb, xb, torch.ones(8).bfloat16(), backend="native")
        with pytest.raises(ValueError, match="native silu_mul kernel takes float32"):
            silu_mul(xb, backend="native")
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


# ---------------------------------------------------------------------------------------
# The C++ CPU kernels (backend "native", float32): the residual sum, SiLU on torch's vector
# width, the rotation and every cache entry bit for bit; the norm bit for bit against
# decode_linear's fused norm (the unfused CPU forward's) and within 1e-6 relative of
# F.rms_norm's (a float32 sum in another order); SiLU on another vector width than torch's
# within 3e-7 relative (one rounding of the exponential on a row's last elements).

native = pytest.mark.skipif(not native_available(), reason="osd_kernels._C is not built")
ISAS = [{}, {"OSD_NO_AVX512": "1"}, {"OSD_NO_AVX2": "1"}]  # AVX-512, AVX2, portable
ISA_IDS = ["avx512", "avx2", "portable"]


def _norm_of(h, weight, eps):
    """decode_linear's fused RMSNorm of ``h`` (an identity GEMV is exact)."""
    eye = torch.eye(h.shape[-1])
    return torch.ops.osd.decode_linear(h.reshape(-1, h.shape[-1]), eye, None, weight, eps)


@native
@pytest.mark.parametrize("env", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize(
    "shape, scale, view",
    [
        ((1, 1, 576), 1.0, "contiguous"),
        ((2, 7, 37), 0.22, "contiguous"),
        ((5, 3, 129), 1.0, "rows"),  # rows of a wider tensor
        ((3, 999), 0.5, "transposed"),  # rows gathered by a copy
        ((1537,), 1.0, "contiguous"),
    ],
)
def test_add_rms_norm_native(monkeypatch, env, shape, scale, view):
    set_isa(monkeypatch, env)
    gen = torch.Generator().manual_seed(sum(shape))
    H = shape[-1]
    if view == "rows":
        wide = _randn(gen, *shape[:-1], 2 * H + 3, dtype=torch.float32)
        x, residual = wide[..., :H], wide[..., H + 3 :]
    elif view == "transposed":
        x = _randn(gen, H, shape[0], dtype=torch.float32).t()
        residual = _randn(gen, *shape, dtype=torch.float32, scale=3.0)
    else:
        x = _randn(gen, *shape, dtype=torch.float32)
        residual = _randn(gen, *shape, dtype=torch.float32, scale=3.0)
    weight = _randn(gen, H, dtype=torch.float32, scale=0.1) + 1
    h_ref, y_ref = add_rms_norm_reference(x, residual, weight, 1e-5, scale)
    h, y = add_rms_norm(x, residual, weight, 1e-5, scale=scale, backend="native")
    assert h.shape == y.shape == x.shape and h.is_contiguous() and y.is_contiguous()
    assert torch.equal(h, h_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=0)
    assert torch.equal(y.reshape(-1, H), _norm_of(h_ref, weight, 1e-5))


@native
@pytest.mark.parametrize("env", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("shape", [(1, 1, 1536), (2, 7, 45), (5, 3, 1500), (3, 49), (17,)])
def test_silu_mul_native(monkeypatch, env, shape):
    set_isa(monkeypatch, env)
    gen = torch.Generator().manual_seed(sum(shape))
    gate_up = _randn(gen, *shape[:-1], 2 * shape[-1], dtype=torch.float32, scale=4.0)
    ref = silu_mul_reference(gate_up)
    got = silu_mul(gate_up, backend="native")
    assert got.shape == ref.shape
    # torch's SiLU runs SLEEF's exp at its capability's vector width: the same one is exact
    ours = None if "OSD_NO_AVX2" in env else "AVX512" if use_avx512() else "AVX2"
    if ours == torch.backends.cpu.get_cpu_capability():
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, rtol=3e-7, atol=1e-30)
    # rows of a wider tensor
    wide = _randn(gen, 3, 2 * shape[-1] + 5, dtype=torch.float32)
    torch.testing.assert_close(
        silu_mul(wide[:, 5:], backend="native"), silu_mul_reference(wide[:, 5:]), rtol=3e-7, atol=0
    )


@native
@pytest.mark.parametrize("env", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize(
    "B, T, Hq, Hkv, D, R",
    [
        (1, 1, 9, 3, 64, 64),  # decode, GQA (SmolLM2-135M's heads)
        (2, 7, 4, 2, 24, 24),
        (5, 3, 3, 1, 20, 12),  # partial rotary, odd head counts
        (3, 5, 2, 2, 18, 0),  # a layer without RoPE
        (4, 3, 7, 7, 6, 2),  # odd T and heads, no GQA, R = 2
    ],
)
def test_rope_kv_write_native(monkeypatch, env, B, T, Hq, Hkv, D, R):
    set_isa(monkeypatch, env)
    gen = torch.Generator().manual_seed(B * 10**4 + T * 1000 + D * 10 + R)
    q, k, v, cos, sin, kv, slots = _rope_case(gen, B, T, Hq, Hkv, D, R, torch.float32)
    kv_ref = kv.clone()
    q_ref = rope_kv_write_reference(q, k, v, cos, sin, kv_ref, slots)
    got = rope_kv_write(q, k, v, cos, sin, kv, slots, backend="native")
    assert got.shape == (B, T, Hq, D) and got.is_contiguous()
    assert torch.equal(got, q_ref) and torch.equal(kv, kv_ref)
    # the qkv form, from [B, T, W] and from [B * T, W] rows
    qkv = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1)
    for rows in (qkv, qkv.reshape(B * T, -1)):
        kv_qkv = kv.clone()
        got = rope_kv_write_qkv(rows, Hq, cos, sin, kv_qkv, slots, backend="native")
        assert torch.equal(got, q_ref) and torch.equal(kv_qkv, kv_ref)


@native
@pytest.mark.parametrize("env", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize(
    "B, T, Hq, Hkv, D, R", [(1, 1, 9, 3, 64, 64), (2, 7, 4, 2, 24, 24), (3, 5, 2, 2, 18, 0)]
)
def test_rope_kv_write_half_cache(monkeypatch, env, B, T, Hq, Hkv, D, R):
    """A float16 cache under float32 q and k: the queries as with a float32 cache, K and V
    rounded to nearest as they are written (what writing float32 then Tensor.half()
    gives), every other entry untouched; the reference writes the same."""
    set_isa(monkeypatch, env)
    gen = torch.Generator().manual_seed(B * 10**4 + T * 1000 + D * 10 + R + 1)
    q, k, v, cos, sin, kv, slots = _rope_case(gen, B, T, Hq, Hkv, D, R, torch.float32)
    kv = kv.half()
    kv32 = kv.float()
    q32 = rope_kv_write(q, k, v, cos, sin, kv32, slots, backend="native")
    kv_ref = kv.clone()
    q_ref = rope_kv_write_reference(q, k, v, cos, sin, kv_ref, slots)
    got = rope_kv_write(q, k, v, cos, sin, kv, slots, backend="native")
    assert torch.equal(got, q32) and torch.equal(got, q_ref)
    assert torch.equal(kv, kv32.half()) and torch.equal(kv, kv_ref)
    qkv = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1)
    kv_qkv = kv_ref.clone()
    rope_kv_write(q, k, v, cos, sin, kv_ref, slots, backend="reference")
    assert torch.equal(rope_kv_write_qkv(qkv, Hq, cos, sin, kv_qkv, slots, backend="native"), q32)
    assert torch.equal(kv_qkv, kv_ref)
    with pytest.raises(TypeError, match="kv"):
        rope_kv_write(q, k, v, cos, sin, kv.bfloat16(), slots)


@native
def test_rope_kv_write_native_strided_operands():
    """One layer of a whole cache (``cache.kv[i]``: strided rows and heads), tables that are
    views of wider ones, a strided slots tensor, head dims with a stride (copied)."""
    gen = torch.Generator().manual_seed(5)
    B, T, Hq, Hkv, D, S = 2, 3, 5, 1, 16, 11
    full = _randn(gen, 3, 2, 4, Hkv, S, D, dtype=torch.float32)  # [L, 2, B_max, H, S, D]
    kv, kv_ref = full[1], full[1].clone()
    q = _randn(gen, B, T, Hq, 2 * D, dtype=torch.float32)[..., ::2]  # stride 2 in D
    k, v = (_randn(gen, B, Hkv, T, D, dtype=torch.float32).transpose(1, 2) for _ in range(2))
    cos, sin = (_randn(gen, B, T, 2 * D, dtype=torch.float32)[..., :D] for _ in range(2))
    slots = torch.tensor([[4, 9, 0, 0], [1, 2, 10, 3]])[:, 1:]
    others = full[[0, 2]].clone()
    q_ref = rope_kv_write_reference(q, k, v, cos, sin, kv_ref, slots)
    got = rope_kv_write(q, k, v, cos, sin, kv, slots, backend="native")
    assert torch.equal(got, q_ref) and torch.equal(full[1], kv_ref)
    assert torch.equal(full[[0, 2]], others)


@native
def test_native_kernel_errors():
    """The C++ kernels check what they read: float32, shapes, slots inside the cache."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, cos, sin, kv, slots = _rope_case(gen, 2, 3, 4, 2, 16, 16, torch.float32)
    ops = torch.ops.osd
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_kv_write(q, k, v, cos, sin, kv, slots + kv.shape[3])
    with pytest.raises(RuntimeError, match="kv must be"):
        ops.rope_kv_write(q, k, v, cos, sin, kv[:, :, :1], slots)
    with pytest.raises(RuntimeError, match="R even"):
        ops.rope_kv_write(q, k, v, cos[..., :3], sin[..., :3], kv, slots)
    with pytest.raises(RuntimeError, match="qkv must be"):
        ops.rope_kv_write_qkv(torch.zeros(6, 100), 4, cos, sin, kv, slots)
    with pytest.raises(RuntimeError, match="must be Float"):
        ops.silu_mul(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="2 I"):
        ops.silu_mul(torch.zeros(2, 7))
    x = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.add_rms_norm(x, x, torch.ones(7), 1e-6, 1.0)
    with pytest.raises(RuntimeError, match="one shape"):
        ops.add_rms_norm(x, torch.zeros(2, 9), torch.ones(8), 1e-6, 1.0)
    with pytest.raises(RuntimeError, match="eps"):
        ops.add_rms_norm(x, x, torch.ones(8), -1.0, 1.0)
    # the Python entry points raise their own errors first
    with pytest.raises(ValueError, match="qkv must hold"):
        rope_kv_write_qkv(torch.zeros(6, 100), 4, cos, sin, kv, slots)
    with pytest.raises(ValueError, match="slots"):
        rope_kv_write_qkv(torch.zeros(6, 128), 4, cos, sin, kv, slots.int())


@native
def test_native_fake_kernels():
    """Schemas, fake (meta) kernels and the cache mutation pass torch's op checks."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, cos, sin, kv, slots = _rope_case(gen, 2, 3, 4, 2, 16, 16, torch.float32)
    x = _randn(gen, 3, 40, dtype=torch.float32)
    ops = torch.ops.osd
    torch.library.opcheck(ops.add_rms_norm.default, (x, x, torch.ones(40), 1e-6, 0.5))
    torch.library.opcheck(ops.silu_mul.default, (x,))
    torch.library.opcheck(ops.rope_kv_write.default, (q, k, v, cos, sin, kv, slots))
    qkv = torch.cat([t.reshape(2, 3, -1) for t in (q, k, v)], dim=-1)
    torch.library.opcheck(ops.rope_kv_write_qkv.default, (qkv, 4, cos, sin, kv, slots))
