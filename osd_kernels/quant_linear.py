"""``quant_linear``: :func:`~osd_kernels.decode_linear` with the weight kept block-quantized,
as 4- or 8-bit codes with float32 factors per group of 32 or 16 weights (the formats of
GGUF files: Q4_0, Q4_1, Q8_0 as stored; the 5-bit and K-quant types re-expressed).

A weight ``[N, K]`` is stored as codes and per-group affine factors, groups of ``G`` (32
or 16; ``G = K / scales.shape[1]``) weights along ``K``::

    W[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G]      (mins None: 0)

- 4-bit: ``qweight`` uint8 ``[N, K / 2]``, codes 0..15; in each block's 16 bytes, byte
  ``j`` holds element ``j`` in its low nibble and element ``j + 16`` in its high one (the
  order of GGUF's Q4_0/Q4_1 blocks, so a file's bytes are used as they are);
- 8-bit: ``qweight`` int8 ``[N, K]``, codes -128..127 (Q8_0).

``scales`` and ``mins`` are float32 ``[N, K / G]``; codes are laid out in blocks of
:data:`BLOCK` (32) whatever ``G``. Decode and verify forwards on a CPU
are bound by reading weights from memory: 4-bit codes with float32 factors are 0.75 bytes a
weight against float32's 4. The C++ kernel (``csrc/cpu/quant_linear.cpp``; AVX-512, AVX2
and portable paths) dequantizes each block in registers and multiplies it into every
row's running sums in decode_linear's order; a code times a scale that came from float16
(times a small integer, for the K-quants) is exact in float32, so its result equals
``decode_linear`` on :func:`dequantize_weight`'s matrix bit for bit, and a row's result
never depends on the other rows.

Past 64 rows (prefill pieces, large batches) the kernel dequantizes 256 weight rows at a
time into a float32 tile and multiplies by it with a GEMM (``at::mm``), never holding the
whole float32 matrix; those results agree with the reference to float32 rounding.

The reference is ``F.linear`` on the dequantized matrix. ``auto`` uses the kernel for
float32 CPU inputs outside autograd, and the reference otherwise (training, CUDA, half
precision): it dequantizes the whole matrix per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from osd_kernels._ops import native_available, resolve_backend

BLOCK = 32  # weights per block of codes (one or two groups of scale and min)


def dequantize_weight(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None
) -> torch.Tensor:
    """The float32 weight ``[N, K]`` of ``(qweight, scales, mins)`` (formats above)."""
    N = qweight.shape[0]
    if qweight.dtype == torch.uint8:
        packed = qweight.reshape(N, -1, BLOCK // 2)
        q = torch.cat([packed & 0xF, packed >> 4], dim=-1)  # [N, K / 32, 32]
    else:
        q = qweight.reshape(N, -1, BLOCK)
    q = q.reshape(N, scales.shape[1], -1)  # [N, K / G, G]
    w = q.float() * scales.unsqueeze(-1)
    if mins is not None:
        w = w + mins.unsqueeze(-1)
    return w.reshape(N, -1)


def quant_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``F.linear(x, dequantize_weight(qweight, scales, mins), bias)``, after
    ``F.rms_norm(x, (K,), norm_weight, eps)`` when ``norm_weight`` is given."""
    if norm_weight is not None:
        x = F.rms_norm(x, norm_weight.shape, norm_weight, eps)
    return F.linear(x, dequantize_weight(qweight, scales, mins).to(x.dtype), bias)


def _check(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
) -> None:
    if qweight.dim() != 2 or qweight.dtype not in (torch.uint8, torch.int8):
        raise ValueError(
            f"qweight must be uint8 [N, K / 2] (4-bit) or int8 [N, K] (8-bit), "
            f"got {qweight.dtype} {tuple(qweight.shape)}"
        )
    N = qweight.shape[0]
    K = qweight.shape[1] * (2 if qweight.dtype == torch.uint8 else 1)
    if K % BLOCK:
        raise ValueError(f"quant_linear needs K to be a multiple of {BLOCK}, got {K}")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must be [..., K={K}], got {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a float tensor, got {x.dtype}")
    groups = scales.shape[-1] if scales.dim() == 2 else -1
    if groups not in (K // BLOCK, 2 * K // BLOCK):
        groups = K // BLOCK
    for name, t in (("scales", scales), ("mins", mins)):
        if t is not None and (t.shape != (N, groups) or t.dtype != torch.float32):
            raise ValueError(
                f"{name} must be float32 [N={N}, K / 32={K // BLOCK}] or [N, "
                f"K / 16={2 * K // BLOCK}] (mins like scales), got {t.dtype} "
                f"{tuple(t.shape)}"
            )
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be {x.dtype} [N={N}], got {bias.dtype} {tuple(bias.shape)}")
    if norm_weight is not None and (norm_weight.shape != (K,) or norm_weight.dtype != x.dtype):
        raise ValueError(
            f"norm_weight must be {x.dtype} [K={K}], got {norm_weight.dtype} "
            f"{tuple(norm_weight.shape)}"
        )
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    devices = {t.device for t in (x, qweight, scales, mins, bias, norm_weight) if t is not None}
    if len(devices) > 1:
        raise ValueError(
            f"x, qweight, scales, mins, bias and norm_weight must be on one "
            f"device, got {sorted(map(str, devices))}"
        )


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    backend: str = "auto",
) -> torch.Tensor:
    """``rms_norm(x) @ W.T + bias`` with ``W`` block-quantized (no norm without
    ``norm_weight``).

    Args:
        x: ``[..., K]`` float (``M`` rows in all); ``K`` a multiple of 32.
        qweight: uint8 ``[N, K / 2]`` 4-bit codes or int8 ``[N, K]`` 8-bit codes.
        scales: float32 ``[N, K / G]``, ``G`` (weights per scale) 32 or 16.
        mins: float32 like ``scales``, or None (zero).
        bias: ``[N]`` or None.
        norm_weight: ``[K]`` or None: the RMSNorm applied to each row of ``x`` first.
        eps: the RMSNorm epsilon.
        backend: ``auto`` (the C++ kernel for float32 CPU inputs outside autograd, else
            the reference) | ``reference`` | ``native`` (the C++ kernel; float32 CPU only).

    Returns:
        ``[..., N]``.
    """
    if backend == "auto":
        if (
            x.device.type != "cpu"
            or x.dtype != torch.float32
            or x.dim() < 1
            or x.stride(-1) != 1
            or not native_available()
            or (
                torch.is_grad_enabled()
                and (x.requires_grad or (norm_weight is not None and norm_weight.requires_grad))
            )
        ):
            return quant_linear_reference(
                x, qweight, scales, mins, bias, norm_weight=norm_weight, eps=eps
            )
        y = torch.ops.osd.quant_linear(
            x.reshape(-1, x.shape[-1]), qweight, scales, mins, bias, norm_weight, eps
        )
        return y.view(*x.shape[:-1], qweight.shape[0])
    impl = resolve_backend(backend, x.device, has_triton=False)
    _check(x, qweight, scales, mins, bias, norm_weight, eps)
    if impl == "reference" or x.device.type != "cpu":
        return quant_linear_reference(
            x, qweight, scales, mins, bias, norm_weight=norm_weight, eps=eps
        )
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > 0 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.ops.osd.quant_linear(
        rows,
        qweight.contiguous(),
        scales.contiguous(),
        None if mins is None else mins.contiguous(),
        bias,
        norm_weight,
        eps,
    )
    return y.reshape(*x.shape[:-1], qweight.shape[0])


if native_available():

    @torch.library.register_fake("osd::quant_linear")
    def _quant_linear_fake(x, qweight, scales, mins, bias, norm_weight=None, eps=1e-6):
        return x.new_empty((x.shape[0], qweight.shape[0]))
