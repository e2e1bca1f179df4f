"""GGUF blocks regrouped 16 weight rows at a time, multiplied with int8 activations: the
format behind ``quant_linear``'s ``ggml_type`` 1002 (Q4_0), 1003 (Q4_1), 1006 (Q5_0),
1008 (Q8_0), 1012 (Q4_K) and 1014 (Q6_K), and 1132 / 1116 for codes with float32 factors
per group of 32 / 16 weights (what osd holds the other types as, and a fused projection
whose parts mix types, :func:`repack_codes`).

The float32 path multiplies every weight into every row of ``x`` with an FMA; a verify
forward of a few rows is then bound by FMAs. With these types each row of ``x`` is
quantized to int8 per block of 32, as llama.cpp's Q8_1 / Q8_K do, and a block of 16
weight rows is multiplied with VNNI's 4-byte dot products (64 multiply-adds an
instruction; the C++ kernel ``csrc/cpu/quant_linear_x16.cpp``), so further rows cost a
fraction of the first.

The result is not the float32 product. Every format's weights are written ``d_s * u +
m_s`` per sub-block ``s`` of 32 weights (16 for Q6_K), ``u`` unsigned integer codes and
``d_s``, ``m_s`` float32 factors that ggml's own dequantization computes exactly:

==========  =================  ==========================  ===========================
type        ``u``              ``d_s``                     ``m_s``
==========  =================  ==========================  ===========================
Q4_0        the 4-bit code     ``d``                       ``-8 d``
Q4_1        the 4-bit code     ``d``                       ``m``
Q5_0        the 5-bit code     ``d``                       ``-16 d``
Q8_0        code + 128         ``d``                       ``-128 d``
Q4_K        the 4-bit code     ``d * scale_s``             ``-(dmin * min_s)``
Q6_K        the 6-bit code     ``d * scale_s`` (int8)      ``-32 d_s``
codes       the signed code    the group's scale           the group's min (or 0)
==========  =================  ==========================  ===========================

(Codes with factors are stored as ``code + 128``, and the kernel takes ``128 *
sum_s(qx)`` off each dot product, so the sum is the signed codes' exactly.)

Per row of ``x`` and block ``b`` of 32 activations,

    dx = max|x_b| / 127,  qx = round_half_even(x_b * (1 / dx)),  sx_s = dx * sum_s(qx)
    y = sum over b, then s, of [ float(u_s . qx_s) * (d_s * dx) + m_s * sx_s ]  (+ bias)

in ascending order, each term as ``acc = fma(float(isum), d_s * dx, acc); acc = fma(m_s,
sx_s, acc)``. :func:`quant_linear_x16_reference` computes exactly that (float64 with a
rounding to float32 after each step). The error against the float32 product is the
rounding of ``x`` to 8 bits per block, about ``|x_b|_max / 254`` a weight, as in
llama.cpp's CPU kernels. A row's result never depends on the other rows, so speculative
decoding stays exact against plain decoding on the same weights.

Layout of ``[N, K / U * B]`` uint8 (``N`` a multiple of 16; ``U, B``: :func:`x16_block`,
the file's block size except Q4_K's 148 bytes for 144): group ``g`` (rows ``16 g .. 16 g
+ 15``) holds its blocks of 32 in order, each the 16 rows' block ``b``:

- code chunks of 64 bytes, chunk ``j`` with row ``r``'s codes ``4 j .. 4 j + 3`` at bytes
  ``4 r .. 4 r + 3``: 8 chunks of whole bytes (Q8_0), or 4 chunks of two nibbles (the
  others), the low nibbles codes ``4 j + i``, the high ones ``16 + 4 j + i``;
- the high bits above the nibbles: Q5_0 one chunk, bit ``j`` of byte ``4 r + i`` the
  fifth bit of code ``4 j + i``; Q6_K two, chunk ``h`` bits ``2 (j - 4 h)`` and up the
  two top bits of code ``4 j + i``;
- the factors: Q4_0 / Q5_0 / Q8_0 the 16 ``d`` as float16, Q4_1 then the 16 ``m``; Q4_K
  the 16 six-bit scales then the 16 six-bit mins as bytes; Q6_K the 16 int8 scales of the
  first 16 weights, then the 16 of the second; codes with factors the 16 ``d`` then the
  16 ``m`` as float32, per group (one or two a block).

The K-quants' super-block factors (Q4_K: the 16 rows' ``d`` then ``dmin``, float16; Q6_K:
``d``) come before each run of 8 blocks.
"""

from __future__ import annotations

import torch

X16_OFFSET = 1000
GROUP = 16  # weight rows a group
# ggml_type of the regrouped blocks -> the GGUF type they came from
X16_TYPES = {X16_OFFSET + t: t for t in (2, 3, 6, 8, 12, 14)}
# codes with float32 factors per group of 32 / 16 weights (``ggml_type`` 0 layers)
CODES_32, CODES_16 = X16_OFFSET + 132, X16_OFFSET + 116
X16_TYPES.update({CODES_32: 0, CODES_16: 0})
# a GGUF type -> (weights, bytes) of its stored block
_FILE = {2: (32, 18), 3: (32, 20), 6: (32, 22), 8: (32, 34), 12: (256, 144), 14: (256, 210)}
_SUPER = {12: 64, 14: 32}  # the K-quants' super-block header bytes of a group
_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}


def x16_block(ggml_type: int) -> tuple[int, int]:
    """``(weights, bytes)`` a row of one stored unit of regrouped ``ggml_type`` (an
    :data:`X16_TYPES` key): the GGUF block's, except Q4_K's 148 bytes (its six-bit scales
    and mins kept a byte each)."""
    if int(ggml_type) in (CODES_32, CODES_16):
        return (32, 40 if int(ggml_type) == CODES_32 else 48)
    t = X16_TYPES[int(ggml_type)]
    return (256, 148) if t == 12 else _FILE[t]


def x16_supported(ggml_type: int, out_features: int) -> bool:
    """True when a layer of GGUF ``ggml_type`` blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K;
    0: codes and factors) with ``out_features`` rows can be regrouped (rows a multiple of
    16)."""
    return (int(ggml_type) in _FILE or int(ggml_type) == 0) and out_features % GROUP == 0


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _bits(b: torch.Tensor, n: int, width: int = 1) -> torch.Tensor:
    """Bytes ``[..., m]`` -> ``[..., m * n]`` fields of ``width`` bits, lowest first."""
    shifts = torch.arange(0, n * width, width, dtype=torch.uint8, device=b.device)
    return ((b.unsqueeze(-1) >> shifts) & ((1 << width) - 1)).flatten(-2)


def _fields(b: torch.Tensor, width: int) -> torch.Tensor:
    """The inverse of :func:`_bits`: ``[..., m, 8 / width]`` fields -> ``[..., m]`` bytes."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=b.device)
    return (b.to(torch.uint8) << shifts).sum(-1, dtype=torch.uint8)


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes ``[..., 12]`` -> its 8 six-bit scales and 8 six-bit mins."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, mn


def _k4_pack(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_k4_scales`."""
    lo = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    mid = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    hi = (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4)
    return torch.cat([lo, mid, hi], dim=-1)


def _codes(blocks: torch.Tensor, t: int) -> torch.Tensor:
    """GGUF blocks ``[N, nu, B]`` -> the unsigned codes ``u`` ``[N, nu * U]`` (uint8, weight
    order)."""
    N, nu, _ = blocks.shape
    if t == 8:
        return (blocks[..., 2:] ^ 0x80).reshape(N, -1)
    if t in (2, 3):
        qs = blocks[..., 2 if t == 2 else 4 :]
        return torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(N, -1)
    if t == 6:
        qs = blocks[..., 6:]
        return (torch.cat([qs & 0xF, qs >> 4], dim=-1) | (_bits(blocks[..., 2:6], 8) << 4)).reshape(
            N, -1
        )
    if t == 12:  # 4 runs of 32 bytes: low nibbles sub-block 2 c, high ones 2 c + 1
        qs = blocks[..., 16:].reshape(N, nu, 4, 1, 32)
        return torch.cat([qs & 0xF, qs >> 4], dim=3).reshape(N, -1)
    # Q6_K: per half h, quarter q: low nibbles of ql[h] bytes (q % 2) * 32.., (>> 4 for
    # q >= 2), the top two bits from qh[h] >> 2 q
    ql = blocks[..., :128].reshape(N, nu, 2, 2, 32)
    qh = blocks[..., 128:192].reshape(N, nu, 2, 1, 32)
    low = torch.cat([ql & 0xF, ql >> 4], dim=3)  # [N, nu, 2, 4, 32]: quarters 0, 1, 2, 3
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3
    return (low | (high << 4)).reshape(N, -1)


def _blocks_of(u: torch.Tensor, t: int, head: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_codes`: codes ``[N, nu * U]`` and each block's non-code
    bytes ``head`` ``[N, nu, h]`` -> GGUF blocks ``[N, nu, B]``."""
    N, nu = head.shape[:2]
    if t == 8:
        return torch.cat([head, u.reshape(N, nu, 32) ^ 0x80], dim=-1)
    if t in (2, 3):
        c = u.reshape(N, nu, 2, 16)
        return torch.cat([head, c[:, :, 0] | (c[:, :, 1] << 4)], dim=-1)
    if t == 6:
        c = u.reshape(N, nu, 32)
        qh = _fields((c >> 4).reshape(N, nu, 4, 8), 1)
        low = (c & 0xF).reshape(N, nu, 2, 16)
        return torch.cat([head[..., :2], qh, low[:, :, 0] | (low[:, :, 1] << 4)], dim=-1)
    if t == 12:
        c = u.reshape(N, nu, 4, 2, 32)
        return torch.cat([head, (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(N, nu, 128)], -1)
    c = u.reshape(N, nu, 2, 4, 32)
    low, high = c & 0xF, c >> 4
    ql = (low[:, :, :, :2] | (low[:, :, :, 2:] << 4)).reshape(N, nu, 128)
    qh = _fields(high.permute(0, 1, 2, 4, 3), 2).reshape(N, nu, 64)
    return torch.cat([ql, qh, head], dim=-1)


def _head(blocks: torch.Tensor, t: int) -> torch.Tensor:
    """Each GGUF block's bytes other than its codes (what :func:`_blocks_of` takes)."""
    return {
        8: lambda b: b[..., :2],
        2: lambda b: b[..., :2],
        3: lambda b: b[..., :4],
        6: lambda b: b[..., :2],
        12: lambda b: b[..., :16],
        14: lambda b: b[..., 192:],
    }[t](blocks)


def _interleave(x: torch.Tensor) -> torch.Tensor:
    """``[G, 16, nb, n, 4]`` (group, row, block, chunk, byte) -> ``[G, nb, n * 64]``."""
    return x.permute(0, 2, 3, 1, 4).reshape(x.shape[0], x.shape[2], -1)


def repack_x16(blocks: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, int]:
    """GGUF blocks ``[N, K / U * B]`` of Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K as stored ->
    the regrouped layout (module docstring) and its ``ggml_type`` (``X16_OFFSET +
    ggml_type``)."""
    t = int(ggml_type)
    N, row = blocks.shape
    if not x16_supported(t, N) or row % _FILE[t][1]:
        raise ValueError(
            f"repack_x16 takes Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K blocks (ggml_type 2, "
            f"3, 6, 8, 12, 14) of a multiple of 16 rows, got ggml_type {t}, shape "
            f"{tuple(blocks.shape)}"
        )
    U, B = _FILE[t]
    nu, G = row // B, N // GROUP
    b = blocks.reshape(N, nu, B)
    nb = nu * U // 32
    u = _codes(b, t).reshape(G, GROUP, nb, 32)
    if t == 8:
        parts = [_interleave(u.reshape(G, GROUP, nb, 8, 4))]
    else:
        low = (u & 0xF).reshape(G, GROUP, nb, 2, 16)
        parts = [
            _interleave((low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(G, GROUP, nb, 4, 4))
        ]
    high = (u >> 4).reshape(G, GROUP, nb, 8, 4)
    if t == 6:  # bit j of byte (r, i): code 4 j + i's fifth bit
        parts.append(_interleave(_fields(high.transpose(3, 4), 1)[..., None, :]))
    elif t == 14:
        h = high.reshape(G, GROUP, nb, 2, 4, 4).transpose(4, 5)  # [.., h, i, j]
        parts.append(_interleave(_fields(h, 2)))
    gb = b.reshape(G, GROUP, nu, B)
    if t in (2, 3, 6, 8):
        parts.append(gb[..., 0:2].permute(0, 2, 1, 3).reshape(G, nb, 32))
        if t == 3:
            parts.append(gb[..., 2:4].permute(0, 2, 1, 3).reshape(G, nb, 32))
        return torch.cat(parts, dim=-1).reshape(N, row).contiguous(), X16_OFFSET + t
    if t == 12:
        sc, mn = _k4_scales(gb[..., 4:16])  # [G, 16, nu, 8]
        factors = [sc.permute(0, 2, 3, 1), mn.permute(0, 2, 3, 1)]  # [G, nu, 8, 16]
        header = gb[..., 0:4].reshape(G, GROUP, nu, 2, 2).permute(0, 2, 3, 1, 4)
    else:
        sc = gb[..., 192:208].reshape(G, GROUP, nu, 8, 2)  # sub-blocks of 16 in pairs
        factors = [sc[..., 0].permute(0, 2, 3, 1), sc[..., 1].permute(0, 2, 3, 1)]
        header = gb[..., 208:210].permute(0, 2, 1, 3)
    body = torch.cat([p.reshape(G, nu, 8, -1) for p in parts] + factors, dim=-1)
    out = torch.cat([header.reshape(G, nu, -1), body.reshape(G, nu, -1)], dim=-1)
    return out.reshape(N, -1).contiguous(), X16_OFFSET + t


def repack_codes(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
) -> tuple[torch.Tensor, int]:
    """Codes and float32 factors (``quant_linear``'s ``ggml_type`` 0 form: uint8 ``[N, K /
    2]`` nibbles or int8 ``[N, K]`` codes, ``scales`` and ``mins`` ``[N, K / G]``, ``G``
    32 or 16) -> the regrouped layout and its ``ggml_type`` (:data:`CODES_32` /
    :data:`CODES_16`)."""
    N = qweight.shape[0]
    codes = _signed_codes(qweight)
    K = codes.shape[1]
    G = K // scales.shape[1]
    if N % GROUP or G not in (16, 32):
        raise ValueError(
            f"repack_codes takes a multiple of 16 rows and groups of 16 or 32 weights, got "
            f"{N} rows, groups of {G}"
        )
    nb, g = K // 32, N // GROUP
    u = (codes.to(torch.int16) + 128).to(torch.uint8).reshape(g, GROUP, nb, 8, 4)
    m = torch.zeros_like(scales) if mins is None else mins
    subs = 32 // G

    def factor(f):  # [N, K / G] -> [g, nb, subs, 16 rows * 4 bytes]
        f = f.float().contiguous().reshape(g, GROUP, nb, subs).permute(0, 2, 3, 1)
        return f.contiguous().view(torch.uint8).reshape(g, nb, subs, 1, 64)

    fac = torch.cat([factor(scales), factor(m)], dim=3).reshape(g, nb, -1)
    out = torch.cat([_interleave(u), fac], dim=-1)
    return out.reshape(N, -1).contiguous(), CODES_16 if G == 16 else CODES_32


def _signed_codes(qweight: torch.Tensor) -> torch.Tensor:
    """``ggml_type`` 0 codes (uint8 nibbles j, j + 16 of each block of 32, or int8) ->
    int8 ``[N, K]``."""
    if qweight.dtype == torch.int8:
        return qweight
    q = qweight.reshape(qweight.shape[0], -1, 16)
    return torch.cat([q & 0xF, q >> 4], dim=-1).reshape(qweight.shape[0], -1).to(torch.int8)


def unpack_codes(
    packed: torch.Tensor, ggml_type: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`repack_codes`, with 8-bit codes: ``(int8 codes [N, K],
    scales, mins)`` (zero mins where there were none)."""
    _, B = x16_block(ggml_type)
    N, row = packed.shape
    subs = 2 if int(ggml_type) == CODES_16 else 1
    nb, g = row // B, N // GROUP
    p = packed.reshape(g, nb, -1)
    u = p[..., :512].reshape(g, nb, 8, GROUP, 4).permute(0, 3, 1, 2, 4).reshape(N, nb * 32)
    codes = (u.to(torch.int16) - 128).to(torch.int8)
    fac = p[..., 512:].contiguous().reshape(g, nb, subs, 2, 64).view(torch.float32)
    fac = fac.permute(0, 4, 1, 2, 3).reshape(N, nb * subs, 2)  # [rows, groups, (d, m)]
    return codes.contiguous(), fac[..., 0].contiguous(), fac[..., 1].contiguous()


def unpack_x16(packed: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, int]:
    """The inverse of :func:`repack_x16`: GGUF blocks as stored and their ``ggml_type``."""
    t = X16_TYPES[int(ggml_type)]
    N, row = packed.shape
    U, B = _FILE[t]
    _, PB = x16_block(ggml_type)
    nu, G = row // PB, N // GROUP
    nb = nu * U // 32
    code_bytes = 512 if t == 8 else 256
    high_bytes = {6: 64, 14: 128}.get(t, 0)
    if t in (2, 3, 6, 8):
        p = packed.reshape(G, nb, -1)
        head = p[..., code_bytes + high_bytes :].reshape(G, nb, -1, GROUP, 2)
        head = head.permute(0, 3, 1, 2, 4).reshape(N, nu, -1)  # d (then m), per row
        body = p[..., : code_bytes + high_bytes]
    else:
        p = packed.reshape(G, nu, -1)
        hb = _SUPER[t]
        body = p[..., hb:].reshape(G, nu, 8, -1)
        fac = body[..., code_bytes + high_bytes :].reshape(G, nu, 8, 2, GROUP)
        fac = fac.permute(0, 4, 1, 2, 3)  # [G, 16, nu, 8, 2]
        sup = p[..., :hb].reshape(G, nu, hb // 32, GROUP, 2).permute(0, 3, 1, 2, 4)
        sup = sup.reshape(N, nu, -1)
        if t == 12:
            scales = _k4_pack(fac[..., 0], fac[..., 1]).reshape(N, nu, 12)
            head = torch.cat([sup, scales], dim=-1)
        else:
            head = torch.cat([fac.reshape(N, nu, 16), sup], dim=-1)
        body = body[..., : code_bytes + high_bytes].reshape(G, nb, -1)
    codes = body[..., :code_bytes].reshape(G, nb, -1, GROUP, 4).permute(0, 3, 1, 2, 4)
    codes = codes.reshape(G, GROUP, nb, -1)  # [G, 16, nb, chunks * 4]
    if t == 8:
        u = codes
    else:
        c = codes.reshape(G, GROUP, nb, 16)
        u = torch.cat([c & 0xF, c >> 4], dim=-1)
    if high_bytes:
        hi = body[..., code_bytes:].reshape(G, nb, -1, GROUP, 4).permute(0, 3, 1, 2, 4)
        if t == 6:  # [G, 16, nb, 1, 4] -> bits j -> codes 4 j + i
            bits = _bits(hi.reshape(G, GROUP, nb, 4), 8).reshape(G, GROUP, nb, 4, 8)
            u = u | (bits.transpose(3, 4).reshape(G, GROUP, nb, 32) << 4)
        else:  # [G, 16, nb, 2, 4] -> two-bit fields jj -> codes 4 (4 h + jj) + i
            f = _bits(hi, 4, 2).reshape(G, GROUP, nb, 2, 4, 4).transpose(4, 5)
            u = u | (f.reshape(G, GROUP, nb, 32) << 4)
    blocks = _blocks_of(u.reshape(N, -1), t, head)
    return blocks.reshape(N, row // PB * B).contiguous(), t


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``[M, K]`` float32 -> (``qx`` float32 integers ``[M, K / 32, 32]``, ``dx``
    ``[M, K / 32]``, ``sx`` ``[M, K / 32]``), as the kernel computes them."""
    M, K = x.shape
    xb = x.float().reshape(M, K // 32, 32)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1))
    return q, d, d * q.sum(-1)


def x16_factors(blocks: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF blocks ``[N, K / U * B]`` of type ``t`` -> ``(u, d, m)``: codes float32 ``[N,
    K / S, S]`` and float32 factors ``[N, K / S]`` per sub-block of ``S`` weights (16 for
    Q6_K, else 32), the module docstring's table, so that a weight is ``d * u + m``."""
    U, B = _FILE[t]
    N = blocks.shape[0]
    b = blocks.reshape(N, -1, B)
    nu = b.shape[1]
    u = _codes(b, t).float()
    if t in (2, 3, 6, 8):
        d = _f16(b[..., 0:2])
        m = _f16(b[..., 2:4]) if t == 3 else d * {2: -8.0, 6: -16.0, 8: -128.0}[t]
        return u.reshape(N, nu, 32), d, m
    if t == 12:
        sc, mn = _k4_scales(b[..., 4:16])
        d = _f16(b[..., 0:2])[..., None] * sc.float()
        m = -(_f16(b[..., 2:4])[..., None] * mn.float())
        return u.reshape(N, nu * 8, 32), d.reshape(N, -1), m.reshape(N, -1)
    d = _f16(b[..., 208:210])[..., None] * b[..., 192:208].contiguous().view(torch.int8).float()
    d = d.reshape(N, -1)
    return u.reshape(N, nu * 16, 16), d, d * -32.0


def quant_linear_x16_reference(
    x: torch.Tensor, packed: torch.Tensor, ggml_type: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``quant_linear`` on regrouped blocks, in PyTorch: the kernel's arithmetic, block by
    block in float64 with a rounding to float32 after each step. ``x`` ``[M, K]``."""
    if int(ggml_type) in (CODES_32, CODES_16):
        codes, d, m = unpack_codes(packed, ggml_type)
        S = codes.shape[1] // d.shape[1]
        u = codes.float().reshape(codes.shape[0], -1, S)
    else:
        blocks, t = unpack_x16(packed, ggml_type)
        u, d, m = x16_factors(blocks, t)
    N, ns, S = u.shape
    q, dx, _ = quantize_activations(x)
    M = x.shape[0]
    qs = q.reshape(M, ns, S)
    dxs = dx.repeat_interleave(32 // S, dim=1)  # [M, ns]: the sub-block's dx
    sx = dxs * qs.sum(-1)  # float32, as the kernel
    isum = torch.einsum("msk,nsk->mns", qs.double(), u.double())  # exact integers
    acc = torch.zeros(M, N, dtype=torch.float64)
    for j in range(ns):
        scale = (d[None, :, j] * dxs[:, None, j]).double()  # a float32 product
        acc = (isum[:, :, j] * scale + acc).float().double()
        acc = (m[None, :, j].double() * sx[:, None, j].double() + acc).float().double()
    y = acc.float()
    return y + bias if bias is not None else y
