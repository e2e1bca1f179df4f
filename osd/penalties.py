"""Repetition, presence and frequency penalties on the target's logits, as vLLM defines
them, for every position a step samples from (``SamplingParams.repetition_penalty``,
``presence_penalty``, ``frequency_penalty``).

For a token seen in the prompt or the output so far, the repetition penalty ``r`` divides
a positive logit by ``r`` and multiplies a negative one by ``r``; then every token loses
``frequency_penalty * count + presence_penalty * (count > 0)``, ``count`` its occurrences
in the output so far. A verify forward scores several positions at once: each position's
"so far" is the request's output plus the drafted tokens on its own path (a chain's
earlier drafts, a tree node's ancestors and itself), so the penalized target at each
position is exactly the distribution plain decoding would sample from there, and the
rejection sampler stays lossless. The draft is not penalized (it only proposes).
"""
from __future__ import annotations

import torch


def wants_penalties(requests) -> bool:
    """Whether any of ``requests`` asks for a penalty."""
    return any(r.params is not None and r.params.has_penalties for r in requests)


def penalize(logits: torch.Tensor, requests, inputs: torch.Tensor | None = None,
             ancestors: torch.Tensor | None = None) -> torch.Tensor:
    """Penalized copy of ``logits [B, T, V]`` (row ``b`` is ``requests[b]``).

    Args:
        inputs: ``[B, T]`` the tokens the forward fed (position 0, the last sampled token,
            is already in the output); None for one position per row.
        ancestors: ``[B, T, T]`` bool, ``[b, n, i]``: input ``i`` precedes position ``n``'s
            prediction on its path (itself included); None for a chain (every earlier
            input).
    """
    B, T, V = logits.shape
    dev = logits.device
    counts = torch.zeros(B, V, dtype=torch.float32, device=dev)
    prompt = torch.zeros(B, V, dtype=torch.bool, device=dev)
    rows = [b for b, r in enumerate(requests) for _ in r.generated]
    if rows:
        toks = [t for r in requests for t in r.generated]
        counts.index_put_((torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)),
                          torch.ones(len(rows), device=dev), accumulate=True)
    rows = [b for b, r in enumerate(requests) for _ in r.prompt]
    prompt[torch.tensor(rows, device=dev), torch.tensor([t for r in requests for t in r.prompt],
                                                        device=dev)] = True
    counts = counts[:, None].expand(B, T, V)
    if inputs is not None and T > 1:
        if ancestors is None:
            ancestors = torch.ones(T, T, dtype=torch.bool, device=dev).tril().expand(B, T, T)
        fed = torch.nn.functional.one_hot(inputs, V).float()
        fed[:, 0] = 0                                   # the root is in the output already
        counts = counts + torch.bmm(ancestors.float(), fed)
    params = [r.params for r in requests]
    col = lambda name: torch.tensor([getattr(p, name) for p in params], dtype=torch.float32,
                                    device=dev)[:, None, None]
    rep = col("repetition_penalty")
    x = logits.float()
    seen = prompt[:, None] | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - col("frequency_penalty") * counts - col("presence_penalty") * (counts > 0)
    return x.to(logits.dtype)


def tree_ancestors(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T, T]`` bool ancestors-or-self of a tree's int64 ancestor bitmasks ``[B, T]``."""
    T = mask.shape[1]
    bits = (mask[..., None] >> torch.arange(T, device=mask.device)) & 1
    return bits.bool() | torch.eye(T, dtype=torch.bool, device=mask.device)
