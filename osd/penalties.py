"""Logit bias, repetition, presence and frequency penalties and ``min_tokens`` on the
target's logits, as OpenAI and vLLM define them, for every position a step samples from
(``SamplingParams.logit_bias``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``, ``min_tokens``: the stop ids get ``-inf`` at positions that would
sample one of the first ``min_tokens`` tokens).

The bias is added first, as if the model had produced it. For a token seen in the prompt
or the output so far, the repetition penalty ``r`` divides a positive logit by ``r`` and
multiplies a negative one by ``r``; then every token loses
``frequency_penalty * count + presence_penalty * (count > 0)``, ``count`` its occurrences
in the output so far. A verify forward scores several positions at once: each position's
"so far" is the request's output plus the drafted tokens on its own path (a chain's
earlier drafts, a tree node's ancestors and itself), so the penalized target at each
position is exactly the distribution plain decoding would sample from there, and the
rejection sampler stays lossless. Drafts are not penalized: any draft distribution is
lossless, and penalizing the chat pair's EAGLE draft the same way did not raise its
acceptance (docs/benchmarks.md).
"""

from __future__ import annotations

import torch


def wants_penalties(requests) -> bool:
    """Whether any of ``requests`` asks for a penalty or a logit bias."""
    return any(r.params is not None and r.params.adjusts_logits for r in requests)


class Penalties:
    """The penalties of a batch's rows (row ``b`` is ``requests[b]``) over a ``vocab``-wide
    vocabulary on ``device``: each row's output counts and prompt tokens, built once."""

    def __init__(self, requests, vocab: int, device) -> None:
        B = len(requests)
        self.counts = torch.zeros(B, vocab, dtype=torch.float32, device=device)  # [B, V]
        self.prompt = torch.zeros(B, vocab, dtype=torch.bool, device=device)  # [B, V]
        rows = [b for b, r in enumerate(requests) for _ in r.generated]
        if rows:
            toks = [t for r in requests for t in r.generated]
            self.counts.index_put_(
                (torch.tensor(rows, device=device), torch.tensor(toks, device=device)),
                torch.ones(len(rows), device=device),
                accumulate=True,
            )
        rows = [b for b, r in enumerate(requests) for _ in r.prompt]
        self.prompt[
            torch.tensor(rows, device=device),
            torch.tensor([t for r in requests for t in r.prompt], device=device),
        ] = True

        def column(name: str) -> torch.Tensor:  # [B, 1, 1]
            return torch.tensor(
                [getattr(r.params, name) for r in requests], dtype=torch.float32, device=device
            )[:, None, None]

        self.bias = None  # [B, 1, V]
        if any(r.params.logit_bias for r in requests):
            self.bias = torch.zeros(B, 1, vocab, dtype=torch.float32, device=device)
            for b, r in enumerate(requests):
                for t, v in (r.params.logit_bias or {}).items():
                    self.bias[b, 0, t] = v
        self.repetition = column("repetition_penalty")
        self.presence = column("presence_penalty")
        self.frequency = column("frequency_penalty")
        # min_tokens: a row's stop ids are banned at the positions that would sample one of
        # its first min_tokens tokens (``room`` more from here)
        self.stops = self.room = None  # [B, 1, V], [B, 1]
        if any(r.params.min_tokens > len(r.generated) for r in requests):
            self.stops = torch.zeros(B, 1, vocab, dtype=torch.bool, device=device)
            for b, r in enumerate(requests):
                self.stops[b, 0, [t for t in r.stop_ids if 0 <= t < vocab]] = True
            self.room = torch.tensor(
                [r.params.min_tokens - len(r.generated) for r in requests], device=device
            )[:, None]

    def apply(
        self,
        logits: torch.Tensor,
        extra: torch.Tensor | None = None,
        depths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Penalized copy of ``logits [B, T, V]``; ``extra [B, T, V]``: counts of the
        tokens on each position's path beyond the output (None: none); ``depths [B, T]``:
        drafted tokens on each position's path (None: ``0 .. T-1``)."""
        counts = self.counts[:, None] if extra is None else self.counts[:, None] + extra
        x = logits.float() if self.bias is None else logits.float() + self.bias
        seen = self.prompt[:, None] | (counts > 0)
        x = torch.where(seen, torch.where(x > 0, x / self.repetition, x * self.repetition), x)
        x = x - self.frequency * counts - self.presence * (counts > 0)
        if self.stops is not None:
            if depths is None:
                depths = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
            x = x.masked_fill(self.stops & (depths < self.room)[..., None], float("-inf"))
        return x.to(logits.dtype)

    def verify(
        self,
        logits: torch.Tensor,
        inputs: torch.Tensor,
        ancestors: torch.Tensor | None = None,
        depths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Penalized ``logits [B, T, V]`` of a verify forward that fed ``inputs [B, T]``
        (position 0, the last sampled token, is in the output already). A tree's
        ``ancestors [B, T, T]`` bool (``[b, n, i]``: input ``i`` is on position ``n``'s
        path, itself included) and ``depths [B, T]``; None for a chain (every earlier
        input; depth = position)."""
        B, T, V = logits.shape
        if T == 1:
            return self.apply(logits)
        if ancestors is None:
            ancestors = torch.ones(T, T, dtype=torch.bool, device=logits.device).tril()
            ancestors = ancestors.expand(B, T, T)
        fed = torch.nn.functional.one_hot(inputs, V).float()
        fed[:, 0] = 0
        return self.apply(logits, torch.bmm(ancestors.float(), fed), depths)


def tree_ancestors(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T, T]`` bool ancestors-or-self of a tree's int64 ancestor bitmasks ``[B, T]``."""
    T = mask.shape[1]
    bits = (mask[..., None] >> torch.arange(T, device=mask.device)) & 1
    return bits.bool() | torch.eye(T, dtype=torch.bool, device=mask.device)
