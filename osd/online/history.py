"""What an online learner did: fault kinds, one record per update attempt, and the
bounded ``LearningHistory`` exposed in ``engine.stats['online']``."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

# Kinds of learner faults counted in ``LearningHistory.faults`` (always reported, 0 or not).
FAULT_KINDS = (
    "update_error",  # an update raised (loss, backward, optimizer step, replay, ...)
    "graph_capture_error",  # capturing the training step in a CUDA graph raised
    "nonfinite_loss",  # a training step's loss was NaN or infinite
    "nonfinite_weights",  # the weights after the steps held NaN or infinity
    "swap_error",  # copying a published update into the serving draft raised
    "checkpoint_error",  # writing a checkpoint raised (the update itself is kept)
    "resume_error",  # a checkpoint could not be read at start (an older one is used)
)


@dataclass
class UpdateRecord:
    """One update attempt, for ``engine.stats``."""

    index: int  # update attempt number (1-based)
    requests_seen: int  # finished requests observed when it started
    loss: float  # mean training loss of its steps (nan if discarded)
    alpha_before: float | None  # held-out acceptance of the old weights
    alpha_after: float | None  # held-out acceptance of the new weights
    applied: bool
    reason: str  # "applied", "guard", "non-finite loss", "non-finite weights",
    # "error", "no data"
    seconds: float


class LearningHistory:
    """What the learner did; exposed in ``engine.stats['online']``.

    Counters cover the whole run; ``records`` keeps only the newest ``max_records`` update
    attempts (a fixed window, so a long-serving engine does not grow). Thread-safe: the
    learner thread records while the serving thread reports.
    """

    def __init__(self, max_records: int = 256):
        self.updates_applied = 0
        self.updates_rejected = 0
        self.attempts = 0  # update attempts, including "no data" ones
        self.checkpoints = 0
        self.update_seconds = 0.0  # total time spent in update attempts
        self.faults: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)
        self.last_error: str | None = None
        self.last_error_at: float | None = None  # time.time() of last_error
        self.records: deque[UpdateRecord] = deque(maxlen=max_records)
        self._lock = threading.Lock()

    def next_index(self) -> int:
        """Number (1-based) of a new update attempt."""
        with self._lock:
            self.attempts += 1
            return self.attempts

    def add(self, rec: UpdateRecord) -> UpdateRecord:
        with self._lock:
            self.records.append(rec)
            self.update_seconds += rec.seconds
            if rec.applied:
                self.updates_applied += 1
            elif rec.reason != "no data":
                self.updates_rejected += 1
        return rec

    def fault(self, kind: str, message: str) -> int:
        """Count a fault of ``kind`` (one of ``FAULT_KINDS``); returns its new count."""
        with self._lock:
            self.faults[kind] = self.faults.get(kind, 0) + 1
            self.last_error = f"{kind}: {message}"
            self.last_error_at = time.time()
            return self.faults[kind]

    def as_dict(self) -> dict:
        with self._lock:
            return {
                "updates_applied": self.updates_applied,
                "updates_rejected": self.updates_rejected,
                "attempts": self.attempts,
                "checkpoints": self.checkpoints,
                "update_seconds": self.update_seconds,
                "faults": dict(self.faults),
                "last_error": self.last_error,
                "last_error_at": self.last_error_at,
                "updates": [dict(r.__dict__) for r in self.records],  # the newest only
                "updates_kept": self.records.maxlen,
            }
