"""Rotary position embeddings: inverse frequencies, cos/sin tables, the rotation, and
the position buffers a model's cached forwards read (:class:`PositionBuffers`).

The tables are built as transformers builds them (float32, then cast) for the RoPE
variants :class:`~osd.models.config.ModelConfig` describes: default, linear, Llama-3 and
LongRoPE scaling, partial rotary widths, and Gemma 3's separate base for its sliding-window
layers.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from osd.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` float32, as transformers computes them.

    ``default``: ``theta^(-2i/d)``; ``linear``: divided by ``factor``; ``llama3``: low
    frequencies divided by ``factor``, high ones kept, the band between interpolated;
    ``longrope``: divided by the short factors (``long``: the long ones). ``d`` is the
    rotated width
    (``config.rope_dim``: all of a head, or its leading ``rotary_dim`` dims).
    """
    dim = config.rope_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if config.rope_type == "longrope":
        factors = torch.tensor(
            config.rope_long_factor if long else config.rope_short_factor, dtype=torch.float32
        )
        return 1.0 / (factors * config.rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_type == "linear":
        return inv_freq / config.rope_factor
    if config.rope_type == "llama3":
        factor, old_len = config.rope_factor, config.rope_original_max_positions
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(
    inv_freq: torch.Tensor, n: int, dtype: torch.dtype, device: torch.device, scale: float = 1.0
):
    """``cos, sin`` tables ``[n, D]`` for positions ``0..n-1``, in the layout of
    :func:`apply_rope`: ``cos = [c, c]`` and ``sin = [-s, s]``, times ``scale`` (LongRoPE's
    attention factor; computed in float32 as transformers does, then cast)."""
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return (
        torch.cat((cos, cos), dim=-1).to(device=device, dtype=dtype),
        torch.cat((-sin, sin), dim=-1).to(device=device, dtype=dtype),
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, H, D]`` by ``cos, sin [B, T, 1, D]`` from :func:`rope_tables`.

    Half-split convention: ``[x1, x2] -> [x1 c - x2 s, x2 c + x1 s]``, written as
    ``x * cos + roll(x, D/2) * sin`` with ``sin = [-s, s]``. Tables narrower than ``D``
    (partial rotary, Phi-4-mini) rotate the leading dims and pass the rest through.
    """
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    return torch.addcmul(x * cos, x.roll(rot // 2, dims=-1), sin)


class PositionBuffers:
    """The constant buffers a model's cached forwards read: ``_arange`` (positions and row
    indices) and the RoPE tables, one per variant ``(local, long)``. A mixin of
    :class:`~osd.models.llama.DecoderLM`, which provides ``config``, ``device`` and
    ``dtype`` and calls :meth:`_init_position_buffers` once they are set.

    Invariant: a CUDA graph reads ``_arange`` and the RoPE tables at every replay, so no
    buffer it captured may be freed. Every cache made by ``new_cache`` sizes them for its
    capacity and batch before any capture (each forward's ``T`` fits the capacity and its
    ``B`` the batch); after :meth:`pin_buffers` a forward that would need a larger one
    raises instead of replacing it, and :meth:`reserve` keeps the buffers it replaces
    alive.
    """

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype

    def _init_position_buffers(self) -> None:
        config = self.config
        self._inv_freq = rope_inv_freq(config)
        # the sliding layers' RoPE (Gemma 3), or None
        self._inv_freq_local = (
            None
            if config.rope_local_theta is None
            else rope_inv_freq(
                dataclasses.replace(
                    config, rope_theta=config.rope_local_theta, rope_type="default", rope_factor=1.0
                )
            )
        )
        # (local, long) -> cos, sin; long: LongRoPE's long factors
        self._tables: dict[tuple[bool, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self._arange = torch.empty(0)
        # Set once CUDA graphs may have captured forwards that read ``_arange`` and
        # ``_tables`` (:meth:`pin_buffers`); from then on a forward never replaces them.
        self._pinned = False
        # Buffers replaced by :meth:`reserve` after pinning: graphs captured earlier still
        # read them, so they are kept alive for the model's lifetime.
        self._retired: list[torch.Tensor] = []

    def reserve(self, positions: int, rows: int = 1, context: int | None = None) -> None:
        """Size ``_arange`` for ``max(positions, rows)`` and the RoPE tables (the variant
        ``context`` selects) for ``positions``. Called by :meth:`new_cache`."""
        # Growth at least doubles, so a pinned model retires few buffers.
        n = max(int(positions), int(rows))
        if self._arange.shape[0] < n or self._arange.device != self.device:
            self._retire(self._arange)
            self._arange = torch.arange(max(n, 2 * self._arange.shape[0], 64), device=self.device)
        for local in (False, True) if self._inv_freq_local is not None else (False,):
            key = self._rope_key(local, positions if context is None else context)
            cos, sin = self._tables.get(key, (torch.empty(0), None))
            if cos.shape[0] < positions or cos.device != self.device or cos.dtype != self.dtype:
                self._retire(cos, sin)
                self._tables[key] = self._new_tables(
                    key, max(int(positions), 2 * cos.shape[0], 256)
                )

    def pin_buffers(self) -> None:
        """From now on forwards read the reserved buffers only (CUDA graphs capture them):
        a forward that would grow one raises a ``RuntimeError`` naming it."""
        self._pinned = True

    def _retire(self, *tensors) -> None:
        if self._pinned:
            self._retired.extend(t for t in tensors if t is not None and t.numel())

    def _grow_error(self, name: str, have: int, need: int) -> RuntimeError:
        return RuntimeError(
            f"{type(self).__name__}.{name} holds {have} entries but a forward needs {need}, "
            f"and CUDA graphs may have captured it (the buffer cannot be replaced): make the "
            f"model's caches with new_cache() before capturing graphs, sized for the longest "
            f"sequence and the largest batch"
        )

    def _iota(self, n: int) -> torch.Tensor:
        """``arange(n)`` int64 on the model's device, a slice of the reserved buffer."""
        if self._arange.shape[0] < n or self._arange.device != self.device:
            if self._pinned:
                raise self._grow_error("_arange", self._arange.shape[0], n)
            self.reserve(n)
        return self._arange[:n]

    def _rope_key(self, local: bool, context: int) -> tuple[bool, bool]:
        """The table variant: ``(local, long)``, long for LongRoPE past its original context."""
        c = self.config
        return local, (
            c.rope_type == "longrope" and not local and context > c.rope_original_max_positions
        )

    def _new_tables(self, key: tuple[bool, bool], n: int):
        local, long = key
        inv_freq = (
            self._inv_freq_local
            if local
            else rope_inv_freq(self.config, long=True)
            if long
            else self._inv_freq
        )
        return rope_tables(inv_freq, n, self.dtype, self.device, self.config.rope_attention_factor)

    def _rope_tables(
        self,
        positions: torch.Tensor,
        needed: int,
        local: bool = False,
        context: int | None = None,
        cached: bool = True,
    ):
        """``cos, sin [B, T, 1, D]`` at ``positions [B, T]`` (``local``: the sliding layers'
        RoPE) from tables covering ``needed`` positions. A LongRoPE model uses its long
        factors when ``context`` (a cache's, default ``needed``) exceeds the original
        context, as llama.cpp chooses by its context size. Tables too small (or on another
        device or dtype) grow, unless pinned: then a cached forward raises, and an uncached
        one (``cached=False``, training) builds a table of its own."""
        key = self._rope_key(local, needed if context is None else context)
        cos, sin = self._tables.get(key, (torch.empty(0), None))
        if cos.shape[0] < needed or cos.device != self.device or cos.dtype != self.dtype:
            n = max(needed, 2 * cos.shape[0], 256)
            if not self._pinned:
                cos, sin = self._tables[key] = self._new_tables(key, n)
            elif cached:
                raise self._grow_error(f"RoPE table {key}", cos.shape[0], needed)
            else:
                cos, sin = self._new_tables(key, needed)
        return cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)

    def _layer_ropes(
        self, positions: torch.Tensor, needed: int, context: int | None = None, cached: bool = True
    ):
        """``(global, local)`` RoPE tables at ``positions`` (local None without one)."""
        local = (
            None
            if self._inv_freq_local is None
            else self._rope_tables(positions, needed, local=True, cached=cached)
        )
        return self._rope_tables(positions, needed, context=context, cached=cached), local
