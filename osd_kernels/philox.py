"""Philox-4x32-10 in PyTorch: the counter-based uniforms of every stochastic osd kernel.

The same generator is in ``csrc/kernels/philox.h`` (C++ and CUDA) and
``osd_kernels/triton/philox.py`` (Triton); all three produce bit-identical words, so the
samplers agree token for token across backends given the same seeds.

Layout of a uniform ``u(seed, offset, stream, index)`` (``seed``, ``offset``: 64-bit per
sequence; ``offset`` selects a fresh stream per call, e.g. a step counter):

- key = ``(lo32(seed), hi32(seed))``;
- counter = ``(index >> 2, stream, lo32(offset), hi32(offset))``;
- the uniform is output word ``index & 3`` mapped to ``(2 * (w >> 9) + 1) * 2**-24``, an
  exact float in the open interval (0, 1), so ``log(u)`` is finite;
- ``stream = 2 * position + purpose`` with :data:`PURPOSE_ACCEPT` (accept tests) or
  :data:`PURPOSE_SAMPLE` (the exponential-race noise of a resampled row, ``index`` = vocab
  id). ``position`` is the chain draft position or the tree node.

uint32 arithmetic is emulated in int64 (products split into 16-bit halves), so it runs on
any device and dtype-promotes nowhere. Arguments may mix tensors and Python ints; every
tensor the functions create is on the device of their first tensor argument.
"""

from __future__ import annotations

import torch

from osd_kernels._ops import native_available

MUL_A = 0xD2511F53
MUL_B = 0xCD9E8D57
WEYL_A = 0x9E3779B9
WEYL_B = 0xBB67AE85
MASK32 = 0xFFFFFFFF

PURPOSE_ACCEPT = 0
PURPOSE_SAMPLE = 1


def _device_of(*args) -> torch.device | None:
    """The device of the first tensor among ``args`` (None if all are Python numbers)."""
    return next((a.device for a in args if torch.is_tensor(a)), None)


def _int64(x, device) -> torch.Tensor:
    """``x`` (tensor or number) as an int64 tensor on ``device``. A number becomes a
    device scalar by a fill, not a host copy, so this is safe inside a CUDA graph capture."""
    if torch.is_tensor(x):
        return x.to(device=device, dtype=torch.int64)
    return torch.full((), int(x), dtype=torch.int64, device=device)


def _mulhilo(const: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of ``const * x`` for ``x`` in [0, 2**32), in int64."""
    c_hi, c_lo = const >> 16, const & 0xFFFF
    a = x * c_hi  # < 2**48
    b = x * c_lo  # < 2**48
    hi = (a + (b >> 16)) >> 16
    lo = (((a & 0xFFFF) << 16) + b) & MASK32
    return hi, lo


def philox4x32_10(c0, c1, c2, c3, k0, k1) -> tuple[torch.Tensor, ...]:
    """Philox-4x32-10 on broadcastable int64 tensors holding uint32 values.

    Returns the four output words as int64 tensors in [0, 2**32).
    """
    words = (c0, c1, c2, c3, k0, k1)
    dev = _device_of(*words)
    c0, c1, c2, c3, k0, k1 = torch.broadcast_tensors(*(_int64(t, dev) & MASK32 for t in words))
    for _ in range(10):
        hi_a, lo_a = _mulhilo(MUL_A, c0)
        hi_b, lo_b = _mulhilo(MUL_B, c2)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + WEYL_A) & MASK32
        k1 = (k1 + WEYL_B) & MASK32
    return c0, c1, c2, c3


def to_uniform(words: torch.Tensor) -> torch.Tensor:
    """uint32 words (int64 tensor) to float32 uniforms in (0, 1), exactly as the kernels."""
    return (words >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24


def stream_id(position, purpose: int):
    """Counter word 1 for ``position`` (draft position or tree node) and ``purpose``."""
    return position * 2 + purpose


def philox_uniform(seed, offset, stream, index) -> torch.Tensor:
    """Uniforms ``u(seed, offset, stream, index)`` in (0, 1), float32, broadcast over the args.

    ``seed`` and ``offset`` are int64 (reinterpreted as uint64), ``stream`` and ``index``
    integers in [0, 2**32).
    """
    dev = _device_of(seed, offset, stream, index)
    seed, offset, index = _int64(seed, dev), _int64(offset, dev), _int64(index, dev)
    words = philox4x32_10(
        index >> 2,
        _int64(stream, dev),
        offset & MASK32,
        (offset >> 32) & MASK32,
        seed & MASK32,
        (seed >> 32) & MASK32,
    )
    lane = torch.broadcast_to(index & 3, words[0].shape)
    picked = torch.where(lane == 0, words[0], words[1])
    picked = torch.where(lane == 2, words[2], picked)
    picked = torch.where(lane == 3, words[3], picked)
    return to_uniform(picked)


def philox_uniform_rows(seed, offset, stream, n: int) -> torch.Tensor:
    """Uniforms for indices ``0 .. n-1``: shape ``broadcast(seed, offset, stream) + (n,)``.

    Equal to ``philox_uniform(seed[..., None], offset[..., None], stream[..., None],
    arange(n))`` but runs one Philox call per four indices.
    """
    dev = _device_of(seed, offset, stream)
    seed = _int64(seed, dev)[..., None]
    offset = _int64(offset, dev)[..., None]
    stream = _int64(stream, dev)[..., None]
    blocks = torch.arange((n + 3) // 4, dtype=torch.int64, device=dev)
    words = philox4x32_10(
        blocks,
        stream,
        offset & MASK32,
        (offset >> 32) & MASK32,
        seed & MASK32,
        (seed >> 32) & MASK32,
    )
    words = torch.stack(words, dim=-1).flatten(-2)[..., :n]
    return to_uniform(words)


if native_available():

    @torch.library.register_fake("osd::philox_uniform")
    def _philox_uniform_fake(seed, offset, stream, num):
        return seed.new_empty((seed.shape[0], num), dtype=torch.float32)
