"""topk_probs: the native kernel against the reference (softmax then top-k) on random rows
of odd and real vocabulary sizes, on the AVX-512 and the portable selection; ties, -inf
entries, k past V, empty and batched leading dims; bad input; opcheck; and the online
collector's teacher rows equal to the reference's."""

import pytest
import torch

import osd_kernels
from osd_kernels import native_available, topk_probs, topk_probs_reference
from osd.online.buffer import compress_target
from tests.conftest import set_isa

native = pytest.mark.skipif(not native_available(), reason="osd_kernels._C is not built")
ISAS = [{}, {"OSD_NO_AVX512": "1"}]
ISA_IDS = ["avx512", "portable"]


def _check(logits, k, **kw):
    ids, probs = topk_probs(logits, k, backend="native", **kw)
    want_ids, want_probs = topk_probs_reference(logits, k)
    assert ids.dtype == torch.int64 and probs.dtype == torch.float32
    assert ids.shape == want_ids.shape and probs.shape == want_probs.shape
    torch.testing.assert_close(probs, want_probs, rtol=2e-6, atol=1e-9)
    # random logits have no ties among the kept ones: the same ids in the same order
    assert torch.equal(ids, want_ids)


@native
@pytest.mark.parametrize("env", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("V", [1, 5, 17, 33, 1000, 49152, 131075])
@pytest.mark.parametrize("k", [1, 7, 32])
def test_native_matches_reference(monkeypatch, env, V, k):
    set_isa(monkeypatch, env)
    g = torch.Generator().manual_seed(V * 100 + k)
    _check(torch.randn(3, V, generator=g) * 4, k)


@native
@pytest.mark.parametrize("env", ISAS, ids=ISA_IDS)
def test_leading_dims_strides_and_empty(monkeypatch, env):
    set_isa(monkeypatch, env)
    g = torch.Generator().manual_seed(1)
    _check(torch.randn(2, 3, 301, generator=g), 9)
    _check(torch.randn(301, generator=g), 9)
    wide = torch.randn(4, 600, generator=g)
    _check(wide[:, ::2], 9)  # rows with a stride: copied to contiguous rows
    _check(wide[1:3, 17:400], 9)  # a row stride past the row length
    ids, probs = topk_probs(torch.randn(0, 50), 8, backend="native")
    assert ids.shape == (0, 8) and probs.shape == (0, 8)


@native
@pytest.mark.parametrize("env", ISAS, ids=ISA_IDS)
def test_ties_rank_the_lower_id_first(monkeypatch, env):
    set_isa(monkeypatch, env)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-3, 4, (5, 257), generator=g).float()  # many equal logits
    ids, probs = topk_probs(x, 40, backend="native")
    vals = x.gather(1, ids)
    want_vals = torch.topk(x, 40, dim=-1).values
    assert torch.equal(vals, want_vals)
    for row, taken in zip(x, ids.tolist()):
        # among equal logits the kept ids are the lowest and come in increasing order
        for a, b in zip(taken, taken[1:]):
            assert row[a] > row[b] or a < b
        last = row[taken[-1]]
        below = [v for v in range(row.numel()) if row[v] == last and v not in taken]
        assert all(v > taken[-1] for v in below)
    torch.testing.assert_close(probs, torch.softmax(x, -1).gather(1, ids), rtol=2e-6, atol=0)


@native
@pytest.mark.parametrize("env", ISAS, ids=ISA_IDS)
def test_minus_inf_and_k_past_v(monkeypatch, env):
    set_isa(monkeypatch, env)
    x = torch.full((2, 40), float("-inf"))
    x[0, [3, 30, 7]] = torch.tensor([1.0, 2.0, 0.5])
    x[1, 39] = 0.0
    ids, probs = topk_probs(x, 4, backend="native")
    assert ids[0, :3].tolist() == [30, 3, 7] and ids[1, 0].item() == 39
    assert probs[:, 3].tolist() == [0.0, 0.0] and probs[1, 0].item() == 1.0
    torch.testing.assert_close(probs[0].sum(), torch.tensor(1.0))
    _check(torch.randn(2, 6), 50)  # k past V: all of V, most probable first


def test_bad_input():
    with pytest.raises(ValueError, match="k must be >= 1"):
        topk_probs(torch.randn(2, 5), 0)
    with pytest.raises(ValueError, match=r"\[..., V\]"):
        topk_probs(torch.randn(2, 0), 3)
    with pytest.raises(TypeError, match="float"):
        topk_probs(torch.ones(2, 5, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="no Triton kernel"):
        topk_probs(torch.randn(2, 5), 3, backend="triton")
    if native_available():
        with pytest.raises(ValueError, match="float32 CPU"):
            topk_probs(torch.randn(2, 5, dtype=torch.bfloat16), 3, backend="native")


def test_auto_takes_half_precision_through_the_reference():
    x = torch.randn(3, 100).to(torch.bfloat16)
    ids, probs = topk_probs(x, 5)
    want = topk_probs_reference(x, 5)
    assert torch.equal(ids, want[0]) and torch.equal(probs, want[1])


@native
def test_opcheck():
    x = torch.randn(3, 70)
    torch.library.opcheck(torch.ops.osd.topk_probs.default, (x, 8))
    torch.library.opcheck(torch.ops.osd.topk_probs.default, (x[:, :0].new_empty(0, 70), 8))


def test_teacher_rows_are_the_reference_top_k():
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(3)) * 4
    ids, probs, full = compress_target(logits, 32)
    want_ids, want_probs = topk_probs_reference(logits, 32)
    assert full is None and torch.equal(ids, want_ids)
    torch.testing.assert_close(probs, want_probs, rtol=2e-6, atol=1e-9)
    assert osd_kernels.topk_probs is topk_probs
