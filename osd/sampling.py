"""Sampling parameters, generation outputs, and the plain (non-speculative) sampler.

Temperature, top-k and top-p are defined once, in ``osd_kernels.warp.warp_probs``; this
module only draws from the warped distribution. Temperature 0 is greedy: argmax, lowest
index on ties.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Mapping, Sequence

import torch

import osd_kernels

FINISH_REASONS = ("stop", "length", "abort", "error")
MAX_LOGPROBS = 20
# What the kernels can represent. Temperature, top-p and the repetition penalty become
# float32 per-row tensors: a positive temperature below MIN_TEMPERATURE (or a repetition
# penalty below MIN_PENALTY) turns logits of ordinary size into float32 overflow, a
# top_p below float32's smallest normal number rounds to 0 (or is flushed to it on GPUs).
# top_k is an int32 tensor; seeds and token counts are int64.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e4
MIN_TOP_P = 2.0**-126
MIN_PENALTY = 1e-6
MAX_PENALTY = 1e4
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Stop strings are searched after every step: their number and length bound that work.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def _as_int(name: str, value, low: int = INT64_MIN, high: int = INT64_MAX) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if not low <= value <= high:
        got = value if abs(value) < 10**30 else f"an integer of {value.bit_length()} bits"
        raise ValueError(f"{name} must be in [{low}, {high}], got {got}")
    return value


def _as_float(name: str, value) -> float:
    """``value`` as a finite float (an int too large for a float is refused too)."""
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(
            f"{name} must be a finite number, got an integer of {value.bit_length()} bits"
        ) from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to generate. Invalid values raise ValueError (TypeError for wrong types),
    including values the kernels cannot represent (the bounds below), so a request that
    gets this far cannot make a batch's step fail.

    Attributes:
        max_new_tokens: tokens to generate at most (>= 1; integers are int64).
        temperature: 0 (greedy decoding) or in [``MIN_TEMPERATURE``, ``MAX_TEMPERATURE``]
            (1e-6 to 1e4).
        top_k: keep the k most likely tokens (0 = off; at most 2**31 - 1, and a k past
            the vocabulary keeps every token).
        top_p: nucleus mass in (0, 1] (1 = off), at least float32's smallest normal
            number (``MIN_TOP_P``).
        seed: base seed; request ``i`` of a ``generate`` call samples with its own Philox
            key derived from ``seed + i`` (``request_seed``), so its output does not depend
            on batching, on the device or on CUDA graphs. None draws the base seed from
            torch's global generator. Under speculation the tokens also depend on what
            the draft proposed (their distribution does not), so after an online update
            the same seed can give other tokens.
        stop_token_ids: ids that end a sequence (the stop token is part of the output),
            in addition to the checkpoint's EOS ids.
        stop: strings that end a sequence once its decoded text holds one (a str or a
            sequence of at most ``MAX_STOP_STRINGS`` (16), each at most ``MAX_STOP_CHARS``
            (256) characters; needs the engine's tokenizer). The output's text is cut
            before the earliest stop string and its ids end at the token that completed
            it; ``finish_reason`` is ``"stop"``.
        logprobs: None, or return each generated token's log-probability and the
            ``logprobs`` (0 to 20) most likely tokens' (``Output.logprobs``): the target's
            distribution before temperature, top-k and top-p, at the position the token
            was generated for (with speculation: the verify forward's, whose prefix is the
            accepted one).
        repetition_penalty: in [1e-6, 1e4] (1 = off): a token already in the prompt or
            the output has a positive logit divided by it and a negative one multiplied
            by it.
        presence_penalty: in [-2, 2] (0 = off), subtracted from the logit of every token
            already in the output.
        frequency_penalty: in [-2, 2] (0 = off), times a token's count in the output,
            subtracted from its logit. Penalties apply to the target's logits before
            temperature, top-k and top-p, at every position a speculative step verifies
            (``osd.penalties``).
        logit_bias: ``{token_id: bias}`` added to the target's logits before the
            penalties (OpenAI's ``logit_bias``; each bias in [-100, 100]).
        min_tokens: EOS and the stop ids cannot be sampled before this many tokens
            (vLLM's ``min_tokens``; at most ``max_new_tokens``). Stop strings are not
            affected.
        ignore_eos: the checkpoint's EOS ids do not end the sequence (``stop_token_ids``
            still do): every request generates ``max_new_tokens``, as benchmarks want.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] | None = None
    stop: str | Sequence[str] | None = None
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "max_new_tokens", _as_int("max_new_tokens", self.max_new_tokens))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            set_(self, name, _as_float(name, value))
        t = self.temperature
        if not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                f"{MAX_TEMPERATURE:g}], got {t}"
            )
        if not (0 < self.top_p <= 1 and self.top_p >= MIN_TOP_P):
            raise ValueError(
                f"top_p must be in (0, 1] and at least {MIN_TOP_P:.3g} (float32's "
                f"smallest normal number), got {self.top_p}"
            )
        set_(self, "top_k", _as_int("top_k", self.top_k))
        if not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(
                f"top_k must be >= 0 and at most {INT32_MAX} (int32), got {self.top_k}"
            )
        if self.seed is not None:
            set_(self, "seed", _as_int("seed", self.seed))
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)):
                raise TypeError("stop_token_ids must be a sequence of ints")
            set_(
                self,
                "stop_token_ids",
                tuple(_as_int("stop_token_ids[]", t) for t in self.stop_token_ids),
            )
        if self.stop is not None:
            stop = (self.stop,) if isinstance(self.stop, str) else self.stop
            if isinstance(stop, bytes) or not all(isinstance(s, str) for s in stop):
                raise TypeError("stop must be a string or a sequence of strings")
            stop = tuple(stop)
            if any(s == "" for s in stop):
                raise ValueError("stop strings must not be empty")
            if len(stop) > MAX_STOP_STRINGS:
                raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
            if any(len(s) > MAX_STOP_CHARS for s in stop):
                raise ValueError(
                    f"stop strings must be at most {MAX_STOP_CHARS} characters, got "
                    f"one of {max(map(len, stop))}"
                )
            set_(self, "stop", stop or None)
        if self.logprobs is not None:
            set_(self, "logprobs", _as_int("logprobs", self.logprobs))
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            set_(self, name, _as_float(name, value))
        if not MIN_PENALTY <= self.repetition_penalty <= MAX_PENALTY:
            raise ValueError(
                f"repetition_penalty must be > 0, in [{MIN_PENALTY:g}, "
                f"{MAX_PENALTY:g}], got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise TypeError("logit_bias must be a mapping {token_id: bias}")
            bias = {}
            for t, b in self.logit_bias.items():
                if isinstance(b, bool) or not isinstance(b, (int, float)):
                    raise TypeError(f"logit_bias[{t!r}] must be a number, got {type(b).__name__}")
                b = _as_float(f"logit_bias[{t!r}]", b)
                if not -100 <= b <= 100:
                    raise ValueError(f"logit_bias[{t!r}] must be in [-100, 100], got {b}")
                bias[_as_int("logit_bias token id", t)] = float(b)
            set_(self, "logit_bias", bias or None)
        set_(self, "min_tokens", _as_int("min_tokens", self.min_tokens))
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_tokens}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        """Whether sampling cuts the distribution (top-k or top-p on a sampled row)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the target's logits are adjusted (penalties, a logit bias, min_tokens)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )


@dataclasses.dataclass
class Output:
    """One generated sequence (or, from ``osd.AsyncEngine``, a snapshot of one).

    Attributes:
        token_ids: generated ids, prompt excluded, stop token included.
        text: ``token_ids`` decoded (special tokens skipped) when a tokenizer exists.
        finish_reason: ``"stop"`` (EOS or a stop token), ``"length"`` (``max_new_tokens``
            or the maximum context reached), ``"abort"`` (aborted), ``"error"`` (the
            request failed: see ``error``); None in an unfinished snapshot.
        stats: per-request speculative statistics (``osd.stats.SpecStats.as_dict``), or
            None for plain decoding.
        prompt_token_ids: the prompt's ids.
        error: why the request failed (``finish_reason == "error"``), else None.
        logprobs: with ``SamplingParams.logprobs``, one :class:`TokenLogprobs` per id of
            ``token_ids``; else None.
    """

    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stats: dict | None = None
    prompt_token_ids: list[int] | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability under the target, and the most likely
    tokens' (``top``: ``(token_id, logprob)`` pairs, most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> list[TokenLogprobs]:
    """:class:`TokenLogprobs` of ``tokens [R]`` under ``logits [R, V]``, each with the
    ``n`` most likely tokens (one host copy for all rows)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1).long())[:, 0].tolist()
    if n:
        top = lp.topk(n, dim=-1)
        ids, vals = top.indices.tolist(), top.values.tolist()
    else:
        ids = vals = [[] for _ in chosen]
    return [
        TokenLogprobs(int(t), c, tuple(zip(i, v)))
        for t, c, i, v in zip(tokens.tolist(), chosen, ids, vals)
    ]


def record_logprobs(requests, logits: torch.Tensor, rows: list[tuple[int, int, int]]) -> None:
    """Append to each request's ``logprobs`` the entries of ``rows``: ``(request index,
    logits row, token)``, ``logits [N, V]``; one batch per distinct ``n`` wanted."""
    if not rows:
        return
    for n in {requests[i].params.logprobs for i, _, _ in rows}:
        mine = [(i, j, t) for i, j, t in rows if requests[i].params.logprobs == n]
        got = token_logprobs(
            logits[[j for _, j, _ in mine]],
            torch.tensor([t for _, _, t in mine], device=logits.device),
            n,
        )
        for (i, _, _), entry in zip(mine, got):
            requests[i].logprobs.append(entry)


class BatchParams:
    """The sampling parameters of a batch's rows, in the form the kernels take.

    ``temperature``, ``top_k``, ``top_p`` are numbers when every row shares them
    (``uniform`` is then that :class:`SamplingParams`) and ``[B]`` tensors on ``device``
    otherwise; a row with temperature 0 is greedy. ``greedy``: every row is greedy;
    ``truncates``: some sampled row uses top-k or top-p.
    """

    def __init__(self, params: Sequence[SamplingParams], device) -> None:
        first = params[0]
        key = (first.temperature, first.top_k, first.top_p)
        same = all((p.temperature, p.top_k, p.top_p) == key for p in params)
        self.uniform: SamplingParams | None = first if same else None
        self.greedy = all(p.greedy for p in params)
        self.truncates = any(p.truncates for p in params)
        if same:
            self.temperature, self.top_k, self.top_p = key
        else:
            self.temperature = torch.tensor(
                [p.temperature for p in params], dtype=torch.float32
            ).to(device)
            self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.int32).to(device)
            self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device)

    def per_row(self, B: int, device) -> dict:
        """``temperature``, ``top_k``, ``top_p`` as ``[B]`` tensors (the kernels' form)."""
        if self.uniform is None:
            return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
        return {
            "temperature": torch.full((B,), self.temperature, device=device),
            "top_k": torch.full((B,), self.top_k, dtype=torch.int32, device=device),
            "top_p": torch.full((B,), self.top_p, device=device),
        }

    def repeat(self, times: int) -> tuple:
        """``(temperature, top_k, top_p)`` for ``B * times`` rows (each row repeated)."""
        if self.uniform is not None:
            return self.temperature, self.top_k, self.top_p
        return tuple(t.repeat_interleave(times) for t in (self.temperature, self.top_k, self.top_p))


# The plain sampler's Philox key is the request's seed XOR this constant, so its draws are
# independent of the speculative sampler's (keyed on the seed itself) and the draft's
# (``osd.spec_decode.model_drafter.DRAFT_KEY``), which all use the same request seed.
PLAIN_KEY = 0x2545F4914F6CDD1D
SEED_MASK = (1 << 63) - 1


def request_seed(base_seed: int, index: int) -> int:
    """The Philox seed of request ``index`` of a call with ``base_seed``: splitmix64 of
    ``base_seed + index``, in [0, 2**63).

    Mixing matters: every stochastic osd kernel keys Philox-4x32-10 on this seed, and so
    does torch's CUDA generator on its own seed with counter 0. Keys drawn straight from
    ``base_seed + index`` would let a torch draw and an osd draw share their random bits.
    """
    z = (int(base_seed) + int(index) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & SEED_MASK


def sample_tokens(
    logits: torch.Tensor,
    params: SamplingParams | BatchParams,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Next tokens ``[B]`` int64 from ``logits [B, V]``, on the device, no host sync.

    Greedy rows (temperature 0) take the argmax (lowest index on ties). Other rows draw once
    from ``warp_probs(logits, temperature, top_k, top_p)`` by the exponential race of
    ``osd_kernels.rejection_sample`` with no drafts (its bonus token), keyed on Philox
    ``(seeds[b] ^ PLAIN_KEY, offsets[b])``: the same logits, seed and offset give the same
    token on every device and backend, eager or in a CUDA graph.

    Args:
        params: one :class:`SamplingParams` for every row, or the rows' :class:`BatchParams`.
        seeds: ``[B]`` int64 request seeds (:func:`request_seed`).
        offsets: ``[B]`` int64, a fresh value per draw of a request (its token position).
    """
    if params.greedy:
        return greedy_tokens(logits)
    B = logits.shape[0]
    none = torch.empty(B, 0, dtype=torch.int64, device=logits.device)
    out, _ = osd_kernels.rejection_sample(
        logits[:, None],
        none,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=seeds ^ PLAIN_KEY,
        offset=offsets,
    )
    return out[:, 0]


def native_rows(logits: torch.Tensor) -> bool:
    """Whether ``osd_kernels.argmax_finite``'s CPU kernel takes ``logits``."""
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and osd_kernels.native_available()
    )


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (the lowest index on ties): on float32 CPU logits the one-pass
    ``osd_kernels.argmax_finite`` (torch's CPU argmax is scalar)."""
    if native_rows(logits):
        return osd_kernels.argmax_finite(logits)[0]
    return logits.argmax(dim=-1)


def greedy_nonfinite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(greedy_tokens(logits) [B], nonfinite_rows(logits) [B])`` for ``logits [B, V]``,
    in one pass over the rows on float32 CPU logits."""
    if native_rows(logits):
        return osd_kernels.argmax_finite(logits)
    return logits.argmax(dim=-1), nonfinite_rows(logits)


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool, on the device: the rows of ``logits [B, ...]`` holding NaN or inf.

    On float32 CPU logits ``osd_kernels.argmax_finite``'s flag: one pass, no thread pool
    woken at a step's sizes. Elsewhere ``0 * x`` is 0
    for finite ``x`` and NaN for inf or NaN, so a row's sum of them is NaN exactly when
    the row holds one (no overflow is possible): one fused pass, several times cheaper
    than ``isfinite`` and ``any`` over the whole ``[B, T, V]``; on the CPU (another dtype)
    the plain row sum goes first: it is finite when every entry is, so only when some
    row's is not (a NaN or inf, or an overflowing sum of finite values) does the exact
    test run."""
    if native_rows(logits) and logits.dim() >= 2 and logits.numel() > 0:
        B, V = logits.shape[0], logits.shape[-1]
        if logits.numel() <= B << 20:  # a step's rows: each batch row as one row
            return osd_kernels.argmax_finite(logits.reshape(B, -1))[1]
        # long rows (a prefill's prompt positions): the kernel's threads take the positions
        return osd_kernels.argmax_finite(logits.reshape(B, -1, V))[1].any(1)
    if logits.device.type == "cpu":
        bad = ~torch.isfinite(logits.flatten(1).sum(1))
        if not bad.any():
            return bad
    return (logits * 0).flatten(1).sum(1).isnan()


def fail_rows(requests, bad: list) -> None:
    """Fail each request whose flag in ``bad`` (host values, from :func:`nonfinite_rows`)
    is set: its tokens would be arbitrary, and its distributions must not teach a draft.
    The other rows are independent of it and go on."""
    for r, b in zip(requests, bad):
        if b and r.finish_reason is None:
            r.fail("the target model produced non-finite logits (NaN or inf) for this request")
