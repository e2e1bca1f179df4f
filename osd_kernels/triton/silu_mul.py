"""Triton kernel for ``silu_mul`` (semantics: ``osd_kernels.silu_mul``).

Program (m, j) owns columns ``[j * BLOCK, (j + 1) * BLOCK)`` of row m: it loads those
columns of the gate half and of the up half of the concatenated projection and stores
``silu(gate) * up``. SiLU is computed in float32 and rounded to the dtype before the
product, as the reference rounds ``F.silu(gate)``.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, s_m, BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    row = gu_ptr + m * s_m
    g = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + m * inter + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def block_for(inter: int) -> int:
    """Columns per program: up to 1,024 (4 warps, 8 a thread)."""
    return min(1024, triton.next_power_of_2(inter))


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton ``silu_mul``; arguments as ``osd_kernels.silu_mul`` (already checked)."""
    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] == 0 or inter == 0:
        return out
    block = block_for(inter)
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out, inter, rows.stride(0), BLOCK=block, num_warps=4
    )
    return out
