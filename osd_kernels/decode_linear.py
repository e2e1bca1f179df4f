"""``decode_linear``: ``y = x W^T + b`` for the few rows of a decode or verify forward,
optionally behind the RMSNorm that precedes most projections of a Llama layer.

A decode step multiplies 1 row per sequence (a verify step k + 1) by every weight matrix.
On one CPU core a general GEMM handles so few rows poorly; the C++ kernel streams each
weight matrix once per pass for up to 12 rows, holding every row's running sums in
registers and prefetching the weights ahead of use (``csrc/cpu/decode_linear.cpp``).
``auto`` uses it for float32 CPU inputs of at most :data:`MAX_ROWS` (16) rows, or
:data:`WIDE_MAX_ROWS` (64) when ``K <= WIDE_MAX_K`` (640), or of any number of rows from a
packed weight (below), outside autograd, and ``F.linear`` otherwise: on CUDA the vendor
GEMM is the kernel (this op has no Triton or CUDA kernel of its own).

A weight that is only read (a target model's) can also be given packed into panels,
``pack_weight(weight)``: ``[N / 16, K, 16]``, the 16 weights that meet one input element on
one cache line. The kernel then broadcasts inputs against whole lines and needs no
horizontal sums, 6 rows per pass (12 with AVX-512): faster than the unpacked passes, and
than torch's GEMM up to prompt-sized inputs (``docs/benchmarks.md``), at the memory of a
second copy of the weight (the reference and ``F.linear`` read the original).

The reference is ``F.linear`` (after ``F.rms_norm`` with ``norm_weight``). The kernel sums
in a different order (8 partial sums per output, or in order over ``K`` from a packed
weight; FMA on AVX2), so results agree to float32 rounding, not bit for bit. A row's
result never depends on the other rows in the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from osd_kernels._ops import native_available, resolve_backend

# auto picks the C++ kernel up to MAX_ROWS rows, and up to WIDE_MAX_ROWS rows when
# K <= WIDE_MAX_K (kMaxPass = 12 rows per pass, several passes tile by tile over the
# weights in csrc/cpu/linear_rows.h). With weights that come from memory, as in a model's
# forward (the chat target's verify over 2 threads) the kernel was
# faster than torch's GEMM at these sizes; with K = 864 or 1536 past 16 rows it was not
# (bench/bench_decode_linear.py, cold rows; docs/benchmarks.md).
MAX_ROWS = 16
WIDE_MAX_ROWS = 64
WIDE_MAX_K = 640


PANEL = 16


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (``N`` a multiple of :data:`PANEL`) -> ``[N / 16, K, 16]``, where
    ``packed[p, k, j] = weight[16 p + j, k]``: the layout the C++ kernel reads fastest."""
    if weight.dim() != 2 or weight.shape[0] % PANEL:
        raise ValueError(
            f"pack_weight needs [N, K] with N a multiple of {PANEL}, got {tuple(weight.shape)}"
        )
    N, K = weight.shape
    return weight.detach().view(N // PANEL, PANEL, K).transpose(1, 2).contiguous()


def decode_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, after ``F.rms_norm(x, (K,), norm_weight, eps)`` when
    ``norm_weight`` is given."""
    if norm_weight is not None:
        x = F.rms_norm(x, norm_weight.shape, norm_weight, eps)
    return F.linear(x, weight, bias)


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x must be [..., K={weight.shape[1]}], got {tuple(x.shape)}")
    if x.dtype != weight.dtype or not x.dtype.is_floating_point:
        raise TypeError(f"x ({x.dtype}) and weight ({weight.dtype}) must share a float dtype")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(
            f"bias must be {x.dtype} [N={weight.shape[0]}], got {bias.dtype} {tuple(bias.shape)}"
        )
    if norm_weight is not None and (
        norm_weight.shape != (weight.shape[1],) or norm_weight.dtype != x.dtype
    ):
        raise ValueError(
            f"norm_weight must be {x.dtype} [K={weight.shape[1]}], got "
            f"{norm_weight.dtype} {tuple(norm_weight.shape)}"
        )
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    devices = {t.device for t in (x, weight, bias, norm_weight) if t is not None}
    if len(devices) > 1:
        raise ValueError(
            f"x, weight, bias and norm_weight must be on one device, got "
            f"{sorted(map(str, devices))}"
        )


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    backend: str = "auto",
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
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
            or ``M <= WIDE_MAX_ROWS`` when ``K <= WIDE_MAX_K``, or any ``M`` with
            ``packed``, outside autograd, else
            ``F.rms_norm`` and ``F.linear``) | ``reference`` |
            ``native`` (the C++ kernel for any ``M``; float32 CPU only).
        packed: ``pack_weight(weight)`` or None. The C++ kernel reads it instead of
            ``weight``; the reference and ``F.linear`` read ``weight``.

    Returns:
        ``[..., N]``.
    """
    if backend == "auto":
        # The per-call cost matters at these sizes: cheap tests here, and the C++ op
        # checks shapes and dtypes itself.
        if (
            x.device.type != "cpu"
            or x.dtype != torch.float32
            or x.dim() < 1
            or (
                packed is None
                and x.numel()
                > (WIDE_MAX_ROWS if x.shape[-1] <= WIDE_MAX_K else MAX_ROWS) * x.shape[-1]
            )
            or x.stride(-1) != 1
            or not weight.is_contiguous()
            or not native_available()
            or (
                torch.is_grad_enabled()
                and (
                    x.requires_grad
                    or weight.requires_grad
                    or (norm_weight is not None and norm_weight.requires_grad)
                )
            )
        ):
            return decode_linear_reference(x, weight, bias, norm_weight=norm_weight, eps=eps)
        y = torch.ops.osd.decode_linear(
            x.reshape(-1, x.shape[-1]), weight if packed is None else packed, bias, norm_weight, eps
        )
        return y.view(*x.shape[:-1], weight.shape[0])
    impl = resolve_backend(backend, x.device, has_triton=False)
    _check(x, weight, bias, norm_weight, eps)
    if packed is not None and (
        packed.shape != (weight.shape[0] // PANEL, weight.shape[1], PANEL)
        or packed.dtype != weight.dtype
        or weight.shape[0] % PANEL
    ):
        raise ValueError(
            f"packed must be pack_weight(weight): {weight.dtype} "
            f"[{weight.shape[0] // PANEL}, {weight.shape[1]}, {PANEL}], got "
            f"{packed.dtype} {tuple(packed.shape)}"
        )
    if impl == "reference" or x.device.type != "cpu":
        return decode_linear_reference(x, weight, bias, norm_weight=norm_weight, eps=eps)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > 0 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = weight.contiguous() if packed is None else packed.contiguous()
    y = torch.ops.osd.decode_linear(rows, w, bias, norm_weight, eps)
    return y.reshape(*x.shape[:-1], weight.shape[0])


if native_available():

    @torch.library.register_fake("osd::decode_linear")
    def _decode_linear_fake(x, weight, bias, norm_weight=None, eps=1e-6):
        n = weight.shape[0] * (PANEL if weight.dim() == 3 else 1)
        return x.new_empty((x.shape[0], n))
