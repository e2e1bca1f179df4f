"""Host-side state of one request as the engine serves it, and the error a request that
fails while it runs raises (``osd.RequestError``)."""
from __future__ import annotations

import dataclasses

from osd.sampling import SamplingParams
from osd.stats import SpecStats


class RequestError(RuntimeError):
    """A request failed while it ran (non-finite target logits, a failed step); the
    engine and the other requests go on."""


@dataclasses.dataclass
class RequestState:
    """Host-side state of one sequence being generated."""

    index: int                        # position in the prompts of the generate() call
    prompt: list[int]                 # prompt token ids
    max_new_tokens: int
    stop_ids: frozenset[int]          # EOS ids and the request's stop ids
    seed: int                         # Philox seed of all its sampling (request_seed)
    params: SamplingParams | None = None   # its own sampling parameters
    generated: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None          # why it failed (finish_reason "error")
    error_kind: str | None = None     # its kind, counted in Engine.stats["errors"]
    draft_index: int = 0              # which draft serves it (routing)
    pinned_draft: int | None = None   # the draft the caller asked for (no routing)
    spec_steps: int = 0               # speculative steps so far (the Philox offset)
    spec_stats: SpecStats | None = None
    teacher: list = dataclasses.field(default_factory=list)  # collected target distributions

    @property
    def length(self) -> int:
        """Tokens in the sequence (prompt and generated)."""
        return len(self.prompt) + len(self.generated)

    @property
    def cached_length(self) -> int:
        """Tokens whose K/V are in the cache: all but the last sampled one."""
        return self.length - 1 if self.generated else len(self.prompt)

    def append(self, token: int, max_seq_len: int) -> None:
        """Record a sampled token and decide whether the sequence is finished."""
        self.generated.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.generated) >= self.max_new_tokens or self.length >= max_seq_len:
            self.finish_reason = "length"

    def fail(self, message: str, kind: str = "nonfinite_logits") -> None:
        """End the request with ``finish_reason = "error"``; it teaches no draft."""
        self.finish_reason, self.error, self.error_kind = "error", message, kind
