"""``silu_mul``: ``silu(gate) * up`` over the concatenated gate-up projection.

A SwiGLU MLP projects its input once through ``w_gate_up = [gate; up]`` and feeds
``silu(gate) * up`` to the down projection. Unfused that is a SiLU kernel and a multiply
kernel with an intermediate in memory; the fused kernel reads the ``[..., 2 I]`` projection
once and writes the ``[..., I]`` product.

Rounding: SiLU is rounded to the dtype before the product, as the reference rounds
``F.silu(gate)``; results agree with it to one rounding of the exponential (float32
``exp`` against torch's).

Backends: ``reference`` (PyTorch, product code: the CPU path), ``triton`` (on CPU tensors
under ``TRITON_INTERPRET=1``); ``auto`` is Triton on CUDA and the reference elsewhere. This
op has no native kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from osd_kernels._ops import resolve_backend

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` with ``gate, up = gate_up.chunk(2, dim=-1)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate, up]``.

    Args:
        gate_up: ``[..., 2 I]`` float32/float16/bfloat16, the gate's ``I`` columns then the
            up projection's.
        backend: ``auto`` | ``reference`` | ``triton``.

    Returns:
        ``[..., I]``, a new tensor.
    """
    if backend == "native":
        raise ValueError("silu_mul has no native kernel (backends: auto, reference, triton)")
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2 I], got {tuple(gate_up.shape)}")
    if gate_up.dtype not in DTYPES:
        raise TypeError(f"gate_up must be one of {DTYPES}, got {gate_up.dtype}")
    if resolve_backend(backend, gate_up.device) != "triton":
        return silu_mul_reference(gate_up)
    # imported on first use so that `import osd_kernels` does not import triton
    from osd_kernels.triton.silu_mul import silu_mul_triton

    return silu_mul_triton(gate_up)
