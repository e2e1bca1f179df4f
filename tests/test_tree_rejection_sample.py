"""tree_rejection_sample: golden greedy trees, every backend against the reference,
degenerate cases, chi-square distribution tests, bad input, opcheck."""

import pytest
import torch
from scipy import stats

from osd_kernels import rejection_sample, tree_rejection_sample, tree_rejection_sample_reference
from osd_kernels._ops import native_available
from osd_kernels.tree_rejection_sample import tree_depths
from osd_kernels.warp import warp_probs
from tests.conftest import backends_for, slow_case
from tests.test_rejection_sample import in_row_chunks

MODES = ["greedy", "point_mass", "with_replacement", "without_replacement"]
ALPHA = 1e-3  # significance of the chi-square tests: each fails by chance with prob 1e-3
N_DRAWS = 150_000
NEG = float("-inf")


def _run(backend, logits, tokens, parents, q=None, **kw):
    if backend == "reference":
        return tree_rejection_sample_reference(logits, tokens, parents, q, **kw)
    return tree_rejection_sample(logits, tokens, parents, q, backend=backend, **kw)


def _all_backends(device):
    return ["reference"] + backends_for(device)


def _assert_equal(got, want, msg=""):
    for name, g, w in zip(("accepted_nodes", "output_token_ids", "num_accepted"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, msg)
        assert torch.equal(g.cpu(), w.cpu()), (name, msg, g, w)


# ---------------------------------------------------------------------------------------
# golden trees for the greedy walk


def _greedy_logits(argmax_rows, V, ties=()):
    """Logits [1, T, V] whose row i has its maximum at argmax_rows[i] (and at the extra
    tokens of ``ties``: (row, token) pairs with the same maximum)."""
    g = torch.Generator().manual_seed(len(argmax_rows))
    logits = torch.randn(1, len(argmax_rows), V, generator=g)
    for i, t in enumerate(argmax_rows):
        logits[0, i, t] = 10.0
    for i, t in ties:
        logits[0, i, t] = 10.0
    return logits


# (name, parents, tokens, argmax per node, ties, max_depth, expected path, expected output)
GOLDEN = [
    (
        "chain_all_accepted",
        [-1, 0, 1, 2],
        [9, 4, 2, 7],
        [4, 2, 7, 1],
        (),
        None,
        [0, 1, 2, 3],
        [4, 2, 7, 1],
    ),
    (
        "chain_mismatch_at_second",
        [-1, 0, 1, 2],
        [9, 4, 2, 7],
        [4, 5, 7, 1],
        (),
        None,
        [0, 1],
        [4, 5],
    ),
    ("root_rejects_all", [-1, 0, 0, 0], [0, 1, 2, 3], [6, 0, 0, 0], (), None, [0], [6]),
    (
        "branching",
        [-1, 0, 0, 0, 2, 2, 5],
        [0, 3, 5, 6, 1, 2, 0],
        [5, 9, 2, 9, 9, 0, 4],
        (),
        None,
        [0, 2, 5, 6],
        [5, 2, 0, 4],
    ),
    (
        "tie_takes_lowest_token",
        [-1, 0, 0, 1, 2],
        [0, 5, 3, 8, 1],
        [5, 8, 1, 2, 2],
        ((0, 3),),
        None,
        [0, 2, 4],
        [3, 1, 2],
    ),
    (
        "repeated_sibling_takes_first",
        [-1, 0, 0, 2],
        [0, 5, 5, 4],
        [5, 7, 4, 3],
        (),
        None,
        [0, 1],
        [5, 7],
    ),
    (
        "absent_nodes_are_skipped",
        [-1, -1, 0, 2, -1, 4],
        [0, 6, 6, 1, 2, 2],
        [6, 0, 1, 2, 0, 0],
        (),
        None,
        [0, 2, 3],
        [6, 1, 2],
    ),
    ("max_depth_caps_the_walk", [-1, 0, 1, 2], [9, 4, 2, 7], [4, 2, 7, 1], (), 1, [0, 1], [4, 2]),
    (
        "deep_right_branch",
        [-1, 0, 0, 1, 2, 4, 4, 6],
        [0, 1, 2, 3, 4, 5, 6, 7],
        [2, 3, 4, 9, 6, 9, 7, 8],
        (),
        None,
        [0, 2, 4, 6, 7],
        [2, 4, 6, 7, 8],
    ),
]


@pytest.mark.parametrize("case", GOLDEN, ids=[c[0] for c in GOLDEN])
def test_greedy_golden_trees(device, case):
    _, parents, tokens, argmax, ties, max_depth, path, out = case
    V = 10
    logits = _greedy_logits(argmax, V, ties).to(device)
    par = torch.tensor([parents], dtype=torch.int32, device=device)
    tok = torch.tensor([tokens], device=device)
    D = max_depth if max_depth is not None else int(tree_depths(par).max())
    want_nodes = torch.full((1, D + 1), -1)
    want_nodes[0, : len(path)] = torch.tensor(path)
    want_out = torch.full((1, D + 1), -1)
    want_out[0, : len(out)] = torch.tensor(out)
    want = (want_nodes, want_out, torch.tensor([len(path) - 1], dtype=torch.int32))
    for backend in _all_backends(device):
        for temperature in (None, 0.0):
            got = _run(backend, logits, tok, par, temperature=temperature, max_depth=max_depth)
            _assert_equal(got, want, backend)


def test_greedy_golden_batch_of_trees(device):
    """The golden trees as one ragged batch (absent nodes pad the smaller ones)."""
    T, V = max(len(c[1]) for c in GOLDEN if c[5] is None), 10
    cases = [c for c in GOLDEN if c[5] is None]
    logits = torch.zeros(len(cases), T, V)
    par = torch.full((len(cases), T), -1, dtype=torch.int32)
    tok = torch.full((len(cases), T), -1)
    for b, (_, parents, tokens, argmax, ties, _, _, _) in enumerate(cases):
        n = len(parents)
        logits[b, :n] = _greedy_logits(argmax, V, ties)[0]
        par[b, :n] = torch.tensor(parents, dtype=torch.int32)
        tok[b, :n] = torch.tensor(tokens)
    for backend in _all_backends(device):
        nodes, out, n = _run(backend, logits.to(device), tok.to(device), par.to(device))
        for b, c in enumerate(cases):
            k = len(c[6])
            assert nodes[b, :k].tolist() == c[6] and out[b, :k].tolist() == c[7], (backend, c[0])
            assert (nodes[b, k:] == -1).all() and (out[b, k:] == -1).all()
            assert int(n[b]) == k - 1


# ---------------------------------------------------------------------------------------
# random trees: every backend against the reference


def _random_parents(gen, B, T, absent=0.1):
    """Random trees with parents[i] < i, biased towards deep paths; some nodes absent."""
    parents = torch.full((B, T), -1, dtype=torch.int32)
    for i in range(1, T):
        back = torch.randint(1, min(i, 3) + 1, (B,), generator=gen)
        parents[:, i] = (i - back).to(torch.int32)
    drop = torch.rand(B, T, generator=gen) < absent
    drop[:, 0] = False
    parents[drop] = -1
    return parents


def _random_case(gen, B, T, V, mode, dtype, *, scale=3.0):
    """Peaked logits, drafts close to the target, children drawn from the draft (or the
    target's argmax), so paths are long and every branch of the rule is exercised."""
    logits = torch.randn(B, T, V, generator=gen) * scale
    parents = _random_parents(gen, B, T)
    q = torch.softmax(logits + torch.randn(B, T, V, generator=gen), dim=-1)
    par = parents.long().clamp(min=0)
    q_par = q.gather(1, par[..., None].expand(B, T, V))  # row i: the draft of i's parent
    tokens = torch.multinomial(q_par.reshape(-1, V), 1, generator=gen).view(B, T)
    amax = logits.gather(1, par[..., None].expand(B, T, V)).argmax(-1)
    use_amax = torch.rand(B, T, generator=gen) < 0.3
    tokens = torch.where(use_amax, amax, tokens)
    tokens[parents < 0] = -1
    temperature = torch.rand(B, generator=gen) * 1.5 + 0.3
    top_k = torch.where(
        torch.rand(B, generator=gen) < 0.5, torch.randint(1, V + 1, (B,), generator=gen), 0
    ).to(torch.int32)
    top_p = torch.where(
        torch.rand(B, generator=gen) < 0.5, torch.rand(B, generator=gen) * 0.8 + 0.2, 1.0
    )
    if mode == "greedy":
        temperature = torch.zeros(B)
    elif B > 1:
        temperature[0] = 0.0  # a greedy row in a stochastic batch
    kw = dict(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=torch.randint(2**62, (B,), generator=gen),
        offset=torch.randint(2**40, (B,), generator=gen),
        without_replacement=mode == "without_replacement",
    )
    draft = q.to(dtype) if mode in ("with_replacement", "without_replacement") else None
    return logits.to(dtype), tokens, parents, draft, kw


def _to(device, logits, tokens, parents, draft, kw):
    kw = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kw.items()}
    draft = None if draft is None else draft.to(device)
    return logits.to(device), tokens.to(device), parents.to(device), draft, kw


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "B,T,V,dtype",
    [
        (1, 1, 111, torch.float32),
        (3, 7, 111, torch.bfloat16),
        (8, 64, 1000, torch.float16),
        (3, 33, 32003, torch.float32),
        (1, 64, 32003, torch.bfloat16),
        (8, 9, 2, torch.float16),
        (3, 12, 1000, torch.float32),
        (3, 12, 1000, torch.bfloat16),
        (3, 12, 1000, torch.float16),
    ],
)
def test_native_matches_reference(device, mode, B, T, V, dtype):
    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + V + MODES.index(mode))
    case = _to(device, *_random_case(gen, B, T, V, mode, dtype))
    logits, tokens, parents, draft, kw = case
    want = tree_rejection_sample_reference(logits, tokens, parents, draft, **kw)
    got = tree_rejection_sample(logits, tokens, parents, draft, backend="native", **kw)
    _assert_equal(got, want, (mode, dtype))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "B,T,V,dtype",
    [
        (3, 7, 111, torch.float32),
        (1, 9, 1000, torch.bfloat16),
        (2, 5, 2, torch.float16),
        (8, 6, 111, torch.float16),
    ],
)
def test_triton_matches_reference(device, mode, B, T, V, dtype):
    """Small shapes: the interpreter runs the bisection passes of top-k / top-p slowly."""
    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + V + MODES.index(mode))
    logits, tokens, parents, draft, kw = _to(device, *_random_case(gen, B, T, V, mode, dtype))
    want = tree_rejection_sample_reference(logits, tokens, parents, draft, **kw)
    got = tree_rejection_sample(logits, tokens, parents, draft, backend="triton", **kw)
    _assert_equal(got, want, (mode, dtype))


@pytest.mark.parametrize("mode", ["greedy", "with_replacement"])
def test_triton_large_vocab(device, mode):
    """V = 32003 (32 blocks per pass), temperature only."""
    gen = torch.Generator().manual_seed(31)
    logits, tokens, parents, draft, kw = _random_case(gen, 1, 5, 32003, mode, torch.float32)
    kw.pop("top_k"), kw.pop("top_p")
    logits, tokens, parents, draft, kw = _to(device, logits, tokens, parents, draft, kw)
    want = tree_rejection_sample_reference(logits, tokens, parents, draft, **kw)
    got = tree_rejection_sample(logits, tokens, parents, draft, backend="triton", **kw)
    _assert_equal(got, want, mode)


@pytest.mark.parametrize("mode", MODES)
def test_strided_inputs(device, mode):
    gen = torch.Generator().manual_seed(11)
    B, T, V = 3, 10, 111
    logits, tokens, parents, draft, kw = _random_case(gen, B, T, V, mode, torch.float32)
    want = tree_rejection_sample_reference(logits, tokens, parents, draft, **kw)
    # logits transposed in memory with a padded vocab, every other column of ids/parents
    big = torch.zeros(T, B, V + 13)
    big[:, :, 5 : 5 + V] = logits.transpose(0, 1)
    s_logits = big[:, :, 5 : 5 + V].transpose(0, 1)
    s_tokens = torch.stack([tokens, tokens], -1)[..., 0]
    s_parents = torch.stack([parents, parents], -1)[..., 1]
    s_draft = None if draft is None else torch.cat([draft, draft], -1)[..., :V]
    assert not s_logits.is_contiguous() and not s_tokens.is_contiguous()
    *tensors, kw = _to(device, s_logits, s_tokens, s_parents, s_draft, kw)
    for backend in backends_for(device):
        _assert_equal(_run(backend, *tensors, **kw), want, backend)


def test_invariants_and_rollback_contract(device):
    """Paths follow parents, tokens are the nodes' tokens, -1 padding, counts add up, and
    accepted_nodes is strictly increasing (what kv_rollback requires)."""
    gen = torch.Generator().manual_seed(5)
    for mode in MODES:
        logits, tokens, parents, draft, kw = _random_case(gen, 6, 24, 50, mode, torch.float32)
        *tensors, dkw = _to(device, logits, tokens, parents, draft, kw)
        for backend in _all_backends(device):
            nodes, out, n = (t.cpu() for t in _run(backend, *tensors, **dkw))
            for b in range(6):
                k = int(n[b])
                path = nodes[b, : k + 1]
                assert path[0] == 0 and (nodes[b, k + 1 :] == -1).all()
                assert (out[b, k + 1 :] == -1).all() and 0 <= out[b, k] < 50
                assert (path[1:] > path[:-1]).all()
                assert (parents[b, path[1:]] == path[:-1].int()).all()
                assert torch.equal(out[b, :k], tokens[b, path[1:]])


def test_tree_on_a_chain_matches_the_chain_sampler(device):
    """A chain-shaped tree uses the chain sampler's random streams: same tokens."""
    gen = torch.Generator().manual_seed(3)
    B, K, V = 16, 5, 40
    logits = (torch.randn(B, K + 1, V, generator=gen) * 2).to(device)
    q = torch.softmax(logits.cpu() + torch.randn(B, K + 1, V, generator=gen), -1).to(device)
    drafts = torch.multinomial(q[:, :K].reshape(-1, V).cpu(), 1, generator=gen).view(B, K)
    drafts = drafts.to(device)
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device), drafts], 1)
    parents = (torch.arange(K + 1, dtype=torch.int32, device=device) - 1).expand(B, K + 1)
    kw = dict(
        temperature=torch.full((B,), 0.9, device=device),
        seed=torch.arange(B, device=device),
        offset=torch.full((B,), 9, device=device),
    )
    for draft in (q, None):
        want_out, want_n = rejection_sample(
            logits, drafts, None if draft is None else draft[:, :K], backend="reference", **kw
        )
        for backend in _all_backends(device):
            nodes, out, n = _run(backend, logits, tokens, parents, draft, **kw)
            assert torch.equal(out, want_out) and torch.equal(n, want_n), backend
            steps = torch.arange(K + 1, device=device)
            assert torch.equal(nodes, torch.where(steps <= n[:, None], steps, -1))


# ---------------------------------------------------------------------------------------
# degenerate inputs that force the answer


def _branchy_tree(B, V, gen):
    """Root with 3 children, each with 2 children: T = 10."""
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3], dtype=torch.int32).expand(B, 10)
    tokens = torch.randint(0, V, (B, 10), generator=gen)
    return parents.contiguous(), tokens


@pytest.mark.parametrize("draft_mode", MODES[1:])
def test_one_hot_target_is_deterministic(device, draft_mode):
    """p one-hot: the child carrying that token is always accepted, others never: the
    result is the greedy walk, whatever the seed and the draft."""
    gen = torch.Generator().manual_seed(1)
    B, V = 12, 16
    parents, tokens = _branchy_tree(B, V, gen)
    logits = torch.randn(B, 10, V, generator=gen)
    hot = torch.randint(0, V, (B, 10), generator=gen)
    tokens[:, 1] = (tokens[:, 2] + 1) % V  # distinct children of the root
    tokens[:, 3] = (tokens[:, 2] + 2) % V
    hot[:, 0] = tokens[:, 2]  # the root's target points at its second child
    logits = logits.scatter(2, hot[..., None], 50.0)
    logits = torch.where(logits < 50.0, NEG, logits)
    q = torch.softmax(torch.randn(B, 10, V, generator=gen), -1)
    draft = None if draft_mode == "point_mass" else q
    case = _to(device, logits, tokens, parents, draft, {})
    greedy = tree_rejection_sample_reference(*case[:3])
    for backend in _all_backends(device):
        got = _run(
            backend,
            *case[:4],
            temperature=1.0,
            seed=torch.arange(B, device=device),
            without_replacement=draft_mode == "without_replacement",
        )
        _assert_equal(got, greedy, backend)
        assert (got[0][:, 1] == 2).all()


@pytest.mark.parametrize("warp", [dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-3)])
@pytest.mark.parametrize("mode", MODES[1:])
def test_warps_that_collapse_to_greedy(device, mode, warp):
    """top_k = 1, a tiny top_p or a tiny temperature make p one-hot at the argmax."""
    gen = torch.Generator().manual_seed(2)
    logits, tokens, parents, draft, _ = _random_case(gen, 3, 10, 30, mode, torch.float32)
    warp = {"temperature": 1.0, **warp}
    case = _to(device, logits, tokens, parents, draft, {})
    greedy = tree_rejection_sample_reference(*case[:3])
    for backend in _all_backends(device):
        got = _run(
            backend,
            *case[:4],
            seed=torch.arange(3, device=device),
            without_replacement=mode == "without_replacement",
            **warp,
        )
        _assert_equal(got, greedy, (backend, warp))


def test_draft_equal_to_target_always_accepts(device):
    """q = p: the first child of every node is accepted (u < p(x) / q(x) = 1)."""
    gen = torch.Generator().manual_seed(4)
    B, T, V = 10, 12, 20
    logits = torch.randn(B, T, V, generator=gen) * 2
    parents = _random_parents(gen, B, T, absent=0.0)
    q = warp_probs(logits.view(-1, V), 0.7).view(B, T, V)
    tokens = torch.multinomial(
        q.gather(1, parents.long().clamp(min=0)[..., None].expand(B, T, V)).view(-1, V),
        1,
        generator=gen,
    ).view(B, T)
    depth = tree_depths(parents)
    # the path of first children: node -> its lowest-index child
    expect = []
    for b in range(B):
        node, path = 0, [0]
        while True:
            kids = [i for i in range(T) if parents[b, i] == node]
            if not kids:
                break
            node = kids[0]
            path.append(node)
        expect.append(path)
    case = _to(device, logits, tokens, parents, q, {})
    for backend in _all_backends(device):
        nodes, out, n = _run(
            backend, *case[:4], temperature=0.7, seed=torch.arange(B, device=device)
        )
        for b in range(B):
            assert nodes[b, : len(expect[b])].tolist() == expect[b], backend
            assert int(n[b]) == int(depth[b, expect[b][-1]])


def test_zero_draft_mass_at_a_supported_token_accepts(device):
    """q(x) = 0 where p(x) > 0: the child is always accepted."""
    B, V = 12, 8
    logits = torch.zeros(B, 3, V)
    q = torch.zeros(B, 3, V)
    q[..., 1:] = 1 / (V - 1)
    tokens = torch.tensor([0, 0, 3]).expand(B, 3).contiguous()
    parents = torch.tensor([-1, 0, 1], dtype=torch.int32).expand(B, 3).contiguous()
    case = _to(device, logits, tokens, parents, q, {})
    for backend in _all_backends(device):
        nodes, out, n = _run(
            backend, *case[:4], temperature=1.0, seed=torch.arange(B, device=device)
        )
        assert (n >= 1).all() and (nodes[:, 1] == 1).all(), backend


def test_residual_without_mass_falls_back_to_the_target(device):
    """q = p and a child outside p's support: it is rejected, the residual max(0, p - q)
    is empty, and the emitted token is drawn from p (never the rejected token)."""
    B, V = 4000, 6
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]).expand(B, 2, V).contiguous()
    p = warp_probs(logits[:, 0], 1.0, 4)[0].double()
    q = warp_probs(logits.view(-1, V), 1.0, 4).view(B, 2, V)
    tokens = torch.tensor([0, 5]).expand(B, 2).contiguous()  # token 5 is outside the top 4
    parents = torch.tensor([-1, 0], dtype=torch.int32).expand(B, 2).contiguous()
    *case, kw = _to(
        device,
        logits,
        tokens,
        parents,
        q,
        dict(temperature=torch.ones(B), top_k=torch.full((B,), 4), seed=torch.arange(B)),
    )
    want = None
    for backend in _all_backends(device):
        rows = 12 if backend == "triton" else B  # the interpreter is slow: a few rows
        got = _run(backend, *(t[:rows] for t in case), **{k: v[:rows] for k, v in kw.items()})
        if want is None:
            want = got
        _assert_equal(got, tuple(t[:rows] for t in want), backend)
        nodes, out, n = got
        assert (n == 0).all()
        counts = torch.bincount(out[:, 0].cpu(), minlength=V).double()
        assert counts[4:].sum() == 0, backend
        if rows == B:
            _, pval = stats.chisquare(counts[:4], p[:4] / p[:4].sum() * B)
            assert pval > ALPHA, (backend, counts)


@pytest.mark.slow
def test_large_temperature_and_v2(device):
    gen = torch.Generator().manual_seed(8)
    for V, temperature in ((2, 3.0), (50, 100.0)):
        for mode in MODES[1:]:
            logits, tokens, parents, draft, kw = _random_case(gen, 3, 9, V, mode, torch.float32)
            kw["temperature"] = torch.full((3,), temperature)
            case = _to(device, logits, tokens, parents, draft, kw)
            want = tree_rejection_sample_reference(*case[:4], **case[4])
            for backend in backends_for(device):
                _assert_equal(_run(backend, *case[:4], **case[4]), want, (V, temperature, mode))


def test_seeds_offsets_and_generator():
    gen = torch.Generator().manual_seed(9)
    logits, tokens, parents, draft, kw = _random_case(
        gen, 64, 12, 30, "with_replacement", torch.float32
    )
    kw.pop("seed"), kw.pop("offset")
    a = tree_rejection_sample(logits, tokens, parents, draft, seed=5, offset=1, **kw)
    assert all(
        torch.equal(x, y)
        for x, y in zip(
            a, tree_rejection_sample(logits, tokens, parents, draft, seed=5, offset=1, **kw)
        )
    )
    b = tree_rejection_sample(logits, tokens, parents, draft, seed=5, offset=2, **kw)
    assert not torch.equal(a[1], b[1])
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    c = tree_rejection_sample(logits, tokens, parents, draft, generator=g1, **kw)
    d = tree_rejection_sample(logits, tokens, parents, draft, generator=g2, **kw)
    assert all(torch.equal(x, y) for x, y in zip(c, d))


# ---------------------------------------------------------------------------------------
# distribution: the emitted tokens follow the warped target


V_DIST, M1, M2 = 6, 3, 2  # vocab, children of the root, children of each child


def _tables(seed):
    """A tabular 'target' p(x1), p(x2 | x1), p(x3 | x1, x2) and 'draft' q(x1), q(x2 | x1)."""
    g = torch.Generator().manual_seed(seed)
    V = V_DIST
    lp0 = torch.randn(V, generator=g) * 1.5
    lp1 = torch.randn(V, V, generator=g) * 1.5
    lp2 = torch.randn(V, V, V, generator=g)
    q0 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q1 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    return lp0, lp1, lp2, q0, q1


def _draw_trees(mode, tables, n, gen):
    """n trees of depth 2 (root, M1 children, M2 grandchildren each) drafted from q."""
    lp0, lp1, lp2, q0, q1 = tables
    V = V_DIST
    if mode == "point_mass":  # deterministic top-k children
        x = torch.topk(q0, M1).indices.expand(n, M1)
        y = torch.topk(q1[x], M2, dim=-1).indices
    else:
        repl = mode == "with_replacement"
        x = torch.multinomial(q0.expand(n, V), M1, replacement=repl, generator=gen)
        y = torch.multinomial(q1[x].reshape(-1, V), M2, replacement=repl, generator=gen).view(
            n, M1, M2
        )
    T = 1 + M1 + M1 * M2
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), x, y.reshape(n, -1)], 1)
    parents = (
        torch.tensor(
            [-1] + [0] * M1 + [1 + k for k in range(M1) for _ in range(M2)], dtype=torch.int32
        )
        .expand(n, T)
        .contiguous()
    )
    logits = torch.cat(
        [lp0.expand(n, 1, V), lp1[x], lp2[x[:, :, None].expand(n, M1, M2), y].reshape(n, -1, V)], 1
    )
    draft = torch.cat([q0.expand(n, 1, V), q1[x], torch.full((n, M1 * M2, V), 1 / V)], 1)
    return logits, tokens, parents, None if mode == "point_mass" else draft


@pytest.mark.parametrize(
    "warp",
    [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9)],
    ids=["plain", "warped"],
)
@pytest.mark.parametrize("mode", MODES[1:])
def test_joint_of_first_two_tokens_follows_the_warped_target(mode, warp):
    """Joint of the first two emitted tokens over 2e5 trees, chi-square at ALPHA.

    When only one token is emitted (the root's recovered token x1), the second is drawn
    from the warped p(. | x1), as the next step would; the joint must then be exactly
    P(x1) P(x2 | x1) of the warped tables.
    """
    tables = _tables(17)
    lp0, lp1 = tables[0], tables[1]
    V = V_DIST
    gen = torch.Generator().manual_seed(23)
    logits, tokens, parents, draft = _draw_trees(mode, tables, N_DRAWS, gen)
    n = N_DRAWS
    kw = {k: torch.full((n,), v) for k, v in warp.items()}
    nodes, out, acc = tree_rejection_sample(
        logits,
        tokens,
        parents,
        draft,
        seed=torch.arange(n),
        offset=torch.full((n,), 3),
        without_replacement=mode == "without_replacement",
        backend="native",
        **kw,
    )
    w = {k: v for k, v in warp.items()}
    p0 = warp_probs(lp0[None], **w)[0]
    p1 = warp_probs(lp1, **w)
    x1 = out[:, 0]
    x2_next = torch.multinomial(p1[x1], 1, generator=gen)[:, 0]
    x2 = torch.where(acc >= 1, out[:, 1], x2_next)
    counts = torch.bincount(x1 * V + x2, minlength=V * V).double()
    expect = (p0[:, None] * p1).reshape(-1).double()
    support = expect > 0
    assert counts[~support].sum() == 0, "a token outside the warped target was emitted"
    _, pval = stats.chisquare(counts[support], expect[support] / expect[support].sum() * n)
    assert pval > ALPHA, (mode, warp, pval)
    assert 0 < float(acc.float().mean()) < 2  # both short and long paths occur


# ---------------------------------------------------------------------------------------
# bad input and the op registration


def test_bad_input_names_the_problem():
    B, T, V = 2, 4, 10
    logits = torch.zeros(B, T, V)
    tokens = torch.zeros(B, T, dtype=torch.long)
    parents = torch.tensor([-1, 0, 1, 1], dtype=torch.int32).expand(B, T).contiguous()
    with pytest.raises(ValueError, match="target_logits"):
        tree_rejection_sample(logits[0], tokens, parents)
    with pytest.raises(TypeError, match="target_logits"):
        tree_rejection_sample(logits.double(), tokens, parents)
    with pytest.raises(TypeError, match="node_token_ids"):
        tree_rejection_sample(logits, tokens.int(), parents)
    with pytest.raises(ValueError, match="node_token_ids"):
        tree_rejection_sample(logits, tokens[:, :3], parents)
    with pytest.raises(TypeError, match="parents"):
        tree_rejection_sample(logits, tokens, parents.long())
    with pytest.raises(ValueError, match="draft_probs"):
        tree_rejection_sample(logits, tokens, parents, torch.zeros(B, T, V + 1))
    with pytest.raises(ValueError, match=r"parents\[:, 0\]"):
        tree_rejection_sample(logits, tokens, torch.zeros(B, T, dtype=torch.int32))
    bad = parents.clone()
    bad[1, 2] = 2
    with pytest.raises(ValueError, match="parents"):
        tree_rejection_sample(logits, tokens, bad)
    with pytest.raises(ValueError, match="node_token_ids"):
        tree_rejection_sample(logits, torch.full((B, T), V), parents)
    with pytest.raises(ValueError, match="temperature"):
        tree_rejection_sample(logits, tokens, parents, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        tree_rejection_sample(logits, tokens, parents, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="max_depth"):
        tree_rejection_sample(logits, tokens, parents, max_depth=T)
    with pytest.raises(ValueError, match="seed"):
        tree_rejection_sample(logits, tokens, parents, seed=torch.zeros(B + 1, dtype=torch.long))


@pytest.mark.skipif(not native_available(), reason="osd_kernels._C is not built")
def test_opcheck():
    gen = torch.Generator().manual_seed(0)
    for mode in ("greedy", "with_replacement"):
        logits, tokens, parents, draft, kw = _random_case(gen, 3, 6, 20, mode, torch.float32)
        args = (
            logits,
            tokens,
            parents,
            draft,
            kw["temperature"],
            kw["top_k"],
            kw["top_p"],
            kw["seed"],
            kw["offset"],
            5,
            False,
        )
        torch.library.opcheck(
            torch.ops.osd.tree_rejection_sample.default,
            args,
            test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
        )


# -- the first emitted token's distribution on every backend and device, small and 128k V
def _dist_cases():
    """(device, backend, V, n draws, warp); as in test_rejection_sample: on CPU the
    reference and the interpreter take a small V with fewer draws, the C++ kernel also
    V = 128,256 with a plain warp; on CUDA every backend takes both."""
    warped = dict(temperature=0.8, top_k=50, top_p=0.9)
    plain = dict(temperature=1.0)
    cases = [
        ("cpu", "native", 1000, 40_000, warped),
        slow_case("cpu", "native", 128_256, 6_000, plain),
        slow_case("cpu", "reference", 1000, 20_000, warped),
        slow_case("cpu", "triton", 16, 300, plain),
    ]
    if torch.cuda.is_available():
        for backend in ("native", "triton", "reference"):
            cases += [
                pytest.param("cuda", backend, *rest, marks=pytest.mark.gpu)
                for rest in (
                    (1000, 100_000, warped),
                    (128_256, 100_000, warped),
                    (128_256, 50_000, plain),
                )
            ]
    return cases


@pytest.mark.parametrize("without_replacement", [False, True], ids=["with", "without"])
@pytest.mark.parametrize(
    "device,backend,V,n,warp",
    _dist_cases(),
    ids=lambda c: str(c) if not isinstance(c, dict) else "-".join(c),
)
def test_first_token_follows_warped_target_every_backend(
    device, backend, V, n, warp, without_replacement
):
    """A root with two children drawn from q (with or without replacement), n trees
    sharing one target and one draft (expanded); the first emitted token must follow the
    warped target p0 (chi-square, cells expected < 5 pooled, p > 1e-3)."""
    gen = torch.Generator().manual_seed(V + n + without_replacement)
    T = 3
    logits = torch.randn(1, T, V, generator=gen) * 2.0
    logits[0, :, : min(40, V // 4)] += 6.0
    q0 = torch.softmax(logits[0, 0] + torch.randn(V, generator=gen), -1)
    children = torch.stack(
        [
            torch.multinomial(q0, 2, replacement=not without_replacement, generator=gen)
            for _ in range(n)
        ]
    )
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.int64), children], 1)
    parents = torch.tensor([-1, 0, 0], dtype=torch.int32).expand(n, T).contiguous()
    draft = torch.cat([q0[None], torch.full((T - 1, V), 1.0 / V)])
    dev = torch.device(device)

    def draw(a: int, b: int) -> torch.Tensor:
        m = b - a
        _, out, _ = tree_rejection_sample(
            logits.to(dev).expand(m, T, V),
            tokens[a:b].to(dev),
            parents[a:b].to(dev),
            draft.to(dev).expand(m, T, V),
            seed=torch.arange(a, b, device=dev),
            offset=torch.full((m,), 5, device=dev),
            without_replacement=without_replacement,
            backend=backend,
            **{k: torch.full((m,), v, device=dev) for k, v in warp.items()},
        )
        return out[:, 0].cpu()

    first = in_row_chunks(n, 2 * T * V * 4, dev, draw)
    p0 = warp_probs(logits[0, :1], **{k: torch.tensor([v]) for k, v in warp.items()})[0]
    counts = torch.bincount(first, minlength=V).double()
    assert counts[p0 == 0].sum() == 0, "a token outside the warped target was emitted"
    exp = p0.double() * n
    small = exp < 5
    obs, ex = counts[~small], exp[~small]
    if exp[small].sum() > 0:  # pool the cells expected < 5
        obs = torch.cat([obs, counts[small].sum(0, keepdim=True)])
        ex = torch.cat([ex, exp[small].sum(0, keepdim=True)])
    _, pval = stats.chisquare(obs.numpy(), ex.numpy() * float(obs.sum() / ex.sum()))
    assert pval > ALPHA, pval
