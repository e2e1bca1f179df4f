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

**GGUF blocks as stored** (``ggml_type`` != 0, one of :data:`STORED_TYPES`): ``qweight``
holds a GGUF tensor's bytes, uint8 ``[N, K / U * B]`` (blocks of ``U`` = 32 weights, or
K-quant super-blocks of 256, in ``B`` bytes), and ``scales`` / ``mins`` are not read (an
empty tensor, None). The kernel (``csrc/cpu/quant_linear_blocks.cpp``) decodes each block
in registers into 8-bit codes and float32 factors that reproduce ggml's dequantization
exactly, so these too give ``decode_linear`` on :func:`dequantize_blocks`' matrix bit for
bit, reading the file's bytes per weight (0.5625 for Q4_K, 0.82 for Q6_K, 0.6875 for
Q5_0, 1.0625 for Q8_0) instead of the float32 factors' extra 0.125 to 0.5.

The reference is ``F.linear`` on the dequantized matrix. ``auto`` uses the kernel for
float32 CPU inputs outside autograd, and the reference otherwise (training, CUDA, half
precision): it dequantizes the whole matrix per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from osd_kernels._ops import native_available, resolve_backend
from osd_kernels.quant_x16 import (
    CODES_16,
    CODES_32,
    X16_TYPES,
    quant_linear_x16_reference,
    unpack_codes,
    unpack_x16,
    x16_block,
)

BLOCK = 32  # weights per block of codes (one or two groups of scale and min)

# ggml type id -> (weights, bytes) a block, for the GGUF block types the kernel reads as
# stored: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K.
STORED_TYPES = {2: (32, 18), 3: (32, 20), 6: (32, 22), 8: (32, 34), 12: (256, 144), 14: (256, 210)}


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte ``at`` of every block row of ``b``, float32 ``[n, 1]``."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` bytes -> ``[n, 32]`` codes: low nibbles are weights 0..15, high 16..31."""
    return torch.cat([b & 0xF, b >> 4], dim=1).float()


def _q4k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, float32 ``[n, 8]`` each."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return sc.float(), mn.float()


def dequantize_blocks(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The float32 weight ``[N, K]`` of GGUF blocks ``[N, K / U * B]`` of ``ggml_type``
    (one of :data:`STORED_TYPES`), as ggml's ``dequantize_row_*`` computes it (the same
    float32 operations as ``osd.models.gguf.blocks.dequantize``)."""
    if int(ggml_type) in (CODES_32, CODES_16):  # codes and factors, regrouped
        return dequantize_weight(*unpack_codes(blocks, ggml_type))
    if int(ggml_type) in X16_TYPES:  # regrouped 16 rows at a time: the file's blocks first
        blocks, ggml_type = unpack_x16(blocks, ggml_type)
    weights, size = STORED_TYPES[int(ggml_type)]
    N = blocks.shape[0]
    b = blocks.reshape(-1, size)
    n = b.shape[0]
    if ggml_type == 8:  # Q8_0
        w = _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()
    elif ggml_type == 2:  # Q4_0
        w = (_nibbles(b[:, 2:]) - 8) * _f16(b, 0)
    elif ggml_type == 3:  # Q4_1
        w = _nibbles(b[:, 4:]) * _f16(b, 0) + _f16(b, 2)
    elif ggml_type == 6:  # Q5_0: fifth bit of weight j is bit j of a little-endian u32
        shifts = torch.arange(8, device=b.device, dtype=torch.uint8)
        high = ((b[:, 2:6].unsqueeze(-1) >> shifts) & 1).reshape(n, 32).float()
        w = (_nibbles(b[:, 6:]) + 16 * high - 16) * _f16(b, 0)
    elif ggml_type == 12:  # Q4_K: sub-block j, the low (j even) / high nibbles of 32 bytes
        sc, mn = _q4k_scales(b[:, 4:16])
        qs = b[:, 16:].reshape(n, 4, 1, 32)
        q = torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(n, 8, 32).float()
        w = q * (_f16(b, 0) * sc).unsqueeze(-1) + (-(_f16(b, 2) * mn)).unsqueeze(-1)
    else:  # Q6_K
        ql = b[:, :128].reshape(n, 2, 2, 32)  # [half, first / second 32 bytes, 32]
        qh = b[:, 128:192].reshape(n, 2, 32)
        low = torch.stack(
            [ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], dim=2
        )
        high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2)
        q = ((low | (high << 4)).float() - 32).reshape(n, 16, 16)
        scale = _f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()
        w = q * scale.unsqueeze(-1)
    return w.reshape(N, -1)


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
    ggml_type: int = 0,
) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with ``W = dequantize_weight(qweight, scales, mins)`` (or
    ``dequantize_blocks(qweight, ggml_type)``), after ``F.rms_norm(x, (K,), norm_weight,
    eps)`` when ``norm_weight`` is given. The regrouped types (:data:`X16_TYPES`) multiply
    int8 activations: :func:`~osd_kernels.quant_x16.quant_linear_x16_reference`."""
    if norm_weight is not None:
        x = F.rms_norm(x, norm_weight.shape, norm_weight, eps)
    if int(ggml_type) in X16_TYPES:
        rows = x.reshape(-1, x.shape[-1])
        y = quant_linear_x16_reference(rows, qweight, ggml_type, bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])
    w = (
        dequantize_blocks(qweight, ggml_type)
        if ggml_type
        else dequantize_weight(qweight, scales, mins)
    )
    return F.linear(x, w.to(x.dtype), bias)


def _check(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    ggml_type: int = 0,
) -> None:
    N = qweight.shape[0] if qweight.dim() == 2 else -1
    if ggml_type:
        if int(ggml_type) not in STORED_TYPES and int(ggml_type) not in X16_TYPES:
            raise ValueError(
                f"ggml_type must be 0 (codes and factors) or one of "
                f"{sorted(STORED_TYPES) + sorted(X16_TYPES)}, got {ggml_type}"
            )
        x16 = int(ggml_type) in X16_TYPES
        weights, size = x16_block(ggml_type) if x16 else STORED_TYPES[int(ggml_type)]
        if x16 and N % 16:
            raise ValueError(
                f"qweight of ggml_type {ggml_type} holds a multiple of 16 rows, got {N}"
            )
        K = x.shape[-1] if x.dim() >= 1 else -1
        if K % weights or qweight.dtype != torch.uint8 or qweight.shape != (N, K // weights * size):
            raise ValueError(
                f"x must be [..., K] and qweight uint8 blocks [N, K / {weights} * {size}] of "
                f"ggml_type {ggml_type}, got x {tuple(x.shape)}, qweight {qweight.dtype} "
                f"{tuple(qweight.shape)}"
            )
        scales = mins = None
    else:
        if qweight.dim() != 2 or qweight.dtype not in (torch.uint8, torch.int8):
            raise ValueError(
                f"qweight must be uint8 [N, K / 2] (4-bit) or int8 [N, K] (8-bit), "
                f"got {qweight.dtype} {tuple(qweight.shape)}"
            )
        K = qweight.shape[1] * (2 if qweight.dtype == torch.uint8 else 1)
        if K % BLOCK:
            raise ValueError(f"quant_linear needs K to be a multiple of {BLOCK}, got {K}")
        if x.dim() < 1 or x.shape[-1] != K:
            raise ValueError(f"x must be [..., K={K}], got {tuple(x.shape)}")
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
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a float tensor, got {x.dtype}")
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
    ggml_type: int = 0,
) -> torch.Tensor:
    """``rms_norm(x) @ W.T + bias`` with ``W`` block-quantized (no norm without
    ``norm_weight``).

    Args:
        x: ``[..., K]`` float (``M`` rows in all); ``K`` a multiple of 32.
        qweight: uint8 ``[N, K / 2]`` 4-bit codes or int8 ``[N, K]`` 8-bit codes; with
            ``ggml_type``, uint8 GGUF blocks ``[N, K / U * B]`` as stored.
        scales: float32 ``[N, K / G]``, ``G`` (weights per scale) 32 or 16; not read with
            ``ggml_type`` (an empty tensor).
        mins: float32 like ``scales``, or None (zero).
        bias: ``[N]`` or None.
        norm_weight: ``[K]`` or None: the RMSNorm applied to each row of ``x`` first.
        eps: the RMSNorm epsilon.
        backend: ``auto`` (the C++ kernel for float32 CPU inputs outside autograd, else
            the reference) | ``reference`` | ``native`` (the C++ kernel; float32 CPU only).
        ggml_type: 0 (codes and factors), or the GGUF block type of ``qweight`` (one of
            :data:`STORED_TYPES`), or blocks regrouped for int8 activations (one of
            :data:`~osd_kernels.quant_x16.X16_TYPES`; not the float32 product, see
            :mod:`osd_kernels.quant_x16`).

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
                x,
                qweight,
                scales,
                mins,
                bias,
                norm_weight=norm_weight,
                eps=eps,
                ggml_type=ggml_type,
            )
        y = torch.ops.osd.quant_linear(
            x.reshape(-1, x.shape[-1]), qweight, scales, mins, bias, norm_weight, eps, ggml_type
        )
        return y.view(*x.shape[:-1], qweight.shape[0])
    impl = resolve_backend(backend, x.device, has_triton=False)
    _check(x, qweight, scales, mins, bias, norm_weight, eps, ggml_type)
    if impl == "reference" or x.device.type != "cpu":
        return quant_linear_reference(
            x, qweight, scales, mins, bias, norm_weight=norm_weight, eps=eps, ggml_type=ggml_type
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
        ggml_type,
    )
    return y.reshape(*x.shape[:-1], qweight.shape[0])


if native_available():

    @torch.library.register_fake("osd::quant_linear")
    def _quant_linear_fake(x, qweight, scales, mins, bias, norm_weight=None, eps=1e-6, ggml_type=0):
        return x.new_empty((x.shape[0], qweight.shape[0]))
