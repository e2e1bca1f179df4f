"""Triton kernel for ``tree_rejection_sample`` (semantics: ``osd_kernels.tree_rejection_sample``,
the walk: ``csrc/kernels/tree_rejection_sample.h``).

Program ``b`` walks sequence ``b``'s tree: one scalar pass over the nodes, and passes over
the vocabulary in ``BLOCK`` chunks where a row is needed. Two float32 workspace rows per
sequence hold the current node's warped target ``p`` and its residual ``r``. Warping
reuses the row statistics of the chain sampler's kernel (top-k and top-p thresholds by
bisection on the float's ordered bit pattern, no sort).

Floating point: divisions (``p = e / Z``, the draft scale ``s / z``, the race keys) are
IEEE round-to-nearest and exp/log are CUDA's ``expf``/``logf``
(``osd_kernels.triton.fpmath``; on a GPU Triton's ``/`` and ``tl.exp`` are approximate
and ``tl.log`` flushes subnormals). On a GPU the kernel is compiled without FMA
contraction, so the residual update ``max(r - scale * q, 0)`` rounds as in the other
backends.

Memory: the workspace rows are written and read back by different threads of the
program (a tile store, then a scalar load of ``r[x]``; the scalar store of ``r[x] = 0``
by one thread, then tile loads), so every such write is fenced by ``tl.debug_barrier()``
on both sides: after the reads of the old values by every thread, and before the reads
of the new ones. The same holds for the -1 fill of the outputs and the single-thread
stores of the walk.
"""

import torch
import triton
import triton.language as tl

from osd_kernels.triton import fpmath
from osd_kernels.triton.philox import philox_uniform
from osd_kernels.triton.rejection_sample import _row_stats, _scaled, _warped


@triton.jit
def _row_argmax(row, stride_v, V, BLOCK: tl.constexpr):
    """Index of the first maximum of a logits row."""
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.zeros((), dtype=tl.int64)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(row + offs.to(tl.int64) * stride_v, mask=offs < V, other=float("-inf")).to(
            tl.float32
        )
        m = tl.max(x, axis=0)
        i = tl.argmax(x, axis=0).to(tl.int64) + v0
        take = m > best
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    return best_i


@triton.jit
def _warp(row, stride_v, V, temperature, top_k, top_p, p_row, r_row, BLOCK: tl.constexpr):
    """Writes the warped target (``osd_kernels.warp.warp_probs``) to ``p_row`` and ``r_row``,
    with the row statistics of the chain sampler's kernel. Barriers on both sides: every
    thread has read the old rows before they are overwritten, and the new rows are
    visible to every thread on return."""
    kth, row_max, inv_z1, p_key, z2 = _row_stats(row, stride_v, V, temperature, top_k, top_p, BLOCK)
    tl.debug_barrier()
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        mask = offs < V
        e = _warped(
            _scaled(row, stride_v, offs, mask, temperature), mask, kth, row_max, inv_z1, p_key
        )
        p = fpmath.div(e, z2)
        tl.store(p_row + offs, p, mask=mask)
        tl.store(r_row + offs, p, mask=mask)
    tl.debug_barrier()


@triton.jit
def _tree_rejection_sample_kernel(
    logits_ptr,
    sl_b,
    sl_t,
    sl_v,
    tok_ptr,
    st_b,
    st_t,
    par_ptr,
    sp_b,
    sp_t,
    q_ptr,
    sq_b,
    sq_t,
    sq_v,
    temp_ptr,
    topk_ptr,
    topp_ptr,
    seed_ptr,
    offset_ptr,
    nodes_ptr,
    out_ptr,
    nacc_ptr,
    work_ptr,
    T,
    V,
    D,
    HAS_Q: tl.constexpr,
    WITHOUT_REPLACEMENT: tl.constexpr,
    BLOCK: tl.constexpr,
    T_BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    W = D + 1
    ti = tl.arange(0, T_BLOCK)
    tl.store(nodes_ptr + b * W + ti, tl.where(ti == 0, 0, -1).to(tl.int64), mask=ti < W)
    tl.store(out_ptr + b * W + ti, tl.full((T_BLOCK,), -1, tl.int64), mask=ti < W)
    tl.debug_barrier()  # the fills land before the single-thread stores of the walk
    lg = logits_ptr + b * sl_b
    temperature = tl.load(temp_ptr + b)
    zero = tl.zeros((), dtype=tl.int64)
    cur = zero
    depth = zero
    emitted = zero
    if not (temperature > 0.0):
        best = _row_argmax(lg, sl_v, V, BLOCK)
        for c in range(1, T):
            par = tl.load(par_ptr + b * sp_b + c * sp_t).to(tl.int64)
            x = tl.load(tok_ptr + b * st_b + c * st_t)
            if (par == cur) & (depth < D) & (x == best):
                tl.store(out_ptr + b * W + depth, x)
                tl.store(nodes_ptr + b * W + depth + 1, zero + c)
                depth += 1
                cur = zero + c
                best = _row_argmax(lg + cur * sl_t, sl_v, V, BLOCK)
        emitted = best
    else:
        top_k = tl.load(topk_ptr + b)
        top_k = tl.where(top_k < V, top_k, 0)
        top_p = tl.load(topp_ptr + b)
        seed = tl.load(seed_ptr + b)
        offset = tl.load(offset_ptr + b)
        p_row = work_ptr + b * 2 * V
        r_row = p_row + V
        _warp(lg, sl_v, V, temperature, top_k, top_p, p_row, r_row, BLOCK)
        s = tl.full((), 1.0, tl.float32)
        z = tl.full((), 1.0, tl.float32)
        tried = tl.zeros((), dtype=tl.float32)
        rank = zero
        u_node = philox_uniform(seed, offset, 2 * cur, zero)
        for c in range(1, T):
            par = tl.load(par_ptr + b * sp_b + c * sp_t).to(tl.int64)
            x = tl.load(tok_ptr + b * st_b + c * st_t)
            if (par == cur) & (depth < D) & (x >= 0) & (x < V):
                j = rank
                rank += 1
                rx = tl.load(r_row + x)
                ok = tl.zeros((), dtype=tl.int1)
                if HAS_Q:
                    q_row = q_ptr + b * sq_b + cur * sq_t
                    live = tl.full((), 1, tl.int1)
                    if WITHOUT_REPLACEMENT:
                        # every earlier candidate of `cur` was rejected: skip a repeat
                        pv = tl.load(par_ptr + b * sp_b + ti * sp_t, mask=ti < c, other=-1)
                        tv = tl.load(tok_ptr + b * st_b + ti * st_t, mask=ti < c, other=-1)
                        rep = (pv.to(tl.int64) == cur) & (tv == x) & (ti >= 1) & (ti < c)
                        live = tl.sum(rep.to(tl.int32), axis=0) == 0
                    if live:
                        qx = tl.load(q_row + x * sq_v).to(tl.float32)
                        scale = tl.where(z > 0.0, fpmath.div(s, tl.where(z > 0.0, z, 1.0)), 0.0)
                        u = philox_uniform(seed, offset, 2 * cur, j)
                        ok = u * (scale * qx) < rx
                        if not ok:
                            tl.debug_barrier()  # every thread has read r[x]
                            acc = tl.zeros((BLOCK,), dtype=tl.float32)
                            for v0 in range(0, V, BLOCK):
                                offs = v0 + tl.arange(0, BLOCK)
                                r = tl.load(r_row + offs, mask=offs < V, other=0.0)
                                q = tl.load(
                                    q_row + offs.to(tl.int64) * sq_v, mask=offs < V, other=0.0
                                ).to(tl.float32)
                                r = tl.maximum(r - scale * q, 0.0)
                                tl.store(r_row + offs, r, mask=offs < V)
                                acc += r
                            tl.debug_barrier()  # the new residual is visible to all threads
                            s = tl.sum(acc, axis=0)
                            if WITHOUT_REPLACEMENT:
                                z = z - qx
                else:
                    nxt = tried + rx
                    ok = u_node < nxt
                    if not ok:
                        tried = nxt
                        tl.debug_barrier()  # every thread has read r[x]
                        tl.store(r_row + x, 0.0)
                        tl.debug_barrier()  # r[x] = 0 is visible to all threads
                if ok:
                    tl.store(out_ptr + b * W + depth, x)
                    tl.store(nodes_ptr + b * W + depth + 1, zero + c)
                    depth += 1
                    cur = zero + c
                    _warp(lg + cur * sl_t, sl_v, V, temperature, top_k, top_p, p_row, r_row, BLOCK)
                    s = tl.full((), 1.0, tl.float32)
                    z = tl.full((), 1.0, tl.float32)
                    tried = tl.zeros((), dtype=tl.float32)
                    rank = zero
                    u_node = philox_uniform(seed, offset, 2 * cur, zero)
        # the emitted token: exponential race over r, or over p if r has no mass
        w_row = r_row
        if HAS_Q:
            if s <= 1e-5:  # RESIDUAL_EPS
                w_row = p_row
        else:
            rmax = tl.zeros((), dtype=tl.float32)
            for v0 in range(0, V, BLOCK):
                offs = v0 + tl.arange(0, BLOCK)
                r = tl.load(r_row + offs, mask=offs < V, other=0.0)
                rmax = tl.maximum(rmax, tl.max(r, axis=0))
            if not (rmax > 0.0):
                w_row = p_row
        best_key = tl.full((), -2.0, tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            w = tl.load(w_row + offs, mask=offs < V, other=0.0)
            u = philox_uniform(seed, offset, 2 * cur + 1, offs)
            key = tl.where(w > 0.0, fpmath.div(w, -fpmath.log(u)), -1.0)
            m = tl.max(key, axis=0)
            i = tl.argmax(key, axis=0).to(tl.int64) + v0
            take = m > best_key
            emitted = tl.where(take, i, emitted)
            best_key = tl.where(take, m, best_key)
    tl.store(out_ptr + b * W + depth, emitted)
    tl.store(nacc_ptr + b, depth.to(tl.int32))


def tree_rejection_sample_triton(
    target_logits,
    node_token_ids,
    parents,
    draft_probs,
    temperature,
    top_k,
    top_p,
    seed,
    offset,
    max_depth: int,
    without_replacement: bool,
):
    """Triton ``tree_rejection_sample``; arguments as ``torch.ops.osd.tree_rejection_sample``
    (already checked by the public wrapper)."""
    B, T, V = target_logits.shape
    dev = target_logits.device
    W = max_depth + 1
    nodes = torch.empty(B, W, dtype=torch.int64, device=dev)
    out = torch.empty(B, W, dtype=torch.int64, device=dev)
    num_accepted = torch.empty(B, dtype=torch.int32, device=dev)
    if B == 0:
        return nodes, out, num_accepted
    work = torch.empty(B, 2, V, dtype=torch.float32, device=dev)
    q = draft_probs if draft_probs is not None else target_logits  # unused when HAS_Q=False
    _tree_rejection_sample_kernel[(B,)](
        target_logits,
        *target_logits.stride(),
        node_token_ids,
        *node_token_ids.stride(),
        parents,
        *parents.stride(),
        q,
        *q.stride(),
        temperature,
        top_k,
        top_p,
        seed,
        offset,
        nodes,
        out,
        num_accepted,
        work,
        T,
        V,
        max_depth,
        HAS_Q=draft_probs is not None,
        WITHOUT_REPLACEMENT=without_replacement,
        BLOCK=min(triton.next_power_of_2(V), 1024),
        T_BLOCK=triton.next_power_of_2(T),
        **fpmath.launch_options(dev),
    )
    return nodes, out, num_accepted
