"""``add_rms_norm``: the residual add and the RMSNorm after it, in one pass.

A pre-norm decoder layer adds each block's output to the residual stream and normalises
the sum for the next block: ``h = residual + scale * x``, ``y = rms_norm(h) * weight``.
Unfused that is an add kernel, then a norm kernel that reads ``h`` back; the fused kernel
reads ``x`` and ``residual`` once and writes ``h`` and ``y``.

Rounding: ``scale * x`` (when ``scale != 1``) and ``h`` are rounded to the inputs' dtype
as the reference rounds them, so ``h`` equals the reference's bit for bit (a sum of two
values of one dtype, computed in float32, rounded once); ``y`` is the norm of that rounded
``h`` computed in float32, within a rounding of ``F.rms_norm`` in half precision and to
float32 rounding in float32 (the sum of squares runs in another order).

The native kernel (``csrc/cpu/fused_layer_ops.cpp``, float32 CPU) computes ``h`` as the
reference does and the norm as the unfused CPU forward does, inside ``decode_linear`` and
``quant_linear`` (the sum of squares in double, in order): its ``y`` equals what those
ops feed their GEMV for ``h`` bit for bit, and ``F.rms_norm``'s within a rounding of the
inverse norm (a few float32 ulps).

Backends: ``reference`` (PyTorch), ``native`` (the C++ kernel; float32 CPU tensors only),
``triton`` (on CPU tensors under ``TRITON_INTERPRET=1``); ``auto`` is Triton on CUDA, the
native kernel for float32 CPU tensors outside autograd, and the reference otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from osd_kernels._ops import native_available, resolve_backend

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    scale: float = 1.0,
):
    """``h = residual + (x if scale == 1 else x * scale)``; returns ``(h, rms_norm(h))``."""
    h = residual + (x if scale == 1.0 else x * scale)
    return h, F.rms_norm(h, weight.shape, weight, eps)


def _check(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    if x.dim() < 1 or x.shape != residual.shape:
        raise ValueError(
            f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must be one shape [..., H]"
        )
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [H={x.shape[-1]}], got {tuple(weight.shape)}")
    if x.dtype not in DTYPES or residual.dtype != x.dtype or weight.dtype != x.dtype:
        raise TypeError(
            f"x, residual and weight must share one of {DTYPES}, got {x.dtype}, "
            f"{residual.dtype}, {weight.dtype}"
        )
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if len({x.device, residual.device, weight.device}) > 1:
        raise ValueError("x, residual and weight must be on one device")


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    scale: float = 1.0,
    backend: str = "auto",
):
    """``h = residual + scale * x`` and ``y = weight * h / sqrt(mean(h^2) + eps)``.

    Args:
        x: ``[..., H]`` float32/float16/bfloat16: a block's output.
        residual: the residual stream, same shape and dtype.
        weight: ``[H]`` the RMSNorm weight, same dtype.
        eps: the RMSNorm epsilon.
        scale: the residual multiplier applied to ``x`` (Granite; 1 elsewhere).
        backend: ``auto`` | ``reference`` | ``native`` | ``triton``.

    Returns:
        ``(h, y)``, both new tensors shaped like ``x``: the new residual and its norm.
    """
    _check(x, residual, weight, eps)
    impl = resolve_backend(backend, x.device)
    if impl == "native":
        grad = torch.is_grad_enabled() and (
            x.requires_grad or residual.requires_grad or weight.requires_grad
        )
        if x.device.type == "cpu" and x.dtype == torch.float32:
            if backend == "native" or not grad:
                h, y = torch.ops.osd.add_rms_norm(x, residual, weight.contiguous(), eps, scale)
                return h, y
        elif backend == "native":
            raise ValueError(
                f"the native add_rms_norm kernel takes float32 CPU tensors, got "
                f"{x.dtype} on {x.device}"
            )
    if impl != "triton":
        return add_rms_norm_reference(x, residual, weight, eps, scale)
    # imported on first use so that `import osd_kernels` does not import triton
    from osd_kernels.triton.add_rms_norm import add_rms_norm_triton

    return add_rms_norm_triton(x, residual, weight, eps, scale)


if native_available():

    @torch.library.register_fake("osd::add_rms_norm")
    def _add_rms_norm_fake(x, residual, weight, eps, scale):
        return x.new_empty(x.shape), x.new_empty(x.shape)
