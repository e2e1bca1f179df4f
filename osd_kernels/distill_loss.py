"""``distill_loss``: divergence between the target's and the draft's next-token distributions,
with the gradient w.r.t. the draft logits fused into the forward pass.

Per row ``n``, ``q = softmax(draft_logits[n])`` and ``p`` is the target distribution:

- ``fkl``: forward KL(p || q) = sum p (log p - log q), cross-entropy to soft labels;
- ``rkl``: reverse KL(q || p) = sum q (log q - log p), with ``log p`` floored at
  ``log(RKL_P_FLOOR)`` so that a zero target probability gives a large finite loss;
- ``jsd``: the true generalised JSD(beta) = beta KL(p || m) + (1 - beta) KL(q || m) with
  ``m = beta p + (1 - beta) q``; it is 0 for ``beta`` in {0, 1} (and so is its gradient);
- ``tvd``: total variation 0.5 sum |p - q| (``1 - TVD`` is the acceptance rate alpha).

The loss is the mean over the unmasked rows; with every row masked it is 0 with a zero
gradient. Targets are constants: no gradient flows to them.

Targets come in two forms:

- full target logits ``[N, V]``: ``p = softmax(target_logits)``, exact;
- sparse top-k ``(topk_ids [N, k], topk_probs [N, k])`` with distinct ids and ``k < V``.
  **Approximation**: the divergence is taken over the coarsened partition of the vocabulary
  into the ``k`` kept tokens plus one "other" bucket. The target's other mass is the
  leftover ``p_o = 1 - sum(topk_probs)``, taken as 0 below ``TOPK_LEFTOVER_EPS`` (rounding
  noise of probabilities that sum to one); the draft's is its mass outside the kept
  ids, ``q_o = sum_{v not kept} q_v`` (computed by a log-sum-exp over those ids, not as
  ``1 - sum``, so it is exact even when tiny). This is an exact divergence between two
  proper distributions on k + 1 outcomes, hence a lower bound of the full divergence
  (data processing inequality for f-divergences). It equals the full divergence when the
  draft's and the target's distributions inside the other bucket are proportional; in
  particular fkl, jsd and tvd are exact when the target has no mass outside the top-k.
  Its gradient moves the draft's other tokens together, each in proportion to its own q.

Gradient: with bucket probabilities ``Q_B`` and ``h_B = Q_B dL/dQ_B`` (``-p`` for fkl,
``q (log q - log p + 1)`` for rkl, ``(1 - beta) q log(q / m)`` for jsd,
``0.5 q sign(q - p)`` for tvd), the gradient w.r.t. logit ``v`` in bucket ``B`` is
``h_B * q_v / Q_B - q_v * sum_B h_B``.

Backends compute the per-row losses and per-row gradients in one pass and keep only the
gradient ``[N, V]`` (in the draft's dtype) for backward: ``reference`` runs the autograd
reference on chunks of ``chunk_size`` rows (fp32 temporaries of one chunk), ``native``
is the C++ CPU kernel (one row per thread at a time), ``triton`` streams each row
(used on CUDA).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from osd_kernels._ops import native_available, resolve_backend

LOSSES = ("fkl", "rkl", "jsd", "tvd")
RKL_P_FLOOR = 1e-30
RKL_LOG_P_FLOOR = math.log(RKL_P_FLOOR)
# A top-k leftover mass below this is rounding noise of the stored probabilities: it counts
# as 0 (otherwise reverse KL would weigh the draft's other mass by log of that noise).
TOPK_LEFTOVER_EPS = 1e-6
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# Default rows per chunk of the reference backend: about 1M fp32 elements per temporary.
_CHUNK_ELEMENTS = 1 << 20


def _split_target(target) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(target_logits, topk_ids, topk_probs), exactly one form set."""
    if isinstance(target, torch.Tensor):
        return target, None, None
    if isinstance(target, (tuple, list)) and len(target) == 2:
        return None, target[0], target[1]
    raise TypeError("target must be a logits tensor [N, V] or a tuple (topk_ids, topk_probs)")


def _check(draft_logits, target_logits, topk_ids, topk_probs, loss, beta, mask) -> None:
    if not isinstance(draft_logits, torch.Tensor) or draft_logits.dim() != 2:
        raise ValueError(
            "draft_logits must be a [N, V] tensor, got "
            f"{getattr(draft_logits, 'shape', type(draft_logits))}"
        )
    if draft_logits.dtype not in _FLOATS:
        raise TypeError(
            f"draft_logits must be float32, float16 or bfloat16, got {draft_logits.dtype}"
        )
    N, V = draft_logits.shape
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; expected one of {LOSSES}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if target_logits is not None:
        if target_logits.shape != (N, V):
            raise ValueError(
                f"target logits must be [N={N}, V={V}], got {tuple(target_logits.shape)}"
            )
        if target_logits.dtype not in _FLOATS:
            raise TypeError(f"target logits must be floating point, got {target_logits.dtype}")
    else:
        if topk_ids.dtype != torch.int64 or topk_ids.dim() != 2 or topk_ids.shape[0] != N:
            raise ValueError(
                f"topk_ids must be int64 [N={N}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}"
            )
        if not 1 <= topk_ids.shape[1] < V:
            raise ValueError(f"top-k targets need 1 <= k < V={V}, got k={topk_ids.shape[1]}")
        if topk_probs.shape != topk_ids.shape or topk_probs.dtype not in _FLOATS:
            raise ValueError(
                f"topk_probs must be float [N, k={topk_ids.shape[1]}], got "
                f"{topk_probs.dtype} {tuple(topk_probs.shape)}"
            )
    if mask is not None and (mask.dtype != torch.bool or mask.shape != (N,)):
        raise ValueError(f"mask must be bool [N={N}], got {mask.dtype} {tuple(mask.shape)}")
    for name, t in (
        ("target logits", target_logits),
        ("topk_ids", topk_ids),
        ("topk_probs", topk_probs),
        ("mask", mask),
    ):
        if t is not None and t.device != draft_logits.device:
            raise ValueError(
                f"{name} is on {t.device} but draft_logits is on {draft_logits.device}"
            )


def bucket_logprobs(draft_logits: torch.Tensor, target) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_p, log_q)`` fp32 over the buckets the divergence is taken on.

    ``[N, V]`` each for full target logits; ``[N, k + 1]`` for a top-k target (the kept ids,
    then the "other" bucket). Differentiable w.r.t. ``draft_logits``; ``target`` as in
    :func:`distill_loss` (not validated here).
    """
    target_logits, topk_ids, topk_probs = _split_target(target)
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    if target_logits is not None:
        return F.log_softmax(target_logits.detach().float(), dim=-1), log_q
    probs = topk_probs.detach().float()
    other = 1.0 - probs.sum(-1, keepdim=True)
    other = torch.where(other < TOPK_LEFTOVER_EPS, 0.0, other)
    kept = torch.zeros_like(log_q, dtype=torch.bool).scatter_(1, topk_ids, True)
    log_q_other = torch.logsumexp(log_q.masked_fill(kept, float("-inf")), -1, keepdim=True)
    log_p = torch.cat([probs, other], -1).log()
    return log_p, torch.cat([log_q.gather(1, topk_ids), log_q_other], -1)


def divergence_rows(
    log_p: torch.Tensor, log_q: torch.Tensor, loss: str, beta: float
) -> torch.Tensor:
    """Row-wise divergence ``[N]`` between distributions given by log-probabilities ``[N, K]``.

    Differentiable w.r.t. ``log_q`` (``log_p`` is a constant); zero probabilities are exact
    (``0 log 0 = 0``).
    """
    p, q = log_p.exp(), log_q.exp()
    zero = torch.zeros((), dtype=log_q.dtype, device=log_q.device)
    if loss == "fkl":
        terms = torch.where(p > 0, p * (log_p - log_q), zero)
    elif loss == "rkl":
        terms = q * (log_q - log_p.clamp_min(RKL_LOG_P_FLOOR))
    elif loss == "jsd":
        if beta in (0.0, 1.0):  # m = q or m = p: the divergence is identically 0
            return (log_q * 0.0).sum(-1)
        log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
        terms = beta * torch.where(p > 0, p * (log_p - log_m), zero) + (1.0 - beta) * q * (
            log_q - log_m
        )
    else:
        terms = 0.5 * (p - q).abs()
    return terms.sum(-1)


def _masked_mean(rows: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return rows.sum() / max(rows.shape[0], 1)
    return torch.where(mask, rows, 0.0).sum() / mask.sum().clamp_min(1)


def distill_loss_reference(
    draft_logits: torch.Tensor,
    target,
    *,
    loss: str = "fkl",
    beta: float = 0.5,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch (autograd) distillation loss; arguments as :func:`distill_loss`.

    Materialises several fp32 ``[N, V]`` tensors; the ground truth for the fused op.
    """
    target_logits, topk_ids, topk_probs = _split_target(target)
    _check(draft_logits, target_logits, topk_ids, topk_probs, loss, beta, mask)
    log_p, log_q = bucket_logprobs(draft_logits, target)
    return _masked_mean(divergence_rows(log_p, log_q, loss, beta), mask)


def distill_loss_fwd_bwd_reference(
    draft_logits, target_logits, topk_ids, topk_probs, mask, loss: str, beta: float, chunk_size: int
):
    """Per-row losses ``[N]`` fp32 and their gradients ``[N, V]`` (draft dtype), chunk by chunk.

    Masked rows get loss 0 and a zero gradient.
    """
    N = draft_logits.shape[0]
    loss_rows = torch.zeros(N, dtype=torch.float32, device=draft_logits.device)
    grad = torch.empty_like(draft_logits)
    for start in range(0, N, chunk_size):
        sl = slice(start, start + chunk_size)
        with torch.enable_grad():
            z = draft_logits[sl].detach().requires_grad_(True)
            target = (
                target_logits[sl] if target_logits is not None else (topk_ids[sl], topk_probs[sl])
            )
            log_p, log_q = bucket_logprobs(z, target)
            rows = divergence_rows(log_p, log_q, loss, beta)
            if mask is not None:
                rows = torch.where(mask[sl], rows, 0.0)
            (g,) = torch.autograd.grad(rows.sum(), z)
        loss_rows[sl] = rows.detach()
        grad[sl] = g
    return loss_rows, grad


class _FusedDistillLoss(torch.autograd.Function):
    """Forward computes the loss and its gradient together; backward only rescales it."""

    @staticmethod
    def forward(
        ctx, draft_logits, target_logits, topk_ids, topk_probs, mask, loss, beta, impl, chunk_size
    ):
        if impl == "reference":
            loss_rows, grad = distill_loss_fwd_bwd_reference(
                draft_logits, target_logits, topk_ids, topk_probs, mask, loss, beta, chunk_size
            )
        elif impl == "triton":
            # imported on first use: `import osd_kernels` must not import triton,
            # and the Triton module imports this one's loss constants
            from osd_kernels.triton.distill_loss import distill_loss_fwd_bwd_triton

            loss_rows, grad = distill_loss_fwd_bwd_triton(
                draft_logits, target_logits, topk_ids, topk_probs, mask, loss, beta
            )
        else:
            loss_rows, grad = torch.ops.osd.distill_loss_fwd_bwd(
                draft_logits, target_logits, topk_ids, topk_probs, mask, loss, beta
            )
        # A device tensor with a mask (no host sync), else a Python number (no host-to-device
        # copy, so the op can be captured in a CUDA graph either way).
        count = (
            mask.sum().clamp_min(1).float()
            if mask is not None
            else float(max(draft_logits.shape[0], 1))
        )
        # Kept as attributes, not saved tensors: backward drops its reference before
        # returning the gradient, so autograd can accumulate it into .grad without a copy.
        ctx.grad, ctx.count = grad, count
        return loss_rows.sum() / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        if ctx.grad is None:
            raise RuntimeError(
                "distill_loss: backward through the fused loss can run only once "
                "(its saved gradient is rescaled in place and handed over)"
            )
        grad, ctx.grad = ctx.grad, None
        grad.mul_((grad_output / ctx.count).to(grad.dtype))
        return grad, None, None, None, None, None, None, None, None


def distill_loss(
    draft_logits: torch.Tensor,
    target,
    *,
    loss: str = "fkl",
    beta: float = 0.5,
    mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Fused distillation loss with its gradient w.r.t. ``draft_logits`` computed in the forward.

    Args:
        draft_logits: ``[N, V]`` float32/float16/bfloat16, the draft's logits (requires grad
            for training).
        target: the target distribution per row, either full logits ``[N, V]`` (any float
            dtype), or a tuple ``(topk_ids [N, k] int64, topk_probs [N, k] float)`` with
            distinct ids, ``1 <= k < V`` and the leftover ``1 - sum(topk_probs)`` as the
            "other" bucket (see the module docstring for the approximation).
        loss: ``"fkl"`` | ``"rkl"`` | ``"jsd"`` | ``"tvd"``.
        beta: JSD weight in ``[0, 1]`` (ignored by the other losses).
        mask: optional ``[N]`` bool; rows with False do not count.
        chunk_size: rows per chunk of the ``reference`` backend (default: about 1M elements
            per chunk); the native and Triton kernels stream rows and ignore it.
        backend: ``auto`` | ``reference`` | ``native`` | ``triton`` (``auto``: Triton on CUDA,
            C++ on CPU).

    Returns:
        A 0-dim float32 tensor: the mean divergence over the unmasked rows (0 if none).
        Its backward can run once; only the gradient ``[N, V]`` in the draft dtype is kept.

    Example:
        >>> loss = distill_loss(draft_logits, (ids, probs), loss="jsd", beta=0.5, mask=keep)
        >>> loss.backward()
    """
    target_logits, topk_ids, topk_probs = _split_target(target)
    _check(draft_logits, target_logits, topk_ids, topk_probs, loss, beta, mask)
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_ELEMENTS // max(draft_logits.shape[1], 1))
    elif chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    impl = resolve_backend(backend, draft_logits.device)
    if impl == "native" and draft_logits.device.type != "cpu":
        impl = "reference"  # the native kernel is CPU-only (Triton serves CUDA)
    if target_logits is not None:
        target_logits = target_logits.detach()
    if topk_probs is not None:
        topk_probs = topk_probs.detach()
    return _FusedDistillLoss.apply(
        draft_logits, target_logits, topk_ids, topk_probs, mask, loss, float(beta), impl, chunk_size
    )


if native_available():

    @torch.library.register_fake("osd::distill_loss_fwd_bwd")
    def _distill_loss_fwd_bwd_fake(
        draft_logits, target_logits, topk_ids, topk_probs, mask, loss, beta
    ):
        return (
            draft_logits.new_empty(draft_logits.shape[0], dtype=torch.float32),
            torch.empty_like(draft_logits),
        )
