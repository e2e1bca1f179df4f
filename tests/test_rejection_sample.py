"""rejection_sample: every backend against the reference (token for token), degenerate
cases, invariants, the output distribution, bad input, opcheck."""

import pytest
import torch
import triton
import triton.language as tl
from scipy.stats import chisquare

from osd_kernels import rejection_sample, rejection_sample_reference, warp
from osd_kernels.triton import fpmath
from osd_kernels.warp import warp_probs
from tests.conftest import slow_case

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (temperature, top_k, top_p) presets; per-row mixes are built from them
PARAMS = {
    "plain": (1.0, 0, 1.0),
    "greedy": (0.0, 0, 1.0),
    "top_k": (0.8, 5, 1.0),
    "top_p": (1.2, 0, 0.8),
    "all": (0.7, 20, 0.9),
}


def _case(gen, B, K, V, dtype, device, *, draft_probs=True, params="plain", ragged=True, scale=2.0):
    """Random logits, a draft close to the target, drafted tokens and per-row parameters."""
    logits = (torch.randn(B, K + 1, V, generator=gen) * scale).to(dtype)
    q = torch.softmax(logits[:, :K].float() + 0.7 * torch.randn(B, K, V, generator=gen), -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(B, K)
    if params == "mixed":
        presets = list(PARAMS.values())
        rows = [presets[i % len(presets)] for i in range(B)]
    else:
        rows = [PARAMS[params]] * B
    kw = dict(
        temperature=torch.tensor([r[0] for r in rows]),
        top_k=torch.tensor([r[1] for r in rows], dtype=torch.int32),
        top_p=torch.tensor([r[2] for r in rows]),
        seed=torch.randint(-(2**62), 2**62, (B,), generator=gen),
        offset=torch.randint(0, 2**40, (B,), generator=gen),
    )
    if ragged:
        kw["num_draft_tokens"] = torch.randint(0, K + 1, (B,), generator=gen, dtype=torch.int32)
    kw = {k: v.to(device) for k, v in kw.items()}
    qd = q.to(dtype).to(device) if draft_probs else None
    return logits.to(device), drafts.to(device), qd, kw


def _assert_same(backend, logits, drafts, q, kw):
    ref = rejection_sample_reference(logits, drafts, q, **kw)
    out = rejection_sample(logits, drafts, q, backend=backend, **kw)
    assert out[0].dtype == torch.int64 and out[1].dtype == torch.int32
    assert torch.equal(out[0], ref[0]), (backend, out[0], ref[0])
    assert torch.equal(out[1], ref[1]), (backend, out[1], ref[1])
    return ref


def _check_invariants(out, acc, drafts, logits, kw):
    """Contiguous acceptance, one emitted token with positive warped mass, -1 padding."""
    B, K1 = out.shape
    n = kw.get("num_draft_tokens", torch.full((B,), K1 - 1)).cpu()
    out, acc, drafts, logits = out.cpu(), acc.cpu(), drafts.cpu(), logits.cpu()
    t = kw["temperature"].cpu()
    for b in range(B):
        a = int(acc[b])
        assert 0 <= a <= int(n[b])
        assert torch.equal(out[b, :a], drafts[b, :a])
        assert torch.all(out[b, a + 1 :] == -1)
        y = int(out[b, a])
        assert 0 <= y < logits.shape[-1]
        if float(t[b]) > 0:
            p = warp_probs(
                logits[b, a][None].float(), t[b], kw["top_k"].cpu()[b], kw["top_p"].cpu()[b]
            )[0]
            assert float(p[y]) > 0, "emitted a token the warped target gives no mass"
        else:
            assert y == int(logits[b, a].float().argmax())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "B,K,V", [(1, 1, 111), (3, 4, 1000), (8, 8, 111), (3, 2, 32003), (8, 5, 1000), (1, 7, 2)]
)
@pytest.mark.parametrize("with_q", [True, False])
def test_native_matches_reference(device, dtype, B, K, V, with_q):
    gen = torch.Generator().manual_seed(B * 1000 + K * 10 + V)
    for params in ["mixed", "plain", "greedy", "all"]:
        logits, drafts, q, kw = _case(
            gen, B, K, V, dtype, device, draft_probs=with_q, params=params
        )
        out, acc = _assert_same("native", logits, drafts, q, kw)
        _check_invariants(out, acc, drafts, logits, kw)


@pytest.mark.parametrize("V", [1000, 32003])
@pytest.mark.parametrize("with_q", [True, False])
def test_native_races_a_small_nucleus_as_the_reference(device, V, with_q):
    """Peaked logits under top-p leave a few tokens with positive rates; the CPU kernel
    then races those alone (race_sparse): the same tokens as the reference's full race,
    for bonus draws and for residuals after a rejection."""
    gen = torch.Generator().manual_seed(V + with_q)
    for top_p in (0.5, 0.9, 0.99, 0.999999):  # the last reaches below the kept keys' floor
        logits, drafts, q, kw = _case(
            gen, 6, 3, V, torch.float32, device, draft_probs=with_q, params="top_p", scale=8.0
        )
        kw["top_p"] = torch.full_like(kw["top_p"], top_p)
        out, acc = _assert_same("native", logits, drafts, q, kw)
        _check_invariants(out, acc, drafts, logits, kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "B,K,V,params", [(3, 3, 111, "mixed"), (1, 5, 37, "all"), (2, 1, 2, "plain")]
)
def test_triton_matches_reference(device, dtype, B, K, V, params):
    gen = torch.Generator().manual_seed(7 * B + K + V)
    for with_q in [True, False]:
        logits, drafts, q, kw = _case(
            gen, B, K, V, dtype, device, draft_probs=with_q, params=params
        )
        _assert_same("triton", logits, drafts, q, kw)


@pytest.mark.parametrize("backend", ["native", "triton"])
def test_strided_inputs(device, backend):
    gen = torch.Generator().manual_seed(3)
    B, K, V = 3, 4, 97
    logits, drafts, q, kw = _case(gen, B, K, V, torch.float32, device, params="mixed")
    # every operand non-contiguous: a padded vocab, a transposed layout, every other draft
    big = torch.zeros(B, K + 1, 2 * V, device=device)
    big[..., ::2] = logits
    logits_s = big[..., ::2]
    q_s = q.transpose(0, 1).contiguous().transpose(0, 1)
    drafts_wide = torch.zeros(B, 2 * K, dtype=torch.long, device=device)
    drafts_wide[:, ::2] = drafts
    drafts_s = drafts_wide[:, ::2]
    assert not (logits_s.is_contiguous() or q_s.is_contiguous() or drafts_s.is_contiguous())
    ref = rejection_sample_reference(logits, drafts, q, **kw)
    out = rejection_sample(logits_s, drafts_s, q_s, backend=backend, **kw)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


BACKENDS = ["reference", "native", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_hot_target_and_top_k_1(device, backend):
    """A one-hot target (or top_k=1, or a tiny top_p) emits only the argmax; drafts equal
    to it are always accepted."""
    gen = torch.Generator().manual_seed(11)
    B, K, V = 4, 3, 50
    logits = torch.randn(B, K + 1, V, generator=gen).to(device)
    best = logits.argmax(-1)
    drafts = best[:, :K].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % V  # one wrong draft
    ones = torch.ones(B, device=device)
    for kw in [dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-4 * ones)]:
        kw = {"temperature": ones, **kw, "seed": torch.arange(B, device=device)}
        out, acc = rejection_sample(logits, drafts, None, backend=backend, **kw)
        assert acc.tolist() == [K, 1, K, K]
        assert out[1, :2].tolist() == [int(best[1, 0]), int(best[1, 1])]
        assert torch.equal(out[0], best[0]) and torch.equal(out[2], best[2])
    hot = torch.full((B, K + 1, V), -1e4, device=device)
    hot.scatter_(2, best[..., None], 0.0)
    out, acc = rejection_sample(hot, drafts, None, temperature=ones, backend=backend)
    assert acc.tolist() == [K, 1, K, K] and out[1, 1] == best[1, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_p_equals_q_always_accepts(device, backend):
    gen = torch.Generator().manual_seed(5)
    B, K, V = 3, 4, 60
    for t, tk, tp in [(1.0, 0, 1.0), (0.6, 10, 1.0), (1.5, 0, 0.7)]:
        logits = (torch.randn(B, K + 1, V, generator=gen) * 3).to(device)
        q = warp_probs(logits[:, :K].reshape(-1, V), t, tk, tp).reshape(B, K, V)
        drafts = torch.multinomial(q.reshape(-1, V).cpu(), 1, generator=gen).reshape(B, K)
        out, acc = rejection_sample(
            logits,
            drafts.to(device),
            q,
            temperature=t,
            top_k=tk,
            top_p=tp,
            seed=torch.arange(B, device=device),
            backend=backend,
        )
        assert acc.tolist() == [K] * B
        assert torch.equal(out[:, :K].cpu(), drafts)


@pytest.mark.filterwarnings("ignore:divide by zero")  # log(0) in the Triton interpreter
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_draft_prob_is_accepted(device, backend):
    """q(x) = 0 where p(x) > 0: min(1, p/q) = 1, so the draft is always accepted."""
    B, K, V = 5, 2, 20
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(B, K + 1, V, generator=gen).to(device)
    drafts = torch.randint(0, V, (B, K), generator=gen).to(device)
    q = torch.softmax(torch.randn(B, K, V, generator=gen), -1).to(device)
    q.scatter_(2, drafts[..., None], 0.0)
    out, acc = rejection_sample(
        logits, drafts, q, temperature=1.0, backend=backend, seed=torch.arange(B, device=device)
    )
    assert acc.tolist() == [K] * B


@pytest.mark.parametrize("backend", ["native", "triton"])
def test_residual_without_mass_falls_back_to_p(device, backend):
    """q >= p everywhere (an unnormalised q of ones): the residual is empty and the
    recovered token comes from p itself; backends agree and never emit zero mass."""
    gen = torch.Generator().manual_seed(13)
    B, K, V = 8, 3, 40
    logits, drafts, _, kw = _case(gen, B, K, V, torch.float32, device, params="top_k")
    q = torch.ones(B, K, V, device=device)
    ref = _assert_same(backend, logits, drafts, q, kw)
    assert bool((ref[1] < kw["num_draft_tokens"]).any()), "no rejection exercised"
    _check_invariants(*ref, drafts, logits, kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_walk(device, backend):
    """Greedy: accept while the draft equals the argmax (lowest index on ties)."""
    logits = torch.zeros(3, 4, 5, device=device)
    logits[:, :, 2] = 1.0
    logits[:, :, 4] = 1.0  # tie with 2: argmax is 2
    logits[1, 1, 0] = 5.0
    drafts = torch.tensor([[2, 2, 2], [2, 2, 2], [2, 4, 2]], device=device)
    n = torch.tensor([3, 3, 2], dtype=torch.int32, device=device)
    out, acc = rejection_sample(logits, drafts, None, num_draft_tokens=n, backend=backend)
    assert acc.tolist() == [3, 1, 1]
    assert out.tolist() == [[2, 2, 2, 2], [2, 0, -1, -1], [2, 2, -1, -1]]


@pytest.mark.parametrize("layout", ["strided", "bfloat16"])
def test_greedy_reads_rows_in_place_or_copied(device, layout):
    """Greedy rows read float32 logits with a contiguous vocab in place and copy the others
    (a strided vocab, half precision) first: the same verdicts either way."""
    gen = torch.Generator().manual_seed(21)
    B, K, V = 4, 5, 1000
    logits = torch.randn(B, K + 1, V, generator=gen).to(torch.bfloat16).float().to(device)
    drafts = logits[:, :K].argmax(-1)
    drafts[1, 2] = (drafts[1, 2] + 1) % V  # a rejection mid-chain
    drafts[3, 0] = (drafts[3, 0] + 1) % V  # and at the first draft
    want = rejection_sample(logits, drafts, None, backend="native")
    if layout == "strided":
        wide = torch.zeros(B, K + 1, 2 * V, device=device)
        wide[..., ::2] = logits
        other = wide[..., ::2]
    else:
        other = logits.to(torch.bfloat16)  # exact: the values came from bfloat16
    got = rejection_sample(other, drafts, None, backend="native")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert want[1].tolist() == [K, 2, K, 0]


@pytest.mark.parametrize("backend", ["native", "triton"])
@pytest.mark.parametrize("temperature", [1e-3, 1e3])
def test_extreme_temperatures(device, backend, temperature):
    gen = torch.Generator().manual_seed(17)
    B, K, V = 4, 3, 64
    logits, drafts, q, kw = _case(gen, B, K, V, torch.float32, device)
    kw["temperature"] = torch.full((B,), temperature, device=device)
    out, acc = _assert_same(backend, logits, drafts, q, kw)
    _check_invariants(out, acc, drafts, logits, kw)


def _joint_first_two(backend, params, one_hot, n=100_000, V=6):
    """Empirical joint of the first two emitted tokens of a two-position generation, and
    the exact warped-target joint. Position 1's target depends on the first token; a row
    whose first draft is rejected emits its second token in a second verify step."""
    gen = torch.Generator().manual_seed(1234)
    t, tk, tp = params
    target0 = torch.randn(V, generator=gen) * 1.5
    target1 = torch.randn(V, V, generator=gen) * 1.5  # logits after token a
    q0 = warp_probs(torch.randn(1, V, generator=gen), t, tk, tp)[0]
    q1 = warp_probs(torch.randn(V, V, generator=gen), t, tk, tp)
    kw = dict(temperature=t, top_k=tk, top_p=tp, seed=torch.arange(n), backend=backend)

    def step(first_logits, first_q, offset):
        x1 = torch.multinomial(first_q, 1, generator=gen)[:, 0]
        x2 = torch.multinomial(q1[x1], 1, generator=gen)[:, 0]
        logits = torch.stack([first_logits, target1[x1], target1[x2]], 1)
        q = None if one_hot else torch.stack([first_q, q1[x1]], 1)
        sub = dict(kw, seed=kw["seed"][: len(x1)])
        return rejection_sample(logits, torch.stack([x1, x2], 1), q, offset=offset, **sub)

    out, acc = step(target0.expand(n, V), q0.expand(n, V), 0)
    first, second = out[:, 0], out[:, 1].clone()
    again = acc == 0
    out2, _ = step(target1[first[again]], q1[first[again]], 1)
    second[again] = out2[:, 0]
    observed = torch.bincount(first * V + second, minlength=V * V).double()
    p0 = warp_probs(target0[None], t, tk, tp)[0]
    p1 = warp_probs(target1, t, tk, tp)
    expected = (p0[:, None] * p1).flatten().double() * n
    return observed, expected


# the native kernel on every configuration, the (slower) reference on two; the two agree
# token for token in the tests above
@pytest.mark.parametrize(
    "backend,one_hot,params",
    [
        *[
            ("native", one_hot, params)
            for one_hot in (False, True)
            for params in [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.75), (0.9, 4, 0.9)]
        ],
        ("reference", False, (0.7, 3, 1.0)),
        ("reference", True, (1.3, 0, 0.75)),
    ],
)
def test_joint_of_first_two_tokens_follows_warped_target(backend, one_hot, params):
    """Chi-square of 10^5 two-token draws against the exact warped joint p0(a) p1(b | a),
    significance 1e-3; cells the warped target excludes must never occur."""
    observed, expected = _joint_first_two(backend, params, one_hot)
    zero = expected == 0
    assert observed[zero].sum() == 0
    stat = chisquare(observed[~zero], expected[~zero] * observed.sum() / expected.sum())
    assert stat.pvalue > 1e-3, (stat, params)


def test_generator_and_seeds():
    gen = torch.Generator().manual_seed(21)
    B, K, V = 4, 3, 30
    logits, drafts, q, _ = _case(gen, B, K, V, torch.float32, "cpu", ragged=False)
    t = torch.ones(B)
    a = rejection_sample(
        logits, drafts, q, temperature=t, generator=torch.Generator().manual_seed(5)
    )
    b = rejection_sample(
        logits, drafts, q, temperature=t, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(a[0], b[0])
    seeds = torch.randint(2**63 - 1, (B,), generator=torch.Generator().manual_seed(5))
    c = rejection_sample(logits, drafts, q, temperature=t, seed=seeds)
    assert torch.equal(a[0], c[0]), "generator draws the per-row seeds, offset 0"
    outs = {
        tuple(
            rejection_sample(logits, drafts, q, temperature=t, seed=seeds, offset=o)[0]
            .flatten()
            .tolist()
        )
        for o in range(8)
    }
    assert len(outs) > 1, "the offset selects fresh randomness"


def test_bad_input_names_the_problem():
    logits = torch.randn(2, 4, 10)
    drafts = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample(logits[0], drafts)
    with pytest.raises(TypeError, match="target_logits"):
        rejection_sample(logits.double(), drafts)
    with pytest.raises(TypeError, match="draft_token_ids"):
        rejection_sample(logits, drafts.int())
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(logits, drafts[:, :2])
    with pytest.raises(ValueError, match="draft_token_ids must lie"):
        rejection_sample(logits, drafts + 10)
    with pytest.raises(ValueError, match="vocab"):
        rejection_sample(logits, drafts, torch.rand(2, 3, 11))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(logits, drafts, torch.rand(2, 2, 10))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample(logits, drafts, num_draft_tokens=torch.tensor([1, 4], dtype=torch.int32))
    with pytest.raises(TypeError, match="num_draft_tokens"):
        rejection_sample(logits, drafts, num_draft_tokens=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="temperature"):
        rejection_sample(logits, drafts, temperature=torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="temperature"):
        rejection_sample(logits, drafts, temperature=torch.ones(3))
    with pytest.raises(ValueError, match="top_k"):
        rejection_sample(logits, drafts, temperature=1.0, top_k=-1)
    with pytest.raises(ValueError, match="top_p"):
        rejection_sample(logits, drafts, temperature=1.0, top_p=0.0)
    with pytest.raises(TypeError, match="seed"):
        rejection_sample(logits, drafts, temperature=1.0, seed=torch.ones(2))
    with pytest.raises(TypeError, match="generator"):
        rejection_sample(logits, drafts, temperature=1.0, generator=5)
    with pytest.raises(ValueError, match="backend"):
        rejection_sample(logits, drafts, backend="cudnn")


def test_opcheck():
    gen = torch.Generator().manual_seed(0)
    B, K, V = 3, 2, 17
    logits, drafts, q, kw = _case(gen, B, K, V, torch.float32, "cpu", params="mixed")
    args = (
        logits,
        drafts,
        q,
        kw["num_draft_tokens"],
        kw["temperature"],
        kw["top_k"],
        kw["top_p"].float(),
        kw["seed"],
        kw["offset"],
    )
    for a in (args, args[:2] + (None,) + args[3:]):
        torch.library.opcheck(
            torch.ops.osd.rejection_sample.default,
            a,
            test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
        )


@triton.jit
def _float_helpers_kernel(a_ptr, b_ptr, div_ptr, exp_ptr, log_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=1.0)
    b = tl.load(b_ptr + offs, mask=mask, other=1.0)
    tl.store(div_ptr + offs, fpmath.div(a, b), mask=mask)
    tl.store(exp_ptr + offs, fpmath.exp(a), mask=mask)
    tl.store(log_ptr + offs, fpmath.log(b), mask=mask)


# log(0), a / tiny and exp(100) in the Triton interpreter (NumPy warns, the results are right)
@pytest.mark.filterwarnings("ignore:divide by zero", "ignore:overflow")
def test_triton_float_helpers(device):
    """The samplers' division is IEEE (equal to torch's float32 division); their exp/log
    are within the documented error bounds of the float64 values: CUDA's expf/logf (2 and
    1 ulp) on a GPU, NumPy's float32 exp/log (2.52 and 3.83 ulp) under the interpreter;
    subnormal results are kept (no flush to zero)."""
    gen = torch.Generator().manual_seed(0)
    n = 4096
    a = torch.cat(
        [
            torch.randn(n - 6, generator=gen) * 30,
            torch.tensor([-100.0, -87.5, 0.0, float("-inf"), 88.0, 1e-30]),
        ]
    )
    b = torch.rand(n, generator=gen) * torch.tensor(10.0) ** torch.randint(
        -30, 30, (n,), generator=gen
    )
    b[:4] = torch.tensor([1.0, 2.0**-130, 0.0, 3.0])
    a, b = a.to(device), b.to(device)
    out = [torch.empty(n, device=device) for _ in range(3)]
    _float_helpers_kernel[(1,)](a, b, *out, n, BLOCK=n, **fpmath.launch_options(device))
    div, exp, log = (t.cpu() for t in out)
    a, b = a.cpu(), b.cpu()
    assert torch.equal(div, a / b)

    def ulps(x, exact):
        exact32 = exact.float()
        ulp = torch.nextafter(exact32.abs(), torch.tensor(float("inf"))) - exact32.abs()
        return torch.where(exact32 == x, 0.0, ((x.double() - exact) / ulp.double()).abs())

    exp_bound, log_bound = (2.0, 1.0) if device.type == "cuda" else (2.52, 3.83)
    assert float(ulps(exp, a.double().exp()).max()) <= exp_bound
    assert float(ulps(log, b.double().log()).max()) <= log_bound
    assert exp[n - 6] > 0  # exp(-100) is subnormal, not flushed to zero


# -- the first emitted token's distribution on every backend and device, small and 128k V
def _dist_cases():
    """(device, backend, V, n draws, warp). The reference materialises [n, K+1, V] and
    the interpreter runs one program per row in Python, so on CPU they take the small V
    with fewer draws; the C++ kernel also takes V = 128,256 (plain warp: its top-k and
    top-p bisections make 30 passes over V per row). On CUDA every backend takes both."""
    warped = dict(temperature=0.8, top_k=50, top_p=0.9)
    plain = dict(temperature=1.0)
    top_p = dict(temperature=0.8, top_p=0.9)  # one row at a time: a small nucleus raced alone
    cases = [
        ("cpu", "native", 1000, 40_000, warped),
        ("cpu", "native", 1000, 40_000, top_p),
        slow_case("cpu", "native", 128_256, 20_000, plain),
        slow_case("cpu", "reference", 1000, 20_000, warped),
        slow_case("cpu", "triton", 16, 400, plain),
    ]
    if torch.cuda.is_available():
        for backend in ("native", "triton", "reference"):
            cases += [
                pytest.param("cuda", backend, *rest, marks=pytest.mark.gpu)
                for rest in (
                    (1000, 100_000, warped),
                    (128_256, 100_000, warped),
                    (128_256, 100_000, plain),
                )
            ]
    return cases


@pytest.mark.parametrize(
    "device,backend,V,n,warp",
    _dist_cases(),
    ids=lambda c: str(c) if not isinstance(c, dict) else "-".join(c),
)
def test_first_token_follows_warped_target_every_backend(device, backend, V, n, warp):
    """n rows share one target and one draft (expanded, stride 0); each draws its draft
    token from q and is verified with its own seed. The first emitted token must follow
    the warped target p0 (chi-square, cells expected < 5 pooled, p > 1e-3), never
    leaving its support."""
    gen = torch.Generator().manual_seed(V + n)
    K = 2
    logits = torch.randn(1, K + 1, V, generator=gen) * 2.0
    logits[0, :, : min(40, V // 4)] += 6.0  # most mass on a few tokens
    q = torch.softmax(logits[0, :K] + torch.randn(K, V, generator=gen), -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).T.contiguous()
    dev = torch.device(device)

    def draw(a: int, b: int) -> torch.Tensor:
        m = b - a
        out, _ = rejection_sample(
            logits.to(dev).expand(m, K + 1, V),
            drafts[a:b].to(dev),
            q.to(dev).expand(m, K, V),
            seed=torch.arange(a, b, device=dev),
            offset=torch.full((m,), 7, device=dev),
            backend=backend,
            **{k: torch.full((m,), v, device=dev) for k, v in warp.items()},
        )
        return out[:, 0].cpu()

    first = in_row_chunks(n, (2 * K + 1) * V * 4, dev, draw)
    p0 = warp_probs(logits[0, :1], **{k: torch.tensor([v]) for k, v in warp.items()})[0]
    counts = torch.bincount(first, minlength=V).double()
    assert counts[p0 == 0].sum() == 0, "a token outside the warped target was emitted"
    exp = p0.double() * n
    small = exp < 5
    obs, ex = counts[~small], exp[~small]
    if exp[small].sum() > 0:  # pool the cells expected < 5
        obs = torch.cat([obs, counts[small].sum(0, keepdim=True)])
        ex = torch.cat([ex, exp[small].sum(0, keepdim=True)])
    stat = chisquare(obs.numpy(), ex.numpy() * float(obs.sum() / ex.sum()))
    assert stat.pvalue > 1e-3, stat


def test_top_p_from_candidates_equals_the_full_sort():
    """On the CPU ``warp_probs`` decides top-p from the largest probabilities only; its
    kept set equals the whole sorted row's, ties and exact-cumsum thresholds included,
    and rows no candidate count covers fall back to the sort."""
    g = torch.Generator().manual_seed(11)
    fallbacks = 0
    for trial in range(240):
        n = int(torch.randint(1, 6, (1,), generator=g))
        v = int(torch.randint(2, 2500, (1,), generator=g))
        x = torch.randn(n, v, generator=g) * float(torch.rand(1, generator=g)) * 8
        if trial % 3 == 0:
            x = (x * 2).round() / 2  # ties everywhere
        if trial % 7 == 0:
            x[:, : v // 2] = x[:, :1]  # one large tie group
        probs = torch.softmax(x, -1)
        p = torch.rand(n, generator=g).clamp(min=1e-3)
        if trial % 4 == 1:  # p exactly at a prefix sum
            csum = torch.sort(probs, -1, descending=True).values.cumsum(-1)
            p = csum[torch.arange(n), torch.randint(0, v, (n,), generator=g)].clamp(max=1.0)
        if trial % 5 == 0:
            p[0] = 1.0
        fast = warp._top_p_keep_candidates(probs, p)
        if fast is None:
            fallbacks += 1
            continue
        assert torch.equal(fast, warp._top_p_keep_sorted(probs, p)), trial
    assert 0 < fallbacks < 120
    flat = torch.zeros(2, 5000)
    assert warp._top_p_keep_candidates(torch.softmax(flat, -1), torch.tensor([0.9, 0.5])) is None
    assert torch.allclose(warp_probs(flat, 1.0, None, 0.9), torch.full((2, 5000), 1 / 5000))


def in_row_chunks(n: int, row_bytes: int, dev: torch.device, draw) -> torch.Tensor:
    """``draw(a, b)`` over row ranges covering ``0 .. n-1``, concatenated. On CUDA the
    ranges hold at most 256 MiB of ``row_bytes`` rows: the reference and the Triton
    wrappers materialise the expanded (stride 0) inputs, which at V = 128,256 and 100,000
    rows would not fit the GPU. Row ``i`` keeps seed ``i`` either way."""
    step = n if dev.type == "cpu" else max(1, (256 << 20) // row_bytes)
    return torch.cat([draw(a, min(n, a + step)) for a in range(0, n, step)])
