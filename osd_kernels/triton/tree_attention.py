"""Triton kernels for ``tree_attention`` (semantics: ``osd_kernels.tree_attention``).

Two paths share the same tile loops (``_prefix_tiles``, ``_new_key_tiles``):

**Single pass** (``_tree_attention_kernel``; prefill, large ``T``, short prefixes).
Program ``(b * Hkv + hk, m)`` owns block ``m`` of the ``T * G`` query rows that share KV
head ``hk`` of row ``b`` (``G = Hq / Hkv``; row ``r`` is query ``r // G`` of head
``hk * G + r % G``), so each K/V tile is loaded once for the whole group. It streams the
prefix ``[0, lens[b])`` in ``BLOCK_N`` tiles with no mask (only the last tile's bound
check), then the new keys ``lens[b] + [0, T)`` in ``BLOCK_T`` tiles:

- with a tree mask (``T <= 64``, one tile) the per-query int64 bitmask decides visibility;
- causal (any ``T``) key ``lens[b] + j`` is visible to query ``t`` iff ``j <= t``, and the
  tiles stop after the block's last query, so a block reads no key past its own
  diagonal and nothing of size ``T x S`` is ever built (the long-prefill path on CUDA).
  For ``T <= 64`` the one tile is the same as the chain mask's, so both agree bit for bit.

**Split KV** (flash-decoding; decode and verify, ``T <= 64``, long prefixes). One pass
over a long prefix gives only ``B * Hkv`` programs, far fewer than the GPU's SMs at small
batch. ``_split_kv_kernel`` runs on a grid ``(B * Hkv * blocks, num_splits + 1)``:

- part ``s < num_splits`` of row ``b`` attends to the prefix chunk
  ``[s * c_b, min((s + 1) * c_b, lens[b]))`` with
  ``c_b = ceil(ceil(lens[b] / num_splits) / SPLIT_ALIGN) * SPLIT_ALIGN``. The chunk is
  computed on the device from ``lens[b]``, so every row spreads its own prefix over the
  splits (a ragged batch, or a CUDA graph captured with a loose length bound, stays
  balanced); a chunk past ``lens[b]`` is empty;
- part ``num_splits`` attends to the new keys ``lens[b] + [0, T)`` under the tree mask or
  the causal rule, exactly as the single pass does. Doing it in its own part (instead of
  in the last split or in the combine) keeps every prefix part unmasked and of equal
  length (but the last), runs it in parallel with them, and leaves the combine free of
  dot products, so the combine can spread over one program per few query rows.

Each part writes its unnormalised partial state to an fp32 workspace: ``acc [T*G, D]``
(``sum_j 2^(s_j - m) v_j``), the running max ``m`` and the sum ``l = sum_j 2^(s_j - m)``,
with scores ``s_j`` in base 2 (``q.k * scale * log2 e``). An empty part writes
``m = -inf, l = 0`` and no ``acc``. ``_split_kv_combine_kernel`` merges the
``num_splits + 1`` partials of each query row by log-sum-exp:
``M = max_s m_s``, ``w_s = 2^(m_s - M)`` (0 for an empty part),
``out = sum_s w_s acc_s / sum_s w_s l_s``. A query row that sees no key (``M = -inf``)
gets zeros, as in the single pass. The merge is exact in real arithmetic; in floating point
it differs from the single pass by rounding only.

``num_splits`` is chosen on the host from shapes and the caller's ``max_kv_len`` bound
(no host sync): :func:`split_kv_num_splits`.

Online softmax in base 2 with an fp32 accumulator:
``m' = max(m, max s)``, ``acc' = acc * 2^(m - m') + P V``, ``out = acc / l``.

Half inputs use the native half ``tl.dot`` on the GPU (probabilities cast to the V dtype,
fp32 accumulation). Under ``TRITON_INTERPRET=1`` every dot runs in fp32, because the
interpreter's bfloat16 ``tl.dot`` returns wrong values (Triton 3.9). On the GPU the split
kernel's tiles are autotuned (``SPLIT_CONFIGS``) per shape class (keys per split, query
rows, head dim, mask); a launch during CUDA graph capture, where autotuning's timing syncs
are not allowed, reuses the config tuned eagerly for its class (or the first one). Under
the interpreter it runs one fixed small config.
"""

import functools
import os

import torch
import triton
import triton.language as tl

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


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    """fp32 products for fp32 inputs (or upcast half inputs), else the native half dot."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def _prefix_tiles(
    q,
    k_base,
    v_base,
    lo,
    hi,
    m_i,
    l_i,
    acc,
    qk_scale,
    sk_s,
    sk_d,
    sv_s,
    sv_d,
    offs_d,
    d_ok,
    FP32_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online softmax of ``q`` over keys ``[lo, hi)``, all visible (only the bound is
    checked). Every tile holds at least one key, so ``m`` becomes finite in the first."""
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        k = tl.load(
            k_base + offs_n[None, :].to(tl.int64) * sk_s + offs_d[:, None] * sk_d,
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        s = _dot(q, k, FP32_DOT)
        s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + offs_n[:, None].to(tl.int64) * sv_s + offs_d[None, :] * sv_d,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + _dot(p, v, FP32_DOT)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _new_key_tiles(
    q,
    k_base,
    v_base,
    bits,
    t,
    length,
    t_end,
    num_q,
    m_i,
    l_i,
    acc,
    qk_scale,
    sk_s,
    sk_d,
    sv_s,
    sv_d,
    offs_d,
    d_ok,
    HAS_MASK: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Online softmax over the new keys ``length + [0, t_end)``: bit ``j`` of ``bits`` (one
    int64 per query row) under a tree mask, else causal (``j <= t``). A row may see none
    of them, so ``m`` can stay ``-inf`` (``m_safe`` keeps the exponentials finite)."""
    for first in range(0, t_end, BLOCK_T):
        offs_t = first + tl.arange(0, BLOCK_T)
        t_ok = offs_t < num_q
        keys = length + offs_t
        k = tl.load(
            k_base + keys[None, :].to(tl.int64) * sk_s + offs_d[:, None] * sk_d,
            mask=t_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        if HAS_MASK:
            visible = ((bits[:, None] >> offs_t[None, :].to(tl.int64)) & 1) != 0
        else:
            visible = offs_t[None, :] <= t[:, None]
        visible = visible & t_ok[None, :]
        s = _dot(q, k, FP32_DOT)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + keys[:, None].to(tl.int64) * sv_s + offs_d[None, :] * sv_d,
            mask=t_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + _dot(p, v, FP32_DOT)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _tree_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lens_ptr,
    mask_ptr,
    num_q,
    num_kv_heads,
    group,
    head_dim,
    qk_scale,
    sq_b,
    sq_t,
    sq_h,
    sq_d,
    sk_b,
    sk_h,
    sk_s,
    sk_d,
    sv_b,
    sv_h,
    sv_s,
    sv_d,
    sm_b,
    sm_t,
    HAS_MASK: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = pid_bh // num_kv_heads
    hk = pid_bh % num_kv_heads
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_q * group
    t = rows // group
    head = hk * group + rows % group
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    b64 = b.to(tl.int64)

    q_ptrs = (
        q_ptr
        + b64 * sq_b
        + t[:, None].to(tl.int64) * sq_t
        + head[:, None].to(tl.int64) * sq_h
        + offs_d[None, :] * sq_d
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = k_ptr + b64 * sk_b + hk.to(tl.int64) * sk_h
    v_base = v_ptr + b64 * sv_b + hk.to(tl.int64) * sv_h
    length = tl.load(lens_ptr + b)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Prefix: every key visible, only the tile bound is checked.
    m_i, l_i, acc = _prefix_tiles(
        q,
        k_base,
        v_base,
        0,
        length,
        m_i,
        l_i,
        acc,
        qk_scale,
        sk_s,
        sk_d,
        sv_s,
        sv_d,
        offs_d,
        d_ok,
        FP32_DOT,
        BLOCK_N,
    )

    # New keys length + [0, T): one tile under a tree mask, causal tiles up to the block's
    # last query otherwise.
    if HAS_MASK:
        bits = tl.load(mask_ptr + b64 * sm_b + t.to(tl.int64) * sm_t, mask=row_ok, other=0)
        t_end = num_q
    else:
        bits = t
        t_end = tl.minimum((tl.program_id(1) * BLOCK_M + BLOCK_M - 1) // group + 1, num_q)
    m_i, l_i, acc = _new_key_tiles(
        q,
        k_base,
        v_base,
        bits,
        t,
        length,
        t_end,
        num_q,
        m_i,
        l_i,
        acc,
        qk_scale,
        sk_s,
        sk_d,
        sv_s,
        sv_d,
        offs_d,
        d_ok,
        HAS_MASK,
        FP32_DOT,
        BLOCK_T,
    )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = (
        out_ptr
        + ((b64 * num_q + t[:, None].to(tl.int64)) * (num_kv_heads * group) + head[:, None])
        * head_dim
        + offs_d[None, :]
    )
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _split_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    lens_ptr,
    mask_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    num_q,
    num_kv_heads,
    group,
    head_dim,
    qk_scale,
    num_splits,
    kv_bucket,
    sq_b,
    sq_t,
    sq_h,
    sq_d,
    sk_b,
    sk_h,
    sk_s,
    sk_d,
    sv_b,
    sv_h,
    sv_s,
    sv_d,
    sm_b,
    sm_t,
    HAS_MASK: tl.constexpr,
    FP32_DOT: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Partial ``(acc, m, l)`` of one part (a prefix split, or the new keys when
    ``part == num_splits``) for one block of query rows. ``kv_bucket`` only keys the
    autotuner (a bucket of the keys per split); the kernel does not read it."""
    num_rows = num_q * group
    blocks = tl.cdiv(num_rows, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // blocks
    block = pid % blocks
    part = tl.program_id(1)
    b = bh // num_kv_heads
    hk = bh % num_kv_heads
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    t = rows // group
    head = hk * group + rows % group
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    b64 = b.to(tl.int64)

    q_ptrs = (
        q_ptr
        + b64 * sq_b
        + t[:, None].to(tl.int64) * sq_t
        + head[:, None].to(tl.int64) * sq_h
        + offs_d[None, :] * sq_d
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = k_ptr + b64 * sk_b + hk.to(tl.int64) * sk_h
    v_base = v_ptr + b64 * sv_b + hk.to(tl.int64) * sv_h
    length = tl.load(lens_ptr + b)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if part < num_splits:
        chunk = tl.cdiv(tl.cdiv(length, num_splits), SPLIT_ALIGN) * SPLIT_ALIGN
        lo = part * chunk
        hi = tl.minimum(lo + chunk, length)
        m_i, l_i, acc = _prefix_tiles(
            q,
            k_base,
            v_base,
            lo,
            hi,
            m_i,
            l_i,
            acc,
            qk_scale,
            sk_s,
            sk_d,
            sv_s,
            sv_d,
            offs_d,
            d_ok,
            FP32_DOT,
            BLOCK_N,
        )
    else:
        if HAS_MASK:
            bits = tl.load(mask_ptr + b64 * sm_b + t.to(tl.int64) * sm_t, mask=row_ok, other=0)
            t_end = num_q
        else:
            bits = t
            t_end = tl.minimum((block * BLOCK_M + BLOCK_M - 1) // group + 1, num_q)
        m_i, l_i, acc = _new_key_tiles(
            q,
            k_base,
            v_base,
            bits,
            t,
            length,
            t_end,
            num_q,
            m_i,
            l_i,
            acc,
            qk_scale,
            sk_s,
            sk_d,
            sv_s,
            sv_d,
            offs_d,
            d_ok,
            HAS_MASK,
            FP32_DOT,
            BLOCK_T,
        )

    # Workspace [B * Hkv, num_splits + 1, T * G] (m, l) and [..., D] (acc).
    slot = (bh.to(tl.int64) * (num_splits + 1) + part) * num_rows + rows
    tl.store(m_ptr + slot, m_i, mask=row_ok)
    tl.store(l_ptr + slot, l_i, mask=row_ok)
    tl.store(
        acc_ptr + slot[:, None] * head_dim + offs_d[None, :],
        acc,
        mask=(row_ok & (l_i > 0))[:, None] & d_ok[None, :],
    )


@triton.jit
def _split_kv_combine_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    num_q,
    num_kv_heads,
    group,
    head_dim,
    num_parts,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Log-sum-exp merge of the ``num_parts`` partials of ``BLOCK_R`` query rows of one
    (row, KV head), normalised and written to ``out [B, T, Hq, D]`` (contiguous)."""
    num_rows = num_q * group
    blocks = tl.cdiv(num_rows, BLOCK_R)
    pid = tl.program_id(0)
    bh = pid // blocks
    rows = (pid % blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim

    slot = (bh.to(tl.int64) * num_parts + offs_s[:, None]) * num_rows + rows[None, :]
    ok = (offs_s < num_parts)[:, None] & row_ok[None, :]
    m = tl.load(m_ptr + slot, mask=ok, other=float("-inf"))  # [S, R]
    l = tl.load(l_ptr + slot, mask=ok, other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)  # rows that saw nothing
    w = tl.exp2(m - m_safe[None, :])  # 0 for an empty part
    l_sum = tl.sum(l * w, 0)
    acc = tl.load(
        acc_ptr + slot[:, :, None] * head_dim + offs_d[None, None, :],
        mask=(ok & (l > 0))[:, :, None] & d_ok[None, None, :],
        other=0.0,
    )
    acc = tl.sum(acc * w[:, :, None], 0)  # [R, D]
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]

    b = bh // num_kv_heads
    hk = bh % num_kv_heads
    t = rows // group
    head = hk * group + rows % group
    o_ptrs = (
        out_ptr
        + (
            (b.to(tl.int64) * num_q + t[:, None].to(tl.int64)) * (num_kv_heads * group)
            + head[:, None]
        )
        * head_dim
        + offs_d[None, :]
    )
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _bench_quick(kernel_call, quantiles):
    """Autotune timing: short warm-up and repetition (the default 25 + 100 ms per config
    makes the first call of every shape class slow)."""
    from triton.testing import do_bench

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
