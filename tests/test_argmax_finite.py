"""argmax_finite: the native kernel against the reference (torch.argmax and isfinite) on
random rows of odd and real vocabulary sizes, on the AVX-512 and the portable pass; ties,
NaN / +inf / -inf placed anywhere (the lanes' tails included), rows of -inf, strided and
empty inputs; bad input; opcheck; and the engine's greedy paths on top of it."""

import pytest
import torch

from osd.sampling import greedy_nonfinite, greedy_tokens, nonfinite_rows
from osd.spec_decode.proposals import ChainProposal
from osd.spec_decode.step import greedy_chain
from osd_kernels import (
    argmax_finite,
    argmax_finite_reference,
    native_available,
    rejection_sample,
)
from tests.conftest import set_isa

native = pytest.mark.skipif(not native_available(), reason="osd_kernels._C is not built")
ISAS = [{}, {"OSD_NO_AVX512": "1"}]
ISA_IDS = ["avx512", "portable"]


def _check(logits):
    ids, bad = argmax_finite(logits, backend="native")
    want_ids, want_bad = argmax_finite_reference(logits)
    assert ids.dtype == torch.int64 and bad.dtype == torch.bool
    assert ids.shape == want_ids.shape and bad.shape == want_bad.shape
    assert torch.equal(bad, want_bad)
    nan = torch.isnan(logits).any(-1)
    assert torch.equal(ids[~nan], want_ids[~nan])  # a row with a NaN: id unspecified
    return ids, bad


@native
@pytest.mark.parametrize("env", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("V", [1, 5, 16, 17, 33, 1000, 49152, 131075])
def test_native_matches_reference(monkeypatch, env, V):
    set_isa(monkeypatch, env)
    g = torch.Generator().manual_seed(V)
    _check(torch.randn(7, V, generator=g) * 4)
    _check(torch.randn(2, 3, V, generator=g))  # leading dims


@native
@pytest.mark.parametrize("env", ISAS, ids=ISA_IDS)
def test_ties_take_the_lowest_index(monkeypatch, env):
    set_isa(monkeypatch, env)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-3, 4, (64, 259), generator=g).float()  # many equal maxima
    ids, _ = _check(x)
    for row, i in zip(x, ids.tolist()):
        assert i == int((row == row.max()).nonzero()[0])
    same = torch.zeros(3, 100)
    same[1, 5:] = 1.0
    same[2, [37, 21, 98]] = 2.0
    assert argmax_finite(same, backend="native")[0].tolist() == [0, 5, 21]


@native
@pytest.mark.parametrize("env", ISAS, ids=ISA_IDS)
@pytest.mark.parametrize("V", [7, 16, 50, 1003])
def test_nonfinite_anywhere(monkeypatch, env, V):
    set_isa(monkeypatch, env)
    g = torch.Generator().manual_seed(V + 1)
    for value in (float("nan"), float("inf"), float("-inf")):
        for at in sorted({0, 1, V // 2, V - 2, V - 1} - {-1}):
            x = torch.randn(3, V, generator=g)
            x[1, at] = value
            ids, bad = _check(x)
            assert bad.tolist() == [False, True, False]
            if value == float("inf"):
                assert ids[1].item() == at
    x = torch.full((4, V), float("-inf"))
    x[1, V - 1] = 0.0
    x[2, 1:] = float("nan")  # a -inf and NaNs
    x[3] = float("nan")
    ids, bad = argmax_finite(x, backend="native")
    assert bad.tolist() == [True, True, True, True]
    assert ids[:2].tolist() == [0, V - 1]  # all -inf: index 0, as torch.argmax
    assert 0 <= ids[2].item() < V and 0 <= ids[3].item() < V
    big = torch.full((2, V), 3.0e38)  # finite values whose sum overflows: finite rows
    assert argmax_finite(big, backend="native")[1].tolist() == [False, False]


@native
@pytest.mark.parametrize("env", ISAS, ids=ISA_IDS)
def test_strides_and_empty(monkeypatch, env):
    set_isa(monkeypatch, env)
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 600, generator=g)
    _check(wide[:, ::2])  # rows with a stride: copied to contiguous rows
    _check(wide[1:4, 17:400])  # a row stride past the row length
    _check(torch.randn(301, generator=g))  # one row: 0-dim results
    ids, bad = argmax_finite(torch.randn(0, 50), backend="native")
    assert ids.shape == (0,) and bad.shape == (0,)
    many = torch.randn(64, 40000, generator=g)  # several tasks of the thread pool
    _check(many)


def test_bad_input():
    with pytest.raises(ValueError, match=r"\[..., V\]"):
        argmax_finite(torch.randn(2, 0))
    with pytest.raises(TypeError, match="float"):
        argmax_finite(torch.ones(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="no Triton kernel"):
        argmax_finite(torch.randn(2, 5), backend="triton")
    if native_available():
        with pytest.raises(ValueError, match="float32 CPU"):
            argmax_finite(torch.randn(2, 5, dtype=torch.bfloat16), backend="native")


def test_auto_takes_half_precision_through_the_reference():
    x = torch.randn(3, 100).to(torch.bfloat16)
    x[2, 4] = float("inf")
    ids, bad = argmax_finite(x)
    assert ids.tolist() == x.argmax(-1).tolist() and bad.tolist() == [False, False, True]


@native
def test_opcheck():
    x = torch.randn(3, 70)
    torch.library.opcheck(torch.ops.osd.argmax_finite.default, (x,))
    torch.library.opcheck(torch.ops.osd.argmax_finite.default, (x.new_empty(0, 70),))


@native
@pytest.mark.parametrize("K", [0, 1, 4])
def test_greedy_chain_equals_the_rejection_sampler(K):
    """The speculative step's greedy chain sampler (one argmax_finite pass) gives the chain
    rejection sampler's tokens and counts, with per-row draft counts, drafts that match
    the argmax for a while, ties and a row of NaN logits."""
    g = torch.Generator().manual_seed(K)
    B, V = 9, 301
    logits = torch.randint(-4, 5, (B, K + 1, V), generator=g).float()  # ties
    drafts = logits[:, :K].argmax(-1)
    flip = torch.rand(B, K, generator=g) < 0.3
    drafts = torch.where(flip, torch.randint(0, V, (B, K), generator=g), drafts)
    logits[B - 1, K, 3] = float("nan")
    for num in (None, torch.randint(0, K + 1, (B,), generator=g, dtype=torch.int32)):
        prop = ChainProposal(drafts, None, None, num, K)
        out, n, bad = greedy_chain(logits, prop)
        seed = torch.zeros(B, dtype=torch.int64)
        want_out, want_n = rejection_sample(
            logits[: B - 1], drafts[: B - 1], None, num_draft_tokens=None if num is None
            else num[: B - 1], seed=seed[: B - 1], offset=seed[: B - 1],
        )  # fmt: skip
        assert n.dtype == torch.int32 and torch.equal(n[: B - 1], want_n)
        assert torch.equal(out[: B - 1], want_out)
        assert bad.tolist() == [False] * (B - 1) + [True]


@native
def test_greedy_helpers_equal_torch():
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-3, 3, (6, 4, 777), generator=g).float()
    x[2, 1, 9] = float("inf")
    x[4, 3, 0] = float("nan")
    assert torch.equal(greedy_tokens(x[:, 0]), x[:, 0].argmax(-1))
    ids, bad = greedy_nonfinite(x[:, 0])
    assert torch.equal(ids, x[:, 0].argmax(-1)) and not bad.any()
    assert nonfinite_rows(x).tolist() == [False, False, True, False, True, False]
    long = torch.randn(2, 30, 40000, generator=g)  # a prefill's many positions
    long[1, 29, 39999] = float("-inf")
    assert nonfinite_rows(long).tolist() == [False, True]
