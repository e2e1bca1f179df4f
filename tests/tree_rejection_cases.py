"""Shared cases of the tree_rejection_sample tests: running a backend, comparing results,
random trees with peaked targets and nearby drafts."""

import torch

from osd_kernels import tree_rejection_sample, tree_rejection_sample_reference
from tests.conftest import backends_for

MODES = ["greedy", "point_mass", "with_replacement", "without_replacement"]
ALPHA = 1e-3  # significance of the chi-square tests: each fails by chance with prob 1e-3
NEG = float("-inf")


def run_sample(backend, logits, tokens, parents, q=None, **kw):
    if backend == "reference":
        return tree_rejection_sample_reference(logits, tokens, parents, q, **kw)
    return tree_rejection_sample(logits, tokens, parents, q, backend=backend, **kw)


def all_backends(device):
    return ["reference"] + backends_for(device)


def assert_equal(got, want, msg=""):
    for name, g, w in zip(("accepted_nodes", "output_token_ids", "num_accepted"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, msg)
        assert torch.equal(g.cpu(), w.cpu()), (name, msg, g, w)


def random_parents(gen, B, T, absent=0.1):
    """Random trees with parents[i] < i, biased towards deep paths; some nodes absent."""
    parents = torch.full((B, T), -1, dtype=torch.int32)
    for i in range(1, T):
        back = torch.randint(1, min(i, 3) + 1, (B,), generator=gen)
        parents[:, i] = (i - back).to(torch.int32)
    drop = torch.rand(B, T, generator=gen) < absent
    drop[:, 0] = False
    parents[drop] = -1
    return parents


def random_case(gen, B, T, V, mode, dtype, *, scale=3.0):
    """Peaked logits, drafts close to the target, children drawn from the draft (or the
    target's argmax), so paths are long and every branch of the rule is exercised."""
    logits = torch.randn(B, T, V, generator=gen) * scale
    parents = random_parents(gen, B, T)
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


def to_device(device, logits, tokens, parents, draft, kw):
    kw = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kw.items()}
    draft = None if draft is None else draft.to(device)
    return logits.to(device), tokens.to(device), parents.to(device), draft, kw
