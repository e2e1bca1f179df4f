"""Triton kernel for ``kv_rollback`` (semantics: ``osd_kernels.kv_rollback``).

Program (b, l*2*H + h) owns one head row of one layer's K or V for sequence b, walks the
accepted path in order and copies the D elements of each slot. Since the path is strictly
increasing, a destination never lies after its source and the in-place copy is race-free:
no slot is read after a copy has written it, and an element's load and store share one
layout (the same thread), so no barrier is needed.
The length update is a second, tiny launch, so it happens after every copy has read it.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_rollback_kernel(
    kv_ptr,
    lens_ptr,
    slots_ptr,
    keep_ptr,
    num_heads,
    head_dim,
    stride_lk,
    stride_b,
    stride_h,
    stride_s,
    slots_stride_b,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    lkh = tl.program_id(1)
    lk = lkh // num_heads
    h = lkh % num_heads
    n = tl.load(keep_ptr + b)
    base = tl.load(lens_ptr + b).to(tl.int64)
    row = (
        kv_ptr + lk.to(tl.int64) * stride_lk + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    )
    for d0 in range(0, head_dim, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        mask = offs < head_dim
        for j in range(0, n):
            src = base + tl.load(slots_ptr + b * slots_stride_b + j)
            dst = base + j
            x = tl.load(row + src * stride_s + offs, mask=mask)
            tl.store(row + dst * stride_s + offs, x, mask=mask)


@triton.jit
def _advance_lens_kernel(lens_ptr, keep_ptr, batch, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < batch
    keep = tl.load(keep_ptr + offs, mask=mask, other=0)
    lens = tl.load(lens_ptr + offs, mask=mask, other=0)
    tl.store(lens_ptr + offs, lens + tl.maximum(keep, 0), mask=mask)


def kv_rollback_triton(
    kv_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    accepted_slots: torch.Tensor,
    num_keep: torch.Tensor,
) -> None:
    """Triton ``kv_rollback``; arguments as ``osd_kernels.kv_rollback`` (already checked)."""
    if kv_cache.stride(5) != 1 or kv_cache.stride(0) != 2 * kv_cache.stride(1):
        raise ValueError("kv_cache must be contiguous in its last dim with mergeable dims 0, 1")
    slots = accepted_slots if accepted_slots.stride(1) == 1 else accepted_slots.contiguous()
    batch = slots.shape[0]
    if batch == 0:
        return
    L, _, _, H, _, D = kv_cache.shape
    _kv_rollback_kernel[(batch, L * 2 * H)](
        kv_cache,
        cache_lens,
        slots,
        num_keep,
        H,
        D,
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        slots.stride(0),
        BLOCK_D=min(triton.next_power_of_2(D), 256),
    )
    _advance_lens_kernel[(1,)](cache_lens, num_keep, batch, BLOCK=triton.next_power_of_2(batch))
