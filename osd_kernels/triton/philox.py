"""Philox-4x32-10 for Triton kernels, bit-identical to ``osd_kernels.philox`` and
``csrc/kernels/philox.h`` (layout documented there).

``philox_uniform(seed, offset, stream, index)`` takes ``seed``/``offset`` as int64 scalars
(or blocks) and ``stream``/``index`` as int32/int64 scalars or blocks (Python ints too);
it returns float32 uniforms in (0, 1). ``philox4x32_10`` is the raw generator on uint32 blocks.
"""

import triton
import triton.language as tl


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Ten Philox-4x32 rounds on uint32 blocks (counter c0..c3, key k0, k1)."""
    for _ in tl.static_range(10):
        _c0, _c2 = c0, c2
        c0 = tl.umulhi(_c2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(_c0, 0xD2511F53) ^ c3 ^ k1
        c1 = _c2 * 0xCD9E8D57
        c3 = _c0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def to_uniform(w):
    """uint32 words to float32 in (0, 1): (2 * (w >> 9) + 1) * 2**-24, exact."""
    return (w >> 9).to(tl.float32) * 1.1920928955078125e-07 + 5.960464477539063e-08


@triton.jit
def philox_uniform(seed, offset, stream, index):
    """u(seed, offset, stream, index) in (0, 1) as float32 (broadcast over the arguments)."""
    # tl.cast also takes Python ints and constexprs (a literal index or stream)
    seed = tl.cast(seed, tl.int64)
    offset = tl.cast(offset, tl.int64)
    index = tl.cast(index, tl.int64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    o0 = (offset & 0xFFFFFFFF).to(tl.uint32)
    o1 = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = ((index >> 2) & 0xFFFFFFFF).to(tl.uint32)
    c1 = (tl.cast(stream, tl.int64) & 0xFFFFFFFF).to(tl.uint32)
    w0, w1, w2, w3 = philox4x32_10(c0, c1, o0, o1, k0, k1)
    lane = index & 3
    w = tl.where(lane == 0, w0, w1)
    w = tl.where(lane == 2, w2, w)
    w = tl.where(lane == 3, w3, w)
    return to_uniform(w)
