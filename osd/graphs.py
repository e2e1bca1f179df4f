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
parameters (temperature, top-k, top-p) are part of the draft loop's key; the forwards do
not depend on them.

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

**Memory invariant.** Every graph of a :class:`StepGraphs` shares one memory pool, so a
graph's replay may write over memory that another graph's outputs occupy (the pool hands
one graph's freed intermediates to a later capture). Hence:

- outputs of a graph are valid until the next replay of *any* graph of the same
  :class:`StepGraphs`, and are consumed before it; except
- outputs of a graph run with ``own_outputs=True``, which are copied (inside the graph)
  into tensors allocated outside the pool before capture: they are valid until the same
  graph replays. The draft loop's outputs are read after the verify graph replays, so the
  draft loop owns its outputs;
- static inputs are allocated outside capture, and the constant buffers the models read
  (``DecoderLM._arange``, the RoPE tables) are sized before any capture and pinned
  (``DecoderLM.pin_buffers``): nothing a graph reads is ever freed.

``StepGraphs(emulate=True, poison=True)`` checks the invariant on the CPU: after every
replay it overwrites the outputs of every other graph that does not own them with garbage
(NaN, or the integer type's extreme), as the shared pool may, so a step that reads them late
emits garbage and fails its tests.

Warm-up runs before a capture execute the body for real; the device state it changes (the
draft cache's lengths) is saved and restored, and K/V written past a row's length is
scratch by the cache's contract.

``emulate=True`` runs the same static-tensor path with plain calls instead of graph
capture and replay, so the bookkeeping is tested on CPU; the CUDA capture itself is tested
on a GPU by ``make gpu-check`` (``docs/gpu.md`` has the results).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

WARMUP_RUNS = 2

# PyTorch supports one CUDA graph capture per process at a time: every capture in osd
# (serving steps here, the learner's training step in ``osd.online.train_graphs``) holds this.
capture_lock = threading.Lock()


def batch_bucket(batch: int, max_batch_size: int) -> int:
    """Smallest power of two ``>= batch``, capped at ``max_batch_size``."""
    return min(max_batch_size, 1 << max(0, batch - 1).bit_length())


@dataclass
class _Entry:
    static: dict  # input tensors the body reads
    body: Callable[[dict], object]  # the captured computation
    graph: object = None  # torch.cuda.CUDAGraph (None when emulated)
    outputs: object = None  # the captured outputs (static tensors)


def _map(fn, outputs):
    """``fn`` over a body's outputs: a tensor, or a tuple of tensors / None."""
    if isinstance(outputs, tuple):
        return tuple(None if t is None else fn(t) for t in outputs)
    return None if outputs is None else fn(outputs)


def _copy_into(owned, outputs):
    if isinstance(outputs, tuple):
        for o, t in zip(owned, outputs):
            if t is not None:
                o.copy_(t)
    elif outputs is not None:
        owned.copy_(outputs)
    return owned


def _garbage(t: torch.Tensor) -> None:
    """Fill ``t`` with values no correct step reads: NaN, or the integer extreme."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


class StepGraphs:
    """Captures and replays bodies over static inputs, one graph per key.

    Args:
        device: the models' device (CUDA, or anything with ``emulate=True``).
        emulate: call the body instead of capturing it (CPU tests of the bookkeeping).
        poison: with ``emulate``, overwrite every other graph's outputs that it does not
            own after each replay (the memory invariant above).
    """

    def __init__(self, device: torch.device, emulate: bool = False, poison: bool = False):
        if poison and not emulate:
            raise ValueError("poison=True checks emulated graphs: pass emulate=True too")
        if not emulate and torch.device(device).type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.emulate = emulate
        self.poison = poison
        self.pool = None if emulate else torch.cuda.graph_pool_handle()
        self.entries: dict[tuple, _Entry] = {}
        self.replays = 0

    def run(
        self,
        key: tuple,
        build: Callable[[], tuple[dict, Callable]],
        fill: Callable[[dict], None],
        state: tuple = (),
        host_state: Callable[[], Callable[[], None]] | None = None,
        own_outputs: bool = False,
    ):
        """Replay the graph of ``key`` (capturing it first if new) and return its outputs:
        valid until the next replay of any graph here, or with ``own_outputs`` until the
        next replay of this one (the memory invariant above).

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
            if own_outputs:
                body = self._owning(body)
            entry = _Entry(static, body)
            fill(static)
            self._capture(entry, state, host_state)
            self.entries[key] = entry
        else:
            fill(entry.static)
        self.replays += 1
        if self.emulate:
            entry.outputs = entry.body(entry.static)
            if self.poison:
                self._poison_others(entry)
            return entry.outputs
        entry.graph.replay()
        return entry.outputs

    @staticmethod
    def _owning(body: Callable[[dict], object]) -> Callable[[dict], object]:
        """``body`` writing its outputs into tensors allocated outside the pool: on its
        first (warm-up, eager) run, which precedes any capture of it."""
        owned = []

        def run(static):
            out = body(static)
            if not owned:
                owned.append(_map(torch.empty_like, out))
            return _copy_into(owned[0], out)

        run.owns_outputs = True
        return run

    def _poison_others(self, replayed: _Entry) -> None:
        for entry in self.entries.values():
            if (
                entry is not replayed
                and entry.outputs is not None
                and not getattr(entry.body, "owns_outputs", False)
            ):
                _map(_garbage, entry.outputs)

    def _capture(self, entry: _Entry, state: tuple, host_state) -> None:
        """Warm up and capture ``entry.body`` with the host state ``host_state()`` sets
        (the widest key range) in force for every run, the capture included; the device
        ``state`` and the host state are restored after each run."""
        saved = [t.clone() for t in state]
        widen = host_state if host_state is not None else (lambda: lambda: None)
        restore_host = widen()

        def restore(rewiden: bool):
            nonlocal restore_host
            for t, s in zip(state, saved):
                t.copy_(s)
            restore_host()  # the run's commits moved the host state
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
        with (
            capture_lock,
            torch.cuda.graph(entry.graph, pool=self.pool, capture_error_mode="thread_local"),
        ):
            entry.outputs = entry.body(entry.static)
        restore(rewiden=False)


def graphed_forward(
    graphs: StepGraphs,
    model,
    cache,
    inputs: torch.Tensor,
    mask: torch.Tensor | None = None,
    depths: torch.Tensor | None = None,
) -> torch.Tensor:
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
            if Bb > B:  # padding rows: a causal chain
                i = torch.arange(T, dtype=torch.int64, device=inputs.device)
                s["mask"][B:] = (2 << i) - 1
                s["depths"][B:] = i
        cache.lens[B:Bb].zero_()  # padding rows are free rows

    def host_state():
        saved = cache.bound
        cache.bound = cache.capacity - T  # capture with the widest key range
        return lambda: setattr(cache, "bound", saved)

    logits = graphs.run(
        ("forward", id(model), id(cache), Bb, T, tree), build, fill, host_state=host_state
    )
    return logits[:B]
