"""rejection_sample's split-vocabulary path (``csrc/kernels/chunk_stats.h``; greedy,
temperature-only and top-k <= 128 sequences take it, on CUDA when ``OSD_SAMPLER_SPLIT=1``)
against the reference and against the one-row path (``OSD_SAMPLER_SPLIT=0``):
vocabularies around and below the chunk size, ties within and across chunks, top-k at
and past the path's limit and at or past V, tiny top-p, the tail groups the chunk records
keep or cannot resolve; chi-square of the emitted tokens where kept tie groups span
chunks, and at V = 128,256 on CUDA."""

import pytest
import torch
from scipy.stats import chisquare

from osd_kernels import rejection_sample, rejection_sample_reference
from osd_kernels.warp import warp_probs

SPLIT_TOP_K_MAX = 128


@pytest.fixture(autouse=True)
def split_path(monkeypatch):
    """The split path on every device (CUDA takes it only when asked, until it has run on
    a GPU)."""
    monkeypatch.setenv("OSD_SAMPLER_SPLIT", "1")


def chunk_size(V: int) -> int:
    """``chunk_size`` of kernels/chunk_stats.h: V / 48 rounded up to 256, at most 4096."""
    s = -(-V // 48)
    return min(-(-s // 256) * 256, 4096)


def _logits(gen, B, K, V, kind):
    x = torch.randn(B, K + 1, V, generator=gen) * 2
    if kind == "ties":  # a few distinct values: ties everywhere, across chunks too
        x = (x * 1.5).round() / 1.5
    elif kind == "plateau":  # a wide tie at the top, spread over every chunk
        x = torch.where(torch.rand(B, K + 1, V, generator=gen) < 0.05, 3.0, x.clamp(max=2.5))
    elif kind == "flat":
        x = torch.zeros(B, K + 1, V)
    return x


def _case(gen, B, K, V, dtype, kind, params, with_q):
    logits = _logits(gen, B, K, V, kind).to(dtype)
    q = torch.softmax(logits[:, :K].float() + 0.7 * torch.randn(B, K, V, generator=gen), -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(B, K)
    t, tk, tp = params
    kw = dict(
        temperature=torch.full((B,), float(t)),
        top_k=torch.full((B,), int(tk), dtype=torch.int32),
        top_p=torch.full((B,), float(tp)),
        seed=torch.randint(-(2**62), 2**62, (B,), generator=gen),
        offset=torch.randint(0, 2**40, (B,), generator=gen),
        num_draft_tokens=torch.randint(0, K + 1, (B,), generator=gen, dtype=torch.int32),
    )
    return logits, drafts, q.to(dtype) if with_q else None, kw


def _to(device, logits, drafts, q, kw):
    def move(t):
        return t.to(device) if torch.is_tensor(t) else t

    return move(logits), move(drafts), move(q), {k: move(v) for k, v in kw.items()}


def _same(logits, drafts, q, kw, monkeypatch=None, device="cpu"):
    """The native kernel on ``device`` equals the reference (and, on CPU with
    ``monkeypatch``, the one-row path) token for token."""
    ref = rejection_sample_reference(logits, drafts, q, **kw)
    dl, dd, dq, dkw = _to(device, logits, drafts, q, kw)
    out = rejection_sample(dl, dd, dq, backend="native", **dkw)
    out = (out[0].cpu(), out[1].cpu())
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), (out, ref)
    if monkeypatch is not None and device == "cpu":
        with monkeypatch.context() as m:
            m.setenv("OSD_SAMPLER_SPLIT", "0")
            one = rejection_sample(logits, drafts, q, backend="native", **kw)
        assert torch.equal(one[0], out[0]) and torch.equal(one[1], out[1])


# (temperature, top_k, top_p): greedy, temperature only, top-k (with top-p), the path's
# limit and one past it, top-k at or past V (off), top-p alone (one-row path), tiny top-p
def _params(V):
    return [
        (0.0, 0, 1.0),
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.3, 1, 1.0),
        (0.8, 5, 1.0),
        (0.8, 50, 0.9),
        (1.2, min(SPLIT_TOP_K_MAX, V - 1), 1.0),
        (1.0, SPLIT_TOP_K_MAX + 1, 0.8),
        (0.9, V, 1.0),
        (0.9, V - 1, 0.95),
        (1.1, 0, 0.8),
        (1.0, 20, 1e-6),
    ]


@pytest.mark.parametrize("V", [2, 111, 256, 257, 1000, 5000, 12289, 32003], ids=lambda v: f"V{v}")
@pytest.mark.parametrize("kind", ["randn", "ties", "plateau"])
def test_split_matches_reference(V, kind, monkeypatch, device):
    """Every parameter set on vocabularies below one chunk, at it, one past it, ending in
    a one-element chunk (12,289) or a partial one; float32 and half precision."""
    gen = torch.Generator().manual_seed(V * 7 + len(kind))
    B, K = 3, 3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for i, params in enumerate(_params(V)):
            with_q = (i + len(kind)) % 2 == 0
            case = _case(gen, B, K, V, dtype, kind, params, with_q)
            _same(*case, monkeypatch if dtype == torch.bfloat16 else None, device)


def test_flat_rows_and_greedy_ties_across_chunks():
    """Constant rows keep every token (top-k ties) and greedy takes index 0; a maximum
    repeated in later chunks loses to the first one."""
    V, K = 3000, 2
    gen = torch.Generator().manual_seed(1)
    for params in [(0.0, 0, 1.0), (1.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 100, 0.5)]:
        _same(*_case(gen, 4, K, V, torch.float32, "flat", params, False))
    logits = torch.randn(1, K + 1, V, generator=gen)
    S = chunk_size(V)
    for v in (S + 7, 2 * S + 1, V - 1):  # equal maxima in three chunks, the first wins
        logits[0, :, v] = 9.0
    out, acc = rejection_sample(logits, torch.tensor([[S + 7, S + 7]]), backend="native")
    assert acc.tolist() == [2] and out.tolist() == [[S + 7, S + 7, S + 7]]
    out, acc = rejection_sample(logits, torch.tensor([[S + 7, 2 * S + 1]]), backend="native")
    assert acc.tolist() == [1] and out.tolist() == [[S + 7, S + 7, -1]]


def _collision(t: float) -> tuple[float, float]:
    """A float32 a and its predecessor b with b / t == a / t in float32."""
    a = torch.tensor(15.5)
    for _ in range(1000):
        b = torch.nextafter(a, torch.tensor(-1.0))
        if torch.equal(b / t, a / t):
            return float(a), float(b)
        a = b
    raise AssertionError("no colliding neighbours found")


@pytest.mark.parametrize("layout", ["kept group", "unknown tail"])
def test_tail_groups_of_scaled_ties(layout):
    """float32 neighbours that division by t maps onto the k-th value: kept by the
    reference. Top-k 1 over [a, b] keeps b as the chunk's tail group; over [a, a, b] the
    tail holds a (a tie) and b, a set its record cannot count, and the sequence takes the
    one-row path. Either way every kept token is emitted, as often as the reference says."""
    t = 1.5
    a, b = _collision(t)
    V, n = 600, 6000
    row = torch.full((V,), -5.0)
    row[300:400] = -3.0  # a second chunk with its own candidates
    kept = [0, 1] if layout == "kept group" else [0, 1, 2]
    row[: len(kept)] = torch.tensor([a, b] if layout == "kept group" else [a, a, b])
    logits = row.expand(n, 2, V)
    drafts = torch.full((n, 1), 7)  # never kept: always rejected, p itself is sampled
    kw = dict(temperature=t, top_k=1, seed=torch.arange(n))
    ref = rejection_sample_reference(
        logits[:50], drafts[:50], None, **{**kw, "seed": kw["seed"][:50]}
    )
    out, acc = rejection_sample(logits, drafts, None, backend="native", **kw)
    assert torch.equal(out[:50], ref[0]) and int(acc.sum()) == 0
    counts = torch.bincount(out[:, 0], minlength=V)
    assert counts[kept].sum() == n
    assert chisquare(counts[kept].numpy()).pvalue > 1e-3


def _first_token_counts(logits_row, q_row, drafts, params, device):
    n = drafts.shape[0]
    V = logits_row.shape[-1]
    logits = logits_row.to(device).expand(n, 2, V)
    q = None if q_row is None else q_row.to(device).expand(n, 1, V)
    t, tk, tp = params
    out, _ = rejection_sample(
        logits,
        drafts.to(device),
        q,
        temperature=t,
        top_k=tk,
        top_p=tp,
        seed=torch.arange(n, device=device),
        offset=3,
        backend="native",
    )
    return torch.bincount(out[:, 0].cpu(), minlength=V).double()


def _assert_follows(counts, p):
    assert counts[p == 0].sum() == 0, "a token outside the warped target was emitted"
    exp = p.double() * counts.sum()
    small = exp < 5
    obs, ex = counts[~small], exp[~small]
    if exp[small].sum() > 0:
        obs = torch.cat([obs, counts[small].sum(0, keepdim=True)])
        ex = torch.cat([ex, exp[small].sum(0, keepdim=True)])
    stat = chisquare(obs.numpy(), ex.numpy() * float(obs.sum() / ex.sum()))
    assert stat.pvalue > 1e-3, stat


def _tie_group_target(V: int) -> torch.Tensor:
    """Top-k 5 keeps 15 tokens: 3 at 3.0 and 12 tied at 2.0 (the 5th value), 8 of them in
    chunk 1 (which stores 4, leaving a kept tail group of 4) and 4 in chunk 3."""
    S = chunk_size(V)
    gen = torch.Generator().manual_seed(5)
    row = torch.randn(V, generator=gen) * 0.3 - 4.0
    row[[10, S + 44, 3 * S + 9]] = 3.0
    row[S : S + 8] = 2.0
    row[3 * S + 20 : 3 * S + 24] = 2.0
    return row


@pytest.mark.parametrize("draft", ["one-hot", "probs"])
@pytest.mark.parametrize(
    "target,params",
    [
        ("tie groups", (1.0, 5, 1.0)),
        ("tie groups", (0.8, 5, 0.7)),
        ("randn", (0.9, 0, 1.0)),
        ("randn", (0.8, 40, 0.85)),
    ],
)
def test_first_token_follows_warped_target(target, params, draft, device):
    """The first emitted token over 20,000 rows follows the warped target (chi-square,
    p > 1e-3) on a 4-chunk vocabulary: drafts drawn from a q that puts most of its mass
    on the kept tie group (so drafts inside the tail group are rejected and the residual
    excludes them or subtracts q), or on a random target."""
    V, n = 1024, 20_000
    gen = torch.Generator().manual_seed(len(target) * 10 + params[1])
    if target == "tie groups":
        row = _tie_group_target(V)
        S = chunk_size(V)
        q = torch.full((V,), 1e-4)
        q[S : S + 8] = 1.0  # the tie group's chunk
        q[10] = 2.0
    else:
        row = torch.randn(V, generator=gen) * 2
        q = torch.softmax(row + torch.randn(V, generator=gen), -1)
    q = q / q.sum()
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)[:, None]
    logits = torch.stack([row, torch.randn(V, generator=gen)])
    counts = _first_token_counts(
        logits, q[None] if draft == "probs" else None, drafts, params, device
    )
    t, tk, tp = params
    p0 = warp_probs(row[None], t, tk, tp)[0]
    _assert_follows(counts, p0)


def test_tie_group_rows_match_reference_and_one_row(monkeypatch, device):
    """The tie-group target with one-hot and q drafts inside the group, token for token."""
    V, n = 1024, 400
    row = _tie_group_target(V)
    S = chunk_size(V)
    gen = torch.Generator().manual_seed(2)
    drafts = torch.randint(S, S + 8, (n, 2), generator=gen)
    q = torch.softmax(torch.randn(n, 2, V, generator=gen), -1)
    q[..., S : S + 8] += 0.5
    q = q / q.sum(-1, keepdim=True)
    logits = torch.stack([row, row, row]).expand(n, 3, V)
    for params in [(1.0, 5, 1.0), (0.8, 5, 0.7), (1.0, 6, 0.999)]:
        t, tk, tp = params
        kw = dict(temperature=t, top_k=tk, top_p=tp, seed=torch.arange(n))
        for qq in (None, q):
            _same(logits, drafts, qq, kw, monkeypatch, device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B", [1, 64])
def test_cuda_split_equals_cpu_at_128k(B):
    """The CUDA split kernels against the C++ kernel (which shares their decisions) at
    V = 128,256, K = 4, bfloat16, every mode, token for token."""
    V, K = 128_256, 4
    gen = torch.Generator().manual_seed(B)
    for params in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 50, 0.9), (0.8, 128, 1.0)]:
        for with_q in (False, True):
            logits, drafts, q, kw = _case(gen, B, K, V, torch.bfloat16, "randn", params, with_q)
            want = rejection_sample(logits, drafts, q, backend="native", **kw)
            dl, dd, dq, dkw = _to("cuda", logits, drafts, q, kw)
            got = rejection_sample(dl, dd, dq, backend="native", **dkw)
            assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("params", [(1.0, 0, 1.0), (0.8, 50, 0.9)], ids=["plain", "warped"])
@pytest.mark.parametrize("draft", ["one-hot", "probs"])
def test_first_token_at_128k_on_cuda(params, draft):
    """The CUDA split kernels' first emitted token over 100,000 rows at V = 128,256
    (bfloat16-valued logits) follows the warped target."""
    V, n = 128_256, 100_000
    gen = torch.Generator().manual_seed(V)
    row = (torch.randn(V, generator=gen) * 2).bfloat16().float()
    row[:40] += 6.0
    q = torch.softmax(row + torch.randn(V, generator=gen), -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)[:, None]
    logits = torch.stack([row, torch.randn(V, generator=gen)]).bfloat16()
    counts = _first_token_counts(
        logits, q[None] if draft == "probs" else None, drafts, params, "cuda"
    )
    t, tk, tp = params
    _assert_follows(counts, warp_probs(row[None], t, tk, tp)[0])
