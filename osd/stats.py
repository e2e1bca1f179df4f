"""Speculative-decoding statistics, per engine and per request.

Reported quantities (REFERENCE.md §1 "α, precisely"):

- ``drafted`` / ``accepted``: draft tokens proposed and accepted; ``acceptance_rate`` is
  their ratio (the empirical accepted / drafted count);
- ``alpha``: the exact per-position acceptance probability ``sum_x min(p(x), q(x)) =
  1 - TV(p, q)`` of the warped target p and draft q, averaged over drafted positions where
  draft probabilities exist (sampling with a model draft); ``None`` otherwise;
- ``mean_accepted_length``: tokens emitted per sequence per target verify step (at batch
  size B one verify forward makes B sequence steps; ``target_forwards`` counts forwards);
- ``lookup_steps``: verify steps whose drafts came from prompt lookup
  (``SpecConfig(prompt_lookup=True)``; α then averages the draft model's positions only);
- ``position_acceptance``: at draft position i, accepted / drafted among the steps that
  drafted at least i + 1 tokens (vLLM's per-position rate);
- ``time_s``: wall time split into draft, verify, sample, rollback (and prefill);
- ``tokens_per_s``: generated tokens over the total wall time of ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("prefill", "draft", "verify", "sample", "rollback", "other")


@dataclass
class SpecStats:
    """Accumulated counters; ``merge`` adds another instance, ``as_dict`` reports."""

    requests: int = 0
    generated_tokens: int = 0
    target_forwards: int = 0  # verify (or plain decode) forwards of the target
    sequence_steps: int = 0  # rows those forwards verified (B per batched forward)
    lookup_steps: int = 0  # verify steps drafted by prompt lookup (prompt_lookup)
    drafted: int = 0
    accepted: int = 0
    alpha_sum: float = 0.0  # sum over drafted positions of 1 - TV(p, q)
    alpha_count: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    time_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    wall_s: float = 0.0

    def add_step(self, drafted: list[int], accepted: list[int], emitted: int) -> None:
        """One verify step over a batch: per-row drafted / accepted counts, tokens emitted."""
        self.target_forwards += 1
        self.sequence_steps += len(drafted)
        self.generated_tokens += emitted
        width = max(drafted, default=0)
        if len(self.drafted_at) < width:
            grow = width - len(self.drafted_at)
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for d, a in zip(drafted, accepted):
            self.drafted += d
            self.accepted += a
            for i in range(d):
                self.drafted_at[i] += 1
                if i < a:
                    self.accepted_at[i] += 1

    def add_alpha(self, total: float, count: int) -> None:
        self.alpha_sum += float(total)
        self.alpha_count += int(count)

    def add_time(self, phase: str, seconds: float) -> None:
        self.time_s[phase] = self.time_s.get(phase, 0.0) + seconds

    def merge(self, other: "SpecStats") -> None:
        self.requests += other.requests
        self.generated_tokens += other.generated_tokens
        self.target_forwards += other.target_forwards
        self.sequence_steps += other.sequence_steps
        self.lookup_steps += other.lookup_steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.alpha_sum += other.alpha_sum
        self.alpha_count += other.alpha_count
        n = max(len(self.drafted_at), len(other.drafted_at))
        self.drafted_at += [0] * (n - len(self.drafted_at))
        self.accepted_at += [0] * (n - len(self.accepted_at))
        for i, (d, a) in enumerate(zip(other.drafted_at, other.accepted_at)):
            self.drafted_at[i] += d
            self.accepted_at[i] += a
        for k, v in other.time_s.items():
            self.time_s[k] = self.time_s.get(k, 0.0) + v
        self.wall_s += other.wall_s

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def alpha(self) -> float | None:
        return self.alpha_sum / self.alpha_count if self.alpha_count else None

    @property
    def mean_accepted_length(self) -> float | None:
        return self.generated_tokens / self.sequence_steps if self.sequence_steps else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else None

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "generated_tokens": self.generated_tokens,
            "target_forwards": self.target_forwards,
            "sequence_steps": self.sequence_steps,
            "lookup_steps": self.lookup_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "alpha": self.alpha,
            "mean_accepted_length": self.mean_accepted_length,
            "position_acceptance": [
                a / d if d else None for d, a in zip(self.drafted_at, self.accepted_at)
            ],
            "time_s": dict(self.time_s),
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
        }
