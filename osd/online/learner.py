"""``OnlineLearner``: distils one draft from the target's verdicts while it serves.

Serving hands every finished request to :meth:`OnlineLearner.observe`. Every
``update_every_requests`` requests (or ``update_every_tokens`` positions) an update runs
on a private *training copy* of the draft:

1. ``steps_per_update`` AdamW steps of ``osd_kernels.distill_loss`` on the newest buffered
   positions (the target's stored distributions; no target forward is ever recomputed);
2. a non-finite loss, or non-finite weights after the steps, discard the whole update;
3. the guard scores old and new weights on the held-out slice of the buffer (acceptance
   against the stored target distributions) and keeps the update only if acceptance did
   not drop by more than ``guard_tolerance``; otherwise weights and optimizer state are
   restored;
4. a kept update is published; the engine copies it into the serving draft between two
   decode steps (:meth:`maybe_swap`), never within one;
5. every ``checkpoint_every`` kept updates, weights and optimizer state are checkpointed
   atomically to ``checkpoint_dir``.

Updates run in a background thread (``background=True``, ``osd.online.update_thread``; on
CUDA the thread works on a side stream, and the step is captured in a CUDA graph, see
``osd.online.train_graphs``) so serving never waits, unless ``wait_for_update`` asks it to.

Learning is an optimisation of serving, never a condition for it: an update that raises
(in the loss, the backward, the optimizer, a graph capture) is rolled back like a rejected
one, counted in ``history.faults`` by kind with its message kept in
``history.last_error``, and later updates run as usual; serving keeps the last good draft.
A failed capture also turns the learner's CUDA graphs off (eager steps from then on).
An EAGLE draft (``osd.models.eagle``) trains its own tensors on batches that carry the
target's stored features; the target's tensors it shares stay shared and frozen, and its
steps run eagerly. The history (``osd.online.history``) keeps counters plus the newest
``history_updates`` records, and after each update the C heap's free pages go back to the
system (``osd.online.memory``), so memory stays bounded however long the engine serves.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import time

import torch

import osd_kernels
from osd.models.quant import own_quant_layers, quantized_state
from osd.online.buffer import Example, ReplayBuffer
from osd.online.checkpoint import complete_checkpoints, load_checkpoint, save_checkpoint
from osd.online.config import OnlineConfig, cpu_has_fast_bf16, resolve_autocast
from osd.online.distill import batch_for, draft_logits, eagle_pass_logits, heldout_alpha
from osd.online.history import FAULT_KINDS as FAULT_KINDS  # public here too
from osd.online.history import LearningHistory, UpdateRecord
from osd.online.memory import pin_mmap_threshold, release_free_memory
from osd.online.update_thread import UpdateThread

logger = logging.getLogger("osd.online")
_warned_cores = False


def warn_if_cores_shared(cores: int | None = None) -> bool:
    """Log once per process when a background learner on the CPU will contend with serving
    for the cores: torch's thread count is the process's, so the learner trains on as many
    threads as serving, and twice that past the cores slows serving
    (``bench/bench_online_threads.py``). Returns whether it warned."""
    global _warned_cores
    cores = cores or os.cpu_count() or 1
    threads = torch.get_num_threads()
    if _warned_cores or 2 * threads <= cores or cores < 2:
        return False
    _warned_cores = True
    logger.warning(
        "osd: a background online learner trains on torch's %d threads beside serving's "
        "%d on %d cores; they contend for the cores and serving slows "
        "(bench/bench_online_threads.py). torch.set_num_threads(%d) leaves each half "
        "(osd serve --online does so by default).",
        threads,
        threads,
        cores,
        max(1, cores // 2),
    )
    return True


class GraphCaptureError(RuntimeError):
    """Capturing the training step in a CUDA graph failed (``osd.online.train_graphs``)."""


def snapshot_state(model: torch.nn.Module, optim: torch.optim.Optimizer):
    """Copies of the model's tensors and the optimizer's per-parameter state tensors."""
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optim_state = {
        p: {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
        for p, st in optim.state.items()
    }
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


class OnlineLearner(UpdateThread):
    """Online distillation of one serving draft model.

    Args:
        draft: the serving draft (an ``osd.models`` model with ``forward_train``). Its
            parameters are only written by :meth:`maybe_swap`.
        config: :class:`OnlineConfig`.
        name: label used in checkpoints and statistics.
        master: the float draft that ``draft`` is a block-quantized copy of
            (``Engine(quantize_draft=...)``): the learner trains a copy of it and each
            published update is quantized (in the learner's thread) into ``draft``'s
            formats. Required when ``draft`` has quantized layers of its own.
    """

    def __init__(
        self,
        draft: torch.nn.Module,
        config: OnlineConfig,
        name: str = "draft",
        master: torch.nn.Module | None = None,
    ):
        self.config = config
        self.name = name
        self._init_thread()
        if config.mmap_threshold is not None:
            pin_mmap_threshold(config.mmap_threshold)
        self.serving = draft
        # A serving draft with block-quantized layers is a copy of a float draft (master):
        # the learner trains a copy of master and publishes its weights quantized.
        self._quant_layers = own_quant_layers(draft)
        if self._quant_layers and master is None:
            raise ValueError(
                f"online learner {name}: the draft keeps quantized layers, which "
                f"cannot learn; give the float draft it was quantized from"
            )
        draft = draft if master is None else master
        self.device = next(draft.parameters()).device
        self.autocast = resolve_autocast(config.autocast, self.device)
        if self.autocast == "bfloat16" and self.device.type == "cpu" and not cpu_has_fast_bf16():
            logger.warning(
                "online learner %s: bf16 autocast on a CPU without native bf16 "
                "matmuls is much slower than fp32; OnlineRecipe.autocast='auto' "
                "picks per CPU",
                name,
            )
        # An EAGLE draft's target tensors (embedding, norm, head) stay shared and frozen.
        shared = list(getattr(draft, "shared_parameters", list)()) + list(
            getattr(draft, "shared_modules", list)()
        )
        half = next(draft.parameters()).dtype in (torch.float16, torch.bfloat16)
        self.model = copy.deepcopy(draft, memo={} if half else {id(p): p for p in shared})
        if half:
            # fp32 master weights and optimizer state: AdamW steps on half weights round
            # most updates away. The serving draft gets them cast at each swap.
            self.model.float()  # its RoPE tables follow the dtype on first use
        self.model.requires_grad_(True)
        for p in getattr(self.model, "shared_parameters", list)():
            p.requires_grad_(False)
        self.model.train()
        use_cuda = self.device.type == "cuda"
        # CUDA: capturable state for the graphed step; CPU: the fused kernel (one pass
        # over each tensor instead of a dozen elementwise ops).
        self.optim = torch.optim.AdamW(
            self.model.parameters(),
            lr=config.lr,
            weight_decay=config.weight_decay,
            capturable=use_cuda,
            fused=None if use_cuda else True,
        )
        self.buffer = ReplayBuffer(
            config.buffer_positions, config.holdout_every, config.holdout_requests
        )
        self.history = LearningHistory(config.history_updates)
        self.requests_seen = 0
        self._since_update_requests = 0
        self._since_update_positions = 0
        # A published update: the weights, and on CUDA the event recorded on the learner's
        # stream after they were written (the serving stream waits on it before copying).
        self._pending: tuple[dict[str, torch.Tensor], torch.cuda.Event | None] | None = None
        self._gen = torch.Generator().manual_seed(config.seed)
        self._snapshot = None  # the state an update in progress rolls back to
        self._graph_step = None
        # EAGLE batches and autocast steps run eagerly.
        if use_cuda and config.cuda_graphs and not shared and self.autocast is None:
            # imported on CUDA only: the captured step is GPU code
            from osd.online.train_graphs import GraphedTrainStep

            self._graph_step = GraphedTrainStep(self.model, self.optim, config)
        self._stream = torch.cuda.Stream(self.device) if use_cuda else None
        if config.checkpoint_dir:
            self._resume(config.checkpoint_dir)
        if config.background:
            if not use_cuda:
                warn_if_cores_shared()
            self._start_thread(f"osd-learner-{name}")

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
            if self._since_update_requests >= self.config.update_every_requests or (
                every_tok is not None and self._since_update_positions >= every_tok
            ):
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
        try:
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
        except Exception as e:
            # A half-copied draft drafts worse but never changes outputs (the target
            # verifies every token); the next published update overwrites all of it.
            self._fault("swap_error", e)
            return False
        finally:
            del state, pending
            if ready is None and self.config.trim_after_update:
                # The published copy was allocated in the learner thread's heap and is
                # freed here: hand those pages back now, not at the next update.
                release_free_memory()
        return True

    # -- training side --------------------------------------------------------------
    def _run_update(self) -> None:
        """One update in the background thread; on CUDA on the learner's side stream."""
        if self._stream is None:
            self._update()
            return
        with torch.cuda.stream(self._stream):
            self._update()
        self._stream.synchronize()

    def _fault(self, kind: str, error: BaseException | str) -> None:
        """Count a fault and log it (the first of each kind with its traceback, then at
        counts 2, 4, 8, ... so that a persistent failure does not flood the log)."""
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        n = self.history.fault(kind, message)
        if n & (n - 1) == 0:
            logger.warning(
                "online learner %s: %s #%d: %s",
                self.name,
                kind,
                n,
                message,
                exc_info=n == 1 and not isinstance(error, str),
            )

    def _loss(self, batch) -> torch.Tensor:
        target = (
            (batch.topk_ids, batch.topk_probs)
            if batch.topk_ids is not None
            else batch.target_logits
        )
        cfg = self.config
        with (
            torch.autocast(self.device.type, dtype=getattr(torch, self.autocast))
            if self.autocast
            else contextlib.nullcontext()
        ):
            if batch.features is None:
                passes = [draft_logits(self.model, batch)]
            else:
                passes = eagle_pass_logits(self.model, batch, cfg.eagle_passes)
        return sum(
            osd_kernels.distill_loss(logits, target, loss=cfg.loss, beta=cfg.beta)
            for logits in passes
        ) / len(passes)

    def _step(self, batch) -> float:
        """One optimizer step -> its loss (nan, with the weights untouched, when the loss
        is not finite on the eager path)."""
        if self._graph_step is not None:
            try:
                return self._graph_step(batch)
            except GraphCaptureError:
                # A capture that failed once will likely fail again: train eagerly from
                # now on. This update is rolled back by the caller.
                self._graph_step = None
                raise
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
        """One update attempt. Never raises: a failure rolls the training copy back to
        its state before the attempt, is counted, and the attempt is recorded as rejected."""
        t0 = time.perf_counter()
        index = self.history.next_index()
        self._snapshot = None
        try:
            # Serving runs under inference mode; training needs autograd on normal tensors.
            with torch.inference_mode(False), torch.enable_grad():
                return self._update_impl(index, t0)
        except Exception as e:
            kind = "graph_capture_error" if isinstance(e, GraphCaptureError) else "update_error"
            self._fault(kind, e)
            try:
                self.optim.zero_grad(set_to_none=True)
                if self._snapshot is not None:
                    restore_state(self.model, self.optim, self._snapshot)
                self.model.train()
            except Exception as e2:  # the next update's snapshot starts from here
                self._fault("update_error", e2)
            return self.history.add(
                UpdateRecord(
                    index,
                    self.requests_seen,
                    math.nan,
                    None,
                    None,
                    False,
                    "error",
                    time.perf_counter() - t0,
                )
            )
        finally:
            self._snapshot = None
            if self.config.trim_after_update:
                release_free_memory()

    def _update_impl(self, index: int, t0: float) -> UpdateRecord:
        cfg = self.config
        examples = self.buffer.batch(cfg.batch_positions, cfg.replay_fraction, self._gen)
        holdout = self.buffer.holdout()
        if not examples:
            return self.history.add(
                UpdateRecord(
                    index,
                    self.requests_seen,
                    math.nan,
                    None,
                    None,
                    False,
                    "no data",
                    time.perf_counter() - t0,
                )
            )
        self._snapshot = snapshot = snapshot_state(self.model, self.optim)
        self.model.eval()
        alpha_before = heldout_alpha(self.model, holdout, cfg.max_train_len, self.device)
        self.model.train()
        batch = batch_for(self.model, examples, cfg.max_train_len, self.device)
        losses = []
        for _ in range(cfg.steps_per_update):
            self._hold()
            losses.append(self._step(batch))
            if not math.isfinite(losses[-1]):
                break  # the update is discarded anyway
        self.model.eval()
        reason = "applied"
        alpha_after = None
        if not all(math.isfinite(v) for v in losses):
            reason = "non-finite loss"
        elif not all(bool(torch.isfinite(p).all()) for p in self.model.parameters()):
            reason = "non-finite weights"
        else:
            self._hold()
            alpha_after = heldout_alpha(self.model, holdout, cfg.max_train_len, self.device)
            if (
                alpha_before is not None
                and alpha_after is not None
                and alpha_after < alpha_before - cfg.guard_tolerance
            ):
                reason = "guard"
        self.model.train()
        mean_loss = sum(losses) / len(losses)
        if reason != "applied":
            restore_state(self.model, self.optim, snapshot)
            if reason != "guard":
                self._fault(
                    reason.replace("non-finite ", "nonfinite_"),
                    f"update {index}: {reason} (losses {losses}); rolled back",
                )
            return self.history.add(
                UpdateRecord(
                    index,
                    self.requests_seen,
                    mean_loss,
                    alpha_before,
                    alpha_after,
                    False,
                    reason,
                    time.perf_counter() - t0,
                )
            )
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self._quant_layers:
            state = quantized_state(state, self._quant_layers)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()  # on the learner's stream, after the clones
        with self._lock:
            self._pending = (state, ready)
        rec = self.history.add(
            UpdateRecord(
                index,
                self.requests_seen,
                mean_loss,
                alpha_before,
                alpha_after,
                True,
                reason,
                time.perf_counter() - t0,
            )
        )
        if cfg.checkpoint_dir and self.history.updates_applied % cfg.checkpoint_every == 0:
            try:
                self.checkpoint()
            except Exception as e:  # the update stands; the next checkpoint retries
                self._fault("checkpoint_error", e)
        return rec

    # -- persistence ----------------------------------------------------------------
    def checkpoint(self) -> str:
        """Write the training copy's weights and optimizer state atomically."""
        meta = {
            "name": self.name,
            "requests_seen": self.requests_seen,
            "updates_applied": self.history.updates_applied,
            "updates_rejected": self.history.updates_rejected,
        }
        path = save_checkpoint(
            self.config.checkpoint_dir,
            self.history.updates_applied,
            self.model.state_dict(),
            self.optim.state_dict(),
            meta,
        )
        with self.history._lock:
            self.history.checkpoints += 1
        return path

    def _resume(self, ckpt_dir: str) -> None:
        """Load the newest checkpoint that reads back whole (older ones if it does not)."""
        for path in complete_checkpoints(ckpt_dir):
            try:
                state, optim_state, meta = load_checkpoint(path)
            except Exception as e:
                self._fault("resume_error", f"{path}: {type(e).__name__}: {e}")
                continue
            break
        else:
            return
        missing = set(self.model.state_dict()) - set(state)
        if missing:
            raise ValueError(
                f"checkpoint {path!r} does not match the draft: missing {sorted(missing)[:3]}"
            )
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                v.copy_(state[k])
            if self._quant_layers:
                state = quantized_state(state, self._quant_layers)
            for k, v in self.serving.state_dict().items():
                v.copy_(state[k])
        if optim_state:
            self.optim.load_state_dict(optim_state)
        self.requests_seen = int(meta.get("requests_seen", 0))
        self.history.updates_applied = int(meta.get("updates_applied", 0))
        self.history.updates_rejected = int(meta.get("updates_rejected", 0))
