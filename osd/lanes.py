"""``Lane``: the cache rows of one draft's requests, and how prompts enter them.

A lane holds ``max_batch_size`` rows of the target's KV cache; its running requests are
always in rows ``0 .. B-1`` (``osd.engine`` has the whole scheduling story). This module
is the admission side: which waiting requests are prefilled this step (:meth:`Lane.admit`)
and how a prompt too long for one prefill piece is *staged* in the lane's one-row staging
cache, a piece per step, before it joins a row reserved for it
(:meth:`Lane.advance_staging`). With a prefix cache (``osd.prefix_cache``) a prompt's
longest kept prefix is copied into its row (or the staging row) instead of prefilled.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from osd.cache import KVCache
from osd.prefix_cache import PrefixCache
from osd.request import RequestState


@dataclasses.dataclass
class Lane:
    """The cache rows of one draft's requests (or of plain decoding): ``active[b]``
    occupies row ``b`` of ``cache`` (and of the draft's own cache), rows ``0 .. B-1``."""

    cache: KVCache
    next_tokens: torch.Tensor  # [max_batch_size] int64, each row's last token
    stage_cache: KVCache  # one row: a long prompt prefilled piece by piece
    speculator: object = None  # osd.spec_decode.step.Speculator, or None (plain)
    active: list[RequestState] = dataclasses.field(default_factory=list)
    waiting: collections.deque = dataclasses.field(default_factory=collections.deque)
    staging: RequestState | None = None  # the long prompt in stage_cache (a row reserved)
    staged: int = 0  # its prompt tokens in stage_cache
    # The target's features [1, n, H] of the staged prompt's reused prefix and of each
    # staged piece, in order (for an EAGLE drafter).
    stage_hidden: list = dataclasses.field(default_factory=list)
    prefix_cache: PrefixCache | None = None  # prompt K/V shared by the engine's lanes

    @property
    def needs_hidden(self) -> bool:
        """Whether the lane's drafter drafts from the target's features."""
        return self.speculator is not None and self.speculator.drafter.needs_hidden

    def admit(
        self, max_batch_size: int, chunk: int, prompt_positions: int, reserved: int = 0
    ) -> list[RequestState]:
        """Waiting requests for the free rows, oldest first. A prompt long enough to need
        more than one prefill piece of ``chunk`` tokens goes to the staging row instead
        (when it is free), to be prefilled one piece per step; the others are prefilled
        now, up to a budget of ``4 * chunk`` prompt tokens per step (at least one
        request). ``reserved`` rows are taken already (a staged prompt joining this step)."""
        free = max_batch_size - len(self.active) - (self.staging is not None) - reserved
        budget = 4 * chunk
        new: list[RequestState] = []
        kept = collections.deque()
        while self.waiting and len(new) < free:
            r = self.waiting.popleft()
            if pieces_left(len(r.prefill_ids), prompt_positions, chunk):
                if self.staging is None and len(new) < free:
                    self.stage_cache.reset()
                    self.staging = r
                    self.staged, hidden = self.load_prefix(r, prompt_positions, self.stage_cache, 0)
                    if hidden is not None:
                        self.stage_hidden.append(hidden[None])
                    self.stage_cache.lens[0] = self.staged
                    self.stage_cache.set_bound(self.staged)
                    free -= 1
                else:
                    kept.append(r)
                continue
            if new and len(r.prefill_ids) > budget:
                kept.append(r)
                break
            budget -= len(r.prefill_ids)
            new.append(r)
        kept.extend(self.waiting)
        self.waiting = kept
        return new

    def advance_staging(self, model, prompt_positions: int, empty_lane) -> tuple | None:
        """One prefill piece of the staged prompt into the staging row (``model``, the
        target). When only its last piece is left, the staged K/V move into the lane's
        next free row (``empty_lane(self)`` first when no row runs) and ``(request,
        tokens already prefilled, their features [n, H] or None)`` is returned, to be
        prefilled there with the last piece."""
        r = self.staging
        if r is None:
            return None
        chunk = model.config.prefill_chunk
        ids = r.prefill_ids
        if pieces_left(len(ids) - self.staged, prompt_positions, chunk):
            dev = model.device
            piece = torch.tensor(
                [ids[self.staged : self.staged + chunk]], dtype=torch.int64, device=dev
            )
            first = torch.zeros(1, 1, dtype=torch.int64, device=dev)
            out = model.prefill(
                piece,
                self.stage_cache,
                torch.tensor([chunk], device=dev),
                logits_index=first,
                return_hidden=self.needs_hidden,
            )
            if self.needs_hidden:
                self.stage_hidden.append(out[1])
            self.staged += chunk
            self.stage_cache.set_bound(self.staged)
            return None
        row, n = len(self.active), self.staged
        if not self.active:
            empty_lane(self)
        self.cache.kv[:, :, row, :, :n].copy_(self.stage_cache.kv[:, :, 0, :, :n])
        self.cache.lens[row] = n
        self.cache.set_bound(max(self.cache.bound, n))
        early = torch.cat(self.stage_hidden, 1)[0] if self.stage_hidden else None
        self.unstage()
        return r, n, early

    def load_prefix(
        self, r: RequestState, prompt_positions: int, cache: KVCache, row: int
    ) -> tuple[int, torch.Tensor | None]:
        """Copy the K/V of the longest kept prefix of ``r``'s prompt (its
        ``prefill_ids``) into ``row`` of ``cache``; return its length (0 without a prefix
        cache) and, for an EAGLE drafter, the target's features there ``[n, H]`` (else
        None). The last ``max(prompt_positions, 1)`` prompt tokens are always fed: their
        logits are used."""
        if self.prefix_cache is None:
            return 0, None
        ids = r.prefill_ids
        limit = len(ids) - max(prompt_positions, 1)
        return self.prefix_cache.load(ids, limit, cache.kv[:, :, row], self.needs_hidden)

    def store_prefix(
        self, requests: list[RequestState], start_row: int, hidden: torch.Tensor | None = None
    ) -> None:
        """Keep the prompt K/V of ``requests``, just prefilled into rows ``start_row ..``,
        and their features ``hidden`` (``[n, longest prompt, H]``) when given."""
        if self.prefix_cache is None:
            return
        for b, r in enumerate(requests):
            self.prefix_cache.store(
                r.prompt, self.cache.kv[:, :, start_row + b], None if hidden is None else hidden[b]
            )

    def unstage(self) -> None:
        """Free the staging row."""
        self.staging, self.staged = None, 0
        self.stage_hidden = []
        self.stage_cache.reset()


def pieces_left(remaining: int, prompt_positions: int, chunk: int) -> bool:
    """Whether a prompt with ``remaining`` tokens to prefill needs a piece before its last
    one. The last piece holds the last ``prompt_positions`` positions (whose logits online
    learning keeps) and at most ``chunk + prompt_positions`` tokens."""
    return remaining - chunk >= max(prompt_positions, 1)
