"""Replay buffer of the target's verdicts, collected while serving.

Every verify step already computes the target's distribution at each drafted position,
so training never runs the target again. For each served request we keep the committed
token sequence and, for the generated positions, the target's distribution that decided
the token there, stored compactly:

- top-k: ``ids [m, k]`` int32 and ``probs [m, k]`` float16/32 of the target's k most likely
  tokens; the leftover mass ``1 - probs.sum()`` is implicit (see ``osd_kernels.distill_loss``
  for how the losses treat it);
- or full logits ``[m, V]`` when ``keep_full_logits`` is set.

Positions are absolute indices into the sequence: position ``t`` holds the distribution
of token ``t`` given tokens ``< t``. Which positions are kept is a policy: all verified
positions (default) or only those where the target corrected the draft (OSD's choice).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch

import osd_kernels


@dataclass
class Example:
    """One served request's training signal (CPU tensors)."""

    tokens: torch.Tensor  # [n] int64: prompt + generated tokens
    positions: torch.Tensor  # [m] int64: positions with a stored target distribution
    topk_ids: torch.Tensor | None  # [m, k] int32 (top-k storage)
    topk_probs: torch.Tensor | None  # [m, k] float32
    logits: torch.Tensor | None  # [m, V] float32 (full storage)
    domain: str | None = None  # optional label (used only for reporting)
    features: torch.Tensor | None = None  # [n - 1, H] float16: the target's features at
    #                                       positions 0 .. n - 2 (an EAGLE draft's inputs)

    @property
    def num_positions(self) -> int:
        return int(self.positions.numel())


def compress_target(logits: torch.Tensor, topk: int | None):
    """``logits [m, V]`` -> (topk_ids, topk_probs, None) or (None, None, logits) on CPU.

    ``logits`` must already be warped the way the draft is trained (plain softmax of the
    target's logits; temperature is a decoding choice, not part of the teacher).
    """
    logits = logits.detach().float()
    if topk is None:
        return None, None, logits.cpu()
    i, p = osd_kernels.topk_probs(logits, topk)
    return i.cpu(), p.cpu(), None


class ReplayBuffer:
    """A bounded FIFO of :class:`Example`, thread-safe (serving appends, training samples).

    Capacity is counted in stored positions, so long requests do not crowd the memory.
    A fixed fraction of requests (every ``holdout_every``-th) goes to a held-out slice used
    only to accept or reject an update. The slice keeps the newest ``holdout_capacity``
    such requests; an older one then retires into the training set (it was never trained
    on while held out), so no request is withheld from learning for good: a task asked
    again later is drafted from what was learned from it, whichever slice it went to.
    """

    def __init__(
        self, capacity_positions: int = 65536, holdout_every: int = 5, holdout_capacity: int = 64
    ):
        self.capacity = int(capacity_positions)
        self.holdout_every = int(holdout_every)
        self._train: deque[Example] = deque()
        self._holdout: deque[Example] = deque(maxlen=int(holdout_capacity))
        self._positions = 0
        self._seen = 0
        self._lock = threading.Lock()

    def add(self, ex: Example) -> None:
        if ex.num_positions == 0:
            return
        with self._lock:
            self._seen += 1
            if self.holdout_every > 0 and self._seen % self.holdout_every == 0:
                retired = (
                    self._holdout.popleft() if len(self._holdout) == self._holdout.maxlen else None
                )
                self._holdout.append(ex)
                if retired is None:
                    return
                ex = retired
            self._train.append(ex)
            self._positions += ex.num_positions
            while self._positions > self.capacity and len(self._train) > 1:
                self._positions -= self._train.popleft().num_positions

    def recent(self, max_positions: int) -> list[Example]:
        """The newest examples holding about ``max_positions`` positions (newest last)."""
        out, n = [], 0
        with self._lock:
            for ex in reversed(self._train):
                if n >= max_positions and out:
                    break
                out.append(ex)
                n += ex.num_positions
        return out[::-1]

    def batch(
        self,
        max_positions: int,
        replay_fraction: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> list[Example]:
        """Examples for one update: the newest ones holding about ``(1 - replay_fraction)
        * max_positions`` positions, then older ones drawn uniformly at random (without
        repeats) up to about ``replay_fraction * max_positions`` more. Rehearsing older
        requests keeps what was learned from them: a repeated or similar query much later
        in the stream is drafted as well as when it was fresh. Order: replayed first,
        then the newest (newest last)."""
        with self._lock:
            train = list(self._train)
        newest, n, i = [], 0, len(train)
        fresh_budget = max_positions * (1.0 - replay_fraction)
        while i > 0 and (n < fresh_budget or not newest):
            i -= 1
            newest.append(train[i])
            n += train[i].num_positions
        replayed, m = [], 0
        if replay_fraction > 0 and i > 0:
            for j in torch.randperm(i, generator=generator).tolist():
                if m >= max_positions * replay_fraction:
                    break
                replayed.append(train[j])
                m += train[j].num_positions
        return replayed + newest[::-1]

    def holdout(self) -> list[Example]:
        with self._lock:
            return list(self._holdout)

    def __len__(self) -> int:
        with self._lock:
            return len(self._train)

    @property
    def num_positions(self) -> int:
        with self._lock:
            return self._positions
