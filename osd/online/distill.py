"""Training batches and held-out acceptance from the replay buffer.

The draft's logits at index ``t - 1`` predict token ``t``, so a stored target
distribution for position ``t`` is matched against the draft's logits at ``t - 1`` (the
shift that OSD's released online loss misses).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from osd.online.buffer import Example


@dataclass
class TrainBatch:
    """Padded draft inputs plus the rows of the flattened logits that carry a target."""

    input_ids: torch.Tensor          # [N, T] int64, right-padded with 0
    attention_mask: torch.Tensor     # [N, T] bool, True on real tokens
    rows: torch.Tensor               # [M] int64 into the [N * T] flattened positions
    topk_ids: torch.Tensor | None    # [M, k] int64
    topk_probs: torch.Tensor | None  # [M, k] float32
    target_logits: torch.Tensor | None  # [M, V] float32

    @property
    def num_positions(self) -> int:
        return int(self.rows.numel())


def build_batch(examples: list[Example], max_len: int, device) -> TrainBatch:
    """Pack ``examples`` (each cut to its newest ``max_len`` tokens) into one batch."""
    if not examples:
        raise ValueError("build_batch needs at least one example")
    cut = []
    for ex in examples:
        start = max(0, ex.tokens.numel() - max_len)
        keep = ex.positions - 1 >= start
        cut.append((ex, start, keep))
    T = max(ex.tokens.numel() - start for ex, start, _ in cut)
    N = len(cut)
    ids = torch.zeros(N, T, dtype=torch.int64)
    mask = torch.zeros(N, T, dtype=torch.bool)
    rows, tk_ids, tk_p, logits = [], [], [], []
    for n, (ex, start, keep) in enumerate(cut):
        toks = ex.tokens[start:]
        ids[n, :toks.numel()] = toks
        mask[n, :toks.numel()] = True
        rows.append(n * T + (ex.positions[keep] - 1 - start))
        if ex.topk_ids is not None:
            tk_ids.append(ex.topk_ids[keep])
            tk_p.append(ex.topk_probs[keep])
        else:
            logits.append(ex.logits[keep])
    as_dev = dict(device=device)
    return TrainBatch(
        input_ids=ids.to(**as_dev), attention_mask=mask.to(**as_dev),
        rows=torch.cat(rows).to(**as_dev),
        topk_ids=torch.cat(tk_ids).long().to(**as_dev) if tk_ids else None,
        topk_probs=torch.cat(tk_p).float().to(**as_dev) if tk_p else None,
        target_logits=torch.cat(logits).float().to(**as_dev) if logits else None,
    )


def draft_logits(model, batch: TrainBatch) -> torch.Tensor:
    """The draft's logits ``[M, V]`` at the batch's target rows (differentiable)."""
    return model.forward_train(batch.input_ids, attention_mask=batch.attention_mask,
                               rows=batch.rows)


def overlap(logits: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """Per-position acceptance ``sum_x min(p(x), q(x))`` ``[M]`` of draft ``logits [M, V]``.

    With top-k storage only the stored tokens count, a lower bound of the exact
    ``1 - TV(p, q)`` that is off by at most the target's leftover mass.
    """
    q = torch.softmax(logits.float(), dim=-1)
    if batch.topk_ids is not None:
        return torch.minimum(batch.topk_probs, q.gather(1, batch.topk_ids)).sum(-1)
    p = torch.softmax(batch.target_logits, dim=-1)
    return torch.minimum(p, q).sum(-1)


@torch.no_grad()
def heldout_alpha(model, examples: list[Example], max_len: int, device) -> float | None:
    """Mean acceptance of ``model`` on ``examples`` against their stored targets (no
    target forward). None when there is nothing to score."""
    examples = [ex for ex in examples if ex.num_positions > 0]
    if not examples:
        return None
    batch = build_batch(examples, max_len, device)
    if batch.num_positions == 0:
        return None
    return float(overlap(draft_logits(model, batch), batch).mean())
