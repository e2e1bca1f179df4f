"""Triton kernel for ``distill_loss_fwd_bwd`` (semantics: ``osd_kernels.distill_loss``).

One program per row streams the vocabulary in ``BLOCK_V`` tiles and keeps nothing but
scalars between passes, so no ``[N, V]`` temporary exists besides the gradient it writes:

1. log-sum-exp of the draft logits (and of the target logits, or, for top-k targets, of the
   draft logits outside the kept ids), lane-wise online and reduced at the end;
2. full targets: the row loss and ``H = sum_B h_B`` (top-k targets do this on the k + 1
   buckets without touching the vocabulary);
3. the gradient ``h_B q_v / Q_B - q_v H`` (formulas in ``csrc/cpu/distill_loss.cpp``).

Kept ids are matched inside a tile by a ``[BLOCK_V, BLOCK_K]`` comparison. Masked rows
write loss 0 and a zero gradient. A program reads back nothing it wrote, so it needs no
barrier. Floating point: Triton's approximate ``/`` and ``tl.exp`` on a GPU are fine here
(a loss and its gradient, compared with tolerances, decide no token).
"""

import math

import torch
import triton
import triton.language as tl

from osd_kernels.distill_loss import LOSSES, RKL_LOG_P_FLOOR, TOPK_LEFTOVER_EPS


@triton.jit
def _bucket_terms(lp, lq, beta, log_beta, log_1mb, LOSS: tl.constexpr, RKL_FLOOR: tl.constexpr):
    """Loss terms l and h = Q dL/dQ, elementwise, from target/draft log probabilities."""
    p = tl.where(lp == float("-inf"), 0.0, tl.exp(lp))
    q = tl.where(lq == float("-inf"), 0.0, tl.exp(lq))
    if LOSS == 0:  # fkl
        l = tl.where(p > 0, p * (lp - lq), 0.0)
        h = -p
    elif LOSS == 1:  # rkl
        d = tl.where(q > 0, lq - tl.maximum(lp, RKL_FLOOR), 0.0)
        l = q * d
        h = q * (d + 1.0)
    elif LOSS == 2:  # jsd
        a = lp + log_beta
        b = lq + log_1mb
        hi = tl.maximum(a, b)
        lm = tl.where(hi == float("-inf"), float("-inf"), hi + tl.log(1.0 + tl.exp(-tl.abs(a - b))))
        kq = tl.where(q > 0, q * (lq - lm), 0.0)
        l = beta * tl.where(p > 0, p * (lp - lm), 0.0) + (1.0 - beta) * kq
        h = (1.0 - beta) * kq
    else:  # tvd
        l = 0.5 * tl.abs(p - q)
        h = tl.where(q > p, 0.5 * q, tl.where(q < p, -0.5 * q, 0.0))
    return l, h


@triton.jit
def _online_lse(m, s, x):
    """Lane-wise online log-sum-exp update of (max m, scaled sum s) with values x."""
    m_new = tl.maximum(m, x)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, s * tl.exp(m - m_safe) + tl.exp(x - m_safe)


@triton.jit
def _finish_lse(m, s):
    mx = tl.max(m, 0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.sum(s * tl.exp(m - mx_safe), 0)
    return tl.where(total > 0, mx_safe + tl.log(total), float("-inf"))


@triton.jit
def _distill_full_kernel(
    z_ptr,
    t_ptr,
    mask_ptr,
    loss_ptr,
    grad_ptr,
    vocab,
    sz_n,
    sz_v,
    st_n,
    st_v,
    beta,
    log_beta,
    log_1mb,
    LOSS: tl.constexpr,
    RKL_FLOOR: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * sz_n
    t_row = t_ptr + row * st_n
    g_row = grad_ptr + row * vocab
    valid = True
    if HAS_MASK:
        valid = tl.load(mask_ptr + row) != 0
    if valid:
        mz = tl.full([BLOCK_V], float("-inf"), tl.float32)
        sz = tl.zeros([BLOCK_V], tl.float32)
        mt = tl.full([BLOCK_V], float("-inf"), tl.float32)
        stt = tl.zeros([BLOCK_V], tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            ok = offs < vocab
            z = tl.load(z_row + offs * sz_v, mask=ok, other=float("-inf")).to(tl.float32)
            t = tl.load(t_row + offs * st_v, mask=ok, other=float("-inf")).to(tl.float32)
            mz, sz = _online_lse(mz, sz, z)
            mt, stt = _online_lse(mt, stt, t)
        lse_z = _finish_lse(mz, sz)
        lse_t = _finish_lse(mt, stt)
        loss = tl.zeros([BLOCK_V], tl.float32)
        hsum = tl.zeros([BLOCK_V], tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            ok = offs < vocab
            z = tl.load(z_row + offs * sz_v, mask=ok, other=float("-inf")).to(tl.float32)
            t = tl.load(t_row + offs * st_v, mask=ok, other=float("-inf")).to(tl.float32)
            l, h = _bucket_terms(t - lse_t, z - lse_z, beta, log_beta, log_1mb, LOSS, RKL_FLOOR)
            loss += tl.where(ok, l, 0.0)
            hsum += tl.where(ok, h, 0.0)
        H = tl.sum(hsum, 0)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            ok = offs < vocab
            z = tl.load(z_row + offs * sz_v, mask=ok, other=float("-inf")).to(tl.float32)
            t = tl.load(t_row + offs * st_v, mask=ok, other=float("-inf")).to(tl.float32)
            l, h = _bucket_terms(t - lse_t, z - lse_z, beta, log_beta, log_1mb, LOSS, RKL_FLOOR)
            g = h - tl.exp(z - lse_z) * H
            tl.store(g_row + offs, g.to(grad_ptr.dtype.element_ty), mask=ok)
        tl.store(loss_ptr + row, tl.sum(loss, 0))
    else:
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            tl.store(
                g_row + offs, tl.zeros([BLOCK_V], grad_ptr.dtype.element_ty), mask=offs < vocab
            )
        tl.store(loss_ptr + row, 0.0)


@triton.jit
def _distill_topk_kernel(
    z_ptr,
    ids_ptr,
    probs_ptr,
    mask_ptr,
    loss_ptr,
    grad_ptr,
    vocab,
    topk,
    sz_n,
    sz_v,
    si_n,
    si_k,
    sp_n,
    sp_k,
    beta,
    log_beta,
    log_1mb,
    LOSS: tl.constexpr,
    RKL_FLOOR: tl.constexpr,
    HAS_MASK: tl.constexpr,
    LEFTOVER_EPS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * sz_n
    g_row = grad_ptr + row * vocab
    valid = True
    if HAS_MASK:
        valid = tl.load(mask_ptr + row) != 0
    if valid:
        offs_k = tl.arange(0, BLOCK_K)
        k_ok = offs_k < topk
        ids = tl.load(ids_ptr + row * si_n + offs_k * si_k, mask=k_ok, other=-1)
        ids = tl.where((ids >= 0) & (ids < vocab), ids, -1)  # never index outside the row
        probs = tl.load(probs_ptr + row * sp_n + offs_k * sp_k, mask=k_ok, other=0.0)
        probs = probs.to(tl.float32)
        m_all = tl.full([BLOCK_V], float("-inf"), tl.float32)
        s_all = tl.zeros([BLOCK_V], tl.float32)
        m_oth = tl.full([BLOCK_V], float("-inf"), tl.float32)
        s_oth = tl.zeros([BLOCK_V], tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(z_row + offs * sz_v, mask=offs < vocab, other=float("-inf"))
            z = z.to(tl.float32)
            kept = tl.sum((offs[:, None] == ids[None, :]).to(tl.int32), 1) > 0
            m_all, s_all = _online_lse(m_all, s_all, z)
            m_oth, s_oth = _online_lse(m_oth, s_oth, tl.where(kept, float("-inf"), z))
        lse = _finish_lse(m_all, s_all)
        lse_oth = _finish_lse(m_oth, s_oth)
        # The k + 1 buckets; padded lanes have p = q = 0 and contribute nothing.
        z_top = tl.load(z_row + tl.where(ids >= 0, ids, 0) * sz_v, mask=ids >= 0, other=0.0)
        lq_top = tl.where(ids >= 0, z_top.to(tl.float32) - lse, float("-inf"))
        lp_top = tl.where(probs > 0, tl.log(tl.where(probs > 0, probs, 1.0)), float("-inf"))
        l_top, h_top = _bucket_terms(lp_top, lq_top, beta, log_beta, log_1mb, LOSS, RKL_FLOOR)
        p_oth = 1.0 - tl.sum(probs, 0)
        p_oth = tl.where(p_oth < LEFTOVER_EPS, 0.0, p_oth)
        lp_oth = tl.where(p_oth > 0, tl.log(tl.where(p_oth > 0, p_oth, 1.0)), float("-inf"))
        l_oth, h_oth = _bucket_terms(
            lp_oth, lse_oth - lse, beta, log_beta, log_1mb, LOSS, RKL_FLOOR
        )
        H = tl.sum(h_top, 0) + h_oth
        lse_oth_safe = tl.where(lse_oth == float("-inf"), 0.0, lse_oth)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            ok = offs < vocab
            z = tl.load(z_row + offs * sz_v, mask=ok, other=float("-inf")).to(tl.float32)
            hit = offs[:, None] == ids[None, :]
            kept = tl.sum(hit.to(tl.int32), 1) > 0
            h_kept = tl.sum(tl.where(hit, h_top[None, :], 0.0), 1)
            # outside the kept ids z <= lse_oth; if lse_oth = -inf every such z is -inf
            r = tl.where(kept, 0.0, tl.exp(z - lse_oth_safe))
            g = tl.where(kept, h_kept, r * h_oth) - tl.exp(z - lse) * H
            tl.store(g_row + offs, g.to(grad_ptr.dtype.element_ty), mask=ok)
        tl.store(loss_ptr + row, tl.sum(l_top, 0) + l_oth)
    else:
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            tl.store(
                g_row + offs, tl.zeros([BLOCK_V], grad_ptr.dtype.element_ty), mask=offs < vocab
            )
        tl.store(loss_ptr + row, 0.0)


def distill_loss_fwd_bwd_triton(
    draft_logits, target_logits, topk_ids, topk_probs, mask, loss: str, beta: float
):
    """Per-row losses ``[N]`` fp32 and gradients ``[N, V]`` (draft dtype); arguments as
    ``torch.ops.osd.distill_loss_fwd_bwd`` (already checked by ``distill_loss``).

    Top-k ids must be in range and distinct (out-of-range ids are ignored, not read).
    """
    N, V = draft_logits.shape
    loss_rows = torch.empty(N, dtype=torch.float32, device=draft_logits.device)
    grad = torch.empty((N, V), dtype=draft_logits.dtype, device=draft_logits.device)
    if N == 0:
        return loss_rows, grad
    if loss == "jsd" and beta in (0.0, 1.0):  # m = q or m = p: identically zero
        return loss_rows.zero_(), grad.zero_()
    code = LOSSES.index(loss)
    log_beta = math.log(beta) if beta > 0 else 0.0
    log_1mb = math.log1p(-beta) if beta < 1 else 0.0
    on_gpu = draft_logits.is_cuda
    mask_arg = mask if mask is not None else loss_rows  # unused pointer when HAS_MASK is False
    common = dict(LOSS=code, RKL_FLOOR=RKL_LOG_P_FLOOR, HAS_MASK=mask is not None)
    if target_logits is not None:
        block_v = min(4096 if on_gpu else 1024, triton.next_power_of_2(V))
        _distill_full_kernel[(N,)](
            draft_logits,
            target_logits,
            mask_arg,
            loss_rows,
            grad,
            V,
            *draft_logits.stride(),
            *target_logits.stride(),
            beta,
            log_beta,
            log_1mb,
            BLOCK_V=block_v,
            num_warps=8 if on_gpu else 1,
            **common,
        )
    else:
        K = topk_ids.shape[1]
        block_k = triton.next_power_of_2(K)
        block_v = min(max(64, (8192 if on_gpu else 32768) // block_k), triton.next_power_of_2(V))
        _distill_topk_kernel[(N,)](
            draft_logits,
            topk_ids,
            topk_probs,
            mask_arg,
            loss_rows,
            grad,
            V,
            K,
            *draft_logits.stride(),
            *topk_ids.stride(),
            *topk_probs.stride(),
            beta,
            log_beta,
            log_1mb,
            LEFTOVER_EPS=TOPK_LEFTOVER_EPS,
            BLOCK_V=block_v,
            BLOCK_K=block_k,
            num_warps=8 if on_gpu else 1,
            **common,
        )
    return loss_rows, grad
