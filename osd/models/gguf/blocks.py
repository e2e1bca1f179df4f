"""GGUF's tensor types: their block layouts, dequantization (bit for bit as ggml's
``dequantize_row_*``) and ggml's reference quantizers for the simple block types.

A block type stores each row as whole blocks of 32 weights (Q4_0 ... Q8_0, IQ4_NL) or
super-blocks of 256 (the K-quants, IQ4_XS). :func:`dequantize` turns a tensor's stored
bytes into floats; :func:`k_quant_parts` and :func:`iq4_parts` give the integer codes and
float32 factors that :class:`osd.models.quant.QuantLinear` keeps; :func:`quantize` writes
F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 bytes (used to build test checkpoints and to
quantize drafts).
"""

from __future__ import annotations

import enum

import numpy as np
import torch

# ggml tensor types: the ids a GGUF tensor info stores.
GGMLType = enum.IntEnum(
    "GGMLType",
    [
        ("F32", 0),
        ("F16", 1),
        ("Q4_0", 2),
        ("Q4_1", 3),
        ("Q5_0", 6),
        ("Q5_1", 7),
        ("Q8_0", 8),
        ("Q8_1", 9),
        ("Q2_K", 10),
        ("Q3_K", 11),
        ("Q4_K", 12),
        ("Q5_K", 13),
        ("Q6_K", 14),
        ("Q8_K", 15),
        ("IQ2_XXS", 16),
        ("IQ2_XS", 17),
        ("IQ3_XXS", 18),
        ("IQ1_S", 19),
        ("IQ4_NL", 20),
        ("IQ3_S", 21),
        ("IQ2_S", 22),
        ("IQ4_XS", 23),
        ("I8", 24),
        ("I16", 25),
        ("I32", 26),
        ("I64", 27),
        ("F64", 28),
        ("IQ1_M", 29),
        ("BF16", 30),
    ],
)

# (weights per block, bytes per block) of the types this module reads.
BLOCK_LAYOUT = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18),  # fp16 d, 16 bytes of nibbles
    GGMLType.Q4_1: (32, 20),  # fp16 d, fp16 m, 16 bytes of nibbles
    GGMLType.Q5_0: (32, 22),  # fp16 d, u32 high bits, 16 bytes of nibbles
    GGMLType.Q5_1: (32, 24),  # fp16 d, fp16 m, u32 high bits, 16 bytes of nibbles
    GGMLType.Q8_0: (32, 34),  # fp16 d, 32 int8
    GGMLType.Q2_K: (256, 84),  # 16 bytes of 4-bit scale/min pairs, 64 bytes of 2-bit codes,
    #                              fp16 d, fp16 dmin
    GGMLType.Q3_K: (256, 110),  # 32 bytes of high bits, 64 bytes of 2-bit codes, 12 bytes of
    #                              6-bit scales, fp16 d
    GGMLType.Q4_K: (256, 144),  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 nibbles
    GGMLType.Q5_K: (256, 176),  # Q4_K's fields, then 32 bytes of high bits before the nibbles
    GGMLType.Q6_K: (256, 210),  # 128 low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d
    GGMLType.IQ4_NL: (32, 18),  # fp16 d, 16 bytes of nibbles indexing IQ4_VALUES
    GGMLType.IQ4_XS: (256, 136),  # fp16 d, u16 high scale bits, 4 bytes of low scale nibbles,
    #                               128 bytes of nibbles indexing IQ4_VALUES
}
# The 16 levels a nibble of IQ4_NL and IQ4_XS selects (ggml's kvalues_iq4nl).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
SUPPORTED_TYPES = tuple(BLOCK_LAYOUT)


def type_name(ggml_type: int) -> str:
    try:
        return GGMLType(ggml_type).name
    except ValueError:
        return f"unknown type {ggml_type}"


# -- dequantization ---------------------------------------------------------------------------
def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte ``start`` of every block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32]: low nibbles are elements 0..15, high 16..31."""
    return torch.cat([qs & 0xF, qs >> 4], dim=1)


def high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian u32 -> [n, 32] bits (bit j belongs to element j)."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _bit_planes(h: torch.Tensor) -> torch.Tensor:
    """[n, 32] bytes -> [n, 8, 32] bits: plane ``j`` holds bit ``j`` of every byte (the
    K-quants' high bits: sub-block ``j`` of 32 weights reads plane ``j``)."""
    shifts = torch.arange(8, device=h.device, dtype=torch.uint8).view(1, 8, 1)
    return (h.unsqueeze(1) >> shifts) & 1


def _k3_scales(s: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 bytes -> 16 signed six-bit scales [n, 16] int (stored with a +32 offset):
    the low four bits are the nibbles of bytes 0-7 (low nibbles first), the high two bits
    come from bytes 8-11, two bits at a time."""
    low = torch.cat([s[:, :8] & 0xF, s[:, :8] >> 4], dim=1)
    high = torch.cat([(s[:, 8:12] >> sh) & 3 for sh in (0, 2, 4, 6)], dim=1)
    return (low | (high << 4)).to(torch.int16) - 32


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, [n, 8] each."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=1)
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return scales, mins


K_QUANTS = (GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)


def k_quant_parts(b: torch.Tensor, ggml_type: int):
    """K-quant super-blocks ``[n, bytes_per_block]`` -> ``(codes, scales, mins)``: integer
    codes ``[n, 256]`` (int16, weight order) and float32 factors ``[n, G]`` per group of
    ``256 / G`` weights (32 for Q4_K and Q5_K, 16 for Q2_K, Q3_K and Q6_K), ``mins`` None
    for the types without one, such that a weight is ``code * scale + min``.

    The factors are computed in float32 as ggml's ``dequantize_row_*`` computes its
    ``d1 = d * sc`` and ``m1 = dmin * m`` (``min = -m1``); a factor is a float16 value times
    a small integer and a code has at most 6 bits, so ``code * scale`` is exact in float32
    and ``code * scale + min`` rounds once, as ggml's ``d1 * q - m1`` does.
    """
    n = b.shape[0]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    if ggml_type in (GGMLType.Q4_K, GGMLType.Q5_K):
        sc, mn = _k4_scales(b[:, 4:16])
        qs = (
            b[:, 16:].reshape(n, 4, 32)
            if ggml_type == GGMLType.Q4_K
            else b[:, 48:].reshape(n, 4, 32)
        )
        q = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(n, 8, 32)
        if ggml_type == GGMLType.Q5_K:  # sub-block j's fifth bit: bit j of qh
            q = q | (_bit_planes(b[:, 16:48]) << 4)
        return (
            q.reshape(n, 256).to(torch.int16),
            _f16(b, 0) * sc.float(),
            -(_f16(b, 2) * mn.float()),
        )
    if ggml_type == GGMLType.Q2_K:
        sc = b[:, :16]
        qs = b[:, 16:80].reshape(n, 2, 1, 32)  # [half, shift, 32 lanes] -> 16 groups of 16
        q = ((qs >> shifts) & 3).reshape(n, 256).to(torch.int16)
        # ggml: dl = d * (sc & 0xF), ml = dmin * (sc >> 4), y = dl * q - ml
        return q, _f16(b, 80) * (sc & 0xF).float(), -(_f16(b, 82) * (sc >> 4).float())
    if ggml_type == GGMLType.Q3_K:
        qs = b[:, 32:96].reshape(n, 2, 1, 32)
        low = ((qs >> shifts) & 3).reshape(n, 256).to(torch.int16)
        # a clear high bit subtracts 4 (ggml: (hm & m) ? 0 : 4)
        high = _bit_planes(b[:, :32]).reshape(n, 256).to(torch.int16)
        return low - ((high ^ 1) << 2), _f16(b, 108) * _k3_scales(b[:, 96:108]).float(), None
    if ggml_type == GGMLType.Q6_K:
        ql = b[:, :128].reshape(n, 2, 2, 32)  # [half, first/second 32 bytes, 32]
        qh = b[:, 128:192].reshape(n, 2, 32)
        low = torch.stack(
            [ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], dim=2
        )  # [n, 2, 4, 32]
        high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2)  # [n, 2, 4, 32]
        q = (low | (high << 4)).reshape(n, 256).to(torch.int16) - 32
        # group g (16 weights) has scale sc[g]; ggml: d * sc[is] * q
        sc = b[:, 192:208].contiguous().view(torch.int8).float()
        return q, _f16(b, 208) * sc, None
    raise ValueError(f"{type_name(ggml_type)} is not a K-quant type")


def iq4_parts(b: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_NL blocks ``[n, 18]`` or IQ4_XS super-blocks ``[n, 136]`` -> ``(codes, scales)``:
    the level of each weight (:data:`IQ4_VALUES`, int16 ``[n, W]``, weight order) and a
    float32 scale per 32 weights ``[n, W / 32]``, such that a weight is ``code * scale``.

    As in ggml's ``dequantize_row_iq4_*``: IQ4_NL's scale is its ``d``; IQ4_XS's sub-block
    ``j`` has the six-bit scale ``ls`` (low four bits from nibble ``j`` of ``scales_l``,
    high two from bits ``2j`` of ``scales_h``) and the scale ``d * (ls - 32)`` in float32.
    Every ``code * scale`` is exact in float32 (at most 11 + 5 + 7 significant bits).
    """
    n = b.shape[0]
    levels = torch.tensor(IQ4_VALUES, dtype=torch.int16, device=b.device)
    if ggml_type == GGMLType.IQ4_NL:
        return levels[nibbles(b[:, 2:]).long()], _f16(b, 0)
    if ggml_type != GGMLType.IQ4_XS:
        raise ValueError(f"{type_name(ggml_type)} is not an IQ4 type")
    q = levels[nibbles(b[:, 8:].reshape(n * 8, 16)).long()].reshape(n, 256)
    low = torch.stack([b[:, 4:8] & 0xF, b[:, 4:8] >> 4], dim=2).reshape(n, 8).to(torch.int32)
    high = b[:, 2:4].to(torch.int32)
    high = high[:, 0] | (high[:, 1] << 8)  # u16 scales_h
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)
    ls = low | (((high.unsqueeze(1) >> shifts) & 3) << 4)
    return q, _f16(b, 0) * (ls - 32).float()


def _dequant_blocks(b: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """[n, bytes_per_block] uint8 -> [n, weights_per_block] float32, as ggml computes it."""
    n = b.shape[0]
    if ggml_type == GGMLType.Q8_0:
        return _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()
    if ggml_type == GGMLType.Q4_0:
        return (nibbles(b[:, 2:]).float() - 8) * _f16(b, 0)
    if ggml_type == GGMLType.Q4_1:
        return nibbles(b[:, 4:]).float() * _f16(b, 0) + _f16(b, 2)
    if ggml_type == GGMLType.Q5_0:
        q = nibbles(b[:, 6:]) | (high_bits(b[:, 2:6]) << 4)
        return (q.float() - 16) * _f16(b, 0)
    if ggml_type == GGMLType.Q5_1:
        q = nibbles(b[:, 8:]) | (high_bits(b[:, 4:8]) << 4)
        return q.float() * _f16(b, 0) + _f16(b, 2)
    if ggml_type in K_QUANTS:
        q, scales, mins = k_quant_parts(b, ggml_type)
        w = q.float().reshape(n, scales.shape[1], -1) * scales.unsqueeze(-1)
        if mins is not None:
            w = w + mins.unsqueeze(-1)
        return w.reshape(n, 256)
    if ggml_type in (GGMLType.IQ4_NL, GGMLType.IQ4_XS):
        q, scales = iq4_parts(b, ggml_type)
        return (q.float().reshape(n, scales.shape[1], 32) * scales.unsqueeze(-1)).reshape(n, -1)
    raise ValueError(f"cannot dequantize {type_name(ggml_type)}")


def dequantize(
    raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Stored bytes of one tensor -> a ``dtype`` tensor of ``shape`` (torch order).

    Args:
        raw: uint8 [nbytes], the tensor's bytes as stored (any device).
        ggml_type: one of :data:`SUPPORTED_TYPES`.
        shape: the tensor's torch shape; the last dim is a whole number of blocks.
        dtype: result dtype. Block types dequantize in float32 first, as ggml does.
    """
    if ggml_type == GGMLType.F32:
        return raw.view(torch.float32).reshape(shape).to(dtype)
    if ggml_type == GGMLType.F16:
        return raw.view(torch.float16).reshape(shape).to(dtype)
    if ggml_type == GGMLType.BF16:
        return raw.view(torch.bfloat16).reshape(shape).to(dtype)
    if ggml_type not in BLOCK_LAYOUT:
        raise ValueError(
            f"cannot dequantize {type_name(ggml_type)}; supported: "
            f"{', '.join(t.name for t in SUPPORTED_TYPES)}"
        )
    _, size = BLOCK_LAYOUT[ggml_type]
    return _dequant_blocks(raw.reshape(-1, size), ggml_type).reshape(shape).to(dtype)


# -- quantization (ggml's reference quantizers) ----------------------------------------------
def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize(x: np.ndarray | torch.Tensor, ggml_type: int) -> np.ndarray:
    """Float weights -> their GGUF bytes (uint8 [nbytes]), as ggml's reference
    ``quantize_row_*_ref`` computes them. Types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1; the last dim must be a multiple of 32 for the block types."""
    if isinstance(x, torch.Tensor):
        if ggml_type == GGMLType.BF16:
            return (
                x.detach()
                .cpu()
                .to(torch.bfloat16)
                .contiguous()
                .view(torch.uint8)
                .numpy()
                .reshape(-1)
            )
        x = x.detach().cpu().float().numpy()
    x = np.ascontiguousarray(x, dtype=np.float32)
    if ggml_type == GGMLType.F32:
        return x.reshape(-1).view(np.uint8)
    if ggml_type == GGMLType.F16:
        return x.astype(np.float16).reshape(-1).view(np.uint8)
    if ggml_type == GGMLType.BF16:
        return quantize(torch.from_numpy(x), ggml_type)
    if ggml_type not in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1):
        raise ValueError(
            f"quantize supports F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
            f"not {type_name(ggml_type)}"
        )
    if x.shape[-1] % 32:
        raise ValueError(f"rows of {x.shape[-1]} weights are not whole blocks of 32")
    blocks = x.reshape(-1, 32)
    with np.errstate(divide="ignore"):
        if ggml_type == GGMLType.Q8_0:
            d = np.abs(blocks).max(axis=1) / 127
            inv = np.where(d != 0, 1 / d, 0).astype(np.float32)
            v = blocks * inv[:, None]
            # roundf (halves away from zero); + 0.5 in float64 is exact for float32 v
            q = (np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)).astype(np.int8)
            return np.concatenate([_fp16_bytes(d), q.view(np.uint8)], axis=1).reshape(-1)
        top = 31 if ggml_type in (GGMLType.Q5_0, GGMLType.Q5_1) else 15
        if ggml_type in (GGMLType.Q4_0, GGMLType.Q5_0):
            signed_max = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
            half = (top + 1) // 2  # the code of 0: 8 (Q4_0) or 16 (Q5_0)
            d = signed_max / -half
            inv = np.where(d != 0, 1 / d, 0).astype(np.float32)
            q = np.minimum(top, np.trunc(blocks * inv[:, None] + (half + 0.5))).astype(np.uint8)
        else:
            lo, hi = blocks.min(axis=1), blocks.max(axis=1)
            d = (hi - lo) / top
            inv = np.where(d != 0, 1 / d, 0).astype(np.float32)
            q = np.minimum(top, np.trunc((blocks - lo[:, None]) * inv[:, None] + 0.5)).astype(
                np.uint8
            )
    packed = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
    head = [_fp16_bytes(d)]
    if ggml_type in (GGMLType.Q4_1, GGMLType.Q5_1):
        head.append(_fp16_bytes(lo))
    if top == 31:  # the fifth bits: bit j of a u32, element j
        bits = (q >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)
        head.append(bits.sum(axis=1, dtype=np.uint32).astype("<u4")[:, None].view(np.uint8))
    return np.concatenate(head + [packed], axis=1).reshape(-1)


__all__ = [
    "GGMLType",
    "BLOCK_LAYOUT",
    "SUPPORTED_TYPES",
    "IQ4_VALUES",
    "K_QUANTS",
    "type_name",
    "k_quant_parts",
    "iq4_parts",
    "dequantize",
    "quantize",
]
