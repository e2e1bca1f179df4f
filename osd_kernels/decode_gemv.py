"""``decode_gemv``: ``y = x W^T + b`` for the few rows of a decode or verify step on a GPU,
with the RMSNorm in front of it and the residual add or the SiLU gate after it.

At batch 1 a decode step's projections are matrix-vector products bound by reading the
weights; a general GEMM (and its split-K reductions) and the separate norm, add and SiLU
kernels around it leave most of the memory bandwidth unused. This op reads each weight
once per block of up to 8 rows, with no split-K, and fuses the surrounding elementwise
work:

- ``norm_weight``: ``x`` is first replaced by ``rms_norm(x) * norm_weight`` (prologue);
- ``gated=True``: ``weight`` is ``[gate; up]`` (``[2 I, K]``) and the result is
  ``silu(x W_gate^T + b_gate) * (x W_up^T + b_up)``, ``[..., I]`` (epilogue);
- ``residual``: the result is ``residual + scale * y`` (epilogue), exclusive with ``gated``.

Rounding follows the reference, which rounds to the dtype after the norm, the projection,
SiLU, the product and ``scale * y``; the dot products sum in float32 in another order.

Backends: ``reference`` (PyTorch: ``F.rms_norm``, ``F.linear``, then the epilogue; product
code), ``triton`` (any number of rows, in blocks of 8; on CPU tensors under
``TRITON_INTERPRET=1``); ``auto`` is Triton on CUDA for at most :data:`MAX_ROWS` rows and
the reference otherwise. This op has no native kernel (``decode_linear`` is the CPU one).
The models' fused layers (``osd/models/fused_layers.py``) use it for forwards of few rows.

Loads in flight: a program's weight tile is ``8 x BLOCK_K``; with 4 warps each thread
loads ``BLOCK_K / 16`` of its elements per step, so at 1 or 2 rows (``BLOCK_K`` 1,024 or
512) a bfloat16 tile is 8 or 4 16-byte loads a thread, at 8 rows (``BLOCK_K`` 128) one,
plus what Triton's software pipelining keeps ahead. None of this has been measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from osd_kernels._ops import resolve_backend
from osd_kernels.silu_mul import silu_mul_reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ROWS = 8  # auto's Triton limit: one row block, the weight read once


def decode_gemv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    scale: float = 1.0,
    gated: bool = False,
) -> torch.Tensor:
    """``F.rms_norm`` (with ``norm_weight``), ``F.linear``, then ``silu_mul`` (``gated``)
    or ``residual + y * scale`` (``residual``)."""
    if norm_weight is not None:
        x = F.rms_norm(x, norm_weight.shape, norm_weight, eps)
    y = F.linear(x, weight, bias)
    if gated:
        y = silu_mul_reference(y)
    if residual is not None:
        y = residual + (y if scale == 1.0 else y * scale)
    return y


def _check(x, weight, bias, norm_weight, eps, residual, gated) -> None:
    if weight.dim() != 2 or (gated and weight.shape[0] % 2):
        raise ValueError(f"weight must be [N, K] ([2 I, K] when gated), got {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x must be [..., K={weight.shape[1]}], got {tuple(x.shape)}")
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"x ({x.dtype}) and weight ({weight.dtype}) must share one of {DTYPES}")
    for name, t, shape in (
        ("bias", bias, (weight.shape[0],)),
        ("norm_weight", norm_weight, (weight.shape[1],)),
        ("residual", residual, (*x.shape[:-1], N)),
    ):
        if t is not None and (t.shape != shape or t.dtype != x.dtype):
            raise ValueError(
                f"{name} must be {x.dtype} {list(shape)}, got {t.dtype} {tuple(t.shape)}"
            )
    if gated and residual is not None:
        raise ValueError("gated and residual are exclusive")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    tensors = [t for t in (x, weight, bias, norm_weight, residual) if t is not None]
    if len({t.device for t in tensors}) > 1:
        raise ValueError("x, weight, bias, norm_weight and residual must be on one device")


def decode_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    scale: float = 1.0,
    gated: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """``[residual + scale *] epilogue(rms_norm(x) @ weight.T + bias)``.

    Args:
        x: ``[..., K]`` float32/float16/bfloat16 (``M`` rows in all).
        weight: ``[N, K]`` (``[2 I, K]``, gate rows then up rows, when ``gated``), same dtype.
        bias: ``[N]`` (``[2 I]``) or None.
        norm_weight: ``[K]`` or None: the RMSNorm applied to ``x`` first.
        eps: the RMSNorm epsilon.
        residual: ``[..., N]`` or None: added to the result (after ``scale``).
        scale: the residual multiplier (Granite; 1 elsewhere).
        gated: return ``silu(gate) * up`` of the two halves of the projection.
        backend: ``auto`` | ``reference`` | ``triton``.

    Returns:
        ``[..., N]`` (``[..., I]`` when gated), a new tensor.
    """
    if backend == "native":
        raise ValueError("decode_gemv has no native kernel (backends: auto, reference, triton)")
    _check(x, weight, bias, norm_weight, eps, residual, gated)
    impl = resolve_backend(backend, x.device)
    rows = x.numel() // max(x.shape[-1], 1)
    if impl != "triton" or (backend == "auto" and rows > MAX_ROWS):
        return decode_gemv_reference(
            x,
            weight,
            bias,
            norm_weight=norm_weight,
            eps=eps,
            residual=residual,
            scale=scale,
            gated=gated,
        )
    # imported on first use so that `import osd_kernels` does not import triton
    from osd_kernels.triton.decode_gemv import decode_gemv_triton

    return decode_gemv_triton(x, weight, bias, norm_weight, eps, residual, scale, gated)
