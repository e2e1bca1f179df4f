"""FlashInfer (``flashinfer-python``) as a side-by-side provider in the GPU benchmarks.

Two adapters take this project's inputs, convert them to FlashInfer's layout and call its
public API:

- :func:`flashinfer_rejection_sample`: chain verification with the signature of
  ``osd_kernels.rejection_sample`` (logits ``[B, K+1, V]``, drafts ``[B, K]``, draft probs
  ``[B, K, V]`` or None), run as FlashInfer's pipeline: ``flashinfer.sampling.softmax`` with
  the temperature, ``top_k_renorm_probs`` then ``top_p_renorm_probs`` (the order of
  ``osd_kernels.warp.warp_probs``), then ``chain_speculative_sampling``. Its time includes
  those conversions, since FlashInfer verifies from probabilities and this engine hands
  over logits. FlashInfer draws its uniforms from its own Philox layout, so only greedy
  rows (a one-hot target, where no draw can change the outcome) are comparable token for
  token; elsewhere only the timing and the shape of the output are.
- :class:`FlashInferTreeAttention`: tree / verify attention with a custom mask through
  ``BatchPrefillWithPagedKVCacheWrapper``. The cache ``[B_max, Hkv, S, D]`` is FlashInfer's
  paged ``HND`` layout with one page of ``S`` slots per row, so K and V are passed without
  a copy; the tree bitmask becomes FlashInfer's flattened boolean mask (per row, the
  ``[T, cache_lens[b] + T]`` visibility matrix, rows concatenated).

Both skip the calling test (:func:`flashinfer_or_skip`) when flashinfer cannot be imported
or there is no CUDA device; FlashInfer's kernels are CUDA-only. Every adapter also takes
the module as ``fi=``, so the CPU tests drive the conversions through a stand-in.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys

import pytest
import torch

from osd_kernels.tree_attention import tree_attention_mask

# FlashInfer's recommended workspace for the prefill wrappers (split-KV partial results).
WORKSPACE_BYTES = 128 * 1024 * 1024


def _installed() -> bool:
    return sys.modules.get("flashinfer") is not None or (
        "flashinfer" not in sys.modules and importlib.util.find_spec("flashinfer") is not None
    )


def flashinfer_or_skip():
    """The ``flashinfer`` module; skips the calling test, naming what is missing, when the
    package is not installed, when there is no CUDA device, or when the import fails."""
    missing = []
    if not _installed():
        missing.append("flashinfer (pip install flashinfer-python)")
    if not torch.cuda.is_available():
        missing.append("a CUDA device")
    if missing:
        pytest.skip("the flashinfer provider needs " + " and ".join(missing))
    try:
        return importlib.import_module("flashinfer")
    except (ImportError, OSError, RuntimeError) as exc:
        pytest.skip(f"flashinfer failed to import: {exc}")


def flashinfer_device() -> tuple[str, torch.dtype]:
    """Device and dtype the flashinfer provider is timed on, ``("cuda", bfloat16)`` as the
    other GPU providers; skips as :func:`flashinfer_or_skip` does."""
    flashinfer_or_skip()
    return "cuda", torch.bfloat16


# -- chain speculative sampling --------------------------------------------------------------


def _rows(x: torch.Tensor, batch: int, per_batch: int, dtype) -> torch.Tensor:
    """A ``[B]`` (or one-element) tensor as ``[B * per_batch]``, row ``b`` repeated."""
    x = x.to(dtype).reshape(-1)
    return (
        x.expand(batch).repeat_interleave(per_batch)
        if x.numel() == 1
        else (x.repeat_interleave(per_batch))
    )


def _onehot_argmax(flat: torch.Tensor) -> torch.Tensor:
    onehot = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
    return onehot.scatter_(1, flat.argmax(-1, keepdim=True), 1.0)


def flashinfer_target_probs(
    fi, logits: torch.Tensor, temperature=None, top_k=None, top_p=None
) -> torch.Tensor:
    """Target probabilities ``[B, K+1, V]`` float32 as FlashInfer takes them: greedy rows
    (temperature None or 0) one-hot on the argmax; the others ``softmax(logits / t)``, then
    top-k, then top-p, each renormalised by FlashInfer's kernels (top-k 0 or None and
    top-p 1 or None are off). Parameters are numbers or ``[B]`` tensors on the device;
    numbers decide on the host, so the scalar path has no host sync."""
    B, K1, V = logits.shape
    flat = logits.reshape(B * K1, V)
    greedy = None
    if not torch.is_tensor(temperature):
        if temperature is None or float(temperature) <= 0:
            return _onehot_argmax(flat).view(B, K1, V)
        t = float(temperature)
    else:
        t = _rows(temperature, B, K1, torch.float32)
        greedy = t <= 0
        t = torch.where(greedy, torch.ones_like(t), t)
    probs = fi.sampling.softmax(flat, temperature=t)
    if torch.is_tensor(top_k):
        k = _rows(top_k, B, K1, torch.int32)
        probs = fi.sampling.top_k_renorm_probs(probs, torch.where(k > 0, k, V))
    elif top_k is not None and int(top_k) > 0:
        probs = fi.sampling.top_k_renorm_probs(probs, min(int(top_k), V))
    if torch.is_tensor(top_p):
        probs = fi.sampling.top_p_renorm_probs(probs, _rows(top_p, B, K1, torch.float32))
    elif top_p is not None and float(top_p) < 1:
        probs = fi.sampling.top_p_renorm_probs(probs, float(top_p))
    if greedy is not None:
        probs = torch.where(greedy[:, None], _onehot_argmax(flat), probs)
    return probs.float().view(B, K1, V)


def flashinfer_draft_probs(
    draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, vocab: int
) -> torch.Tensor:
    """Draft probabilities ``[B, K, V]`` float32: the given ones, or one-hot on the drafted
    tokens (point drafts: FlashInfer then accepts with probability ``p(x)``, as
    ``rejection_sample`` does without draft probabilities)."""
    if draft_probs is not None:
        return draft_probs.float()
    B, K = draft_token_ids.shape
    q = torch.zeros(B, K, vocab, dtype=torch.float32, device=draft_token_ids.device)
    return q.scatter_(2, draft_token_ids.long().unsqueeze(-1), 1.0)


def _philox_kwargs(seed, offset, batch: int, device) -> dict:
    """``seed`` / ``offset`` for FlashInfer: both int64 ``[B]`` tensors on the device, or
    both ints; empty (FlashInfer draws its own) when ``seed`` is None."""
    if seed is None:
        return {}
    offset = 0 if offset is None else offset
    if torch.is_tensor(seed) or torch.is_tensor(offset):

        def as_rows(x):
            x = torch.as_tensor(x, dtype=torch.int64).to(device).reshape(-1)
            return x.expand(batch).contiguous() if x.numel() == 1 else x

        return {"seed": as_rows(seed), "offset": as_rows(offset)}
    return {"seed": int(seed), "offset": int(offset)}


def flashinfer_rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    temperature=None,
    top_k=None,
    top_p=None,
    seed=None,
    offset=None,
    backend=None,
    fi=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain verification by FlashInfer, called as ``osd_kernels.rejection_sample``.

    Returns ``output_token_ids [B, K+1]`` int64 (accepted drafts, one recovered or bonus
    token, then -1) and ``num_accepted [B]`` int32, FlashInfer's emitted draft count.
    ``backend`` is accepted and ignored so a benchmark can swap the two functions. ``fi``:
    the flashinfer module (default: imported, or the test skipped).
    """
    if fi is None:
        fi = flashinfer_or_skip()
    B, K1, V = target_logits.shape
    target = flashinfer_target_probs(fi, target_logits, temperature, top_k, top_p)
    draft = flashinfer_draft_probs(draft_token_ids, draft_probs, V)
    out, _, emitted = fi.sampling.chain_speculative_sampling(
        draft,
        draft_token_ids.int(),
        target,
        **_philox_kwargs(seed, offset, B, target_logits.device),
    )
    return out.long(), emitted.int()


def assert_chain_output(got, want, draft_token_ids: torch.Tensor, greedy: bool) -> None:
    """FlashInfer's chain output ``got`` against the reference's ``want``: equal token for
    token when ``greedy``; otherwise well formed (the accepted drafts, one token, then -1),
    since the two random streams differ."""
    out, acc = (x.cpu() for x in got)
    if greedy:
        assert torch.equal(out, want[0]) and torch.equal(acc, want[1]), "flashinfer"
        return
    drafts = draft_token_ids.cpu().long()
    B, K1 = out.shape
    assert acc.shape == (B,) and bool(((acc >= 0) & (acc < K1)).all()), acc
    pos = torch.arange(K1).expand(B, K1)
    accepted = pos < acc[:, None].long()
    padded = torch.cat([drafts, drafts[:, :1]], 1)
    assert bool((out == padded)[accepted].all()), "accepted drafts differ"
    assert bool((out[pos == acc[:, None].long()] >= 0).all()), "no emitted token"
    assert bool((out[pos > acc[:, None].long()] == -1).all()), "padding is not -1"


# -- tree / verify attention -----------------------------------------------------------------


def paged_layout(cache_lens: torch.Tensor, num_queries: int) -> tuple[torch.Tensor, ...]:
    """FlashInfer's paged indices for a ``[B, Hkv, S, D]`` cache with one page per row:
    ``qo_indptr`` (``T`` queries a row), ``paged_kv_indptr`` (one page a row),
    ``paged_kv_indices`` (row ``b`` is page ``b``) and ``paged_kv_last_page_len``
    (``cache_lens[b] + T`` keys), all int32 on the device of ``cache_lens [B]``."""
    B, device = cache_lens.shape[0], cache_lens.device
    steps = torch.arange(B + 1, dtype=torch.int32, device=device)
    rows = torch.arange(B, dtype=torch.int32, device=device)
    return steps * num_queries, steps, rows, (cache_lens + num_queries).to(torch.int32)


def flat_custom_mask(cache_lens: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
    """The tree bitmask ``[B, T]`` as FlashInfer's flattened boolean ``custom_mask``: for
    each row ``b``, the ``[T, cache_lens[b] + T]`` visibility matrix of
    ``osd_kernels.tree_attention.tree_attention_mask`` in row-major order, rows
    concatenated (length ``sum_b T * (cache_lens[b] + T)``). One host sync (the widest
    row), taken at plan time."""
    B, T = tree_mask.shape
    kv_lens = cache_lens[:B].long() + T
    width = int(kv_lens.max())
    visible = tree_attention_mask(cache_lens[:B], tree_mask, B, T, width)
    inside = torch.arange(width, device=visible.device) < kv_lens[:, None, None]
    return visible[inside.expand(B, T, width)]


class FlashInferTreeAttention:
    """Planned FlashInfer attention for one batch shape, called like ``tree_attention``.

    ``plan`` runs once here (host work, outside the timed call); :meth:`__call__` is the
    kernel alone. ``q [B, T, Hq, D]``, ``k_cache`` / ``v_cache [B_max, Hkv, S, D]`` (row
    ``b``'s prefix at ``[0, cache_lens[b])``, its tree right after), ``cache_lens [B_max]``
    int32, ``tree_mask [B, T]`` int64 bitmask or None (causal). Output ``[B, T, Hq, D]``.
    """

    def __init__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_lens: torch.Tensor,
        tree_mask: torch.Tensor | None,
        *,
        scale: float | None = None,
        fi=None,
    ):
        if fi is None:
            fi = flashinfer_or_skip()
        B, T, Hq, D = q.shape
        _, Hkv, S, _ = k_cache.shape
        lens = cache_lens[:B]
        self.shape = (B, T, Hq, D)
        self.kv = (k_cache, v_cache)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
        self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="HND")
        qo_indptr, kv_indptr, kv_indices, last_page_len = paged_layout(lens, T)
        self.wrapper.plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            last_page_len,
            Hq,
            Hkv,
            D,
            S,
            custom_mask=None if tree_mask is None else flat_custom_mask(lens, tree_mask),
            causal=tree_mask is None,
            sm_scale=1.0 / math.sqrt(D) if scale is None else float(scale),
            q_data_type=q.dtype,
            kv_data_type=k_cache.dtype,
        )

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        B, T, Hq, D = self.shape
        out = self.wrapper.run(q.reshape(B * T, Hq, D), self.kv)
        return out.view(B, T, Hq, D)
