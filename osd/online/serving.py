"""Online learning while serving: one learner per draft, and a router across drafts.

The engine calls :meth:`OnlineManager.choose` when a request arrives (which draft serves
it), :meth:`OnlineManager.swap` between decode steps (publish learned weights), and
:meth:`OnlineManager.finish` when a request ends (turn its collected target distributions
into a training example, feed the draft that served it, and update the router).

Whatever goes wrong in learning or routing is counted (:meth:`OnlineManager.faults`) and
never reaches serving: a request whose routing fails goes to draft 0, one whose example
cannot be built is simply not learned from. Per-request statistics are kept for the newest
``OnlineRuntime.history_requests`` requests only, next to run totals, so memory stays flat
however many requests the engine serves.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import deque

import torch

from osd.online.buffer import Example
from osd.online.config import OnlineConfig
from osd.online.distill import heldout_alpha
from osd.online.history import FAULT_KINDS
from osd.online.learner import OnlineLearner
from osd.online.router import Router

logger = logging.getLogger("osd.online")

# Faults of the manager itself (the learners count theirs, osd.online.history.FAULT_KINDS).
MANAGER_FAULT_KINDS = (
    "route_error",  # choosing a draft raised (the request went to draft 0)
    "observe_error",  # turning a finished request into training data or router feedback raised
)


def example_from_request(r, domain: str | None = None) -> Example | None:
    """Build the training example of a finished request (None if nothing was kept)."""
    if not getattr(r, "teacher", None):
        return None
    tokens = torch.tensor(r.prompt + r.generated, dtype=torch.int64)
    teacher = r.teacher  # (positions, topk ids, topk probs, logits) per kept step
    pos = torch.cat([t[0] for t in teacher])
    keep = pos < tokens.numel()  # drop positions past a stop / length cut
    if not bool(keep.any()):
        return None
    full = teacher[0][3] is not None
    features = None
    if getattr(r, "features", None):
        features = torch.cat(r.features)[: tokens.numel() - 1]
        if features.shape[0] < tokens.numel() - 1:
            return None  # a feature is missing: no EAGLE example
    return Example(
        tokens=tokens,
        positions=pos[keep],
        # int32 ids: a third less memory per stored position than int64 (build_batch widens)
        topk_ids=None if full else torch.cat([t[1] for t in teacher])[keep].to(torch.int32),
        topk_probs=None if full else torch.cat([t[2] for t in teacher])[keep].float(),
        logits=torch.cat([t[3] for t in teacher])[keep] if full else None,
        domain=domain,
        features=features,
    )


class OnlineManager:
    """Learners for ``drafts`` (serving models) plus a router when there are several.
    ``masters[i]``: the float draft that ``drafts[i]`` is a quantized copy of (or None)."""

    def __init__(
        self,
        drafts: list[torch.nn.Module],
        config: OnlineConfig,
        masters: list[torch.nn.Module | None] | None = None,
    ):
        self.config = config
        self.drafts = drafts
        self.learners = []
        masters = masters or [None] * len(drafts)
        for i, (d, master) in enumerate(zip(drafts, masters)):
            cfg = config
            if config.checkpoint_dir and len(drafts) > 1:
                cfg = dataclasses.replace(
                    config, checkpoint_dir=os.path.join(config.checkpoint_dir, f"draft{i}")
                )
            self.learners.append(OnlineLearner(d, cfg, name=f"draft{i}", master=master))
        self.router = Router(len(drafts), config.router) if len(drafts) > 1 else None
        # (draft, alpha) of the newest requests; the totals below cover all of them.
        self.alpha_log: deque[tuple[int, float | None]] = deque(maxlen=config.history_requests)
        self.requests = 0
        self._alpha_sum = 0.0
        self._alpha_count = 0
        self._routed_counts = [0] * len(drafts)
        self._faults = dict.fromkeys(MANAGER_FAULT_KINDS, 0)
        self._last_error: tuple[float, str] | None = None
        self._lock = threading.Lock()  # stats may be read from another thread

    def choose(self, prompt: list[int]) -> int:
        if self.router is None:
            return 0
        try:
            return self.router.choose(self.router.features(prompt))
        except Exception as e:
            self._fault("route_error", e)
            return 0

    def swap(self, draft: int) -> bool:
        return self.learners[draft].maybe_swap()

    def training(self) -> bool:
        """Whether a learner is training beside serving now (background learners only)."""
        return any(learner.training for learner in self.learners)

    def finish(self, r, draft: int, alpha: float | None) -> None:
        with self._lock:
            self.alpha_log.append((draft, alpha))
            self.requests += 1
            self._routed_counts[draft] += 1
            if alpha is not None:
                self._alpha_sum += alpha
                self._alpha_count += 1
        try:
            self._learn_from(r, draft, alpha)
        except Exception as e:
            self._fault("observe_error", e)

    def _learn_from(self, r, draft: int, alpha: float | None) -> None:
        ex = example_from_request(r)
        if ex is None:
            return
        if self.router is not None:
            x = self.router.features(r.prompt)
            if self.router.config.feedback == "score":
                scores = [
                    heldout_alpha(m, [ex], self.config.max_train_len, next(m.parameters()).device)
                    for m in self.drafts
                ]
                self.router.update_all(x, scores)
            elif alpha is not None:
                self.router.update(x, draft, alpha)
        self.learners[draft].observe(ex)

    def _fault(self, kind: str, error: BaseException) -> None:
        message = f"{type(error).__name__}: {error}"
        with self._lock:
            self._faults[kind] += 1
            n = self._faults[kind]
            self._last_error = (time.time(), f"{kind}: {message}")
        if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: a persistent fault does not flood
            logger.warning("online learning: %s #%d: %s", kind, n, message, exc_info=n == 1)

    def faults(self) -> dict[str, int]:
        """Fault counts by kind over the run, learners' and the manager's together (every
        kind present, 0 when it never happened)."""
        out = dict.fromkeys(FAULT_KINDS + MANAGER_FAULT_KINDS, 0)
        for learner in self.learners:
            for kind, n in learner.history.as_dict()["faults"].items():
                out[kind] = out.get(kind, 0) + n
        with self._lock:
            for kind, n in self._faults.items():
                out[kind] += n
        return out

    def last_error(self) -> str | None:
        """The newest fault's message (``"kind: Type: text"``), or None."""
        errors = [
            (h["last_error_at"], h["last_error"])
            for h in (learner.history.as_dict() for learner in self.learners)
            if h["last_error"] is not None
        ]
        with self._lock:
            if self._last_error is not None:
                errors.append(self._last_error)
        return max(errors)[1] if errors else None

    def wait(self) -> None:
        for learner in self.learners:
            learner.wait()

    def pause(self) -> None:
        for learner in self.learners:
            learner.pause()

    def resume(self) -> None:
        for learner in self.learners:
            learner.resume()

    def close(self) -> None:
        for learner in self.learners:
            learner.close()

    def checkpoint(self) -> list[str]:
        return [learner.checkpoint() for learner in self.learners if learner.config.checkpoint_dir]

    def history(self, window: int = 8) -> dict:
        """Learning history: run totals, plus recent windows.

        ``alpha_per_window``: mean α per ``window`` consecutive requests, over the newest
        ``history_requests`` requests; windows are aligned to request indices, the first
        one starts at request ``alpha_per_window_start`` (0-based). ``routed``: the draft
        of each of those newest requests, the first being request ``routed_start``;
        ``routed_counts``: requests per draft over the run. ``drafts[i]["updates"]`` and
        ``loss[i]``: the newest ``history_updates`` update attempts of draft i.
        """
        drafts = [learner.history.as_dict() for learner in self.learners]
        with self._lock:
            recent = list(self.alpha_log)
            total, alpha_sum, alpha_count = self.requests, self._alpha_sum, self._alpha_count
            routed_counts = list(self._routed_counts)
        first = total - len(recent)  # request index of recent[0]
        skip = (-first) % window
        windows = []
        for i in range(skip, len(recent), window):
            chunk = [a for _, a in recent[i : i + window] if a is not None]
            windows.append(sum(chunk) / len(chunk) if chunk else None)
        return {
            "drafts": drafts,
            "requests": total,
            "alpha_mean": alpha_sum / alpha_count if alpha_count else None,
            "alpha_per_window": windows,
            "window": window,
            "alpha_per_window_start": first + skip,
            "routed": [d for d, _ in recent],
            "routed_start": first,
            "routed_counts": routed_counts,
            "updates_applied": sum(d["updates_applied"] for d in drafts),
            "updates_rejected": sum(d["updates_rejected"] for d in drafts),
            "update_seconds": sum(d["update_seconds"] for d in drafts),
            "loss": [[u["loss"] for u in d["updates"]] for d in drafts],
            "faults": self.faults(),
            "last_error": self.last_error(),
            "learners_busy": sum(learner.busy for learner in self.learners),
        }
