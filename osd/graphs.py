"""CUDA graphs for the forwards of a speculative step (GPU only; CPU stays eager).

A decode step at small batch is a few hundred tiny kernels, so on a GPU its launch cost
rivals its work. :class:`StepGraphs` captures, per batch-size bucket,

- the **draft loop** of a chain (``ModelDrafter``: the pending-token forward, then
  ``k - 1`` one-token forwards, each token drawn greedily or from the warped draft with
  counter-based Philox noise), keyed ``(bucket, pending width P, k, sampling params)``;
- the **verify forward** of the target (chain or tree), keyed ``(bucket, T, tree?)``, and
  the one-token forward of plain decoding (:func:`graphed_forward`, ``T = 1``),

and replays them. Everything that varies per step is a tensor read by the graph: the
tokens, tree masks and depths, the caches' device-side lengths, and the randomness
(per-row Philox ``seed`` and ``offset``), so no capture bakes in a step's values. Sampling
parameters (temperature, top-k, top-p) are part of the key. Steps that sample with top-k or
top-p run eagerly (:func:`graphable`).

Batches are padded up to the bucket (1, 2, 4, 8, ... and the engine's largest batch).
Rows past the active batch are free rows of the caches, so padding them is harmless: their
lengths are set to 0 first, so their K/V writes stay in bounds, and their results are
dropped. Outputs are the graph's static tensors, valid until the next replay of the same
graph; a step consumes them before the next step.

Host-side state that a capture cannot see is kept outside the graph: each cache's
``bound`` is advanced by the caller exactly as the eager commits would. Captures are
made with the key range of the attention at its largest (``bound = capacity - width``),
so they stay valid for every later length; the Triton and flash-attn kernels read the
lengths on the device anyway.

Warm-up runs before a capture execute the body for real; the device state it changes (the
draft cache's lengths) is saved and restored, and K/V written past a row's length is
scratch by the cache's contract.

``emulate=True`` runs the same static-tensor path with plain calls instead of graph
capture and replay, so the bookkeeping is tested on CPU; the CUDA capture itself is tested
on a GPU by ``make gpu-check`` (``docs/gpu.md`` has the results).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable

import torch

WARMUP_RUNS = 2

# PyTorch supports one CUDA graph capture per process at a time: every capture in osd
# (serving steps here, the learner's training step in ``osd.online.graphs``) holds this.
capture_lock = threading.Lock()


# Diagnostics only: OSD_GRAPH_TRUNCATED=1 graphs top-k / top-p steps too (see graphable).
GRAPH_TRUNCATED = os.environ.get("OSD_GRAPH_TRUNCATED") == "1"


def graphable(params) -> bool:
    """Whether a step sampled with ``params`` (``SamplingParams`` or ``BatchParams``) may
    replay graphs: greedy and temperature-only sampling do. Steps with top-k or top-p run
    eagerly, since graphed steps with those cuts did not reproduce the eager steps on a GPU
    (``docs/gpu.md``); the eager CUDA path passes the engine's chi-square tests with them.
    :data:`GRAPH_TRUNCATED` lifts the restriction, to study it on a GPU."""
    return GRAPH_TRUNCATED or not params.truncates


def batch_bucket(batch: int, max_batch_size: int) -> int:
    """Smallest power of two ``>= batch``, capped at ``max_batch_size``."""
    return min(max_batch_size, 1 << max(0, batch - 1).bit_length())


@dataclass
class _Entry:
    static: dict                      # input tensors the body reads
    body: Callable[[dict], object]    # the captured computation
    graph: object = None              # torch.cuda.CUDAGraph (None when emulated)
    outputs: object = None            # the captured outputs (static tensors)


class StepGraphs:
    """Captures and replays bodies over static inputs, one graph per key.

    Args:
        device: the models' device (CUDA, or anything with ``emulate=True``).
        emulate: call the body instead of capturing it (CPU tests of the bookkeeping).
    """

    def __init__(self, device: torch.device, emulate: bool = False):
        if not emulate and torch.device(device).type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.emulate = emulate
        self.pool = None if emulate else torch.cuda.graph_pool_handle()
        self.entries: dict[tuple, _Entry] = {}
        self.replays = 0

    def run(self, key: tuple, build: Callable[[], tuple[dict, Callable]],
            fill: Callable[[dict], None], state: tuple = (),
            host_state: Callable[[], Callable[[], None]] | None = None):
        """Replay the graph of ``key`` (capturing it first if new) and return its outputs.

        Args:
            key: the graph's identity (shapes and baked-in constants).
            build: ``() -> (static, body)``: fresh static inputs and the body
                ``body(static) -> outputs`` (tensors, or a tuple of tensors / None).
            fill: copies this step's values into ``static``.
            state: device tensors the body mutates (restored after warm-up).
            host_state: ``() -> restore``: saves host-side state the body changes while
                it is being captured (cache bounds); ``restore()`` puts it back.
        """
        entry = self.entries.get(key)
        if entry is None:
            static, body = build()
            entry = _Entry(static, body)
            fill(static)
            self._capture(entry, state, host_state)
            self.entries[key] = entry
        else:
            fill(entry.static)
        self.replays += 1
        if self.emulate:
            return entry.body(entry.static)
        entry.graph.replay()
        return entry.outputs

    def _capture(self, entry: _Entry, state: tuple, host_state) -> None:
        """Warm up and capture ``entry.body`` with the host state ``host_state()`` sets
        (the widest key range) in force for every run, the capture included; the device
        ``state`` and the host state are restored after each run."""
        saved = [t.clone() for t in state]
        widen = host_state if host_state is not None else (lambda: (lambda: None))
        restore_host = widen()

        def restore(rewiden: bool):
            nonlocal restore_host
            for t, s in zip(state, saved):
                t.copy_(s)
            restore_host()                      # the run's commits moved the host state
            if rewiden:
                restore_host = widen()

        if self.emulate:
            for i in range(WARMUP_RUNS):
                entry.body(entry.static)
                restore(rewiden=i + 1 < WARMUP_RUNS)
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                entry.body(entry.static)
                restore(rewiden=True)
        torch.cuda.current_stream().wait_stream(side)
        entry.graph = torch.cuda.CUDAGraph()
        # thread_local: the learner thread may run eager work meanwhile (its own capture
        # waits for the lock).
        with capture_lock, torch.cuda.graph(entry.graph, pool=self.pool,
                                            capture_error_mode="thread_local"):
            entry.outputs = entry.body(entry.static)
        restore(rewiden=False)


def graphed_forward(graphs: StepGraphs, model, cache, inputs: torch.Tensor,
                    mask: torch.Tensor | None = None,
                    depths: torch.Tensor | None = None) -> torch.Tensor:
    """``model(inputs, cache, tree_mask=mask, depths=depths)`` -> ``[B, T, V]`` logits,
    replayed from the graph of the batch bucket (``inputs [B, T]``, tree ``mask`` and
    ``depths [B, T]``). Falls back to the eager forward (and its capacity error) when the
    tokens do not fit the cache."""
    B, T = inputs.shape
    if cache.bound + T > cache.capacity:
        return model(inputs, cache, tree_mask=mask, depths=depths)
    Bb = batch_bucket(B, cache.max_batch_size)
    tree = mask is not None

    def build():
        dev = inputs.device
        static = {"ids": torch.zeros(Bb, T, dtype=torch.int64, device=dev)}
        if tree:
            static["mask"] = torch.zeros(Bb, T, dtype=torch.int64, device=dev)
            static["depths"] = torch.zeros(Bb, T, dtype=torch.int64, device=dev)

        def body(s):
            return model(s["ids"], cache, tree_mask=s.get("mask"), depths=s.get("depths"))
        return static, body

    def fill(s):
        s["ids"][:B].copy_(inputs)
        if tree:
            s["mask"][:B].copy_(mask)
            s["depths"][:B].copy_(depths)
            if Bb > B:                 # padding rows: a causal chain
                i = torch.arange(T, dtype=torch.int64, device=inputs.device)
                s["mask"][B:] = (2 << i) - 1
                s["depths"][B:] = i
        cache.lens[B:Bb].zero_()       # padding rows are free rows

    def host_state():
        saved = cache.bound
        cache.bound = cache.capacity - T   # capture with the widest key range
        return lambda: setattr(cache, "bound", saved)

    logits = graphs.run(("forward", id(model), id(cache), Bb, T, tree), build, fill,
                        host_state=host_state)
    return logits[:B]
