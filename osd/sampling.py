"""Sampling parameters, generation outputs, and the plain (non-speculative) sampler.

Temperature, top-k and top-p are defined once, in ``osd_kernels.warp.warp_probs``; this
module only draws from the warped distribution. Temperature 0 is greedy: argmax, lowest
index on ties.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Sequence

import torch

from osd_kernels.warp import warp_probs

FINISH_REASONS = ("stop", "length")


def _as_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to generate. Invalid values raise ValueError (TypeError for wrong types).

    Attributes:
        max_new_tokens: tokens to generate at most (>= 1).
        temperature: >= 0; 0 is greedy decoding.
        top_k: keep the k most likely tokens (0 = off).
        top_p: nucleus mass in (0, 1] (1 = off).
        seed: base seed; request ``i`` of a ``generate`` call samples with its own generator
            seeded ``seed + i``, so its output does not depend on batching. None draws the
            base seed from torch's global generator.
        stop_token_ids: ids that end a sequence (the stop token is part of the output),
            in addition to the checkpoint's EOS ids.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "max_new_tokens", _as_int("max_new_tokens", self.max_new_tokens))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            set_(self, name, float(value))
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        set_(self, "top_k", _as_int("top_k", self.top_k))
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None:
            set_(self, "seed", _as_int("seed", self.seed))
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)):
                raise TypeError("stop_token_ids must be a sequence of ints")
            set_(self, "stop_token_ids",
                 tuple(_as_int("stop_token_ids[]", t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass
class Output:
    """One generated sequence.

    Attributes:
        token_ids: generated ids, prompt excluded, stop token included.
        text: ``token_ids`` decoded (special tokens skipped) when a tokenizer exists.
        finish_reason: ``"stop"`` (EOS or a stop token) or ``"length"`` (``max_new_tokens``
            or the maximum context reached).
        stats: per-request speculative statistics (``osd.stats.SpecStats.as_dict``), or
            None for plain decoding.
    """

    token_ids: list[int]
    text: str | None
    finish_reason: str
    stats: dict | None = None


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generators: Sequence[torch.Generator] | torch.Generator | None) -> torch.Tensor:
    """Next tokens ``[B]`` int64 from ``logits [B, V]``, on the device, no host sync.

    Greedy when ``params.temperature == 0`` (argmax, lowest index on ties). Otherwise one
    draw per row from ``warp_probs(logits, temperature, top_k, top_p)``, row ``b`` with
    ``generators[b]`` (one generator for all rows when a single one is given).
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = warp_probs(logits, params.temperature, params.top_k, params.top_p)
    if generators is None or isinstance(generators, torch.Generator):
        return torch.multinomial(probs, 1, generator=generators).squeeze(1)
    if len(generators) != probs.shape[0]:
        raise ValueError(f"{len(generators)} generators for {probs.shape[0]} rows")
    return torch.cat([torch.multinomial(probs[b:b + 1], 1, generator=g).squeeze(1)
                      for b, g in enumerate(generators)])
