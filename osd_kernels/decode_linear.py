"""``decode_linear``: ``y = x W^T + b`` for the few rows of a decode or verify forward,
optionally behind the RMSNorm that precedes most projections of a Llama layer.

A decode step multiplies 1 row per sequence (a verify step k + 1) by every weight matrix.
On one CPU core a general GEMM handles so few rows poorly; the C++ kernel streams each
weight matrix once per pass for up to 12 rows, holding every row's running sums in
registers and prefetching the weights ahead of use (``csrc/cpu/decode_linear.cpp``).
``auto`` uses it for float32 CPU inputs of at most :data:`MAX_ROWS` (16) rows, or
:data:`WIDE_MAX_ROWS` (64) when ``K <= WIDE_MAX_K`` (640), outside autograd, and
``F.linear`` otherwise: on CUDA the vendor GEMM is the kernel (this op has no Triton or
CUDA kernel of its own).

The reference is ``F.linear`` (after ``F.rms_norm`` with ``norm_weight``). The kernel sums
in a different order (8 partial sums per output, FMA on AVX2), so results agree to float32
rounding, not bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from osd_kernels._ops import native_available, resolve_backend

# auto picks the C++ kernel up to MAX_ROWS rows, and up to WIDE_MAX_ROWS rows when
# K <= WIDE_MAX_K (kMaxPass = 12 rows per pass, several passes tile by tile over the
# weights in csrc/cpu/linear_rows.h). With weights that come from memory, as in a model's
# forward (the chat target's verify over 2 threads: scripts/verify_cost.py) the kernel was
# faster than torch's GEMM at these sizes; with K = 864 or 1536 past 16 rows it was not
# (bench/bench_decode_linear.py, cold rows; docs/benchmarks.md).
MAX_ROWS = 16
WIDE_MAX_ROWS = 64
WIDE_MAX_K = 640


def decode_linear_reference(x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, *,
                            norm_weight: torch.Tensor | None = None,
                            eps: float = 1e-6) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, after ``F.rms_norm(x, (K,), norm_weight, eps)`` when
    ``norm_weight`` is given."""
    if norm_weight is not None:
        x = F.rms_norm(x, norm_weight.shape, norm_weight, eps)
    return F.linear(x, weight, bias)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           norm_weight: torch.Tensor | None, eps: float) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x must be [..., K={weight.shape[1]}], got {tuple(x.shape)}")
    if x.dtype != weight.dtype or not x.dtype.is_floating_point:
        raise TypeError(f"x ({x.dtype}) and weight ({weight.dtype}) must share a float dtype")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be {x.dtype} [N={weight.shape[0]}], got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    if norm_weight is not None and (norm_weight.shape != (weight.shape[1],)
                                    or norm_weight.dtype != x.dtype):
        raise ValueError(f"norm_weight must be {x.dtype} [K={weight.shape[1]}], got "
                         f"{norm_weight.dtype} {tuple(norm_weight.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    devices = {t.device for t in (x, weight, bias, norm_weight) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"x, weight, bias and norm_weight must be on one device, got "
                         f"{sorted(map(str, devices))}")


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  backend: str = "auto") -> torch.Tensor:
    """``rms_norm(x) @ weight.T + bias`` (no norm without ``norm_weight``).

    Args:
        x: ``[..., K]`` float (``M`` rows in all).
        weight: ``[N, K]`` of the same dtype.
        bias: ``[N]`` or None.
        norm_weight: ``[K]`` or None. When given, each row of ``x`` is first replaced by
            ``norm_weight * x / sqrt(mean(x^2) + eps)`` (the RMSNorm in front of the
            attention, MLP and output projections of a Llama layer).
        eps: the RMSNorm epsilon.
        backend: ``auto`` (the C++ kernel for float32 CPU inputs with ``M <= MAX_ROWS``,
            or ``M <= WIDE_MAX_ROWS`` when ``K <= WIDE_MAX_K``, outside autograd, else
            ``F.rms_norm`` and ``F.linear``) | ``reference`` |
            ``native`` (the C++ kernel for any ``M``; float32 CPU only).

    Returns:
        ``[..., N]``.
    """
    if backend == "auto":
        # The per-call cost matters at these sizes: cheap tests here, and the C++ op
        # checks shapes and dtypes itself.
        if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() < 1
                or x.numel() > (WIDE_MAX_ROWS if x.shape[-1] <= WIDE_MAX_K else MAX_ROWS)
                * x.shape[-1] or x.stride(-1) != 1
                or not weight.is_contiguous() or not native_available()
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (
                    norm_weight is not None and norm_weight.requires_grad)))):
            return decode_linear_reference(x, weight, bias, norm_weight=norm_weight, eps=eps)
        y = torch.ops.osd.decode_linear(x.reshape(-1, x.shape[-1]), weight, bias, norm_weight, eps)
        return y.view(*x.shape[:-1], weight.shape[0])
    impl = resolve_backend(backend, x.device, has_triton=False)
    _check(x, weight, bias, norm_weight, eps)
    if impl == "reference" or x.device.type != "cpu":
        return decode_linear_reference(x, weight, bias, norm_weight=norm_weight, eps=eps)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > 0 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.ops.osd.decode_linear(rows, weight.contiguous(), bias, norm_weight, eps)
    return y.reshape(*x.shape[:-1], weight.shape[0])


if native_available():
    @torch.library.register_fake("osd::decode_linear")
    def _decode_linear_fake(x, weight, bias, norm_weight=None, eps=1e-6):
        return x.new_empty((x.shape[0], weight.shape[0]))
