"""``argmax_finite``: per row, the first index of its largest logit and whether the row
holds a NaN or an infinity.

A greedy step's whole sampler is an argmax of the target's logits, and every step checks
those logits for NaN and inf before trusting them (``osd.sampling.nonfinite_rows``): two
reductions over the same rows. On the CPU torch's argmax runs scalar and each reduction
wakes the thread pool, about 85 and 70 us for one row of 49,152 logits on the 2-core VM,
several percent of a 135M model's decode step. The native kernel
(``csrc/cpu/argmax_finite.cpp``, float32 CPU) does both in one pass a row, 16 lanes at a
time with AVX-512 (``bench/bench_argmax_finite.py``).

Results: ``ids`` equal ``torch.argmax`` (the lowest index among equal maxima) on every
row without a NaN; a row holding a NaN has its flag set and an unspecified id. The flag
is set exactly when the row holds a NaN, +inf or -inf (``~isfinite(row).all()``).

Backends: ``reference`` (PyTorch), ``native`` (float32 CPU tensors only); ``auto`` is the
native kernel for float32 CPU tensors and the reference elsewhere (on CUDA its two ops
run on the device).
"""

from __future__ import annotations

import torch

from osd_kernels._ops import native_available, resolve_backend


def argmax_finite_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits.argmax(-1), ~isfinite(logits).all(-1))``."""
    return logits.argmax(-1), ~torch.isfinite(logits).all(-1)


def argmax_finite(
    logits: torch.Tensor, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The argmax of each row along the last dim and whether the row is not all finite.

    Args:
        logits: ``[..., V]`` float tensor, ``V >= 1``.
        backend: ``auto`` | ``reference`` | ``native``.

    Returns:
        ``(ids [...] int64, nonfinite [...] bool)``.
    """
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [..., V] with V >= 1, got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
    impl = resolve_backend(backend, logits.device, has_triton=False)
    if impl == "native":
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            return torch.ops.osd.argmax_finite(logits.detach())
        if backend == "native":
            raise ValueError(
                f"the native argmax_finite kernel takes float32 CPU tensors, got "
                f"{logits.dtype} on {logits.device}"
            )
    return argmax_finite_reference(logits.detach())


if native_available():

    @torch.library.register_fake("osd::argmax_finite")
    def _argmax_finite_fake(logits):
        shape = logits.shape[:-1]
        return logits.new_empty(shape, dtype=torch.int64), logits.new_empty(shape, dtype=torch.bool)
