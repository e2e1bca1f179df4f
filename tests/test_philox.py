"""Philox-4x32-10: known answers, and bit equality of the PyTorch, C++ and Triton versions."""

import pytest
import torch
import triton
import triton.language as tl

from osd.spec_decode import model_drafter as drafters
from osd_kernels import philox as P
from osd_kernels._ops import native_available
from osd_kernels.triton.philox import philox4x32_10, philox_uniform

# Random123's kat_vectors for philox4x32_10: (counter, key) -> output words.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]

SEEDS = torch.tensor([0, 1, -1, 2**62 + 12345, -(2**40) - 7])
OFFSETS = torch.tensor([0, 2**32 + 3, 17, -5, 2**50])


@pytest.mark.parametrize("counter,key,expect", KAT)
def test_known_answers_torch(counter, key, expect):
    words = P.philox4x32_10(*counter, *key)
    assert tuple(int(w) for w in words) == expect


def test_uniform_range_and_moments():
    u = P.philox_uniform(7, 3, P.stream_id(2, P.PURPOSE_SAMPLE), torch.arange(200_000))
    assert u.dtype == torch.float32
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert torch.isfinite(torch.log(u)).all()
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert abs(float((u * u).mean()) - 1 / 3) < 0.005
    # extremes of the word -> float map are exact and strictly inside (0, 1)
    ends = P.to_uniform(torch.tensor([0, 0xFFFFFFFF]))
    assert ends.tolist() == [2.0**-24, 1 - 2.0**-24]


def test_streams_and_offsets_differ():
    idx = torch.arange(64)
    a = P.philox_uniform(5, 0, 0, idx)
    assert not torch.equal(a, P.philox_uniform(5, 1, 0, idx))
    assert not torch.equal(a, P.philox_uniform(5, 0, 1, idx))
    assert not torch.equal(a, P.philox_uniform(6, 0, 0, idx))
    assert torch.equal(a, P.philox_uniform(5, 0, 0, idx))


@pytest.mark.skipif(not native_available(), reason="osd_kernels._C is not built")
@pytest.mark.parametrize("n", [0, 1, 3, 1031, 49155])
def test_cpp_matches_torch(n):
    out = torch.ops.osd.philox_uniform(SEEDS, OFFSETS, 9, n)
    ref = P.philox_uniform(SEEDS[:, None], OFFSETS[:, None], 9, torch.arange(n)[None])
    assert torch.equal(out, ref)
    assert torch.equal(out, P.philox_uniform_rows(SEEDS, OFFSETS, 9, n))


@pytest.mark.skipif(not native_available(), reason="osd_kernels._C is not built")
def test_draft_sampler_noise_is_the_same_on_every_path(monkeypatch):
    """``sample_draft`` takes its CPU noise from the C++ generator: the same tokens as the
    PyTorch generator's."""
    g = torch.Generator().manual_seed(3)
    q = torch.softmax(torch.randn(SEEDS.shape[0], 1001, generator=g), -1)
    fast = drafters.sample_draft(q, SEEDS, OFFSETS, 2)
    monkeypatch.setattr(drafters, "native_available", lambda: False)
    assert torch.equal(fast, drafters.sample_draft(q, SEEDS, OFFSETS, 2))


@triton.jit
def raw_kernel(c_ptr, k_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    c0 = tl.load(c_ptr + i * 4).to(tl.uint32)
    c1 = tl.load(c_ptr + i * 4 + 1).to(tl.uint32)
    c2 = tl.load(c_ptr + i * 4 + 2).to(tl.uint32)
    c3 = tl.load(c_ptr + i * 4 + 3).to(tl.uint32)
    k0 = tl.load(k_ptr + i * 2).to(tl.uint32)
    k1 = tl.load(k_ptr + i * 2 + 1).to(tl.uint32)
    w0, w1, w2, w3 = philox4x32_10(c0, c1, c2, c3, k0, k1)
    tl.store(out_ptr + i * 4, w0.to(tl.int64))
    tl.store(out_ptr + i * 4 + 1, w1.to(tl.int64))
    tl.store(out_ptr + i * 4 + 2, w2.to(tl.int64))
    tl.store(out_ptr + i * 4 + 3, w3.to(tl.int64))


@triton.jit
def uniform_kernel(seed_ptr, offset_ptr, stream, out_ptr, n, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    seed = tl.load(seed_ptr + b)
    offset = tl.load(offset_ptr + b)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + b * n + i, philox_uniform(seed, offset, stream, i), mask=i < n)


@triton.jit
def randint4x_kernel(seed, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    w0, w1, w2, w3 = tl.randint4x(seed, i)
    tl.store(out_ptr + i * 4, w0.to(tl.uint32).to(tl.int64))
    tl.store(out_ptr + i * 4 + 1, w1.to(tl.uint32).to(tl.int64))
    tl.store(out_ptr + i * 4 + 2, w2.to(tl.uint32).to(tl.int64))
    tl.store(out_ptr + i * 4 + 3, w3.to(tl.uint32).to(tl.int64))


def test_triton_matches_torch():
    counters = torch.tensor([c for c, _, _ in KAT] + [KAT[0][0]], dtype=torch.int64)
    keys = torch.tensor([k for _, k, _ in KAT] + [KAT[0][1]], dtype=torch.int64)
    out = torch.zeros(4, 4, dtype=torch.int64)
    raw_kernel[(1,)](counters, keys, out, N=4)
    assert [tuple(r) for r in out.tolist()] == [e for _, _, e in KAT] + [KAT[0][2]]

    n = 203
    uni = torch.zeros(len(SEEDS), n)
    uniform_kernel[(len(SEEDS),)](SEEDS, OFFSETS, 11, uni, n, BLOCK=64)
    ref = P.philox_uniform(SEEDS[:, None], OFFSETS[:, None], 11, torch.arange(n)[None])
    assert torch.equal(uni, ref)

    # the generator is Triton's own tl.randint4x with key = seed, counter = (offset, 0, 0, 0)
    seed = 2**33 + 17
    words = torch.zeros(16, 4, dtype=torch.int64)
    randint4x_kernel[(1,)](seed, words, N=16)
    ref = torch.stack(P.philox4x32_10(torch.arange(16), 0, 0, 0, seed & P.MASK32, seed >> 32), 1)
    assert torch.equal(words, ref)
