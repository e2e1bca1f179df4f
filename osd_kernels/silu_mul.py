"""``silu_mul``: ``silu(gate) * up`` over the concatenated gate-up projection.

A SwiGLU MLP projects its input once through ``w_gate_up = [gate; up]`` and feeds
``silu(gate) * up`` to the down projection. Unfused that is a SiLU kernel and a multiply
kernel with an intermediate in memory; the fused kernel reads the ``[..., 2 I]`` projection
once and writes the ``[..., I]`` product.

Rounding: SiLU is rounded to the dtype before the product, as the reference rounds
``F.silu(gate)``; results agree with it to one rounding of the exponential (float32
``exp`` against torch's).

The native kernel (``csrc/cpu/fused_layer_ops.cpp``, float32 CPU) computes SiLU as ATen
does, ``x / (1 + exp(-x))`` with SLEEF's ``expf`` over blocks of two vectors and glibc's
on the rest of a row: equal to the reference bit for bit where both run the same vector
width (the AVX-512 kernel beside torch's AVX-512 capability, AVX2 beside AVX2), else
within one rounding of the exponential on a row's last elements.

Backends: ``reference`` (PyTorch), ``native`` (the C++ kernel; float32 CPU tensors only),
``triton`` (on CPU tensors under ``TRITON_INTERPRET=1``); ``auto`` is Triton on CUDA, the
native kernel for float32 CPU tensors outside autograd, and the reference otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from osd_kernels._ops import native_available, resolve_backend

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
        backend: ``auto`` | ``reference`` | ``native`` | ``triton``.

    Returns:
        ``[..., I]``, a new tensor.
    """
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2 I], got {tuple(gate_up.shape)}")
    if gate_up.dtype not in DTYPES:
        raise TypeError(f"gate_up must be one of {DTYPES}, got {gate_up.dtype}")
    impl = resolve_backend(backend, gate_up.device)
    if impl == "native":
        grad = torch.is_grad_enabled() and gate_up.requires_grad
        if gate_up.device.type == "cpu" and gate_up.dtype == torch.float32:
            if backend == "native" or not grad:
                return torch.ops.osd.silu_mul(gate_up)
        elif backend == "native":
            raise ValueError(
                f"the native silu_mul kernel takes float32 CPU tensors, got "
                f"{gate_up.dtype} on {gate_up.device}"
            )
    if impl != "triton":
        return silu_mul_reference(gate_up)
    # imported on first use so that `import osd_kernels` does not import triton
    from osd_kernels.triton.silu_mul import silu_mul_triton

    return silu_mul_triton(gate_up)


if native_available():

    @torch.library.register_fake("osd::silu_mul")
    def _silu_mul_fake(gate_up):
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
