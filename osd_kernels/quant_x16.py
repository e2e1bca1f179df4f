"""GGUF blocks regrouped 16 weight rows at a time, multiplied with int8 activations: the
format behind ``quant_linear``'s ``ggml_type`` 1002 (Q4_0), 1003 (Q4_1) and 1008 (Q8_0).

The float32 path multiplies every weight into every row of ``x`` with an FMA; a verify
forward of a few rows is then bound by FMAs. With these types each row of ``x`` is
quantized to int8 per block of 32, as llama.cpp's Q8_1 does, and a block of 16 weight rows
is multiplied with VNNI's 4-byte dot products (64 multiply-adds an instruction; the C++
kernel ``csrc/cpu/quant_linear_x16.cpp``), so further rows cost a fraction of the first.

The result is not the float32 product: per row of ``x`` and block ``b`` of 32,

    dx = max|x_b| / 127,  qx = round_half_even(x_b * (1 / dx)),  sx = dx * sum(qx)
    y = sum over b of [ float(u_b . qx) * (d_b * dx) + m_b * sx ]   (+ bias)

with the weights of block ``b`` of a row written ``d_b * u + m_b`` (``u`` unsigned codes:
Q4_1's as stored, Q4_0's with ``m = -8 d``, Q8_0's plus 128 with ``m = -128 d``), the sum
taken in ascending ``b``, each term as ``acc = fma(float(isum), d * dx, acc); acc =
fma(m, sx, acc)``. :func:`quant_linear_x16_reference` computes exactly that (float64
with a rounding to float32 after each step). The error against the float32 product is the
rounding of ``x`` to 8 bits per block, about ``|x_b|_max / 254`` a weight, as in
llama.cpp's CPU kernels. A row's result never depends on the other rows, so speculative
decoding stays exact against plain decoding on the same weights.

Layout of ``[N, K / 32 * B]`` uint8 (``B`` the GGUF block's bytes, ``N`` a multiple of
16): group ``g`` (rows ``16 g .. 16 g + 15``) holds its blocks in order, each the 16 rows'
block ``b``: code chunks of 64 bytes, chunk ``j`` with row ``r``'s codes ``4 j .. 4 j + 3``
at bytes ``4 r .. 4 r + 3`` (Q4_0 / Q4_1: the file's nibble bytes, 4 chunks; Q8_0: ``u``,
8 chunks), then the 16 ``d`` as float16, then (Q4_1) the 16 ``m``.
"""

from __future__ import annotations

import torch

X16_OFFSET = 1000
GROUP = 16  # weight rows a group
# ggml_type of the regrouped blocks -> the GGUF type they came from
X16_TYPES = {X16_OFFSET + 2: 2, X16_OFFSET + 3: 3, X16_OFFSET + 8: 8}
_BYTES = {2: 18, 3: 20, 8: 34}  # a GGUF block's bytes


def x16_supported(ggml_type: int, out_features: int) -> bool:
    """True when a layer of GGUF ``ggml_type`` blocks with ``out_features`` rows can be
    regrouped (Q4_0, Q4_1, Q8_0; rows a multiple of 16)."""
    return int(ggml_type) in _BYTES and out_features % GROUP == 0


def _split(blocks: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GGUF blocks ``[..., B]`` -> (codes bytes, d bytes, m bytes or None)."""
    if t == 3:
        return blocks[..., 4:], blocks[..., 0:2], blocks[..., 2:4]
    return blocks[..., 2:], blocks[..., 0:2], None


def repack_x16(blocks: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, int]:
    """GGUF blocks ``[N, K / 32 * B]`` of Q4_0, Q4_1 or Q8_0 as stored -> the same bytes
    regrouped (module docstring) and their ``ggml_type`` (``X16_OFFSET + ggml_type``)."""
    t = int(ggml_type)
    N, row = blocks.shape
    if not x16_supported(t, N) or row % _BYTES[t]:
        raise ValueError(
            f"repack_x16 takes Q4_0 / Q4_1 / Q8_0 blocks (ggml_type 2, 3, 8) of a multiple of "
            f"16 rows, got ggml_type {t}, shape {tuple(blocks.shape)}"
        )
    nb, G = row // _BYTES[t], N // GROUP
    b = blocks.reshape(G, GROUP, nb, _BYTES[t])
    codes, d, m = _split(b, t)
    if t == 8:
        codes = codes ^ 0x80  # int8 code + 128: the unsigned operand of the dot products
    chunks = codes.reshape(G, GROUP, nb, -1, 4).permute(0, 2, 3, 1, 4).reshape(G, nb, -1)
    parts = [chunks, d.permute(0, 2, 1, 3).reshape(G, nb, 2 * GROUP)]
    if m is not None:
        parts.append(m.permute(0, 2, 1, 3).reshape(G, nb, 2 * GROUP))
    return torch.cat(parts, dim=-1).reshape(N, row).contiguous(), X16_OFFSET + t


def unpack_x16(packed: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, int]:
    """The inverse of :func:`repack_x16`: GGUF blocks as stored and their ``ggml_type``."""
    t = X16_TYPES[int(ggml_type)]
    N, row = packed.shape
    nb, G = row // _BYTES[t], N // GROUP
    p = packed.reshape(G, nb, GROUP * _BYTES[t])
    code_bytes = GROUP * (32 if t == 8 else 16)
    codes = p[..., :code_bytes].reshape(G, nb, -1, GROUP, 4).permute(0, 3, 1, 2, 4)
    codes = codes.reshape(G, GROUP, nb, -1)
    if t == 8:
        codes = codes ^ 0x80
    d = p[..., code_bytes : code_bytes + 32].reshape(G, nb, GROUP, 2).permute(0, 2, 1, 3)
    parts = [d]
    if t == 3:
        m = p[..., code_bytes + 32 :].reshape(G, nb, GROUP, 2).permute(0, 2, 1, 3)
        parts.append(m)
    parts.append(codes)
    return torch.cat(parts, dim=-1).reshape(N, row).contiguous(), t


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``[M, K]`` float32 -> (``qx`` float32 integers ``[M, K / 32, 32]``, ``dx``
    ``[M, K / 32]``, ``sx`` ``[M, K / 32]``), as the kernel computes them."""
    M, K = x.shape
    xb = x.float().reshape(M, K // 32, 32)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1))
    return q, d, d * q.sum(-1)


def _f16_bytes(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def quant_linear_x16_reference(
    x: torch.Tensor, packed: torch.Tensor, ggml_type: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``quant_linear`` on regrouped blocks, in PyTorch: the kernel's arithmetic, block by
    block in float64 with a rounding to float32 after each step. ``x`` ``[M, K]``."""
    blocks, t = unpack_x16(packed, ggml_type)
    N = blocks.shape[0]
    nb = blocks.shape[1] // _BYTES[t]
    b = blocks.reshape(N, nb, _BYTES[t])
    codes, d_bytes, m_bytes = _split(b, t)
    d = _f16_bytes(d_bytes)  # [N, nb]
    if t == 8:
        u = (codes.contiguous().view(torch.int8).to(torch.int32) + 128).float()
        m = d * -128.0
    else:
        u = torch.cat([codes & 0xF, codes >> 4], dim=-1).float()
        m = _f16_bytes(m_bytes) if t == 3 else d * -8.0
    q, dx, sx = quantize_activations(x)
    isum = torch.einsum("mbk,nbk->mnb", q.double(), u.double())  # exact integers
    acc = torch.zeros(x.shape[0], N, dtype=torch.float64)
    for j in range(nb):
        scale = (d[None, :, j] * dx[:, None, j]).double()  # a float32 product
        acc = (isum[:, :, j] * scale + acc).float().double()
        acc = (m[None, :, j].double() * sx[:, None, j].double() + acc).float().double()
    y = acc.float()
    return y + bias if bias is not None else y
