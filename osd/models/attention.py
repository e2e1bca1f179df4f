"""The one attention dispatch point of the runtime.

Every cached forward (a prefill piece, decode, chain or tree verify) calls
:func:`attention`, which hands the queries, the layer's cache views and the tree mask to
``osd_kernels.tree_attention``. Causal calls (``tree_mask=None``) take any number of
queries; a tree mask covers at most 64. Backends (``ModelConfig.attention_backend``):

- ``auto``: on CPU, per call, the C++ kernel for few query rows (decode, verify), and for
  large blocks (prefill pieces) too where its AVX-512 path runs, else the SDPA reference
  for those; Triton on CUDA;
- ``reference``: ``osd_kernels``' SDPA reference with a boolean ``[B, T, S]`` mask;
- ``native``: the C++ kernel behind ``torch.ops.osd.tree_attention`` (CPU; on CUDA the
  reference runs instead);
- ``triton``: the Triton tree-attention kernel (default on CUDA); causal blocks stream
  key tiles up to each query block's diagonal, so long prefill pieces need no mask;
- ``flash``: flash-attn's ``flash_attn_with_kvcache`` for causal forwards (prefill, decode,
  chain verify) on CUDA in fp16/bf16 when the ``flash`` extra is installed; forwards with a
  tree mask still go to Triton.

:func:`causal_attention` is the cacheless full-sequence path used for training
(differentiable, plain SDPA).

Sliding-window layers (Mistral, Phi-3-mini, Qwen2 with ``use_sliding_window``, Gemma)
pass ``window``: a query at position ``p`` sees only keys at positions above
``p - window``. Calls whose keys all lie within the window (``max_kv_len <= window``) take
the paths above unchanged. Past the window, causal calls of few rows on the CPU run the
C++ kernel once per query over the slice of its window (:func:`windowed_rows`), so a
query's output does not depend on the queries beside it; the others go to
:func:`windowed_attention`, an SDPA with the window in its boolean mask. Soft-capped
scores (Gemma 2, ``softcap``: ``c * tanh(s / c)`` before the mask) take
:func:`windowed_attention` too, which then computes the scores itself.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from osd_kernels import native_available, tree_attention
from osd_kernels.tree_attention import CPU_NATIVE_MAX_ROWS, tree_attention_mask


@functools.lru_cache(maxsize=None)
def flash_available() -> bool:
    """True when flash-attn (the optional ``flash`` extra) imports."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attention_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Turn a configured backend into the one used for a model on ``device`` in ``dtype``.

    ``auto`` is ``triton`` on CUDA; on CPU it stays ``auto``, so ``tree_attention`` picks
    per call: the C++ kernel for few query rows (decode, chain and small-tree verify; it
    measured several times faster than the SDPA reference there) and for large blocks
    such as prefill pieces where its AVX-512 path runs (else the SDPA reference takes
    those; ``osd_kernels.tree_attention``). ``flash`` needs CUDA, fp16 or bf16 and an
    importable flash-attn (ValueError otherwise).
    """
    if backend == "auto":
        return "triton" if device.type == "cuda" else "auto"
    if backend == "flash":
        if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"the flash attention backend needs CUDA and fp16/bf16, got {device.type} {dtype}"
            )
        if not flash_available():
            raise ValueError(
                "the flash attention backend needs flash-attn (pip install 'osd[flash]')"
            )
    return backend


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    *,
    scale: float,
    max_kv_len: int,
    backend: str,
    window: int | None = None,
    depths: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of ``T`` new queries per row over the row's cache (prefix + new keys).

    Args:
        q: ``[B, T, Hq, D]``.
        k_cache, v_cache: ``[B_max, Hkv, S, D]`` views of one layer of the ``KVCache``; the
            new keys are already written at ``lens[b] + i``.
        lens: ``[B_max]`` int32, committed lengths (the new tokens not included).
        tree_mask: ``[B, T]`` int64 bitmask per query (``T <= 64``), or None for causal
            (any ``T``; query ``i`` sees keys ``j <= lens[b] + i``).
        scale: softmax scale.
        max_kv_len: host-side upper bound of ``max(lens[:B]) + T``.
        backend: a resolved backend (:func:`resolve_attention_backend`).
        window: the layer's sliding window, or None.
        depths: ``[B, T]`` tree depths of the queries (None: ``0..T-1``); with ``window``,
            they give the new keys' positions.
        softcap: soft-capping of the scaled scores, or None.

    Returns:
        ``[B, T, Hq, D]`` in the dtype of ``q``.
    """
    if (
        window is not None
        and max_kv_len > window
        and softcap is None
        and tree_mask is None
        and backend in ("auto", "native")
        and q.device.type == "cpu"
        and native_available()
        and q.shape[0] * q.shape[1] <= WINDOW_ROWS_MAX
    ):
        return windowed_rows(q, k_cache, v_cache, lens, scale=scale, window=window)
    if softcap is not None or (window is not None and max_kv_len > window):
        return windowed_attention(
            q,
            k_cache,
            v_cache,
            lens,
            tree_mask,
            depths,
            scale=scale,
            max_kv_len=max_kv_len,
            window=window,
            softcap=softcap,
        )
    if backend == "flash":
        if tree_mask is None:
            return _flash_causal(q, k_cache, v_cache, lens, scale)
        backend = "triton"
    if (
        backend == "auto"
        and q.device.type == "cpu"
        and native_available()
        and q.shape[1] * (q.shape[2] // k_cache.shape[1]) <= CPU_NATIVE_MAX_ROWS
    ):
        # What tree_attention's auto picks here (the C++ kernel, which checks its own
        # arguments), without its Python checks: decode steps make one call per layer.
        return torch.ops.osd.tree_attention(q, k_cache, v_cache, lens, tree_mask, scale)
    return tree_attention(
        q, k_cache, v_cache, lens, tree_mask, scale=scale, max_kv_len=max_kv_len, backend=backend
    )


# Most query rows (batch x new tokens) that windowed_rows computes one call per row; a
# larger block (a prefill piece) is one masked SDPA.
WINDOW_ROWS_MAX = 64


def windowed_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: torch.Tensor,
    *,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Causal sliding-window attention of few query rows on the CPU, one C++ kernel call
    per query: query ``i`` of row ``b`` (position ``p = lens[b] + i``) attends over the
    cache slice of its window, slots ``max(0, p - window + 1) .. p``, as a decode step at
    ``p`` does. A query's output is therefore the same function of the same inputs
    whether it is decoded alone or verified among others (a masked SDPA over the whole
    block sums in an order that depends on the block's shape, and int8 activations can
    turn such a last-bit difference into a different greedy token). Arguments as
    :func:`attention`; ``[B, T, Hq, D]``."""
    B, T = q.shape[:2]
    op = torch.ops.osd.tree_attention.default
    outs = []
    for b, n in enumerate(lens[:B].tolist()):
        qb, kb, vb = q[b : b + 1], k_cache[b : b + 1], v_cache[b : b + 1]
        for i in range(T):
            p = n + i
            start = max(0, p - window + 1)
            outs.append(
                op(
                    qb[:, i : i + 1],
                    kb[:, :, start : p + 1],
                    vb[:, :, start : p + 1],
                    _one_len(p - start),
                    None,
                    scale,
                )
            )
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1).view(q.shape)


@functools.lru_cache(maxsize=4096)
def _one_len(n: int) -> torch.Tensor:
    """``[n]`` as the int32 ``cache_lens`` of a one-row call (read only by the kernel)."""
    return torch.tensor([n], dtype=torch.int32)


def windowed_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    depths: torch.Tensor | None,
    *,
    scale: float,
    max_kv_len: int,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`attention` with a sliding window: query ``i`` of row ``b`` (position
    ``p = lens[b] + depth``) sees what the tree or causal mask lets it see among keys
    whose position is above ``p - window`` (every key when ``window`` is None). A cached
    key's position is its slot; a new key's is ``lens[b]`` plus its depth. With
    ``softcap``, the scaled scores are soft-capped before the mask. Arguments as
    :func:`attention`; ``[B, T, Hq, D]``.
    """
    B, T, Hq, _ = q.shape
    if B == 0 or T == 0:
        return q.new_zeros(q.shape)
    kv_len = min(max_kv_len, k_cache.shape[2])
    visible = tree_attention_mask(lens, tree_mask, B, T, kv_len)  # [B, T, kv]
    base = lens[:B].to(torch.int64).view(B, 1)
    steps = (
        torch.arange(T, device=q.device).view(1, T).expand(B, T)
        if depths is None
        else depths.to(torch.int64)
    )
    slots = torch.arange(kv_len, device=q.device).view(1, kv_len)
    rel = slots - base  # [B, kv]
    new = (rel >= 0) & (rel < T)
    key_pos = torch.where(new, base + steps.gather(1, rel.clamp(0, T - 1)), slots)
    if window is not None:
        visible = visible & (key_pos.unsqueeze(1) > (base + steps - window).unsqueeze(2))
    out = _masked_sdpa(
        q.transpose(1, 2),
        k_cache[:B, :, :kv_len].to(q.dtype),  # a half cache widened (a no-op otherwise)
        v_cache[:B, :, :kv_len].to(q.dtype),
        visible.unsqueeze(1),
        scale,
        softcap,
    )
    # A query that sees nothing (possible only in a malformed tree) outputs zero.
    return out.transpose(1, 2).masked_fill(~visible.any(-1).view(B, T, 1, 1), 0.0)


def _masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """SDPA of ``q [N, Hq, T, D]`` over ``k, v [N, Hkv, S, D]`` under the boolean ``mask``
    (broadcast to ``[N, Hq, T, S]``); with ``softcap``, the scores are computed here and
    soft-capped (``c * tanh(s / c)``) before the mask, with the softmax in float32, as
    transformers' Gemma 2 eager attention computes them."""
    N, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv
        )
    # The query heads of one KV head are consecutive: multiply each group by its K and V
    # once ([N, Hkv, rep * T, D]) instead of copying K and V for every query head.
    scores = torch.matmul(q.reshape(N, Hkv, Hq // Hkv * T, D), k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(N, Hq, T, S).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs.view(N, Hkv, Hq // Hkv * T, S), v).view(N, Hq, T, D)


def _flash_causal(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """flash-attn over keys ``[0, lens[b] + T)``; its causal mask is aligned to the end,
    so query ``i`` sees keys ``j <= lens[b] + i``, as the causal tree mask does."""
    from flash_attn import flash_attn_with_kvcache  # optional dependency (CUDA only)

    B, T = q.shape[:2]
    # flash-attn reads the cache as [B, S, Hkv, D] with any row/head strides.
    return flash_attn_with_kvcache(
        q,
        k_cache[:B].transpose(1, 2),
        v_cache[:B].transpose(1, 2),
        cache_seqlens=lens[:B] + T,
        softmax_scale=scale,
        causal=True,
    )


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Cacheless causal self-attention over whole sequences (training; differentiable).

    Args:
        q: ``[N, T, Hq, D]``; k, v: ``[N, T, Hkv, D]``.
        key_padding_mask: ``[N, T]`` bool, False for padding keys; None when unpadded. A
            query always sees itself, so no row is fully masked.
        scale: softmax scale.
        window: the layer's sliding window (query ``i`` sees keys ``j > i - window``), or
            None.
        softcap: soft-capping of the scaled scores, or None.

    Returns:
        ``[N, T, Hq, D]``.
    """
    T = q.shape[1]
    gqa = q.shape[2] != k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if softcap is not None or (window is not None and T > window):
        i = torch.arange(T, device=q.device)
        mask = i[None, :] <= i[:, None]  # [T, T]
        if window is not None:
            mask = mask & (i[None, :] > i[:, None] - window)
        if key_padding_mask is not None:
            eye = torch.eye(T, dtype=torch.bool, device=q.device)
            mask = (mask & key_padding_mask[:, None, :]) | eye  # [N, T, T]
        mask = mask if mask.dim() == 3 else mask.expand(q.shape[0], T, T)
        out = _masked_sdpa(qh, kh, vh, mask[:, None], scale, softcap)
    elif key_padding_mask is None:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=q.device)
        mask = (causal & key_padding_mask[:, None, :]) | eye  # [N, T, T]
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask[:, None], scale=scale, enable_gqa=gqa
        )
    return out.transpose(1, 2)
