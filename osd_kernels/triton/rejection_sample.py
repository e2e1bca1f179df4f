"""Triton kernel for ``rejection_sample`` (semantics: ``osd_kernels.rejection_sample``).

Program ``b`` owns sequence ``b`` and walks its draft positions in order, reading each
target row in vocab tiles of ``BLOCK_V``; rows after the first rejection are never read.
Per visited row it finds

- the top-k threshold: the k-th largest scaled logit, by bisection on the float's ordered
  bit pattern (32 counting passes, no sort);
- ``M = max s`` and ``Z1 = sum exp(s - M)`` over the top-k set;
- the top-p threshold: the smallest probability key ``T`` with mass(p > T) < top_p, by
  bisection over the bit patterns of [0, 1] (31 mass passes);
- ``Z2``, the mass of the kept set, so ``log p(x) = s_x - M - log Z2``.

The accept test needs only the draft token's logit. The rejected or bonus row then runs the
exponential race ``argmax r_v / -log u_v`` with the Philox noise of that row
(``osd_kernels.triton.philox``), after one pass that checks whether the residual has mass.

Floating point: every division (``l / temperature``, ``1 / Z``, the race keys) is IEEE
round-to-nearest and exp/log are CUDA's ``expf``/``logf`` (``osd_kernels.triton.fpmath``;
on a GPU Triton's ``/`` and ``tl.exp`` are approximate and ``tl.log`` flushes subnormals),
and on a GPU the launch turns off FMA contraction, so each of these operations rounds as
in the C++ and CUDA kernels. Sums (``Z``, the top-p mass) still add in another order, so
the backends agree token for token up to float rounding. Under the interpreter exp/log
are NumPy's.

Memory: the output row is filled with -1 by the whole program and then written one token
at a time by a single thread (Triton's scalar stores), so a barrier separates the two.
"""

import torch
import triton
import triton.language as tl

from osd_kernels.triton import fpmath
from osd_kernels.triton.philox import philox_uniform

INT32_MIN = tl.constexpr(-2147483648)
INT32_MAX = tl.constexpr(2147483647)
ONE_KEY = tl.constexpr(0x3F800000)  # bit pattern of 1.0f


@triton.jit
def _order_key(f):
    """Monotone int32 key of a float (-0.0 folded into +0.0)."""
    i = (f + 0.0).to(tl.int32, bitcast=True)
    return tl.where(i >= 0, i, i ^ 0x7FFFFFFF)


@triton.jit
def _from_order_key(k):
    i = tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.int32)
    return i.to(tl.float32, bitcast=True)


@triton.jit
def _scaled(row_ptr, stride_v, offs, mask, temperature):
    x = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=mask, other=float("-inf"))
    return fpmath.div(x.to(tl.float32), temperature)


@triton.jit
def _top_k_threshold(row_ptr, stride_v, vocab, temperature, top_k, BLOCK_V: tl.constexpr):
    """The k-th largest scaled logit: the largest key T with count(key >= T) >= k."""
    lo = tl.full((), INT32_MIN, tl.int64)
    hi = tl.full((), INT32_MAX, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        count = tl.zeros((), tl.int32)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            mask = offs < vocab
            s = _scaled(row_ptr, stride_v, offs, mask, temperature)
            count += tl.sum(((_order_key(s).to(tl.int64) >= mid) & mask).to(tl.int32))
        ok = count >= top_k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return _from_order_key(lo)


@triton.jit
def _top_p_key(
    row_ptr, stride_v, vocab, temperature, kth, row_max, inv_z1, top_p, BLOCK_V: tl.constexpr
):
    """Smallest key T of [0, 1] with mass(p > T) < top_p (p normalised over the top-k set)."""
    lo = tl.zeros((), tl.int32)
    hi = tl.full((), ONE_KEY, tl.int32)
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        mass = tl.zeros((), tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            mask = offs < vocab
            s = _scaled(row_ptr, stride_v, offs, mask, temperature)
            p = tl.where(mask & (s >= kth), fpmath.exp(s - row_max), 0.0) * inv_z1
            mass += tl.sum(tl.where(_order_key(p) > mid, p, 0.0))
        below = mass < top_p
        hi = tl.where(below, mid, hi)
        lo = tl.where(below, lo, mid + 1)
    return lo


@triton.jit
def _row_stats(row_ptr, stride_v, vocab, temperature, top_k, top_p, BLOCK_V: tl.constexpr):
    """(kth, M, inv_z1, top-p key, Z2) of one warped target row."""
    kth = tl.full((), float("-inf"), tl.float32)
    if top_k > 0:
        kth = _top_k_threshold(row_ptr, stride_v, vocab, temperature, top_k, BLOCK_V)
    row_max = tl.full((), float("-inf"), tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        s = _scaled(row_ptr, stride_v, offs, offs < vocab, temperature)
        row_max = tl.maximum(row_max, tl.max(s))
    z1 = tl.zeros((), tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        s = _scaled(row_ptr, stride_v, offs, mask, temperature)
        z1 += tl.sum(tl.where(mask & (s >= kth), fpmath.exp(s - row_max), 0.0))
    inv_z1 = fpmath.div(1.0, z1)
    p_key = tl.zeros((), tl.int32)
    z2 = z1
    if top_p < 1.0:
        p_key = _top_p_key(
            row_ptr, stride_v, vocab, temperature, kth, row_max, inv_z1, top_p, BLOCK_V
        )
        z2 = tl.zeros((), tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            mask = offs < vocab
            s = _scaled(row_ptr, stride_v, offs, mask, temperature)
            e = tl.where(mask & (s >= kth), fpmath.exp(s - row_max), 0.0)
            z2 += tl.sum(tl.where(_order_key(e * inv_z1) >= p_key, e, 0.0))
    return kth, row_max, inv_z1, p_key, z2


@triton.jit
def _residual(p, offs, mask, q_row, stride_qv, x_rej, HAS_Q: tl.constexpr):
    """The residual max(p - q, 0) of one vocabulary tile: q read from the draft
    probabilities, or (without them) a point mass at the rejected draft ``x_rej``."""
    if HAS_Q:
        q = tl.load(q_row + offs.to(tl.int64) * stride_qv, mask=mask, other=0.0).to(tl.float32)
        return tl.maximum(p - q, 0.0)
    return tl.where(offs == x_rej, 0.0, p)


@triton.jit
def _warped(s, mask, kth, row_max, inv_z1, p_key):
    """exp(s - M) on the kept set (top-k and top-p), 0 elsewhere."""
    e = tl.where(mask & (s >= kth), fpmath.exp(s - row_max), 0.0)
    return tl.where(_order_key(e * inv_z1) >= p_key, e, 0.0)


@triton.jit
def _rejection_sample_kernel(
    logits_ptr,
    stride_lb,
    stride_lk,
    stride_lv,
    draft_ptr,
    stride_db,
    stride_dk,
    q_ptr,
    stride_qb,
    stride_qk,
    stride_qv,
    num_draft_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    seed_ptr,
    offset_ptr,
    out_ptr,
    accepted_ptr,
    max_draft,
    vocab,
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(num_draft_ptr + b), 0), max_draft)
    temperature = tl.load(temperature_ptr + b)
    top_k = tl.load(top_k_ptr + b)
    top_k = tl.where((top_k > 0) & (top_k < vocab), top_k, 0)
    top_p = tl.minimum(tl.load(top_p_ptr + b), 1.0)
    seed = tl.load(seed_ptr + b)
    offset = tl.load(offset_ptr + b)
    row0 = logits_ptr + b * stride_lb
    drafts = draft_ptr + b * stride_db
    out_row = out_ptr + b * (max_draft + 1)
    ks = tl.arange(0, BLOCK_K)
    tl.store(out_row + ks, tl.full((BLOCK_K,), -1, tl.int64), mask=ks < max_draft + 1)
    tl.debug_barrier()  # the -1 fill lands before the single-thread token stores below

    live = True
    j = n
    if temperature > 0.0:
        rejected = False
        x_rej = tl.full((), -1, tl.int64)
        for i in range(0, n):
            if live:
                row = row0 + i * stride_lk
                kth, row_max, inv_z1, p_key, z2 = _row_stats(
                    row, stride_lv, vocab, temperature, top_k, top_p, BLOCK_V
                )
                x = tl.load(drafts + i * stride_dk)
                in_vocab = (x >= 0) & (x < vocab)
                xs = tl.where(in_vocab, x, 0)
                s_x = fpmath.div(tl.load(row + xs * stride_lv).to(tl.float32), temperature)
                e_x = _warped(s_x, in_vocab, kth, row_max, inv_z1, p_key)
                log_p = tl.where(e_x > 0.0, (s_x - row_max) - fpmath.log(z2), float("-inf"))
                q_x = 1.0
                if HAS_Q:
                    q_x = tl.load(
                        q_ptr + b * stride_qb + i * stride_qk + xs * stride_qv,
                        mask=in_vocab,
                        other=1.0,
                    ).to(tl.float32)
                u = philox_uniform(seed, offset, 2 * i, 0)
                if fpmath.log(u) + fpmath.log(q_x) < log_p:
                    tl.store(out_row + i, x)
                else:
                    live = False
                    rejected = True
                    j = i
                    x_rej = x
        row = row0 + j * stride_lk
        kth, row_max, inv_z1, p_key, z2 = _row_stats(
            row, stride_lv, vocab, temperature, top_k, top_p, BLOCK_V
        )
        inv_z2 = fpmath.div(1.0, z2)
        q_row = q_ptr + b * stride_qb + j * stride_qk
        # does the residual have mass? (else the race runs on p itself)
        use_resid = False
        if rejected:
            resid_max = tl.zeros((), tl.float32)
            for v0 in range(0, vocab, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                mask = offs < vocab
                p = (
                    _warped(
                        _scaled(row, stride_lv, offs, mask, temperature),
                        mask,
                        kth,
                        row_max,
                        inv_z1,
                        p_key,
                    )
                    * inv_z2
                )
                r = _residual(p, offs, mask, q_row, stride_qv, x_rej, HAS_Q)
                resid_max = tl.maximum(resid_max, tl.max(r))
            use_resid = resid_max > 0.0
        best_key = tl.full((), -1.0, tl.float32)
        best_v = tl.zeros((), tl.int64)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            mask = offs < vocab
            r = (
                _warped(
                    _scaled(row, stride_lv, offs, mask, temperature),
                    mask,
                    kth,
                    row_max,
                    inv_z1,
                    p_key,
                )
                * inv_z2
            )
            if use_resid:
                r = _residual(r, offs, mask, q_row, stride_qv, x_rej, HAS_Q)
            u = philox_uniform(seed, offset, 2 * j + 1, offs)
            key = tl.where(r > 0.0, fpmath.div(r, -fpmath.log(u)), -1.0)
            tile_best = tl.max(key)
            tile_v = v0 + tl.argmax(key, axis=0, tie_break_left=True)
            better = tile_best > best_key
            best_v = tl.where(better, tile_v.to(tl.int64), best_v)
            best_key = tl.where(better, tile_best, best_key)
        tl.store(out_row + j, best_v)
    else:
        for i in range(0, n + 1):
            if live:
                row = row0 + i * stride_lk
                best = tl.full((), float("-inf"), tl.float32)
                best_v = tl.zeros((), tl.int64)
                for v0 in range(0, vocab, BLOCK_V):
                    offs = v0 + tl.arange(0, BLOCK_V)
                    x = tl.load(
                        row + offs.to(tl.int64) * stride_lv, mask=offs < vocab, other=float("-inf")
                    ).to(tl.float32)
                    tile_best = tl.max(x)
                    tile_v = v0 + tl.argmax(x, axis=0, tie_break_left=True)
                    better = tile_best > best
                    best_v = tl.where(better, tile_v.to(tl.int64), best_v)
                    best = tl.where(better, tile_best, best)
                tl.store(out_row + i, best_v)
                accept = False
                if i < n:
                    accept = tl.load(drafts + i * stride_dk) == best_v
                if not accept:
                    live = False
                    j = i
    tl.store(accepted_ptr + b, j.to(tl.int32))


def rejection_sample_triton(
    target_logits: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs, params
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``rejection_sample``; arguments as ``osd_kernels.rejection_sample`` with the
    per-row parameters already materialised (``osd_kernels.rejection_sample.RowParams``)."""
    batch, k1, vocab = target_logits.shape
    out = torch.empty((batch, k1), dtype=torch.int64, device=target_logits.device)
    accepted = torch.empty((batch,), dtype=torch.int32, device=target_logits.device)
    if batch == 0:
        return out, accepted
    has_q = draft_probs is not None
    q = draft_probs if has_q else target_logits
    _rejection_sample_kernel[(batch,)](
        target_logits,
        *target_logits.stride(),
        draft_token_ids,
        *draft_token_ids.stride(),
        q,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        params.num_draft_tokens,
        params.temperature,
        params.top_k,
        params.top_p,
        params.seed,
        params.offset,
        out,
        accepted,
        k1 - 1,
        vocab,
        HAS_Q=has_q,
        BLOCK_V=min(triton.next_power_of_2(vocab), 1024),
        BLOCK_K=triton.next_power_of_2(k1),
        **fpmath.launch_options(target_logits.device),
    )
    return out, accepted
