"""CUDA-graph capture of the online distillation step (GPU only).

One graph per shape bucket ``(rows N, tokens T, positions M)``, each rounded up to a power
of two, captures the whole step: draft forward, ``distill_loss``, backward, gradient
clipping and the AdamW update (``capturable=True``, so its step counter lives on the GPU).
A batch is copied into the bucket's static tensors (padding rows point at position 0 and
are masked out of the loss) and the graph is replayed. Warm-up iterations needed before
capture run on a snapshot that is restored afterwards, so capturing never changes the
weights.

The learner's capture and the serving thread's (``osd.graphs``) take the same process-wide
lock, so two captures never overlap. CPU training stays eager.

At most ``OnlineRuntime.max_train_graphs`` graphs are kept, least recently used dropped
first: each holds a private memory pool sized for its bucket, so an unbounded set of
shapes would keep claiming GPU memory. A failed capture raises
``osd.online.learner.GraphCaptureError`` with the weights and optimizer state as they were.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

import osd_kernels
from osd.graphs import capture_lock
from osd.online.learner import GraphCaptureError, restore_state, snapshot_state


def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, int(n - 1).bit_length()))


class GraphedTrainStep:
    """Replays a captured training step for batches of ``osd.online.distill.TrainBatch``."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer, config):
        self.model = model
        self.optim = optim
        self.config = config
        self.graphs: OrderedDict[tuple, dict] = OrderedDict()  # least recently used first
        self.max_graphs = getattr(config, "max_train_graphs", 8)
        self.captures = 0

    def _static(self, key, batch):
        n, t, m = key
        dev = batch.input_ids.device
        s = {
            "input_ids": torch.zeros(n, t, dtype=torch.int64, device=dev),
            "attention_mask": torch.zeros(n, t, dtype=torch.bool, device=dev),
            "rows": torch.zeros(m, dtype=torch.int64, device=dev),
            "row_mask": torch.zeros(m, dtype=torch.bool, device=dev),
        }
        if batch.topk_ids is not None:
            k = batch.topk_ids.shape[1]
            s["topk_ids"] = torch.zeros(m, k, dtype=torch.int64, device=dev)
            s["topk_probs"] = torch.zeros(m, k, dtype=torch.float32, device=dev)
        else:
            s["target_logits"] = torch.zeros(m, batch.target_logits.shape[1], device=dev)
        return s

    def _fill(self, s, batch) -> None:
        n, t = batch.input_ids.shape
        m = batch.num_positions
        s["input_ids"].zero_()
        s["attention_mask"].zero_()
        s["input_ids"][:n, :t].copy_(batch.input_ids)
        s["attention_mask"][:n, :t].copy_(batch.attention_mask)
        width = s["input_ids"].shape[1]
        rows = (batch.rows // t) * width + batch.rows % t  # re-index into the padded width
        s["rows"].zero_()
        s["rows"][:m].copy_(rows)
        s["row_mask"].zero_()
        s["row_mask"][:m] = True
        if "topk_ids" in s:
            s["topk_ids"].zero_()
            s["topk_probs"].zero_()
            s["topk_ids"][:m].copy_(batch.topk_ids)
            s["topk_probs"][:m].copy_(batch.topk_probs)
        else:
            s["target_logits"].zero_()
            s["target_logits"][:m].copy_(batch.target_logits)

    def _body(self, s) -> torch.Tensor:
        logits = self.model.forward_train(
            s["input_ids"], attention_mask=s["attention_mask"], rows=s["rows"], full_vocab=False
        )
        target = (s["topk_ids"], s["topk_probs"]) if "topk_ids" in s else s["target_logits"]
        loss = osd_kernels.distill_loss(
            logits, target, loss=self.config.loss, beta=self.config.beta, mask=s["row_mask"]
        )
        loss.backward()
        if self.config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.config.max_grad_norm, foreach=True
            )
        self.optim.step()
        return loss

    def _capture(self, key, batch) -> dict:
        s = self._static(key, batch)
        self._fill(s, batch)
        snapshot = snapshot_state(self.model, self.optim)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    self.optim.zero_grad(set_to_none=True)
                    self._body(s)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            self.optim.zero_grad(set_to_none=True)
            # One capture per process at a time (the serving thread captures too); other
            # threads keep running their eager work and replays meanwhile (thread_local).
            with capture_lock, torch.cuda.graph(graph, capture_error_mode="thread_local"):
                loss = self._body(s)
        finally:  # warm-up steps moved the weights: undo them
            self.optim.zero_grad(set_to_none=True)
            restore_state(self.model, self.optim, snapshot)
        return {"graph": graph, "static": s, "loss": loss}

    def __call__(self, batch) -> float:
        n, t = batch.input_ids.shape
        key = (_bucket(n, 1), _bucket(t, 16), _bucket(batch.num_positions, 64))
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(key, batch)
            except Exception as e:
                raise GraphCaptureError(
                    f"capturing the training step for shape bucket "
                    f"(rows, tokens, positions) = {key} failed: "
                    f"{type(e).__name__}: {e}"
                ) from e
            self.captures += 1
            while len(self.graphs) >= self.max_graphs:
                _, old = self.graphs.popitem(last=False)
                old["graph"].reset()  # frees the graph's memory pool now
            self.graphs[key] = entry
        self.graphs.move_to_end(key)
        self._fill(entry["static"], batch)
        entry["graph"].replay()
        return float(entry["loss"])  # host sync on the training thread, not the serving one
