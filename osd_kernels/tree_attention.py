"""``tree_attention``: attention of a token tree's queries over a ragged KV cache.

Row ``b`` of the batch has ``cache_lens[b]`` committed keys (the prefix) and, right after
them at slots ``cache_lens[b] + i``, the keys of its ``T`` tree nodes (written by the same
forward). Query ``i`` of row ``b`` sees

- every prefix key ``j < cache_lens[b]`` (the prefix is never masked), and
- tree key ``cache_lens[b] + i'`` iff bit ``i'`` of ``tree_mask[b, i]`` is set.

``tree_mask`` is one int64 bitmask per query, so a masked call has ``T <= 64``. ``None``
means causal, for any ``T``: query ``i`` sees keys ``j < cache_lens[b] + i + 1``, so plain
decode, prefill of any length and chain verify are the same call. A chain is the
lower-triangular mask. A query that sees no key at all (an empty prefix and an empty mask
row) gets a zero output.

Grouped-query attention: query head ``h`` reads KV head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from osd_kernels._ops import native_available, resolve_backend, use_avx512

MAX_TREE = 64
# ``auto`` on CPU without the kernel's AVX-512 path: the C++ kernel for at most this many
# query rows per KV head (T * Hq / Hkv), above it the reference, whose SDPA runs blocked
# GEMMs: with 9 / 3 heads over 300 to 2,000 cached keys the AVX2 kernel was faster up to
# 51 rows and slower from 66 on an AVX2 machine. The AVX-512 path (head dims that are a
# multiple of 16) was faster than SDPA for every block measured, prefills of 1,000 tokens
# included, so it takes any T (docs/benchmarks.md).
CPU_NATIVE_MAX_ROWS = 48
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def half_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether this is float32 ``q`` over a float16 cache (a CPU engine's half K/V,
    widened to float32 as it is read)."""
    return q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype == torch.float16


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [B_max, Hkv, S, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    B, T, Hq, D = q.shape
    B_max, Hkv, _, Dk = k_cache.shape
    if q.dtype not in _FLOATS:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if (k_cache.dtype, v_cache.dtype) != (q.dtype, q.dtype) and not half_cache(q, k_cache, v_cache):
        raise TypeError(
            f"k_cache/v_cache dtype ({k_cache.dtype}/{v_cache.dtype}) must match q ({q.dtype}), "
            "or be float16 under float32 q"
        )
    if Dk != D:
        raise ValueError(f"head dim of q ({D}) and of the cache ({Dk}) differ")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if B > B_max:
        raise ValueError(f"q has {B} rows but the cache holds only {B_max}")
    if tree_mask is not None and T > MAX_TREE:
        raise ValueError(
            f"T={T} queries per row exceeds the bitmask limit {MAX_TREE} of "
            f"a tree_mask (causal calls, tree_mask=None, take any T)"
        )
    if cache_lens.dtype != torch.int32 or cache_lens.shape != (B_max,):
        raise ValueError(
            f"cache_lens must be int32 [B_max={B_max}], got {cache_lens.dtype} "
            f"{tuple(cache_lens.shape)}"
        )
    if tree_mask is not None and (tree_mask.dtype != torch.int64 or tree_mask.shape != (B, T)):
        raise ValueError(
            f"tree_mask must be int64 [B={B}, T={T}], got {tree_mask.dtype} "
            f"{tuple(tree_mask.shape)}"
        )
    for name, t in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("cache_lens", cache_lens),
        ("tree_mask", tree_mask),
    ):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def causal_tree_mask(
    batch: int, num_nodes: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The chain (causal) bitmask ``[batch, num_nodes]`` int64: row ``i`` has bits ``0..i``."""
    if not 0 < num_nodes <= MAX_TREE:
        raise ValueError(f"num_nodes must be in 1..{MAX_TREE}, got {num_nodes}")
    i = torch.arange(num_nodes, dtype=torch.int64, device=device)
    # (1 << (i + 1)) - 1 overflows for i = 63; -1 has all 64 bits set.
    rows = torch.where(i == 63, torch.full_like(i, -1), (1 << (i + 1)) - 1)
    return rows.expand(batch, num_nodes).contiguous()


def tree_mask_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self bitmasks ``[B, T]`` int64 of trees given by ``parents [B, T]``.

    ``parents[b, i]`` is node ``i``'s parent (``-1`` for the root, ``parents[b, i] < i``);
    bit ``j`` of row ``i`` is set iff node ``j`` is ``i`` or one of its ancestors, which is
    the ``tree_mask`` of :func:`tree_attention`. Pointer doubling: ``ceil(log2 T)`` gathers,
    no host sync.
    """
    if parents.dim() != 2 or parents.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"parents must be int32/int64 [B, T], got {parents.dtype} {tuple(parents.shape)}"
        )
    B, T = parents.shape
    if T > MAX_TREE:
        raise ValueError(f"T={T} nodes exceeds the bitmask limit {MAX_TREE}")
    one = torch.ones((), dtype=torch.int64, device=parents.device)
    mask = (one << torch.arange(T, device=parents.device)).expand(B, T).contiguous()
    jump = parents.long()
    for _ in range(max(T - 1, 0).bit_length()):
        has = jump >= 0
        safe = jump.clamp_min(0)
        mask = mask | torch.where(has, mask.gather(1, safe), 0)
        jump = torch.where(has, jump.gather(1, safe), -1)
    return mask


def tree_attention_mask(
    cache_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    batch: int,
    num_queries: int,
    kv_len: int,
) -> torch.Tensor:
    """Boolean visibility ``[B, T, kv_len]``: ``[b, i, j]`` is True iff query ``i`` sees key ``j``.

    Causal (``tree_mask=None``, any ``T``): ``j <= cache_lens[b] + i``, one comparison per
    element. With a bitmask (``T <= 64``): the prefix, plus bit ``j - cache_lens[b]`` of
    ``tree_mask[b, i]``. Built without a loop over the batch or a host sync.
    """
    device = cache_lens.device
    lens = cache_lens[:batch].to(torch.int64).view(batch, 1, 1)
    j = torch.arange(kv_len, device=device, dtype=torch.int64).view(1, 1, kv_len)
    rel = j - lens  # [B, 1, kv]
    bit_idx = torch.arange(num_queries, device=device, dtype=torch.int64)
    if tree_mask is None:
        return rel <= bit_idx.view(1, num_queries, 1)  # [B, T, kv]
    bits = ((tree_mask.unsqueeze(-1) >> bit_idx) & 1).bool()  # [B, T, T]
    in_tree = (rel >= 0) & (rel < num_queries)
    tree_ok = bits.gather(2, rel.clamp(0, num_queries - 1).expand(batch, num_queries, kv_len))
    return (rel < 0) | (in_tree & tree_ok)


def tree_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    *,
    scale: float | None = None,
    max_kv_len: int | None = None,
) -> torch.Tensor:
    """SDPA over keys ``[0, max_kv_len)`` with the boolean mask of :func:`tree_attention_mask`.

    Arguments as :func:`tree_attention`. Computes in the dtype of ``q``. The mask is
    ``[B, T, max_kv_len]`` booleans (shared by the heads), so memory grows with
    ``T * max_kv_len``; the runtime bounds ``T`` by prefilling in chunks.
    """
    B, T, Hq, D = q.shape
    if max_kv_len is None:
        # Host sync, only when the caller did not pass its host-side upper bound.
        max_kv_len = int(cache_lens[:B].max()) + T if B > 0 else T
    if B == 0 or T == 0:
        return q.new_zeros(q.shape)
    kv_len = min(max_kv_len, k_cache.shape[2])
    visible = tree_attention_mask(cache_lens, tree_mask, B, T, kv_len)  # [B, T, kv]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k_cache[:B, :, :kv_len].to(q.dtype),  # a half cache widened (a no-op otherwise)
        v_cache[:B, :, :kv_len].to(q.dtype),
        attn_mask=visible.unsqueeze(1),
        scale=scale,
        enable_gqa=Hq != k_cache.shape[1],
    )
    out = out.transpose(1, 2)
    if tree_mask is None:
        return out  # causal: every query sees at least its own key
    # A query that sees nothing outputs zero (SDPA's math path would give NaN).
    return out.masked_fill(~visible.any(-1).view(B, T, 1, 1), 0.0)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    max_kv_len: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of ``T`` tree queries per row over the row's cached prefix plus the tree.

    Args:
        q: ``[B, T, Hq, D]`` float32/float16/bfloat16, the queries of the new tokens (any
            ``T`` when causal, ``T <= 64`` with a ``tree_mask``). Any strides.
        k_cache, v_cache: ``[B_max, Hkv, S, D]``, same dtype as ``q``, or float16 under
            float32 ``q`` (a half cache, widened to float32 as it is read); typically views
            ``kv[l, 0]`` / ``kv[l, 1]`` of the runtime's ``[L, 2, B_max, Hkv, S, D]`` cache.
            Row ``b < B`` holds its prefix at slots ``[0, cache_lens[b])`` and the tree's
            K/V at ``[cache_lens[b], cache_lens[b] + T)``. ``Hq % Hkv == 0``.
        cache_lens: ``[B_max]`` int32, committed prefix length per row (on the device).
        tree_mask: ``[B, T]`` int64; bit ``i'`` of ``tree_mask[b, i]`` lets query ``i``
            see tree key ``i'``. ``None`` is causal: query ``i`` sees keys
            ``j <= cache_lens[b] + i``.
        scale: softmax scale, default ``1 / sqrt(D)``.
        max_kv_len: host-side upper bound of ``max(cache_lens[:B]) + T`` (at most ``S``),
            so no backend needs a host sync. ``None``: the reference computes it (one
            sync); Triton takes ``S`` (it sizes only the split-KV decision).
        backend: ``auto`` | ``reference`` | ``native`` | ``triton``. ``auto`` is Triton on
            CUDA (its causal path streams key tiles up to each query's diagonal, so a long
            causal prefill needs no ``[T, S]`` mask); on CPU the C++ kernel when
            ``T * Hq / Hkv <= CPU_NATIVE_MAX_ROWS`` (decode, chain and small-tree verify)
            or when its AVX-512 path serves the call (:func:`osd_kernels.use_avx512` and
            ``D % 16 == 0``: any ``T``, prefill included), else the reference (SDPA's
            blocked GEMMs win for large blocks against the AVX2 path). In float32 on the
            AVX-512 path a query's result depends only on its visible keys in position
            order (``csrc/cpu/attention_rows.h``), not on the call's other queries.
            ``native`` on a CUDA tensor runs the reference (the C++ kernel is CPU-only).
            Triton splits long prefixes over several programs per (row, KV head) for
            ``T <= 64`` (split KV, ``osd_kernels.triton.tree_attention``).

    Returns:
        ``[B, T, Hq, D]`` in the dtype of ``q``. A query that sees no key gets zeros.

    Example:
        >>> # verify a 3-node tree: root, and two children of the root
        >>> mask = torch.tensor([[0b001, 0b011, 0b101]])
        >>> out = tree_attention(q, kv[l, 0], kv[l, 1], lens, mask, max_kv_len=bound)
    """
    _check(q, k_cache, v_cache, cache_lens, tree_mask)
    if max_kv_len is not None and max_kv_len > k_cache.shape[2]:
        raise ValueError(f"max_kv_len={max_kv_len} exceeds the cache capacity {k_cache.shape[2]}")
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    impl = resolve_backend(backend, q.device)
    rows_per_kv_head = q.shape[1] * (q.shape[2] // k_cache.shape[1])
    if impl == "native" and (
        q.device.type != "cpu"
        or (
            backend == "auto"
            and rows_per_kv_head > CPU_NATIVE_MAX_ROWS
            and not (q.shape[3] % 16 == 0 and use_avx512())
        )
    ):
        impl = "reference"  # the native kernel is CPU-only (Triton serves CUDA)
    if impl == "reference":
        return tree_attention_reference(
            q, k_cache, v_cache, cache_lens, tree_mask, scale=scale, max_kv_len=max_kv_len
        )
    if impl == "triton":
        # imported on first use so that `import osd_kernels` does not import triton
        from osd_kernels.triton.tree_attention import tree_attention_triton

        return tree_attention_triton(
            q, k_cache, v_cache, cache_lens, tree_mask, scale, max_kv_len=max_kv_len
        )
    return torch.ops.osd.tree_attention(q, k_cache, v_cache, cache_lens, tree_mask, scale)


if native_available():

    @torch.library.register_fake("osd::tree_attention")
    def _tree_attention_fake(q, k_cache, v_cache, cache_lens, tree_mask, scale):
        return q.new_empty(q.shape)
