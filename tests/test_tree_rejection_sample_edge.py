"""tree_rejection_sample: degenerate inputs that force the answer (one-hot targets, warps
that collapse to greedy, q = p, residuals without mass), seeds and generators, bad input
and the op registration."""

import pytest
import torch
from scipy import stats

from osd_kernels import tree_rejection_sample, tree_rejection_sample_reference
from osd_kernels._ops import native_available
from osd_kernels.tree_rejection_sample import tree_depths
from osd_kernels.warp import warp_probs
from tests.conftest import backends_for
from tests.tree_rejection_cases import (
    ALPHA,
    MODES,
    NEG,
    all_backends,
    assert_equal,
    random_case,
    random_parents,
    run_sample,
    to_device,
)


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
    case = to_device(device, logits, tokens, parents, draft, {})
    greedy = tree_rejection_sample_reference(*case[:3])
    for backend in all_backends(device):
        got = run_sample(
            backend,
            *case[:4],
            temperature=1.0,
            seed=torch.arange(B, device=device),
            without_replacement=draft_mode == "without_replacement",
        )
        assert_equal(got, greedy, backend)
        assert (got[0][:, 1] == 2).all()


@pytest.mark.parametrize("warp", [dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-3)])
@pytest.mark.parametrize("mode", MODES[1:])
def test_warps_that_collapse_to_greedy(device, mode, warp):
    """top_k = 1, a tiny top_p or a tiny temperature make p one-hot at the argmax."""
    gen = torch.Generator().manual_seed(2)
    logits, tokens, parents, draft, _ = random_case(gen, 3, 10, 30, mode, torch.float32)
    warp = {"temperature": 1.0, **warp}
    case = to_device(device, logits, tokens, parents, draft, {})
    greedy = tree_rejection_sample_reference(*case[:3])
    for backend in all_backends(device):
        got = run_sample(
            backend,
            *case[:4],
            seed=torch.arange(3, device=device),
            without_replacement=mode == "without_replacement",
            **warp,
        )
        assert_equal(got, greedy, (backend, warp))


def test_draft_equal_to_target_always_accepts(device):
    """q = p: the first child of every node is accepted (u < p(x) / q(x) = 1)."""
    gen = torch.Generator().manual_seed(4)
    B, T, V = 10, 12, 20
    logits = torch.randn(B, T, V, generator=gen) * 2
    parents = random_parents(gen, B, T, absent=0.0)
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
    case = to_device(device, logits, tokens, parents, q, {})
    for backend in all_backends(device):
        nodes, out, n = run_sample(
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
    case = to_device(device, logits, tokens, parents, q, {})
    for backend in all_backends(device):
        nodes, out, n = run_sample(
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
    *case, kw = to_device(
        device,
        logits,
        tokens,
        parents,
        q,
        dict(temperature=torch.ones(B), top_k=torch.full((B,), 4), seed=torch.arange(B)),
    )
    want = None
    for backend in all_backends(device):
        rows = 12 if backend == "triton" else B  # the interpreter is slow: a few rows
        got = run_sample(backend, *(t[:rows] for t in case), **{k: v[:rows] for k, v in kw.items()})
        if want is None:
            want = got
        assert_equal(got, tuple(t[:rows] for t in want), backend)
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
            logits, tokens, parents, draft, kw = random_case(gen, 3, 9, V, mode, torch.float32)
            kw["temperature"] = torch.full((3,), temperature)
            case = to_device(device, logits, tokens, parents, draft, kw)
            want = tree_rejection_sample_reference(*case[:4], **case[4])
            for backend in backends_for(device):
                assert_equal(
                    run_sample(backend, *case[:4], **case[4]), want, (V, temperature, mode)
                )


def test_seeds_offsets_and_generator():
    gen = torch.Generator().manual_seed(9)
    logits, tokens, parents, draft, kw = random_case(
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
        logits, tokens, parents, draft, kw = random_case(gen, 3, 6, 20, mode, torch.float32)
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
