"""kv_rollback: every backend against the reference, overlapping slots, opcheck."""

import pytest
import torch

from osd_kernels import chain_rollback, kv_rollback, kv_rollback_reference
from tests.conftest import backends_for

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _random_case(gen, L, B_max, B, H, S, D, T, dtype, device):
    kv = torch.randn(L, 2, B_max, H, S, D, generator=gen).to(dtype).to(device)
    lens = torch.randint(0, S - T, (B_max,), generator=gen, dtype=torch.int32).to(device)
    slots = torch.full((B, T), -1, dtype=torch.int64)
    keep = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n = int(torch.randint(0, T + 1, (1,), generator=gen))
        if n:
            # a strictly increasing path that starts at the root (node 0)
            rest = torch.randperm(T - 1, generator=gen)[: n - 1].sort().values + 1
            slots[b, :n] = torch.cat([torch.zeros(1, dtype=torch.long), rest])
        keep[b] = n
    return kv, lens, slots.to(device), keep.to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 1, 1, 16, 8, 4),
        (2, 5, 3, 3, 37, 20, 9),
        (3, 8, 8, 2, 80, 64, 33),
        (1, 4, 2, 1, 70, 7, 64),
    ],
)
def test_matches_reference(device, dtype, shape):
    L, B_max, B, H, S, D, T = shape
    gen = torch.Generator().manual_seed(hash(shape) % 2**31)
    for backend in backends_for(device):
        kv, lens, slots, keep = _random_case(gen, L, B_max, B, H, S, D, T, dtype, device)
        kv_ref, lens_ref = kv.clone(), lens.clone()
        kv_rollback_reference(kv_ref, lens_ref, slots, keep)
        ptr = kv.data_ptr()
        kv_rollback(kv, lens, slots, keep, backend=backend)
        assert kv.data_ptr() == ptr
        assert torch.equal(lens, lens_ref), backend
        assert torch.equal(kv, kv_ref), backend


def test_parallel_rows(threads):
    """Many rows and heads through the C++ kernel's parallel loop."""
    gen = torch.Generator().manual_seed(5)
    kv, lens, slots, keep = _random_case(gen, 3, 16, 16, 4, 90, 32, 17, torch.float32, "cpu")
    ref, ref_lens = kv.clone(), lens.clone()
    kv_rollback_reference(ref, ref_lens, slots, keep)
    kv_rollback(kv, lens, slots, keep, backend="native")
    assert torch.equal(kv, ref) and torch.equal(lens, ref_lens)


def test_overlapping_source_and_destination(device):
    """Path [0, 1, 3, 4, 6]: slot 3 -> 2 and 4 -> 3 overlap (4's destination is 3's source)."""
    L, H, S, D = 2, 2, 12, 5
    for backend in ["reference"] + backends_for(device):
        kv = torch.arange(L * 2 * 1 * H * S * D, dtype=torch.float32).reshape(L, 2, 1, H, S, D)
        kv = kv.to(device)
        lens = torch.tensor([2], dtype=torch.int32, device=device)
        slots = torch.tensor([[0, 1, 3, 4, 6]], device=device)
        keep = torch.tensor([5], dtype=torch.int32, device=device)
        expect = kv.clone()
        for j, s in enumerate([0, 1, 3, 4, 6]):
            expect[..., 2 + j, :] = kv[..., 2 + s, :]
        kv_rollback(kv, lens, slots, keep, backend=backend)
        assert torch.equal(kv, expect), backend
        assert lens.tolist() == [7]


def test_strided_cache_view(device):
    """A cache whose head dim is padded (non-contiguous rows) is compacted correctly."""
    gen = torch.Generator().manual_seed(0)
    for backend in backends_for(device):
        full = torch.randn(2, 2, 3, 2, 30, 16, generator=gen).to(device)
        kv = full[..., :12]
        assert not kv.is_contiguous()
        lens = torch.tensor([3, 0, 10], dtype=torch.int32, device=device)
        slots = torch.tensor([[0, 2, 5], [0, 1, -1], [0, 4, -1]], device=device)
        keep = torch.tensor([3, 2, 2], dtype=torch.int32, device=device)
        ref, ref_lens = kv.clone(), lens.clone()
        kv_rollback_reference(ref, ref_lens, slots, keep)
        kv_rollback(kv, lens, slots, keep, backend=backend)
        assert torch.equal(kv, ref) and torch.equal(lens, ref_lens), backend


def test_chain_rollback_is_a_length_update(device):
    lens = torch.tensor([5, 7, 9], dtype=torch.int32, device=device)
    chain_rollback(lens, torch.tensor([1, 0], dtype=torch.int32, device=device))
    assert lens.tolist() == [6, 7, 9]


def test_bad_input_names_the_problem():
    kv = torch.zeros(1, 2, 2, 1, 8, 4)
    lens = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_cache"):
        kv_rollback(
            kv[0], lens, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="cache_lens"):
        kv_rollback(
            kv, lens.long(), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="num_keep"):
        kv_rollback(kv, lens, torch.zeros(1, 1, dtype=torch.long), torch.ones(2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="strictly increasing"):
        kv_rollback(
            kv, lens, torch.tensor([[0, 0]]), torch.tensor([2], dtype=torch.int32), backend="native"
        )


def test_opcheck():
    kv = torch.randn(2, 2, 3, 2, 10, 4)
    lens = torch.tensor([1, 2, 0], dtype=torch.int32)
    slots = torch.tensor([[0, 2], [0, 1]])
    keep = torch.tensor([2, 1], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.osd.kv_rollback.default,
        (kv, lens, slots, keep),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
