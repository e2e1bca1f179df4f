"""tree_rejection_sample: golden greedy trees, and every backend against the reference on
random trees (strided inputs, the invariants kv_rollback relies on, chains against the chain
sampler). Degenerate inputs and bad input: test_tree_rejection_sample_edge.py; the emitted
tokens' distribution: test_tree_rejection_sample_dist.py."""

import pytest
import torch

from osd_kernels import rejection_sample, tree_rejection_sample, tree_rejection_sample_reference
from osd_kernels.tree_rejection_sample import tree_depths
from tests.conftest import backends_for
from tests.tree_rejection_cases import (
    MODES,
    all_backends,
    assert_equal,
    random_case,
    run_sample,
    to_device,
)


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
    for backend in all_backends(device):
        for temperature in (None, 0.0):
            got = run_sample(
                backend, logits, tok, par, temperature=temperature, max_depth=max_depth
            )
            assert_equal(got, want, backend)


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
    for backend in all_backends(device):
        nodes, out, n = run_sample(backend, logits.to(device), tok.to(device), par.to(device))
        for b, c in enumerate(cases):
            k = len(c[6])
            assert nodes[b, :k].tolist() == c[6] and out[b, :k].tolist() == c[7], (backend, c[0])
            assert (nodes[b, k:] == -1).all() and (out[b, k:] == -1).all()
            assert int(n[b]) == k - 1


# ---------------------------------------------------------------------------------------
# random trees: every backend against the reference


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
    case = to_device(device, *random_case(gen, B, T, V, mode, dtype))
    logits, tokens, parents, draft, kw = case
    want = tree_rejection_sample_reference(logits, tokens, parents, draft, **kw)
    got = tree_rejection_sample(logits, tokens, parents, draft, backend="native", **kw)
    assert_equal(got, want, (mode, dtype))


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
    logits, tokens, parents, draft, kw = to_device(device, *random_case(gen, B, T, V, mode, dtype))
    want = tree_rejection_sample_reference(logits, tokens, parents, draft, **kw)
    got = tree_rejection_sample(logits, tokens, parents, draft, backend="triton", **kw)
    assert_equal(got, want, (mode, dtype))


@pytest.mark.parametrize("mode", ["greedy", "with_replacement"])
def test_triton_large_vocab(device, mode):
    """V = 32003 (32 blocks per pass), temperature only."""
    gen = torch.Generator().manual_seed(31)
    logits, tokens, parents, draft, kw = random_case(gen, 1, 5, 32003, mode, torch.float32)
    kw.pop("top_k"), kw.pop("top_p")
    logits, tokens, parents, draft, kw = to_device(device, logits, tokens, parents, draft, kw)
    want = tree_rejection_sample_reference(logits, tokens, parents, draft, **kw)
    got = tree_rejection_sample(logits, tokens, parents, draft, backend="triton", **kw)
    assert_equal(got, want, mode)


@pytest.mark.parametrize("mode", MODES)
def test_strided_inputs(device, mode):
    gen = torch.Generator().manual_seed(11)
    B, T, V = 3, 10, 111
    logits, tokens, parents, draft, kw = random_case(gen, B, T, V, mode, torch.float32)
    want = tree_rejection_sample_reference(logits, tokens, parents, draft, **kw)
    # logits transposed in memory with a padded vocab, every other column of ids/parents
    big = torch.zeros(T, B, V + 13)
    big[:, :, 5 : 5 + V] = logits.transpose(0, 1)
    s_logits = big[:, :, 5 : 5 + V].transpose(0, 1)
    s_tokens = torch.stack([tokens, tokens], -1)[..., 0]
    s_parents = torch.stack([parents, parents], -1)[..., 1]
    s_draft = None if draft is None else torch.cat([draft, draft], -1)[..., :V]
    assert not s_logits.is_contiguous() and not s_tokens.is_contiguous()
    *tensors, kw = to_device(device, s_logits, s_tokens, s_parents, s_draft, kw)
    for backend in backends_for(device):
        assert_equal(run_sample(backend, *tensors, **kw), want, backend)


def test_invariants_and_rollback_contract(device):
    """Paths follow parents, tokens are the nodes' tokens, -1 padding, counts add up, and
    accepted_nodes is strictly increasing (what kv_rollback requires)."""
    gen = torch.Generator().manual_seed(5)
    for mode in MODES:
        logits, tokens, parents, draft, kw = random_case(gen, 6, 24, 50, mode, torch.float32)
        *tensors, dkw = to_device(device, logits, tokens, parents, draft, kw)
        for backend in all_backends(device):
            nodes, out, n = (t.cpu() for t in run_sample(backend, *tensors, **dkw))
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
        for backend in all_backends(device):
            nodes, out, n = run_sample(backend, logits, tokens, parents, draft, **kw)
            assert torch.equal(out, want_out) and torch.equal(n, want_n), backend
            steps = torch.arange(K + 1, device=device)
            assert torch.equal(nodes, torch.where(steps <= n[:, None], steps, -1))
