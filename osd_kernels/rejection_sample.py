"""``rejection_sample``: fused chain speculative-sampling verification.

A draft proposed ``x_1 .. x_n`` (``n = num_draft_tokens[b] <= K``); the target scored the
``K + 1`` prefixes. Per sequence, with ``p_i`` the target's warped distribution at
position ``i`` (``osd_kernels.warp.warp_probs``: temperature, then top-k, then top-p) and
``q_i`` the draft's (already warped) one:

- stochastic rows (temperature > 0): accept ``x_i`` iff ``log u_i + log q_i(x_i) <
  log p_i(x_i)`` (``log 0 = -inf``; this is ``u_i < p_i(x_i) / q_i(x_i)``). At the first
  rejection emit one token from the residual ``max(0, p_i - q_i)`` (one-hot drafts:
  ``p_i`` with ``x_i`` removed), or from ``p_i`` itself when the residual has no mass,
  and stop. If all ``n`` are accepted, emit a bonus token from ``p_n``. The emitted
  tokens are distributed exactly as the warped target.
- greedy rows (temperature 0 or None): accept while ``x_i == argmax`` of the target
  logits (lowest index on ties), then emit that argmax (at the first mismatch, or as the
  bonus).

Randomness is counter-based Philox (``osd_kernels.philox``), keyed on ``(seed[b],
offset[b])`` and a stream per position and purpose, so every backend emits the same
tokens for the same seeds:

- accept test at position ``i``: ``u_i = u(seed, offset, stream=2*i + 0, index=0)``;
- the emitted token at position ``j`` (rejected or bonus row): exponential race
  ``argmax_v r_v / E_v`` over ``r_v > 0`` (lowest index on ties), ``E_v = -log u(seed,
  offset, stream=2*j + 1, index=v)``, where ``r`` is the (unnormalised) residual or
  ``p_j``. The race picks ``v`` with probability ``r_v / sum(r)``.

Backends agree token for token up to float rounding of the softmax (a tie within an ulp
between the accept ratio and ``u``, or between the two best race keys, can differ).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from osd_kernels._ops import native_available, native_has_device, resolve_backend
from osd_kernels.philox import (
    PURPOSE_ACCEPT,
    PURPOSE_SAMPLE,
    philox_uniform,
    philox_uniform_rows,
    stream_id,
)
from osd_kernels.warp import warp_probs

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RowParams(NamedTuple):
    """Per-row sampling parameters of a kernel call, materialised as ``[B]`` tensors on the
    logits' device (``osd.SamplingParams`` is the per-request form users write)."""

    num_draft_tokens: torch.Tensor  # int32, number of valid drafts per row (<= K)
    temperature: torch.Tensor  # float32, 0 = greedy
    top_k: torch.Tensor  # int32, 0 = off
    top_p: torch.Tensor  # float32, 1 = off
    seed: torch.Tensor  # int64 Philox key
    offset: torch.Tensor  # int64 Philox stream selector


def check_float_dtype(name: str, tensor: torch.Tensor) -> None:
    """Raise TypeError unless ``tensor`` is float32, bfloat16 or float16."""
    if tensor.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {tensor.dtype}")


def check_on_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    """Raise ValueError unless ``tensor`` is on ``device`` (the device of target_logits)."""
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but target_logits is on {device}")


# The former name of RowParams.
SamplingParams = RowParams


def check_sampling_values(params: RowParams) -> None:
    """Range checks of temperature (finite, >= 0), top_k (>= 0) and top_p (in (0, 1]).
    They read the values on the host: call them on CPU tensors only."""
    # [B] values, checked in Python: cheaper than a few torch ops per call at these sizes
    t, tk, tp = params.temperature.tolist(), params.top_k.tolist(), params.top_p.tolist()
    if not all(math.isfinite(x) and x >= 0 for x in t):
        raise ValueError(f"temperature must be finite and >= 0, got {t}")
    if any(x < 0 for x in tk):
        raise ValueError(f"top_k must be >= 0 (0 = off), got {tk}")
    if not all(0 < x <= 1 for x in tp):
        raise ValueError(f"top_p must lie in (0, 1] (1 = off), got {tp}")


# (value, batch, dtype, device) -> a [batch] tensor of value: see _shared_full
_SHARED: dict = {}


def _shared_full(value, batch: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.full((batch,), value)``, one tensor per key for every call that asks: the
    kernels only read their per-row parameters, and a decode step would otherwise build
    the same few ``[B]`` tensors again each time. CPU only (a tensor made while a CUDA
    graph is captured would hold nothing until the graph replays); nothing is kept while
    torch.compile traces (fake tensors)."""
    key = (value, batch, dtype, device)
    t = _SHARED.get(key)
    if t is None:
        t = torch.full((batch,), value, dtype=dtype, device=device)
        if type(t) is torch.Tensor and not torch.compiler.is_compiling():
            if len(_SHARED) >= 256:
                _SHARED.clear()
            _SHARED[key] = t
    return t


def _per_row(
    name: str,
    value,
    batch: int,
    default,
    dtype: torch.dtype,
    device,
    kinds: tuple,
    shared: bool = False,
) -> torch.Tensor:
    if value is None:
        value = default
    elif isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a [B] tensor or a number, got {type(value).__name__}")
    if not torch.is_tensor(value):
        if not isinstance(value, kinds):
            raise TypeError(
                f"{name} must be {'an integer' if kinds == (int,) else 'a number'}, got {value!r}"
            )
        if shared and device.type == "cpu":
            return _shared_full(value, batch, dtype, device)
        return torch.full((batch,), value, dtype=dtype, device=device)
    if value.shape != (batch,):
        raise ValueError(f"{name} must have shape [B={batch}], got {tuple(value.shape)}")
    check_on_device(name, value, device)
    if kinds == (int,) and value.is_floating_point():
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    return value if value.dtype == dtype else value.to(dtype)


def sampling_params(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    *,
    num_draft_tokens=None,
    temperature=None,
    top_k=None,
    top_p=None,
    seed=None,
    offset=None,
    generator=None,
    shared: bool = False,
) -> RowParams:
    """Materialise the per-row parameters (defaults, seeds drawn from ``generator``).
    ``shared``: a default or a number becomes a CPU tensor shared with every other call
    that asks for the same one (the caller must not write to it)."""
    batch, k = draft_token_ids.shape
    device = target_logits.device
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if generator.device.type != "cpu":
            raise ValueError(
                f"generator must be a CPU torch.Generator, got one on {generator.device}"
            )
    if (
        num_draft_tokens is not None
        and torch.is_tensor(num_draft_tokens)
        and num_draft_tokens.dtype not in (torch.int32, torch.int64)
    ):
        raise TypeError(f"num_draft_tokens must be int32 (or int64), got {num_draft_tokens.dtype}")
    n = _per_row(
        "num_draft_tokens", num_draft_tokens, batch, k, torch.int32, device, (int,), shared
    )
    t = _per_row(
        "temperature", temperature, batch, 0.0, torch.float32, device, (int, float), shared
    )
    tk = _per_row("top_k", top_k, batch, 0, torch.int32, device, (int,), shared)
    tp = _per_row("top_p", top_p, batch, 1.0, torch.float32, device, (int, float), shared)
    if seed is None:
        # a fresh random key per row, drawn on the host (the generator is a CPU one) and
        # copied to the device
        seed = torch.randint(
            2**63 - 1, (batch,), generator=generator, dtype=torch.int64, device="cpu"
        )
        seed = seed.to(device)
    s = _per_row("seed", seed, batch, 0, torch.int64, device, (int,))
    o = _per_row("offset", offset, batch, 0, torch.int64, device, (int,))
    return RowParams(n, t, tk, tp, s, o)


def _check_tensors(target_logits, draft_token_ids, draft_probs) -> None:
    if not torch.is_tensor(target_logits) or target_logits.dim() != 3:
        raise ValueError(
            "target_logits must be a [B, K+1, V] tensor, got "
            f"{getattr(target_logits, 'shape', type(target_logits).__name__)}"
        )
    check_float_dtype("target_logits", target_logits)
    batch, k1, vocab = target_logits.shape
    if vocab < 1:
        raise ValueError("target_logits has an empty vocabulary")
    if not torch.is_tensor(draft_token_ids) or draft_token_ids.dim() != 2:
        raise ValueError("draft_token_ids must be a [B, K] tensor")
    if draft_token_ids.dtype != torch.int64:
        raise TypeError(f"draft_token_ids must be int64, got {draft_token_ids.dtype}")
    if tuple(draft_token_ids.shape) != (batch, k1 - 1):
        raise ValueError(
            f"draft_token_ids must be [B={batch}, K={k1 - 1}] to match "
            f"target_logits [B, K+1, V]={tuple(target_logits.shape)}, got "
            f"{tuple(draft_token_ids.shape)}"
        )
    check_on_device("draft_token_ids", draft_token_ids, target_logits.device)
    if draft_probs is not None:
        if not torch.is_tensor(draft_probs) or draft_probs.dim() != 3:
            raise ValueError("draft_probs must be a [B, K, V] tensor or None")
        check_float_dtype("draft_probs", draft_probs)
        if draft_probs.shape[2] != vocab:
            raise ValueError(
                f"draft_probs vocab size {draft_probs.shape[2]} does not match "
                f"target_logits vocab size {vocab}"
            )
        if tuple(draft_probs.shape[:2]) != (batch, k1 - 1):
            raise ValueError(
                f"draft_probs must be [B={batch}, K={k1 - 1}, V], got {tuple(draft_probs.shape)}"
            )
        check_on_device("draft_probs", draft_probs, target_logits.device)


def _check_values(
    target_logits, draft_token_ids, params: RowParams, counts: bool = True, sampling: bool = True
) -> None:
    """Range checks, on CPU only: on CUDA they would need a host sync (kernels clamp).
    ``counts`` / ``sampling`` False: ``num_draft_tokens`` / the sampling parameters are
    the defaults, valid by construction, and go unchecked."""
    if target_logits.device.type != "cpu":
        return
    _, k1, vocab = target_logits.shape
    if draft_token_ids.numel():
        low, high = (int(v) for v in torch.aminmax(draft_token_ids))
        if low < 0 or high >= vocab:
            raise ValueError(f"draft_token_ids must lie in [0, V={vocab})")
    if counts:
        n = params.num_draft_tokens.tolist()
        if any(x < 0 or x > k1 - 1 for x in n):
            raise ValueError(f"num_draft_tokens must lie in [0, K={k1 - 1}], got {n}")
    if sampling:
        check_sampling_values(params)


def _race(resid: torch.Tensor, params: RowParams, position: torch.Tensor) -> torch.Tensor:
    """Exponential race over ``resid [B, V] >= 0`` with the Philox noise of ``position [B]``."""
    u = philox_uniform_rows(
        params.seed, params.offset, stream_id(position, PURPOSE_SAMPLE), resid.shape[1]
    )
    keys = torch.where(resid > 0, resid / -torch.log(u), torch.full_like(resid, -1.0))
    return keys.argmax(dim=-1)


def rejection_sample_reference(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    num_draft_tokens=None,
    temperature=None,
    top_k=None,
    top_p=None,
    seed=None,
    offset=None,
    generator=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch chain rejection sampler (the ground truth); arguments as
    :func:`rejection_sample`. Materialises the warped ``[B, K+1, V]`` target."""
    params = sampling_params(
        target_logits,
        draft_token_ids,
        num_draft_tokens=num_draft_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        offset=offset,
        generator=generator,
    )
    batch, k1, vocab = target_logits.shape
    k = k1 - 1
    device = target_logits.device
    rows = torch.arange(batch, device=device)
    pos = torch.arange(k, device=device)
    logits = target_logits.float()
    greedy = params.temperature == 0
    n = params.num_draft_tokens.long().clamp(0, k)
    in_vocab = (draft_token_ids >= 0) & (draft_token_ids < vocab)
    x = torch.where(in_vocab, draft_token_ids, torch.zeros_like(draft_token_ids))
    argmax = logits.argmax(dim=-1)  # [B, K+1], lowest index on ties

    def per_position(t):
        return t.repeat_interleave(k1)

    p = warp_probs(
        logits.reshape(batch * k1, vocab),
        per_position(params.temperature),
        per_position(params.top_k),
        per_position(params.top_p),
    ).view(batch, k1, vocab)
    px = p[:, :k].gather(2, x[..., None]).squeeze(-1) * in_vocab
    if draft_probs is not None:
        qx = draft_probs.float().gather(2, x[..., None]).squeeze(-1)
    else:
        qx = torch.ones_like(px)
    u = philox_uniform(
        params.seed[:, None], params.offset[:, None], stream_id(pos, PURPOSE_ACCEPT)[None], 0
    )
    stochastic_ok = torch.log(u) + torch.log(qx) < torch.log(px)
    greedy_ok = draft_token_ids == argmax[:, :k]
    ok = torch.where(greedy[:, None], greedy_ok, stochastic_ok) & (pos[None] < n[:, None])
    num_accepted = ok.int().cumprod(dim=-1).sum(dim=-1)  # [B], accepted prefix length
    j = num_accepted.long()
    rejected = j < n

    pj = p[rows, j]  # [B, V]: the one row that is resampled
    resid = pj
    if k > 0:
        jd = j.clamp(max=k - 1)
        if draft_probs is not None:
            resid = (pj - draft_probs.float()[rows, jd]).clamp(min=0)
        else:
            drop = torch.zeros_like(pj, dtype=torch.bool)
            drop[rows, x[rows, jd]] = in_vocab[rows, jd]
            resid = torch.where(drop, torch.zeros_like(pj), pj)
        resid = torch.where(rejected[:, None], resid, pj)
    empty = ~(resid > 0).any(dim=-1)
    resid = torch.where(empty[:, None], pj, resid)
    token = torch.where(greedy, argmax[rows, j], _race(resid, params, j))

    out = torch.full((batch, k1), -1, dtype=torch.int64, device=device)
    out[:, :k] = torch.where(pos[None] < j[:, None], draft_token_ids, out[:, :k])
    out[rows, j] = token
    return out, num_accepted.to(torch.int32)


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    num_draft_tokens=None,
    temperature=None,
    top_k=None,
    top_p=None,
    seed=None,
    offset=None,
    generator=None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a chain of drafted tokens against the target in one fused step.

    Args:
        target_logits: ``[B, K+1, V]`` float32/bfloat16/float16, any strides. Row ``i`` is
            the target's distribution after the prefix and the first ``i`` drafts.
        draft_token_ids: ``[B, K]`` int64, the drafted tokens (in ``[0, V)``).
        draft_probs: ``[B, K, V]`` float32/bfloat16/float16, the draft's already-warped
            distributions the tokens were drawn from; None for one-hot drafts (greedy or
            n-gram drafts: accept with probability ``p(x)``).
        num_draft_tokens: ``[B]`` int32, drafts per row for ragged batches (``<= K``);
            None means ``K``. Drafts past it are ignored.
        temperature: ``[B]`` float (or a number); None or 0 means greedy.
        top_k: ``[B]`` int (or a number); None or 0 means off.
        top_p: ``[B]`` float in (0, 1] (or a number); None or 1 means off.
        seed, offset: ``[B]`` int64 (or numbers): the Philox key and stream selector of
            each row. Reusing a (seed, offset) pair reuses its randomness, so advance
            ``offset`` every step (e.g. the committed length). Passing both as device
            tensors keeps the op free of host syncs (CUDA-graph safe).
        generator: a CPU ``torch.Generator`` used to draw ``seed`` when it is None
            (``torch.randint(2**63 - 1, (B,), generator=generator)``; the global generator
            if None too); ``offset`` defaults to 0.
        backend: ``auto`` | ``reference`` | ``native`` | ``triton``. ``auto`` takes the
            native kernel on CPU and, when the extension was built with CUDA, on CUDA; the
            Triton kernel (one program per sequence, not the split-vocabulary design) only
            on CUDA without a native build, where the reference would sync the host.
            ``native`` takes the split-vocabulary path for greedy, temperature-only and
            top-k <= 128 sequences (``csrc/kernels/chunk_stats.h``) and the
            one-row-per-sequence path for the others; ``OSD_SAMPLER_SPLIT=1`` / ``0``
            forces it on / off, and on CUDA it is off unless set (its kernels have not run
            on a GPU yet).

    Returns:
        ``output_token_ids [B, K+1]`` int64: the accepted drafts, then exactly one
        recovered or bonus token, then -1 padding; ``num_accepted [B]`` int32.

    Example:
        >>> out, acc = rejection_sample(logits, drafts, q, temperature=torch.ones(B),
        ...                             seed=seeds, offset=lens.long())
        >>> # row b emitted out[b, :acc[b] + 1]

    On CPU the values are validated (ids in range, ``num_draft_tokens <= K``, sampling
    parameters in range); on CUDA that would need a host sync, so the kernels clamp
    instead (out-of-range draft ids are rejected).
    """
    _check_tensors(target_logits, draft_token_ids, draft_probs)
    params = sampling_params(
        target_logits,
        draft_token_ids,
        num_draft_tokens=num_draft_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        offset=offset,
        generator=generator,
        shared=True,  # the kernels below only read the per-row tensors
    )
    given = (temperature, top_k, top_p)
    _check_values(
        target_logits,
        draft_token_ids,
        params,
        counts=num_draft_tokens is not None,
        sampling=any(v is not None for v in given),
    )
    device = target_logits.device
    # Triton only as the fallback of a CUDA device the native build lacks
    impl = resolve_backend(backend, device, prefer_triton_on_gpu=not native_has_device(device))
    if impl == "reference":
        return rejection_sample_reference(
            target_logits, draft_token_ids, draft_probs, **params._asdict()
        )
    if impl == "triton":
        # imported on first use so that `import osd_kernels` does not import triton
        from osd_kernels.triton.rejection_sample import rejection_sample_triton

        return rejection_sample_triton(target_logits, draft_token_ids, draft_probs, params)
    return torch.ops.osd.rejection_sample(target_logits, draft_token_ids, draft_probs, *params)


if native_available():

    @torch.library.register_fake("osd::rejection_sample")
    def _rejection_sample_fake(
        target_logits,
        draft_token_ids,
        draft_probs,
        num_draft_tokens,
        temperature,
        top_k,
        top_p,
        seed,
        offset,
    ):
        batch, k1, _ = target_logits.shape
        out = target_logits.new_empty((batch, k1), dtype=torch.int64)
        return out, target_logits.new_empty((batch,), dtype=torch.int32)
