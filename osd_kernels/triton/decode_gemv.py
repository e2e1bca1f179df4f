"""Triton kernel for ``decode_gemv`` (semantics: ``osd_kernels.decode_gemv``).

Program (j, i) computes output columns ``[j * BLOCK_N, (j + 1) * BLOCK_N)`` for rows
``[i * BLOCK_M, (i + 1) * BLOCK_M)`` (``BLOCK_M <= 8``: a decode or verify step's few
rows, so the weight is read once per row block). It walks ``K`` in tiles of ``BLOCK_K``
with no split-K: each weight tile ``[BLOCK_N, BLOCK_K]`` (4-8 rows of the weight; a wide
``BLOCK_K`` when there are few rows, so each thread has several 16-byte loads of the tile
in flight) meets every row's ``x`` tile; the products accumulate elementwise in
``[BLOCK_M, BLOCK_N, BLOCK_K]`` float32 registers and are reduced once after the loop.

- Norm prologue (``HAS_NORM``): a first pass over each row of ``x`` sums its squares; each
  ``x`` tile is then normalised and rounded to the dtype before use, as ``F.rms_norm``'s
  output is rounded.
- SiLU epilogue (``GATED``): the weight is ``[gate; up]``, ``[2 N, K]``; the program also
  reads the matching up rows, ``N`` rows further, and stores ``silu(gate) * up``, each
  rounded where the reference rounds (the projection, SiLU, the product).
- Residual epilogue (``HAS_RES``): stores ``residual + scale * y`` (``y`` and ``scale * y``
  rounded first, as the reference's ``residual + y * scale``).
"""

import torch
import triton
import triton.language as tl

MAX_ROWS = 8  # BLOCK_M: rows that share one read of the weight
BLOCK_N = 8  # weight rows (output columns) per program
TILE = 8192  # BLOCK_M * BLOCK_N * BLOCK_K elements of the accumulator (4 warps: 64 a thread)


@triton.jit
def _decode_gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    nw_ptr,
    res_ptr,
    out_ptr,
    M,
    N,
    K,
    eps,
    scale,
    sx_m,
    sw_n,
    sr_m,
    HAS_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    GATED: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    m_mask = rm < M
    # 3-D index vectors: the tiles are loaded straight into the accumulator's layout
    # (x as [BLOCK_M, 1, BLOCK_K], the weight as [1, BLOCK_N, BLOCK_K]), so the product
    # needs no layout conversion through shared memory
    m3 = rm[:, None, None]
    n3 = rn[None, :, None]
    k3 = rk[None, None, :]
    x_rows = x_ptr + m3.to(tl.int64) * sx_m  # [BLOCK_M, 1, 1]
    w_rows = w_ptr + n3.to(tl.int64) * sw_n  # [1, BLOCK_N, 1]
    if HAS_NORM:
        squares = tl.zeros([BLOCK_M, 1, 1], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k3
            xk = tl.load(x_rows + kk, mask=(m3 < M) & (kk < K), other=0.0).to(tl.float32)
            squares += tl.sum(xk * xk, axis=2, keep_dims=True)
        rstd = 1.0 / tl.sqrt(squares / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k3
        k_mask = kk < K
        xk = tl.load(x_rows + kk, mask=(m3 < M) & k_mask, other=0.0)
        if HAS_NORM:
            nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            xk = (xk.to(tl.float32) * rstd * nw).to(dtype)
        xf = xk.to(tl.float32)
        w_mask = (n3 < N) & k_mask
        acc += xf * tl.load(w_rows + kk, mask=w_mask, other=0.0).to(tl.float32)
        if GATED:
            acc_up += xf * tl.load(w_rows + N * sw_n + kk, mask=w_mask, other=0.0).to(tl.float32)
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y.to(dtype).to(tl.float32)
    if GATED:
        u = tl.sum(acc_up, axis=2)
        if HAS_BIAS:
            u += tl.load(b_ptr + N + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        u = u.to(dtype).to(tl.float32)
        y = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32) * u
    out_mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        if HAS_SCALE:
            y = (y * scale).to(dtype).to(tl.float32)
        r = tl.load(
            res_ptr + rm[:, None].to(tl.int64) * sr_m + rn[None, :], mask=out_mask, other=0.0
        )
        y = r.to(tl.float32) + y
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], y.to(dtype), mask=out_mask)


def blocks_for(rows: int, K: int, gated: bool) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` for ``rows`` rows: the accumulators hold ``TILE``
    elements (half each when gated), ``BLOCK_K`` in [32, 1024] and at most ``K`` rounded up."""
    block_m = min(MAX_ROWS, triton.next_power_of_2(max(rows, 1)))
    block_k = TILE // (block_m * BLOCK_N * (2 if gated else 1))
    block_k = max(32, min(1024, block_k, triton.next_power_of_2(K)))
    return block_m, BLOCK_N, block_k


def decode_gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias,
    norm_weight,
    eps: float,
    residual,
    scale: float,
    gated: bool,
) -> torch.Tensor:
    """Triton ``decode_gemv``; arguments as ``osd_kernels.decode_gemv`` (already checked)."""
    K = x.shape[-1]
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    M = rows.shape[0]
    out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    res = None
    if residual is not None:
        res = residual.reshape(-1, N)
        if res.stride(-1) != 1:
            res = res.contiguous()
    block_m, block_n, block_k = blocks_for(M, K, gated)
    _decode_gemv_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, block_m))](
        rows,
        w,
        rows if bias is None else bias,
        rows if norm_weight is None else norm_weight,
        rows if res is None else res,
        out,
        M,
        N,
        K,
        float(eps),
        float(scale),
        rows.stride(0),
        w.stride(0),
        0 if res is None else res.stride(0),
        HAS_BIAS=bias is not None,
        HAS_NORM=norm_weight is not None,
        GATED=gated,
        HAS_RES=res is not None,
        HAS_SCALE=res is not None and scale != 1.0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out
