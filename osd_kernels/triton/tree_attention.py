"""Triton ``tree_attention`` (semantics: ``osd_kernels.tree_attention``): the host side.

The kernels and their design (single pass, split KV with its combine, the online softmax)
are in :mod:`osd_kernels.triton.tree_attention_kernels`, whose names are importable from
here too. This module picks the path and sizes the split:

``num_splits`` is chosen on the host from shapes and the caller's ``max_kv_len`` bound
(no host sync): :func:`split_kv_num_splits`. On the GPU the split kernel's tiles are
autotuned (``SPLIT_CONFIGS``) per shape class (keys per split, query rows, head dim,
mask); a launch during CUDA graph capture, where autotuning's timing syncs are not
allowed, reuses the config tuned eagerly for its class (or the first one). Under the
interpreter it runs one fixed small config.
"""

import functools
import os

import torch
import triton
from triton.testing import do_bench

# The tile helpers are re-exported too, so every kernel-module name stays importable here.
from osd_kernels.triton.tree_attention_kernels import (  # noqa: F401
    _dot,
    _new_key_tiles,
    _prefix_tiles,
    _split_kv_combine_kernel,
    _split_kv_kernel,
    _tree_attention_kernel,
)


_LOG2E = 1.4426950408889634
MAX_TREE = 64  # a tree mask is one int64 per query; also the causal tile of new keys

# Split-KV sizing (see split_kv_num_splits).
DEFAULT_NUM_SMS = 132  # H100 SXM / H200; CPU tensors (interpreter) size for this GPU
PROGRAMS_PER_SM = 2  # aim for about two split programs per SM
SPLIT_MIN_KEYS = 256  # a split streams at least this many prefix keys ...
SPLIT_MIN_KEYS_PER_ROW = 8  # ... and at least 8 per query row (bounds workspace traffic)
MAX_SPLITS = 63  # num_splits + 1 partials fit one 64-wide combine tile
# Prefix chunks are multiples of this many keys (a multiple of every BLOCK_N tried), so a
# split's tiles never straddle two splits and the partition does not depend on the config.
SPLIT_ALIGN_GPU = 128
# Under the interpreter: one fixed config, small tiles so tests exercise many splits.
INTERPRET_BLOCK_N = 32

# GPU autotune space of _split_kv_kernel: (BLOCK_N, num_warps, num_stages).
SPLIT_CONFIGS = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3))


def _bench_quick(kernel_call, quantiles):
    """Autotune timing: short warm-up and repetition (the default 25 + 100 ms per config
    makes the first call of every shape class slow)."""
    return do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


_split_kv_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in SPLIT_CONFIGS],
    key=["kv_bucket", "BLOCK_M", "BLOCK_D", "HAS_MASK"],
    do_bench=_bench_quick,
)(_split_kv_kernel)


# Autotuned (BLOCK_N, num_warps, num_stages) per shape class, for launches under capture.
_tuned: dict = {}


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """SM count of a CUDA device (host-side query, cached), else ``DEFAULT_NUM_SMS``."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _block_m(rows: int, on_gpu: bool) -> int:
    """Query rows per program: all ``T * G`` rows of a KV head when they fit."""
    return max(16, min(64 if on_gpu else 32, triton.next_power_of_2(rows)))


def split_kv_num_splits(
    batch: int,
    kv_heads: int,
    num_queries: int,
    group: int,
    max_kv_len: int,
    num_sms: int = DEFAULT_NUM_SMS,
    block_m: int = 64,
) -> int:
    """Prefix splits per (row, KV head) for the split-KV path; 1 means the single pass.

    From shapes and the host-side bound ``max_kv_len`` (of ``max(lens) + T``) only, so no
    host sync. The single pass already runs ``programs = batch * kv_heads * blocks``
    programs (``blocks = ceil(T * G / block_m)``); splitting multiplies them, aiming at
    ``PROGRAMS_PER_SM * num_sms`` in all, while every split keeps at least
    ``max(SPLIT_MIN_KEYS, SPLIT_MIN_KEYS_PER_ROW * T * G)`` prefix keys, so the fp32
    workspace (``T * G * D`` per split, written and read once) stays small beside the
    K/V it summarises, and at most ``MAX_SPLITS``. Returns 1 for ``T > 64`` (prefill).
    """
    if num_queries > MAX_TREE:
        return 1
    rows = num_queries * group
    programs = batch * kv_heads * triton.cdiv(rows, block_m)
    prefix = max(max_kv_len - num_queries, 0)
    by_size = prefix // max(SPLIT_MIN_KEYS, SPLIT_MIN_KEYS_PER_ROW * rows)
    by_occupancy = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(programs, 1))
    splits = min(by_size, by_occupancy, MAX_SPLITS)
    return splits if splits >= 2 else 1


def _split_kv(
    q, k_cache, v_cache, cache_lens, tree_mask, qk_scale, out, num_splits, prefix_bound, on_gpu
):
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    rows = T * group
    parts = num_splits + 1
    acc = torch.empty((B * Hkv, parts, rows, D), dtype=torch.float32, device=q.device)
    ml = torch.empty((2, B * Hkv, parts, rows), dtype=torch.float32, device=q.device)
    block_m = _block_m(rows, on_gpu)
    block_d = max(16, triton.next_power_of_2(D))
    mask = tree_mask if tree_mask is not None else cache_lens
    # Autotune key: the keys per split, as a power of two in [128, 8192].
    kv_bucket = min(
        max(triton.next_power_of_2(triton.cdiv(max(prefix_bound, 1), num_splits)), 128), 8192
    )
    args = (
        q,
        k_cache,
        v_cache,
        cache_lens,
        mask,
        acc,
        ml[0],
        ml[1],
        T,
        Hkv,
        group,
        D,
        qk_scale,
        num_splits,
        kv_bucket,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        tree_mask.stride(0) if tree_mask is not None else 0,
        tree_mask.stride(1) if tree_mask is not None else 0,
    )
    meta = dict(
        HAS_MASK=tree_mask is not None,
        FP32_DOT=q.dtype == torch.float32 or not on_gpu,
        BLOCK_M=block_m,
        BLOCK_T=max(16, min(MAX_TREE, triton.next_power_of_2(T))),
        BLOCK_D=block_d,
    )
    grid = (B * Hkv * triton.cdiv(rows, block_m), parts)
    if on_gpu and not _interpreting():
        key = (kv_bucket, q.dtype, *meta.values())
        if torch.cuda.is_current_stream_capturing():
            # Autotuning times the kernel with host syncs, which a CUDA graph capture
            # forbids: take the config tuned eagerly for this shape class (the warm-up
            # before a capture runs it), else the first one.
            block_n, warps, stages = _tuned.get(key, SPLIT_CONFIGS[0])
            _split_kv_kernel[grid](
                *args,
                SPLIT_ALIGN=SPLIT_ALIGN_GPU,
                BLOCK_N=block_n,
                num_warps=warps,
                num_stages=stages,
                **meta,
            )
        else:
            _split_kv_tuned[grid](*args, SPLIT_ALIGN=SPLIT_ALIGN_GPU, **meta)
            best = _split_kv_tuned.best_config
            _tuned[key] = (best.kwargs["BLOCK_N"], best.num_warps, best.num_stages)
    else:
        _split_kv_kernel[grid](
            *args, SPLIT_ALIGN=INTERPRET_BLOCK_N, BLOCK_N=INTERPRET_BLOCK_N, **meta
        )
    block_s = triton.next_power_of_2(parts)
    block_r = max(1, min(triton.next_power_of_2(rows), 8192 // (block_s * block_d)))
    _split_kv_combine_kernel[(B * Hkv * triton.cdiv(rows, block_r),)](
        acc,
        ml[0],
        ml[1],
        out,
        T,
        Hkv,
        group,
        D,
        parts,
        BLOCK_S=block_s,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
    return out


def tree_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scale: float,
    *,
    max_kv_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton ``tree_attention``; arguments as ``osd_kernels.tree_attention`` (already checked).

    Reads ``cache_lens`` on the device: no host sync. ``max_kv_len`` (the caller's
    host-side bound of ``max(lens) + T``; ``None`` takes the cache capacity) only sizes
    the split: ``num_splits=None`` picks the path with :func:`split_kv_num_splits`
    (split KV when it returns more than 1, else the single pass); ``0`` forces the
    single pass; ``n >= 1`` forces the split path with ``n`` prefix splits (``T <= 64``).
    Returns a contiguous ``[B, T, Hq, D]`` tensor.
    """
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    out = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    on_gpu = q.is_cuda
    bound = k_cache.shape[2] if max_kv_len is None else max_kv_len
    if num_splits is None:
        num_splits = split_kv_num_splits(
            B, Hkv, T, group, bound, _num_sms(q.device), _block_m(T * group, on_gpu)
        )
        num_splits = num_splits if num_splits > 1 else 0
    elif num_splits < 0 or num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits must be in 0..{MAX_SPLITS}, got {num_splits}")
    elif num_splits > 0 and T > MAX_TREE:
        raise ValueError(f"the split-KV path takes T <= {MAX_TREE} queries, got T={T}")
    if num_splits > 0:
        return _split_kv(
            q,
            k_cache,
            v_cache,
            cache_lens,
            tree_mask,
            scale * _LOG2E,
            out,
            num_splits,
            max(bound - T, 0),
            on_gpu,
        )

    block_m = _block_m(T * group, on_gpu)
    block_n = 64 if on_gpu else 32
    # Causal: the kernel never reads the mask (HAS_MASK is False) but needs a valid pointer.
    mask = tree_mask if tree_mask is not None else cache_lens
    grid = (B * Hkv, triton.cdiv(T * group, block_m))
    _tree_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        cache_lens,
        mask,
        T,
        Hkv,
        group,
        D,
        scale * _LOG2E,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        tree_mask.stride(0) if tree_mask is not None else 0,
        tree_mask.stride(1) if tree_mask is not None else 0,
        HAS_MASK=tree_mask is not None,
        FP32_DOT=q.dtype == torch.float32 or not on_gpu,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_T=max(16, min(MAX_TREE, triton.next_power_of_2(T))),
        BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    return out
