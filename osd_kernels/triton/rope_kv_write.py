"""Triton kernel for ``rope_kv_write`` (semantics: ``osd_kernels.rope_kv_write``).

Program (b * T + t, h) owns one head of token t of row b: a query head (``h < Hq``), whose
rotated values go to the output, or key/value head ``h - Hq``, whose rotated key and whose
value go to the cache at ``[row b, slot slots[b, t]]``. RoPE's half-split rotation needs
each element's partner half a head away: a second load of the same head row (cached), so
no data moves between threads. Elements past ``rot_dim`` (partial rotary) pass through.
``x * cos`` is rounded to the dtype before the rest of the sum, as the reference rounds it.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(src, cos_row, sin_row, d, head_dim, rot_dim, ROPE: tl.constexpr):
    """One head row ``src[0:head_dim]``, rotated by the first ``rot_dim`` of the tables."""
    x = tl.load(src + d, mask=d < head_dim, other=0.0)
    if ROPE:
        half = rot_dim // 2
        in_rot = d < rot_dim
        partner = tl.where(d < half, d + half, d - half)
        xp = tl.load(src + partner, mask=in_rot, other=0.0).to(tl.float32)
        c = tl.load(cos_row + d, mask=in_rot, other=1.0).to(tl.float32)
        s = tl.load(sin_row + d, mask=in_rot, other=0.0).to(tl.float32)
        xc = (x.to(tl.float32) * c).to(src.dtype.element_ty).to(tl.float32)
        x = tl.where(in_rot, (xc + xp * s).to(src.dtype.element_ty), x)
    return x


@triton.jit
def _rope_kv_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    kv_ptr,
    slots_ptr,
    out_ptr,
    T,
    num_q_heads,
    head_dim,
    rot_dim,
    sq_b,
    sq_t,
    sq_h,
    sk_b,
    sk_t,
    sk_h,
    sv_b,
    sv_t,
    sv_h,
    sc_b,
    sc_t,
    ss_b,
    ss_t,
    sl_b,
    skv_kv,
    skv_b,
    skv_h,
    skv_s,
    ROPE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bt = tl.program_id(0)
    h = tl.program_id(1)
    b = (bt // T).to(tl.int64)
    t = (bt % T).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    cos_row = cos_ptr + b * sc_b + t * sc_t
    sin_row = sin_ptr + b * ss_b + t * ss_t
    if h < num_q_heads:
        x = _rotate(
            q_ptr + b * sq_b + t * sq_t + h * sq_h, cos_row, sin_row, d, head_dim, rot_dim, ROPE
        )
        tl.store(out_ptr + ((b * T + t) * num_q_heads + h) * head_dim + d, x, mask=dmask)
    else:
        hk = (h - num_q_heads).to(tl.int64)
        slot = tl.load(slots_ptr + b * sl_b + t)
        dst = kv_ptr + b * skv_b + hk * skv_h + slot * skv_s
        x = _rotate(
            k_ptr + b * sk_b + t * sk_t + hk * sk_h, cos_row, sin_row, d, head_dim, rot_dim, ROPE
        )
        tl.store(dst + d, x, mask=dmask)
        v = tl.load(v_ptr + b * sv_b + t * sv_t + hk * sv_h + d, mask=dmask)
        tl.store(dst + skv_kv + d, v, mask=dmask)


def num_warps_for(head_dim: int) -> int:
    return 1 if head_dim <= 128 else 2


def rope_kv_write_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    kv: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Triton ``rope_kv_write``; arguments as ``osd_kernels.rope_kv_write`` (already checked)."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if kv.stride(-1) != 1:
        raise ValueError("kv must be contiguous in its last dim")
    if slots.stride(-1) != 1:
        slots = slots.contiguous()
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    out = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    if B * T == 0:
        return out
    rope = cos is not None
    if rope:
        cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (cos, sin))
        tables = (cos, sin, cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1))
        rot = cos.shape[-1]
    else:  # the tables are not read: any pointer, zero strides
        tables, rot = (q, q, 0, 0, 0, 0), 0
    c_ptr, s_ptr, sc_b, sc_t, ss_b, ss_t = tables
    _rope_kv_write_kernel[(B * T, Hq + Hkv)](
        q,
        k,
        v,
        c_ptr,
        s_ptr,
        kv,
        slots,
        out,
        T,
        Hq,
        D,
        rot,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        sc_b,
        sc_t,
        ss_b,
        ss_t,
        slots.stride(0),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        ROPE=rope,
        BLOCK_D=triton.next_power_of_2(D),
        num_warps=num_warps_for(D),
    )
    return out
