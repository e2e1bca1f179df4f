"""Triton kernel for ``add_rms_norm`` (semantics: ``osd_kernels.add_rms_norm``).

Program m owns row m: it loads the row of ``x`` and of the residual once, stores their sum
(rounded to the residual's dtype) as the new residual, and normalises that rounded sum, so
the normed output is exactly the norm of the residual the next block adds to. The whole
row sits in registers (``BLOCK >= hidden``, at most ``MAX_HIDDEN`` elements); sums run in
float32.
"""

import torch
import triton
import triton.language as tl

# Largest hidden size one program holds in registers (16 warps: 32 fp32 values a thread
# per live row vector at this size).
MAX_HIDDEN = 16384


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    res_out_ptr,
    out_ptr,
    hidden,
    eps,
    scale,
    sx_m,
    sr_m,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + m * sx_m + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        # rounded to the input dtype first, as the reference's ``x * scale`` is
        x = (x.to(tl.float32) * scale).to(x_ptr.dtype.element_ty)
    r = tl.load(res_ptr + m * sr_m + offs, mask=mask, other=0.0).to(tl.float32)
    h = (r + x.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + m * hidden + offs, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * hidden + offs, (hf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def num_warps_for(block: int) -> int:
    """Warps for a row of ``block`` elements: about 8 elements a thread, 1 to 16 warps."""
    return max(1, min(16, block // 256))


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: float
):
    """Triton ``add_rms_norm``; arguments as ``osd_kernels.add_rms_norm`` (already checked)."""
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        raise ValueError(
            f"the Triton add_rms_norm holds a row of at most {MAX_HIDDEN} elements, got {hidden}"
        )
    xs = x.reshape(-1, hidden)
    rs = residual.reshape(-1, hidden)
    if xs.stride(-1) != 1:
        xs = xs.contiguous()
    if rs.stride(-1) != 1:
        rs = rs.contiguous()
    res_out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    rows = xs.shape[0]
    if rows == 0:
        return res_out, out
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(rows,)](
        xs,
        rs,
        weight,
        res_out,
        out,
        hidden,
        float(eps),
        float(scale),
        xs.stride(0),
        rs.stride(0),
        HAS_SCALE=scale != 1.0,
        BLOCK=block,
        num_warps=num_warps_for(block),
    )
    return res_out, out
