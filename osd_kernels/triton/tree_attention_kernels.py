"""The Triton kernels of ``tree_attention`` (semantics: ``osd_kernels.tree_attention``;
launch, path choice and autotuning: ``osd_kernels.triton.tree_attention``).

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

Online softmax in base 2 with an fp32 accumulator:
``m' = max(m, max s)``, ``acc' = acc * 2^(m - m') + P V``, ``out = acc / l``.

Half inputs use the native half ``tl.dot`` on the GPU (probabilities cast to the V dtype,
fp32 accumulation). Under ``TRITON_INTERPRET=1`` every dot runs in fp32, because the
interpreter's bfloat16 ``tl.dot`` returns wrong values (Triton 3.9). The split
kernel's ``BLOCK_N``, warps and stages are autotuned on the GPU by the launcher.
"""

import triton
import triton.language as tl


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
