"""``OnlineLearner``: distils one draft from the target's verdicts while it serves.

Serving hands every finished request to :meth:`OnlineLearner.observe`. Every
``update_every_requests`` requests (or ``update_every_tokens`` positions) an update runs
on a private *training copy* of the draft:

1. ``steps_per_update`` AdamW steps of ``osd_kernels.distill_loss`` on the newest buffered
   positions (the target's stored distributions; no target forward is ever recomputed);
2. a non-finite loss discards the whole update;
3. the guard scores old and new weights on the held-out slice of the buffer (acceptance
   against the stored target distributions) and keeps the update only if acceptance did
   not drop by more than ``guard_tolerance``; otherwise weights and optimizer state are
   restored;
4. a kept update is published; the engine copies it into the serving draft between two
   decode steps (:meth:`maybe_swap`), never within one;
5. every ``checkpoint_every`` kept updates, weights and optimizer state are checkpointed
   atomically to ``checkpoint_dir``.

Updates run in a background thread (``background=True``; on CUDA the thread works on a
side stream, and the step is captured in a CUDA graph, see ``osd.online.graphs``) so
serving never waits, unless ``wait_for_update`` asks it to.
"""
from __future__ import annotations

import copy
import math
import threading
import time
from dataclasses import dataclass, field

import torch

import osd_kernels
from osd.online.buffer import Example, ReplayBuffer
from osd.online.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from osd.online.config import OnlineConfig
from osd.online.distill import build_batch, draft_logits, heldout_alpha


def snapshot_state(model: torch.nn.Module, optim: torch.optim.Optimizer):
    """Copies of the model's tensors and the optimizer's per-parameter state tensors."""
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optim_state = {p: {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
                   for p, st in optim.state.items()}
    return weights, optim_state


@torch.no_grad()
def restore_state(model: torch.nn.Module, optim: torch.optim.Optimizer, snapshot) -> None:
    """Undo to ``snapshot`` **in place** (a captured CUDA graph holds these very tensors).

    Optimizer state created after the snapshot is zeroed (a fresh AdamW state)."""
    weights, optim_state = snapshot
    for k, v in model.state_dict().items():
        v.copy_(weights[k])
    for p, st in optim.state.items():
        saved = optim_state.get(p, {})
        for k, v in st.items():
            if torch.is_tensor(v):
                v.copy_(saved[k]) if k in saved else v.zero_()


@dataclass
class UpdateRecord:
    """One update attempt, for ``engine.stats``."""

    index: int                 # update attempt number (1-based)
    requests_seen: int         # finished requests observed when it started
    loss: float                # mean training loss of its steps (nan if discarded)
    alpha_before: float | None  # held-out acceptance of the old weights
    alpha_after: float | None   # held-out acceptance of the new weights
    applied: bool
    reason: str                # "applied", "non-finite loss", "guard", "no data"
    seconds: float


@dataclass
class LearningHistory:
    """What the learner did; exposed as ``engine.stats['online']``."""

    updates_applied: int = 0
    updates_rejected: int = 0
    checkpoints: int = 0
    records: list[UpdateRecord] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "updates_applied": self.updates_applied,
            "updates_rejected": self.updates_rejected,
            "checkpoints": self.checkpoints,
            "updates": [r.__dict__ for r in self.records],
        }


class OnlineLearner:
    """Online distillation of one serving draft model.

    Args:
        draft: the serving draft (an ``osd.models`` model with ``forward_train``). Its
            parameters are only written by :meth:`maybe_swap`.
        config: :class:`OnlineConfig`.
        name: label used in checkpoints and statistics.
    """

    def __init__(self, draft: torch.nn.Module, config: OnlineConfig, name: str = "draft"):
        self.config = config
        self.name = name
        self.serving = draft
        self.device = next(draft.parameters()).device
        self.model = copy.deepcopy(draft)
        if next(draft.parameters()).dtype in (torch.float16, torch.bfloat16):
            # fp32 master weights and optimizer state: AdamW steps on half weights round
            # most updates away. The serving draft gets them cast at each swap.
            self.model.float()
            if hasattr(self.model, "_cos"):
                self.model._cos = self.model._sin = torch.empty(0)   # rebuilt in fp32
        self.model.requires_grad_(True)
        self.model.train()
        use_cuda = self.device.type == "cuda"
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=config.lr,
                                       weight_decay=config.weight_decay, capturable=use_cuda)
        self.buffer = ReplayBuffer(config.buffer_positions, config.holdout_every)
        self.history = LearningHistory()
        self.requests_seen = 0
        self._since_update_requests = 0
        self._since_update_positions = 0
        # A published update: the weights, and on CUDA the event recorded on the learner's
        # stream after they were written (the serving stream waits on it before copying).
        self._pending: tuple[dict[str, torch.Tensor], torch.cuda.Event | None] | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._due = 0
        self._busy = False
        self._closed = False
        self._gen = torch.Generator().manual_seed(config.seed)
        self._graph_step = None
        if use_cuda and config.cuda_graphs:
            from osd.online.graphs import GraphedTrainStep

            self._graph_step = GraphedTrainStep(self.model, self.optim, config)
        self._stream = torch.cuda.Stream(self.device) if use_cuda else None
        if config.checkpoint_dir:
            self._resume(config.checkpoint_dir)
        self._thread = None
        if config.background:
            self._thread = threading.Thread(target=self._loop, name=f"osd-learner-{name}",
                                            daemon=True)
            self._thread.start()

    # -- serving side ---------------------------------------------------------------
    def observe(self, example: Example) -> None:
        """Record a finished request; trigger an update when one is due."""
        self.buffer.add(example)
        due = False
        with self._lock:
            self.requests_seen += 1
            self._since_update_requests += 1
            self._since_update_positions += example.num_positions
            every_tok = self.config.update_every_tokens
            if (self._since_update_requests >= self.config.update_every_requests
                    or (every_tok is not None and self._since_update_positions >= every_tok)):
                self._since_update_requests = 0
                self._since_update_positions = 0
                due = True
                if self._thread is not None:
                    self._due += 1
                    self._wake.notify()
        if due and self._thread is None:
            self._update()
        elif due and self.config.wait_for_update:
            self.wait()

    def maybe_swap(self) -> bool:
        """Copy a published update into the serving draft. Call between decode steps."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        state, ready = pending
        stream = torch.cuda.current_stream(self.device) if ready is not None else None
        if ready is not None:
            stream.wait_event(ready)
        with torch.no_grad():
            for name, p in self.serving.state_dict().items():
                if name in state:
                    p.copy_(state[name])
                    if stream is not None:
                        # allocated on the learner's stream, read on this one
                        state[name].record_stream(stream)
        return True

    def wait(self) -> None:
        """Block until no update is queued or running."""
        with self._lock:
            while self._due or self._busy:
                self._wake.wait(timeout=0.05)

    def close(self) -> None:
        """Stop the background thread (pending work is finished first)."""
        if self._thread is None:
            return
        self.wait()
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        self._thread.join()
        self._thread = None

    # -- training side --------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._due and not self._closed:
                    self._wake.wait()
                if self._closed and not self._due:
                    return
                self._due = 0
                self._busy = True
            try:
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        self._update()
                    self._stream.synchronize()
                else:
                    self._update()
            finally:
                with self._lock:
                    self._busy = False
                    self._wake.notify_all()

    def _loss(self, batch) -> torch.Tensor:
        logits = draft_logits(self.model, batch)
        target = ((batch.topk_ids, batch.topk_probs) if batch.topk_ids is not None
                  else batch.target_logits)
        return osd_kernels.distill_loss(logits, target, loss=self.config.loss,
                                        beta=self.config.beta)

    def _step(self, batch) -> float:
        if self._graph_step is not None:
            return self._graph_step(batch)
        self.optim.zero_grad(set_to_none=True)
        loss = self._loss(batch)
        if not torch.isfinite(loss):
            return float("nan")
        loss.backward()
        if self.config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optim.step()
        return float(loss.detach())

    def _update(self) -> UpdateRecord:
        # Serving runs under inference mode; training needs autograd on normal tensors.
        with torch.inference_mode(False), torch.enable_grad():
            return self._update_impl()

    def _update_impl(self) -> UpdateRecord:
        cfg = self.config
        t0 = time.perf_counter()
        index = len(self.history.records) + 1
        examples = self.buffer.recent(cfg.batch_positions)
        holdout = self.buffer.holdout()
        if not examples:
            return self._record(UpdateRecord(index, self.requests_seen, math.nan, None, None,
                                             False, "no data", time.perf_counter() - t0))
        snapshot = snapshot_state(self.model, self.optim)
        self.model.eval()
        alpha_before = heldout_alpha(self.model, holdout, cfg.max_train_len, self.device)
        self.model.train()
        batch = build_batch(examples, cfg.max_train_len, self.device)
        losses = [self._step(batch) for _ in range(cfg.steps_per_update)]
        self.model.eval()
        finite = all(math.isfinite(v) for v in losses) and all(
            bool(torch.isfinite(p).all()) for p in self.model.parameters())
        alpha_after = (heldout_alpha(self.model, holdout, cfg.max_train_len, self.device)
                       if finite else None)
        self.model.train()
        reason = "applied"
        if not finite:
            reason = "non-finite loss"
        elif (alpha_before is not None and alpha_after is not None
              and alpha_after < alpha_before - cfg.guard_tolerance):
            reason = "guard"
        mean_loss = sum(losses) / len(losses)
        if reason != "applied":
            restore_state(self.model, self.optim, snapshot)
            return self._record(UpdateRecord(index, self.requests_seen, mean_loss, alpha_before,
                                             alpha_after, False, reason, time.perf_counter() - t0))
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()                  # on the learner's stream, after the clones
        with self._lock:
            self._pending = (state, ready)
        rec = self._record(UpdateRecord(index, self.requests_seen, mean_loss, alpha_before,
                                        alpha_after, True, reason, time.perf_counter() - t0))
        if cfg.checkpoint_dir and self.history.updates_applied % cfg.checkpoint_every == 0:
            self.checkpoint()
        return rec

    def _record(self, rec: UpdateRecord) -> UpdateRecord:
        self.history.records.append(rec)
        if rec.applied:
            self.history.updates_applied += 1
        elif rec.reason != "no data":
            self.history.updates_rejected += 1
        return rec

    # -- persistence ----------------------------------------------------------------
    def checkpoint(self) -> str:
        """Write the training copy's weights and optimizer state atomically."""
        meta = {"name": self.name, "requests_seen": self.requests_seen,
                "updates_applied": self.history.updates_applied,
                "updates_rejected": self.history.updates_rejected}
        path = save_checkpoint(self.config.checkpoint_dir, self.history.updates_applied,
                               self.model.state_dict(), self.optim.state_dict(), meta)
        self.history.checkpoints += 1
        return path

    def _resume(self, ckpt_dir: str) -> None:
        path = latest_checkpoint(ckpt_dir)
        if path is None:
            return
        state, optim_state, meta = load_checkpoint(path)
        missing = set(self.model.state_dict()) - set(state)
        if missing:
            raise ValueError(f"checkpoint {path!r} does not match the draft: missing "
                             f"{sorted(missing)[:3]}")
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                v.copy_(state[k])
            for k, v in self.serving.state_dict().items():
                v.copy_(state[k])
        if optim_state:
            self.optim.load_state_dict(optim_state)
        self.requests_seen = int(meta.get("requests_seen", 0))
        self.history.updates_applied = int(meta.get("updates_applied", 0))
        self.history.updates_rejected = int(meta.get("updates_rejected", 0))
