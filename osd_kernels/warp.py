"""Sampling-distribution warping shared by every sampler in osd (the reference).

The rejection samplers warp the target exactly as the draft was warped, and plain
decoding samples from the same warped distribution, so there is one definition:

1. temperature ``t``: ``softmax(logits / t)``; ``t == 0`` means greedy (argmax, lowest
   index on ties) and is handled by callers, not here;
2. top-k (``k > 0``): keep tokens whose logit is >= the k-th largest logit (ties at the
   threshold are kept);
3. top-p (``p < 1``), on the top-k-renormalised distribution: keep token x iff the total
   probability of tokens *strictly* more likely than x is < p. For distinct
   probabilities this is the usual "smallest prefix of the sorted distribution whose mass
   reaches p", including the token that crosses p; ties are kept or dropped together, so
   the rule needs no sort and every backend computes the same set.

The result is renormalised. All math is in float32.
"""

from __future__ import annotations

import torch


def _per_row(x, n_rows: int, default: float, device, dtype) -> torch.Tensor:
    if x is None:
        return torch.full((n_rows,), default, device=device, dtype=dtype)
    if not torch.is_tensor(x):
        return torch.full((n_rows,), float(x), device=device, dtype=dtype)
    return (
        x.to(device=device, dtype=dtype).reshape(-1).expand(n_rows)
        if x.numel() == 1
        else x.to(device=device, dtype=dtype).reshape(n_rows)
    )


def warp_probs(logits: torch.Tensor, temperature=None, top_k=None, top_p=None) -> torch.Tensor:
    """Warped probabilities ``[N, V]`` float32 from ``logits [N, V]``.

    ``temperature``, ``top_k``, ``top_p``: scalars or ``[N]`` tensors (None = off / 1.0).
    Rows with temperature 0 are treated as temperature 1 here (greedy callers take the
    argmax instead).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    n, v = logits.shape
    x = logits.float()
    t = _per_row(temperature, n, 1.0, x.device, torch.float32)
    t = torch.where(t > 0, t, torch.ones_like(t))
    x = x / t[:, None]
    k = _per_row(top_k, n, 0, x.device, torch.int64)
    kk = k.clamp(1, v)
    # Scalar parameters decide on the host; per-row tensors need a host sync here. With
    # scalars the function has none, so it can run inside a CUDA graph capture.
    if torch.is_tensor(top_k):
        k_max = int(kk.max()) if bool((k > 0).any()) else 0
    else:
        k_max = min(int(top_k), v) if top_k is not None and int(top_k) > 0 else 0
    if k_max:
        kth = torch.topk(x, k_max, dim=-1).values.gather(1, (kk - 1)[:, None])
        x = torch.where((k[:, None] > 0) & (x < kth), torch.full_like(x, float("-inf")), x)
    probs = torch.softmax(x, dim=-1)
    p = _per_row(top_p, n, 1.0, x.device, torch.float32)
    use_p = bool((p < 1).any()) if torch.is_tensor(top_p) else top_p is not None and top_p < 1
    if use_p:
        keep = _top_p_keep_candidates(probs, p) if probs.device.type == "cpu" else None
        if keep is None:
            keep = _top_p_keep_sorted(probs, p)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _top_p_keep_sorted(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The top-p rule on the whole sorted distribution: ``[N, V]`` bool, token x kept iff
    the mass strictly above it is < ``p`` (or ``p >= 1``). Sync-free (CUDA graphs)."""
    sorted_p, _ = torch.sort(probs, dim=-1, descending=True)
    # mass strictly above each sorted value: cumsum minus the mass of all its ties
    csum = torch.cumsum(sorted_p, dim=-1)
    # for value probs[x], mass strictly greater = csum at the last index with value > probs[x]
    idx = torch.searchsorted(-sorted_p.contiguous(), -probs.contiguous(), right=False)
    above = torch.where(idx > 0, csum.gather(1, (idx - 1).clamp(min=0)), torch.zeros_like(probs))
    return (above < p[:, None]) | (p[:, None] >= 1)


# Candidate counts tried by the CPU top-p path before it sorts the whole row.
TOP_P_CANDIDATES = (64, 1024)


def _top_p_keep_candidates(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor | None:
    """The same set as :func:`_top_p_keep_sorted` from the ``m`` largest probabilities
    only, or None when no tried ``m`` holds mass ``p`` in some row (one host sync per try,
    so CPU only).

    The kept set is an upper set: every token at least as likely as the least likely kept
    one. Its members are among the ``m`` largest once their cumulative mass reaches ``p``:
    a token below all of them has at least that mass strictly above it. The prefix sums
    of the ``m`` largest are the first ``m`` of the whole sorted row's, so the decisions
    are identical to the full sort's.
    """
    n, v = probs.shape
    for m in TOP_P_CANDIDATES:
        m = min(m, v)
        vals = torch.topk(probs, m, dim=-1).values  # [N, m] descending
        csum = torch.cumsum(vals, dim=-1)
        if m < v and not bool(((csum[:, -1] >= p) | (p >= 1)).all()):
            continue
        idx = torch.searchsorted(-vals, -vals, right=False)  # count strictly above
        above = torch.where(idx > 0, csum.gather(1, (idx - 1).clamp(min=0)), torch.zeros_like(vals))
        kept = above < p[:, None]
        inf = torch.full_like(vals, float("inf"))
        floor = torch.where(kept, vals, inf).amin(-1)  # least likely kept
        return (probs >= floor[:, None]) | (p[:, None] >= 1)
    return None
