"""``topk_probs``: the ``k`` most probable tokens of ``softmax(logits)`` per row and their
probabilities.

Online learning stores the target's distribution at every verified position as its top-k
(``osd.online.buffer.compress_target``), on the serving thread, after every step. The
reference is a softmax over the vocabulary and a top-k of it: two ops that each read the
row and the first writing a new one. The native kernel (``csrc/cpu/topk_probs.cpp``,
float32 CPU) reads each row three times and writes only the ``k`` outputs: its max, the sum
of ``exp(x - max)``, and a selection that compares each logit with the smallest of the
``k`` kept so far (16 at a time with AVX-512), in a fraction of the reference's time
(``bench/bench_topk_probs.py``).

Results: ids most probable first; among equal logits the lower id first (the reference,
``torch.topk``, leaves their order unspecified). Probabilities agree with the reference's
to float32 rounding of the normaliser (a sum in another order, ``exp`` within 1 ulp).
A row holding a NaN gives unspecified results.

Backends: ``reference`` (PyTorch), ``native`` (float32 CPU tensors only); ``auto`` is the
native kernel for float32 CPU tensors and the reference elsewhere (on CUDA both of its ops
run on the device).
"""

from __future__ import annotations

import torch

from osd_kernels._ops import native_available, resolve_backend


def topk_probs_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(torch.softmax(logits.float(), -1), min(k, V))`` as ``(ids, probs)``."""
    probs = torch.softmax(logits.float(), dim=-1)
    p, i = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    return i, p


def topk_probs(
    logits: torch.Tensor, k: int, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most probable tokens of ``softmax(logits)`` along the last dim.

    Args:
        logits: ``[..., V]`` float tensor, ``V >= 1``.
        k: how many to keep (``min(k, V)`` are returned), ``>= 1``.
        backend: ``auto`` | ``reference`` | ``native``.

    Returns:
        ``(ids [..., min(k, V)] int64, probs [..., min(k, V)] float32)``, most probable
        first.
    """
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [..., V] with V >= 1, got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    impl = resolve_backend(backend, logits.device, has_triton=False)
    if impl == "native":
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            return torch.ops.osd.topk_probs(logits.detach(), k)
        if backend == "native":
            raise ValueError(
                f"the native topk_probs kernel takes float32 CPU tensors, got "
                f"{logits.dtype} on {logits.device}"
            )
    return topk_probs_reference(logits.detach(), k)


if native_available():

    @torch.library.register_fake("osd::topk_probs")
    def _topk_probs_fake(logits, k):
        shape = (*logits.shape[:-1], min(k, logits.shape[-1]))
        return logits.new_empty(shape, dtype=torch.int64), logits.new_empty(shape)
