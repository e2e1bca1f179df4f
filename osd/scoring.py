"""Prompt scoring: each prompt token's log-probability under a model given the tokens
before it (:meth:`osd.Engine.score`, the server's ``echo``)."""
from __future__ import annotations

import torch

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
        piece = ids[start:min(start + chunk, len(ids) - 1)]
        logits = model(torch.tensor([piece], device=device), cache)
        cache.commit(torch.full((1,), len(piece), dtype=torch.int32, device=device), len(piece))
        nxt = torch.tensor(ids[start + 1:start + 1 + len(piece)], device=device)
        entries += token_logprobs(logits[0], nxt, n)
    return entries
