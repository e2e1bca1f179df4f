"""Prompt scoring: each prompt token's log-probability under a model given the tokens
before it (:meth:`osd.Engine.score`, the server's ``echo``)."""

from __future__ import annotations

import torch

from osd.models.eagle import EagleLM
from osd.sampling import TokenLogprobs, token_logprobs


def score_tokens(model, ids: list[int], n: int, context: int) -> list[TokenLogprobs | None]:
    """One entry per token of ``ids``: None for the first, then its :class:`TokenLogprobs`
    with the ``n`` most likely tokens'. The prompt runs through ``model`` in pieces of
    ``model.config.prefill_chunk`` tokens (logits ``[1, piece, V]`` at a time), in a cache
    of its own sized for it; ``context`` is the engine's longest sequence (it picks
    LongRoPE's factors as generation does)."""
    chunk = model.config.prefill_chunk
    device = model.device
    cache = model.new_cache(1, len(ids), context=context)
    entries: list[TokenLogprobs | None] = [None]
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : min(start + chunk, len(ids) - 1)]
        logits = model(torch.tensor([piece], device=device), cache)
        cache.commit(torch.full((1,), len(piece), dtype=torch.int32, device=device), len(piece))
        nxt = torch.tensor(ids[start + 1 : start + 1 + len(piece)], device=device)
        entries += token_logprobs(logits[0], nxt, n)
    return entries


@torch.no_grad()
def draft_alphas(target, drafts: list, ids: list[int], start: int) -> list[float | None]:
    """Teacher-forced acceptance of each draft on a served sequence: the mean over the
    positions ``start .. len(ids) - 1`` (an answer after its prompt ``ids[:start]``) of
    ``1 - TV(p, q) = sum_x min(p(x), q(x))``, p and q the plain softmax of the target's
    and the draft's next-token logits given ``ids`` before the position.

    This is the draft's α on the text itself, whichever drafter (the draft model, prompt
    lookup) served each step. The target runs once for every draft. An EAGLE draft reads
    token ``t + 1`` beside the target's feature at ``t`` and scores token ``t + 2`` there
    (``osd.online.distill``), so it is fed ``ids[1:]`` with the target's features at
    positions ``0 .. len(ids) - 2``; positions before 2 are not scored for it.
    """
    n = len(ids) - start
    if start < 1 or n < 1:
        raise ValueError(
            f"draft_alphas needs 1 <= start < len(ids), got start={start}, len(ids)={len(ids)}"
        )
    x = torch.tensor([ids], device=target.device)
    rows = torch.arange(start - 1, len(ids) - 1, device=target.device)  # logits of t: t - 1
    logits, feats = target.forward_train(x, rows=rows, return_hidden=True)
    p = torch.softmax(logits.float(), -1)  # [n, V]
    out = []
    for draft in drafts:
        dev = draft.device
        if isinstance(draft, EagleLM):
            keep = rows >= 1  # positions t >= 2
            q = draft.forward_train(
                x[:, 1:].to(dev), rows=(rows[keep] - 1).to(dev), features=feats[:, :-1].to(dev)
            )
            pk = p[keep]
        else:
            q, pk = draft.forward_train(x.to(dev), rows=rows.to(dev)), p
        q = torch.softmax(q.float(), -1).to(p.device)
        out.append(float(torch.minimum(pk, q).sum(-1).mean()) if len(pk) else None)
    return out
