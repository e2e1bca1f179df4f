"""tree_rejection_sample: the emitted tokens follow the warped target (chi-square tests on
the joint of the first two tokens, and on the first token on every backend and device)."""

import pytest
import torch
from scipy import stats

from osd_kernels import tree_rejection_sample
from osd_kernels.warp import warp_probs
from tests.conftest import slow_case
from tests.test_rejection_sample import in_row_chunks
from tests.tree_rejection_cases import ALPHA, MODES

N_DRAWS = 150_000


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
