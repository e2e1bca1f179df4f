"""Triton kernel for ``tree_attention`` (semantics: ``osd_kernels.tree_attention``).

Flash-attention style. Program ``(b * Hkv + hk, m)`` owns block ``m`` of the
``T * G`` query rows that share KV head ``hk`` of row ``b`` (``G = Hq / Hkv``; row ``r`` is
query ``r // G`` of head ``hk * G + r % G``), so each K/V tile is loaded once for the whole
group. It streams the prefix ``[0, lens[b])`` in ``BLOCK_N`` tiles with no mask (only the
last tile's bound check), then the new keys ``lens[b] + [0, T)`` in ``BLOCK_T`` tiles:

- with a tree mask (``T <= 64``, one tile) the per-query int64 bitmask decides visibility;
- causal (any ``T``) key ``lens[b] + j`` is visible to query ``t`` iff ``j <= t``, and the
  tiles stop after the block's last query, so a block reads no key past its own
  diagonal and nothing of size ``T x S`` is ever built (the long-prefill path on CUDA).
  For ``T <= 64`` the one tile is the same as the chain mask's, so both agree bit for bit.

Online softmax in base 2 with an fp32 accumulator:
``m' = max(m, max s)``, ``acc' = acc * 2^(m - m') + P V``, ``out = acc / l``. A query that
sees no key keeps ``l = 0`` and writes zeros.

Half inputs use the native half ``tl.dot`` on the GPU (probabilities cast to the V dtype,
fp32 accumulation). Under ``TRITON_INTERPRET=1`` every dot runs in fp32, because the
interpreter's bfloat16 ``tl.dot`` returns wrong values (Triton 3.9).
"""
import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
MAX_TREE = 64   # a tree mask is one int64 per query; also the causal tile of new keys


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    """fp32 products for fp32 inputs (or upcast half inputs), else the native half dot."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lens_ptr, mask_ptr,
                           num_q, num_kv_heads, group, head_dim, qk_scale,
                           sq_b, sq_t, sq_h, sq_d, sk_b, sk_h, sk_s, sk_d,
                           sv_b, sv_h, sv_s, sv_d, sm_b, sm_t,
                           HAS_MASK: tl.constexpr, FP32_DOT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
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

    q_ptrs = (q_ptr + b64 * sq_b + t[:, None].to(tl.int64) * sq_t
              + head[:, None].to(tl.int64) * sq_h + offs_d[None, :] * sq_d)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = k_ptr + b64 * sk_b + hk.to(tl.int64) * sk_h
    v_base = v_ptr + b64 * sv_b + hk.to(tl.int64) * sv_h
    length = tl.load(lens_ptr + b)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Prefix: every key visible, only the tile bound is checked.
    for start in range(0, length, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < length
        k = tl.load(k_base + offs_n[None, :].to(tl.int64) * sk_s + offs_d[:, None] * sk_d,
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        s = _dot(q, k, FP32_DOT)
        s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None].to(tl.int64) * sv_s + offs_d[None, :] * sv_d,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p, v, FP32_DOT)
        m_i = m_new

    # New keys length + [0, T): one tile under a tree mask, causal tiles up to the block's
    # last query otherwise.
    if HAS_MASK:
        bits = tl.load(mask_ptr + b64 * sm_b + t.to(tl.int64) * sm_t, mask=row_ok, other=0)
        t_end = num_q
    else:
        t_end = tl.minimum((tl.program_id(1) * BLOCK_M + BLOCK_M - 1) // group + 1, num_q)
    for first in range(0, t_end, BLOCK_T):
        offs_t = first + tl.arange(0, BLOCK_T)
        t_ok = offs_t < num_q
        keys = length + offs_t
        k = tl.load(k_base + keys[None, :].to(tl.int64) * sk_s + offs_d[:, None] * sk_d,
                    mask=t_ok[None, :] & d_ok[:, None], other=0.0)
        if HAS_MASK:
            visible = ((bits[:, None] >> offs_t[None, :].to(tl.int64)) & 1) != 0
        else:
            visible = offs_t[None, :] <= t[:, None]
        visible = visible & t_ok[None, :]
        s = _dot(q, k, FP32_DOT)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows that saw nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + keys[:, None].to(tl.int64) * sv_s + offs_d[None, :] * sv_d,
                    mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p, v, FP32_DOT)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = (out_ptr + ((b64 * num_q + t[:, None].to(tl.int64)) * (num_kv_heads * group)
                         + head[:, None]) * head_dim + offs_d[None, :])
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def tree_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cache_lens: torch.Tensor, tree_mask: torch.Tensor | None,
                          scale: float) -> torch.Tensor:
    """Triton ``tree_attention``; arguments as ``osd_kernels.tree_attention`` (already checked).

    Reads ``cache_lens`` on the device: no host sync, any ``max_kv_len`` is unnecessary.
    Returns a contiguous ``[B, T, Hq, D]`` tensor.
    """
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    out = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    on_gpu = q.is_cuda
    block_m = max(16, min(64 if on_gpu else 32, triton.next_power_of_2(T * group)))
    block_n = 64 if on_gpu else 32
    # Causal: the kernel never reads the mask (HAS_MASK is False) but needs a valid pointer.
    mask = tree_mask if tree_mask is not None else cache_lens
    grid = (B * Hkv, triton.cdiv(T * group, block_m))
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, out, cache_lens, mask,
        T, Hkv, group, D, scale * _LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        tree_mask.stride(0) if tree_mask is not None else 0,
        tree_mask.stride(1) if tree_mask is not None else 0,
        HAS_MASK=tree_mask is not None, FP32_DOT=q.dtype == torch.float32 or not on_gpu,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_T=max(16, min(MAX_TREE, triton.next_power_of_2(T))),
        BLOCK_D=max(16, triton.next_power_of_2(D)))
    return out
