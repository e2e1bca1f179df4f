"""GGUF's block types (``osd.models.gguf.blocks``) against straightforward references:
every dequantizer equals a per-block loop written from ggml's C code, bit for bit, and the
quantizers equal ggml's reference quantizers byte for byte."""

import math
import struct

import numpy as np
import pytest
import torch

from osd.models import gguf
from osd.models.gguf import GGMLType, dequantize, quantize

T = GGMLType


# -- reference dequantizers and quantizers (one block at a time, after ggml's C code) -----
K_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)  # 256-weight super-blocks
SUPER_TYPES = (*K_TYPES, T.IQ4_XS)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _h(b, i):
    return np.float32(np.frombuffer(bytes(b[i : i + 2]), np.float16)[0])


def _ref_block(b, t):
    f32 = np.float32
    y = np.zeros(256 if t in SUPER_TYPES else 32, np.float32)
    if t == T.Q8_0:
        d = _h(b, 0)
        for j in range(32):
            y[j] = f32(b[2 + j] - 256 if b[2 + j] > 127 else b[2 + j]) * d
    elif t in (T.Q4_0, T.Q4_1):
        d, qs = _h(b, 0), b[2:] if t == T.Q4_0 else b[4:]
        for j in range(16):
            if t == T.Q4_0:
                y[j], y[j + 16] = f32((qs[j] & 0xF) - 8) * d, f32((qs[j] >> 4) - 8) * d
            else:
                m = _h(b, 2)
                y[j], y[j + 16] = f32(qs[j] & 0xF) * d + m, f32(qs[j] >> 4) * d + m
    elif t in (T.Q5_0, T.Q5_1):
        d = _h(b, 0)
        qh = struct.unpack("<I", bytes(b[2:6] if t == T.Q5_0 else b[4:8]))[0]
        qs = b[6:] if t == T.Q5_0 else b[8:]
        for j in range(16):
            xh0 = ((qh >> j) << 4) & 0x10
            xh1 = (qh >> (j + 12)) & 0x10
            x0, x1 = (qs[j] & 0xF) | xh0, (qs[j] >> 4) | xh1
            if t == T.Q5_0:
                y[j], y[j + 16] = f32(x0 - 16) * d, f32(x1 - 16) * d
            else:
                m = _h(b, 2)
                y[j], y[j + 16] = f32(x0) * d + m, f32(x1) * d + m
    elif t in (T.Q4_K, T.Q5_K):
        d, dmin, sc = _h(b, 0), _h(b, 2), b[4:16]
        q, qh = (b[16:144], None) if t == T.Q4_K else (b[48:176], b[16:48])

        def scale_min(j):
            if j < 4:
                return sc[j] & 63, sc[j + 4] & 63
            return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | (
                (sc[j] >> 6) << 4
            )

        out, qi, is_ = 0, 0, 0
        for _ in range(0, 256, 64):
            s, m = scale_min(is_)
            d1, m1 = d * f32(s), dmin * f32(m)
            s, m = scale_min(is_ + 1)
            d2, m2 = d * f32(s), dmin * f32(m)
            u1, u2 = 1 << is_, 2 << is_  # Q5_K: the fifth bits of this 64
            for lane in range(32):
                h = 16 if qh is not None and qh[lane] & u1 else 0
                y[out + lane] = d1 * f32((q[qi + lane] & 0xF) + h) - m1
            for lane in range(32):
                h = 16 if qh is not None and qh[lane] & u2 else 0
                y[out + 32 + lane] = d2 * f32((q[qi + lane] >> 4) + h) - m2
            out, qi, is_ = out + 64, qi + 32, is_ + 2
    elif t == T.Q2_K:
        sc, q, d, dmin = b[0:16], b[16:80], _h(b, 80), _h(b, 82)
        out, is_ = 0, 0
        for qi in (0, 32):
            for shift in (0, 2, 4, 6):
                for part in (0, 16):
                    dl, ml = d * f32(sc[is_] & 0xF), dmin * f32(sc[is_] >> 4)
                    for lane in range(16):
                        y[out + lane] = dl * f32((q[qi + part + lane] >> shift) & 3) - ml
                    out, is_ = out + 16, is_ + 1
    elif t == T.Q3_K:
        hm, q, raw, d = b[0:32], b[32:96], b[96:108], _h(b, 108)
        aux = list(struct.unpack("<3I", bytes(raw))) + [0]
        k1, k2, tmp = 0x03030303, 0x0F0F0F0F, aux[2]
        aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4)
        aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4)
        aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4)
        aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4)
        scales = np.frombuffer(struct.pack("<4I", *aux), np.int8)
        out, is_, m = 0, 0, 1
        for qi in (0, 32):
            for shift in (0, 2, 4, 6):
                for part in (0, 16):
                    dl = d * f32(int(scales[is_]) - 32)
                    for lane in range(16):
                        low = (q[qi + part + lane] >> shift) & 3
                        y[out + lane] = dl * f32(low - (0 if hm[part + lane] & m else 4))
                    out, is_ = out + 16, is_ + 1
                m <<= 1
    elif t == T.Q6_K:
        ql, qh = b[0:128], b[128:192]
        sc = np.frombuffer(bytes(b[192:208]), np.int8)
        d = _h(b, 208)
        for half in range(2):
            o, L, H, S = half * 128, half * 64, half * 32, half * 8
            for lane in range(32):
                is_ = lane // 16
                q1 = ((ql[L + lane] & 0xF) | (((qh[H + lane] >> 0) & 3) << 4)) - 32
                q2 = ((ql[L + lane + 32] & 0xF) | (((qh[H + lane] >> 2) & 3) << 4)) - 32
                q3 = ((ql[L + lane] >> 4) | (((qh[H + lane] >> 4) & 3) << 4)) - 32
                q4 = ((ql[L + lane + 32] >> 4) | (((qh[H + lane] >> 6) & 3) << 4)) - 32
                y[o + lane] = d * f32(sc[S + is_]) * f32(q1)
                y[o + lane + 32] = d * f32(sc[S + is_ + 2]) * f32(q2)
                y[o + lane + 64] = d * f32(sc[S + is_ + 4]) * f32(q3)
                y[o + lane + 96] = d * f32(sc[S + is_ + 6]) * f32(q4)
    elif t == T.IQ4_NL:
        d, qs = _h(b, 0), b[2:18]
        for j in range(16):
            y[j] = d * f32(IQ4_VALUES[qs[j] & 0xF])
            y[j + 16] = d * f32(IQ4_VALUES[qs[j] >> 4])
    elif t == T.IQ4_XS:
        d, scales_h = _h(b, 0), struct.unpack("<H", bytes(b[2:4]))[0]
        scales_l, qs = b[4:8], b[8:136]
        for ib in range(8):
            ls = ((scales_l[ib // 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)
            dl = d * f32(ls - 32)
            for j in range(16):
                y[32 * ib + j] = dl * f32(IQ4_VALUES[qs[16 * ib + j] & 0xF])
                y[32 * ib + j + 16] = dl * f32(IQ4_VALUES[qs[16 * ib + j] >> 4])
    else:
        raise ValueError(t)
    return y


def ref_dequantize(raw: np.ndarray, t) -> np.ndarray:
    size = gguf.BLOCK_LAYOUT[t][1]
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1, size)
    return np.concatenate([_ref_block(row.tobytes(), t) for row in raw])


def _roundf(v: np.float32) -> int:
    return int(math.copysign(math.floor(abs(float(v)) + 0.5), float(v)))


def ref_quantize(x: np.ndarray, t) -> bytes:
    """ggml's quantize_row_{q8_0,q4_0,q4_1,q5_0,q5_1}_ref, one block at a time in float32."""
    f32, out = np.float32, b""
    for blk in np.asarray(x, np.float32).reshape(-1, 32):
        if t == T.Q8_0:
            amax = max(abs(v) for v in blk)
            d = f32(amax) / f32(127)
            inv = f32(1) / d if d else f32(0)
            q = [_roundf(v * inv) for v in blk]
            out += np.float16(d).tobytes() + np.array(q, np.int8).tobytes()
            continue
        five = t in (T.Q5_0, T.Q5_1)
        if t in (T.Q4_0, T.Q5_0):
            amax, mx = f32(0), f32(0)
            for v in blk:
                if amax < abs(v):
                    amax, mx = abs(v), v
            d = mx / f32(-16 if five else -8)
            inv = f32(1) / d if d else f32(0)
            q = [min(31 if five else 15, int(v * inv + f32(16.5 if five else 8.5))) for v in blk]
            head = np.float16(d).tobytes()
        else:
            lo, hi = min(blk), max(blk)
            d = (hi - lo) / f32(31 if five else 15)
            inv = f32(1) / d if d else f32(0)
            q = [min(31 if five else 15, int((v - lo) * inv + f32(0.5))) for v in blk]
            head = np.float16(d).tobytes() + np.float16(lo).tobytes()
        if five:
            qh = sum(((q[j] & 0x10) >> 4) << j for j in range(32))
            head += struct.pack("<I", qh)
        out += head + bytes((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4) for j in range(16))
    return out


def random_blocks(t, n: int, seed: int = 0) -> np.ndarray:
    """``n`` random blocks of type ``t`` with finite fp16 scale fields."""
    rng = np.random.default_rng(seed)
    size = gguf.BLOCK_LAYOUT[t][1]
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    halves = {
        T.Q8_0: [0],
        T.Q4_0: [0],
        T.Q5_0: [0],
        T.Q4_1: [0, 2],
        T.Q5_1: [0, 2],
        T.Q2_K: [80, 82],
        T.Q3_K: [108],
        T.Q4_K: [0, 2],
        T.Q5_K: [0, 2],
        T.Q6_K: [208],
        T.IQ4_NL: [0],
        T.IQ4_XS: [0],
    }[t]
    for at in halves:
        b[:, at : at + 2] = rng.uniform(-2, 2, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return b.reshape(-1)


# -- tests ----------------------------------------------------------------------------------
BLOCK_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, *SUPER_TYPES]


@pytest.mark.parametrize("t", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_per_block_reference(t):
    n = 7 if t in SUPER_TYPES else 21
    raw = random_blocks(t, n, seed=int(t))
    per_row = gguf.BLOCK_LAYOUT[t][0] * (1 if t in SUPER_TYPES else 3)
    shape = (n * gguf.BLOCK_LAYOUT[t][0] // per_row, per_row)
    got = dequantize(torch.from_numpy(raw.copy()), t, shape)
    want = torch.from_numpy(ref_dequantize(raw, t)).reshape(shape)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, want)
    half = dequantize(torch.from_numpy(raw.copy()), t, shape, torch.bfloat16)
    assert torch.equal(half, want.to(torch.bfloat16))


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_quantize_matches_ggml_reference(t):
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)) * 3
    x[0, :32] = 0.0  # an all-zero block: d = 0
    x[1, 32:64] = 1.5  # a constant block
    raw = quantize(x, t)
    assert raw.tobytes() == ref_quantize(x.numpy(), t)
    back = torch.from_numpy(ref_dequantize(raw, t)).reshape(-1, 32)
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(1, keepdim=True)
    # Worst error in steps: half a step (Q4_0, Q5_0: a whole one, the end at +8 / +16 is
    # clamped), plus the fp16 rounding of d (and of Q4_1's and Q5_1's minimum).
    spread = blocks.amax(1, True) - blocks.amin(1, True)
    step, steps = {
        T.Q8_0: (amax / 127, 0.5),
        T.Q4_0: (amax / 8, 1.0),
        T.Q4_1: (spread / 15, 0.5),
        T.Q5_0: (amax / 16, 1.0),
        T.Q5_1: (spread / 31, 0.5),
    }[t]
    assert ((back - blocks).abs() <= step * (steps + 0.1) + amax * 2**-10).all()


@pytest.mark.parametrize("t", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_types_round_trip(t):
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    raw = torch.from_numpy(quantize(x, t).copy())
    want = {T.F32: x, T.F16: x.half().float(), T.BF16: x.bfloat16().float()}[t]
    assert torch.equal(dequantize(raw, t, (3, 40)), want)
