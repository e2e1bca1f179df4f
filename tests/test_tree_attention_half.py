"""tree_attention over a float16 cache under float32 queries (a CPU engine's half K/V,
widened as it is read): every C++ path and the Triton kernel against the same call over
a float32 cache holding the same values, and against the reference."""

import pytest
import torch

from osd_kernels import tree_attention
from tests.test_tree_attention import CPU_PATHS, _case, _check_close, _use_path, random_tree_mask


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("D", (24, 64, 128))
def test_half_cache_under_float32_queries(monkeypatch, path, D):
    """Float32 queries over a float16 cache (a CPU engine's half K/V, widened as it is
    read): on every path, tree and causal, decode and verify sizes, exactly what the same
    call gives over a float32 cache holding the same values, and within the float32
    tolerance of the reference."""
    _use_path(monkeypatch, path)
    gen = torch.Generator().manual_seed(D)
    for B, T in ((1, 1), (3, 7), (2, 40)):
        q, kv, lens = _case(gen, B, T, 9, 3, D, torch.float32, "cpu", max_prefix=150)
        half = kv.half()
        widened = half.float()
        for m in (random_tree_mask(gen, B, T), None):
            got = tree_attention(q, half[1, 0], half[1, 1], lens, m, backend="native")
            same = tree_attention(q, widened[1, 0], widened[1, 1], lens, m, backend="native")
            assert got.dtype == torch.float32 and torch.equal(got, same), (B, T, m is None)
            ref = tree_attention(q, half[1, 0], half[1, 1], lens, m, backend="reference")
            _check_close(ref, q, widened[1, 0], widened[1, 1], lens, m, torch.float32, "ref")
            _check_close(got, q, widened[1, 0], widened[1, 1], lens, m, torch.float32, path)


def test_half_cache_triton(device):
    """The Triton kernel takes a float16 cache under float32 queries too (its loads widen
    it); the engine makes such caches on the CPU only."""
    gen = torch.Generator().manual_seed(41)
    q, kv, lens = _case(gen, 3, 5, 4, 2, 16, torch.float32, device)
    half = kv.half()
    for m in (random_tree_mask(gen, 3, 5).to(device), None):
        got = tree_attention(q, half[0, 0], half[0, 1], lens, m, backend="triton")
        assert got.dtype == torch.float32
        _check_close(
            got, q, half[0, 0].float(), half[0, 1].float(), lens, m, torch.float32, "triton"
        )
