"""Training batches and held-out acceptance from the replay buffer.

The draft's logits at index ``t - 1`` predict token ``t``, so a stored target
distribution for position ``t`` is matched against the draft's logits at ``t - 1`` (the
shift that OSD's released online loss misses).

A draft with a restricted head (``DecoderLM.restrict_head``) trains on its own columns:
:func:`build_batch` maps the targets into them (:func:`to_head_vocab`).

An EAGLE draft (``osd.models.eagle``) reads token ``t + 1`` beside the target's feature at
``t``, and its output there scores token ``t + 2``: its batches start one token later, carry
the stored features, and match position ``t``'s target against draft index ``t - 2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from osd.models.eagle import EagleLM
from osd.online.buffer import Example


@dataclass
class TrainBatch:
    """Padded draft inputs plus the rows of the flattened logits that carry a target."""

    input_ids: torch.Tensor  # [N, T] int64, right-padded with 0
    attention_mask: torch.Tensor  # [N, T] bool, True on real tokens
    rows: torch.Tensor  # [M] int64 into the [N * T] flattened positions
    topk_ids: torch.Tensor | None  # [M, k] int64 (columns of the draft's head)
    topk_probs: torch.Tensor | None  # [M, k] float32
    target_logits: torch.Tensor | None  # [M, V_head] float32
    features: torch.Tensor | None = None  # [N, T, H] an EAGLE draft's input features

    @property
    def num_positions(self) -> int:
        return int(self.rows.numel())


def build_batch(
    examples: list[Example],
    max_len: int,
    device,
    head_ids: torch.Tensor | None = None,
    eagle: bool = False,
    dtype: torch.dtype = torch.float32,
) -> TrainBatch:
    """Pack ``examples`` (each cut to its newest ``max_len`` tokens) into one batch, the
    targets in the columns of a head restricted to ``head_ids [V_head]`` when given;
    ``eagle``: the batch of an EAGLE draft (features in ``dtype``)."""
    if not examples:
        raise ValueError("build_batch needs at least one example")
    shift = int(eagle)
    if eagle and any(ex.features is None for ex in examples):
        raise ValueError("an EAGLE draft trains on examples with the target's features")
    cut = []
    for ex in examples:
        start = max(0, ex.tokens.numel() - max_len)
        keep = ex.positions - 1 - shift >= start
        cut.append((ex, start, keep))
    T = max(1, max(ex.tokens.numel() - start - shift for ex, start, _ in cut))
    N = len(cut)
    ids = torch.zeros(N, T, dtype=torch.int64)
    mask = torch.zeros(N, T, dtype=torch.bool)
    feats = torch.zeros(N, T, examples[0].features.shape[-1], dtype=dtype) if eagle else None
    rows, tk_ids, tk_p, logits = [], [], [], []
    for n, (ex, start, keep) in enumerate(cut):
        toks = ex.tokens[start + shift :]
        ids[n, : toks.numel()] = toks
        mask[n, : toks.numel()] = True
        if eagle:
            feats[n, : toks.numel()] = ex.features[start : start + toks.numel()].to(dtype)
        rows.append(n * T + (ex.positions[keep] - 1 - shift - start))
        if ex.topk_ids is not None:
            tk_ids.append(ex.topk_ids[keep])
            tk_p.append(ex.topk_probs[keep])
        else:
            logits.append(ex.logits[keep])
    as_dev = dict(device=device)
    tk_ids = torch.cat(tk_ids).long() if tk_ids else None
    tk_p = torch.cat(tk_p).float() if tk_p else None
    logits = torch.cat(logits).float() if logits else None
    if head_ids is not None:
        tk_ids, tk_p, logits = to_head_vocab(head_ids.cpu(), tk_ids, tk_p, logits)
    return TrainBatch(
        input_ids=ids.to(**as_dev),
        attention_mask=mask.to(**as_dev),
        rows=torch.cat(rows).to(**as_dev),
        topk_ids=None if tk_ids is None else tk_ids.to(**as_dev),
        topk_probs=None if tk_p is None else tk_p.to(**as_dev),
        target_logits=None if logits is None else logits.to(**as_dev),
        features=None if feats is None else feats.to(**as_dev),
    )


def to_head_vocab(
    head_ids: torch.Tensor,
    topk_ids: torch.Tensor | None,
    topk_probs: torch.Tensor | None,
    logits: torch.Tensor | None,
):
    """Targets over the vocabulary -> over the columns of a head that keeps ``head_ids``.

    Full logits ``[M, V]`` keep their ``head_ids`` columns (softmax renormalises over
    them). Top-k targets ``[M, k]`` keep the ids the head has, as column indices; an id
    it lacks keeps its place with probability 0 and a spare column index that is not
    among the row's kept ones (``distill_loss`` wants distinct ids), so its target mass
    joins the leftover bucket. Needs ``V_head >= 2k``.
    """
    if logits is not None:
        return None, None, logits.index_select(1, head_ids)
    k = topk_ids.shape[1]
    if head_ids.numel() < 2 * k:
        raise ValueError(f"a head of {head_ids.numel()} tokens is too small for top-{k} targets")
    column = torch.full((int(head_ids.max()) + 1,), -1, dtype=torch.int64)
    column[head_ids] = torch.arange(head_ids.numel())
    local = torch.where(
        topk_ids < column.numel(),
        column[topk_ids.clamp(max=column.numel() - 1)],
        torch.full_like(topk_ids, -1),
    )  # [M, k]
    absent = local < 0
    spares = head_ids.numel() - 1 - torch.arange(2 * k)  # [2k]
    taken = (spares[None, :, None] == local[:, None, :]).any(-1)  # [M, 2k]
    free = spares[torch.argsort(taken.to(torch.int8), dim=1, stable=True)]  # free ones first
    nth = (absent.cumsum(1) - 1).clamp(min=0)  # [M, k]
    local = torch.where(absent, free.gather(1, nth), local)
    return local, topk_probs.masked_fill(absent, 0.0), None


def draft_logits(model, batch: TrainBatch) -> torch.Tensor:
    """The draft's logits ``[M, V_head]`` at the batch's target rows (differentiable)."""
    return model.forward_train(
        batch.input_ids,
        attention_mask=batch.attention_mask,
        rows=batch.rows,
        full_vocab=False,
        features=batch.features,
    )


def eagle_pass_logits(model, batch: TrainBatch, passes: int) -> list[torch.Tensor]:
    """An EAGLE draft's logits ``[M, V_head]`` per pass: the first reads the target's
    features, each later one the features the pass before predicted (detached), as the
    draft reads its own from the second drafted token on."""
    x, out = batch.features, []
    for _ in range(max(1, passes)):
        logits, g = model.forward_train(
            batch.input_ids,
            attention_mask=batch.attention_mask,
            rows=batch.rows,
            full_vocab=False,
            features=x,
            return_hidden=True,
        )
        out.append(logits)
        x = torch.cat([batch.features[:, :1], g[:, :-1].detach().to(x.dtype)], 1)
    return out


def batch_for(model, examples: list[Example], max_len: int, device) -> TrainBatch:
    """:func:`build_batch` for ``model`` (its head columns; EAGLE inputs for an EAGLE
    draft)."""
    return build_batch(
        examples,
        max_len,
        device,
        model.head_ids,
        eagle=isinstance(model, EagleLM),
        dtype=model.dtype,
    )


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
    batch = batch_for(model, examples, max_len, device)
    if batch.num_positions == 0:
        return None
    return float(overlap(draft_logits(model, batch), batch).mean())
