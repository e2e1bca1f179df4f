"""Online learning while serving: one learner per draft, and a router across drafts.

The engine calls :meth:`OnlineManager.choose` when a request arrives (which draft serves
it), :meth:`OnlineManager.swap` between decode steps (publish learned weights), and
:meth:`OnlineManager.finish` when a request ends (turn its collected target distributions
into a training example, feed the draft that served it, and update the router).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from osd.online.buffer import Example
from osd.online.config import OnlineConfig
from osd.online.distill import heldout_alpha
from osd.online.learner import OnlineLearner
from osd.online.router import Router


def example_from_request(r, domain: str | None = None) -> Example | None:
    """Build the training example of a finished request (None if nothing was kept)."""
    if not getattr(r, "teacher", None):
        return None
    tokens = torch.tensor(r.prompt + r.generated, dtype=torch.int64)
    pos = torch.cat([t[0] for t in r.teacher])
    keep = pos < tokens.numel()          # drop positions past a stop / length cut
    if not bool(keep.any()):
        return None
    full = r.teacher[0][3] is not None
    return Example(
        tokens=tokens, positions=pos[keep],
        topk_ids=None if full else torch.cat([t[1] for t in r.teacher])[keep].long(),
        topk_probs=None if full else torch.cat([t[2] for t in r.teacher])[keep].float(),
        logits=torch.cat([t[3] for t in r.teacher])[keep] if full else None,
        domain=domain)


class OnlineManager:
    """Learners for ``drafts`` (serving models) plus a router when there are several."""

    def __init__(self, drafts: list[torch.nn.Module], config: OnlineConfig):
        self.config = config
        self.drafts = drafts
        self.learners = []
        for i, d in enumerate(drafts):
            cfg = config
            if config.checkpoint_dir and len(drafts) > 1:
                cfg = dataclasses.replace(config, checkpoint_dir=os.path.join(config.checkpoint_dir, f"draft{i}"))
            self.learners.append(OnlineLearner(d, cfg, name=f"draft{i}"))
        self.router = Router(len(drafts), config.router) if len(drafts) > 1 else None
        self.alpha_log: list[tuple[int, float | None]] = []    # (draft, alpha) per request

    def choose(self, prompt: list[int]) -> int:
        if self.router is None:
            return 0
        return self.router.choose(self.router.features(prompt))

    def swap(self, draft: int) -> bool:
        return self.learners[draft].maybe_swap()

    def finish(self, r, draft: int, alpha: float | None) -> None:
        self.alpha_log.append((draft, alpha))
        ex = example_from_request(r)
        if ex is None:
            return
        if self.router is not None:
            x = self.router.features(r.prompt)
            if self.router.config.feedback == "score":
                scores = [heldout_alpha(m, [ex], self.config.max_train_len,
                                        next(m.parameters()).device) for m in self.drafts]
                self.router.update_all(x, scores)
            elif alpha is not None:
                self.router.update(x, draft, alpha)
        self.learners[draft].observe(ex)

    def wait(self) -> None:
        for learner in self.learners:
            learner.wait()

    def close(self) -> None:
        for learner in self.learners:
            learner.close()

    def checkpoint(self) -> list[str]:
        return [learner.checkpoint() for learner in self.learners
                if learner.config.checkpoint_dir]

    def history(self, window: int = 8) -> dict:
        """Learning history: updates per draft and mean α per window of requests."""
        alphas = [a for _, a in self.alpha_log]
        windows = []
        for i in range(0, len(alphas), window):
            chunk = [a for a in alphas[i:i + window] if a is not None]
            windows.append(sum(chunk) / len(chunk) if chunk else None)
        out = {"drafts": [learner.history.as_dict() for learner in self.learners],
               "alpha_per_window": windows, "window": window,
               "routed": [d for d, _ in self.alpha_log]}
        out["updates_applied"] = sum(lr.history.updates_applied for lr in self.learners)
        out["updates_rejected"] = sum(lr.history.updates_rejected for lr in self.learners)
        out["loss"] = [[rec.loss for rec in lr.history.records] for lr in self.learners]
        return out
