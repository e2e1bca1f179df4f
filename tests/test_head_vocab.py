"""A draft with a reduced head vocabulary (``DecoderLM.restrict_head``): its logits are
the full head's at the kept tokens and -inf elsewhere; speculative decoding with it stays
lossless (greedy equal to plain, sampled joint equal to the target's); it learns online
on its own columns; checkpoints carry the vocabulary in ``head_vocab.json``."""

import json

import pytest
import torch

import osd
from osd.models.loading import HEAD_VOCAB_FILE, load_model
from osd.online.distill import to_head_vocab
from osd.spec import DynamicTree
from osd.spec_decode.model_drafter import ModelDrafter
from osd_kernels.warp import warp_probs
from tests.test_models import VOCAB, tiny_hf_model
from tests.test_speculative import (
    V_SMALL,
    _small_pair,
    assert_joint_follows_target,
    perturbed,
    prompts_of,
    record_verdicts,
    serve_in_batches,
)


def _kept(vocab: int, n: int, seed: int) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:n]


@pytest.fixture(scope="module")
def pair():
    target = tiny_hf_model("llama", seed=91)
    return target, perturbed(target, 0.3, seed=92)


def test_logits_are_the_full_heads_at_kept_tokens(pair):
    full = load_model(pair[1])
    ids = _kept(VOCAB, 50, seed=1)
    cut = load_model(pair[1]).restrict_head(ids)
    assert cut.head_vocab_size == 50 and full.head_vocab_size == VOCAB
    x = torch.tensor(prompts_of([9, 9], seed=2))
    out = {}
    for name, m in (("full", full), ("cut", cut)):
        cache = m.new_cache(2, 32)
        out[name] = m.prefill(x, cache, torch.tensor([9, 6], dtype=torch.int32))
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(out["cut"][..., outside]).all() and (out["cut"][..., outside] < 0).all()
    torch.testing.assert_close(out["cut"][..., ids], out["full"][..., ids])
    train = cut.forward_train(x, rows=torch.tensor([0, 3, 11]), full_vocab=False)  # [3, 50]
    ref = full.forward_train(x).reshape(18, VOCAB)[[0, 3, 11]][:, ids]
    torch.testing.assert_close(train, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "params",
    [
        osd.SamplingParams(8, temperature=0.8),
        osd.SamplingParams(8, temperature=0.7, top_k=5, top_p=0.9),
        osd.SamplingParams(8, temperature=1.3, top_k=80),
    ],
)
def test_draft_warps_only_the_kept_columns(pair, params):
    """The drafter warps a restricted head's own columns: the distribution warping the
    whole row gives (the other tokens have probability 0)."""
    ids = _kept(VOCAB, 50, seed=3)
    cut = load_model(pair[1]).restrict_head(ids)
    drafter = ModelDrafter(cut, 2, 32)
    x = torch.tensor(prompts_of([9, 9], seed=4))
    logits = cut.prefill(x, cut.new_cache(2, 32), torch.tensor([9, 6], dtype=torch.int32))[:, -1]
    got = drafter._warp(logits, params)
    want = warp_probs(logits, params.temperature, params.top_k, params.top_p)
    assert got.shape == want.shape and torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_restrict_head_refuses_bad_ids(pair):
    m = load_model(pair[1])
    for ids, msg in (([], "at least one"), ([0, VOCAB], "must lie in"), ([3, 3], "distinct")):
        with pytest.raises(ValueError, match=msg):
            m.restrict_head(ids)
    m.restrict_head([1, 2, 3])
    with pytest.raises(ValueError, match="already restricted"):
        m.restrict_head([4])


def _engine(target, draft, **kw):
    kw.setdefault("max_batch_size", 4)
    kw.setdefault("max_seq_len", 96)
    return osd.Engine(load_model(target), draft=draft, **kw)


@pytest.mark.parametrize(
    "spec",
    [
        dict(num_draft_tokens=4),
        dict(tree=DynamicTree(topk=3, depth=3, max_nodes=8)),
        dict(num_draft_tokens=3, prompt_lookup=True),
    ],
    ids=["chain", "dyntree", "lookup"],
)
def test_greedy_equals_plain(pair, spec):
    prompts = prompts_of([5, 12, 8], seed=3)
    prompts[0] = prompts[0] * 3
    ref = _engine(pair[0], None).generate(prompts, osd.SamplingParams(24))
    # Half the vocabulary kept, the target's own argmax tokens not always among them.
    draft = load_model(pair[1]).restrict_head(_kept(VOCAB, VOCAB // 2, seed=4))
    eng = _engine(pair[0], [draft], spec=osd.SpecConfig(**spec))
    outs = eng.generate(prompts, osd.SamplingParams(24))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert 0 < eng.stats["accepted"] < eng.stats["drafted"]


@pytest.mark.parametrize(
    "spec",
    [dict(num_draft_tokens=3), dict(num_draft_tokens=3, prompt_lookup=True, lookup_tree_below=4)],
    ids=["chain", "lookup-tree"],
)
@pytest.mark.parametrize(
    "params",
    [osd.SamplingParams(16), osd.SamplingParams(16, temperature=0.8, top_k=40, top_p=0.9, seed=5)],
    ids=["greedy", "sampled"],
)
def test_alpha_is_exact_over_the_kept_columns(pair, spec, params):
    """The reported α is the mean of 1 - TV(p, q) over the drafted positions, p the
    target's (warped when sampling) distribution and q the draft's over the whole
    vocabulary, recomputed here from each step's logits: summing over the head's own
    columns loses nothing."""
    draft = load_model(pair[1]).restrict_head(_kept(VOCAB, VOCAB // 2, seed=6))
    eng = _engine(pair[0], [draft], spec=osd.SpecConfig(**spec), max_batch_size=1)
    verdicts = record_verdicts(eng)
    eng.generate([prompts_of([6], seed=7)[0] * 3], params)
    total, count = 0.0, 0

    def dist(logits):
        if params.greedy:
            return torch.softmax(logits.float(), -1)
        n = logits.shape[0]
        return warp_probs(
            logits,
            torch.full((n,), params.temperature),
            torch.full((n,), params.top_k),
            torch.full((n,), params.top_p),
        )

    for v in verdicts:
        prop = v.proposal
        if getattr(prop, "draft_logits", None) is not None:  # a lookup tree
            nodes = [0] + prop.draft_nodes[0, :-1].tolist()
            p, q = dist(v.logits[0, nodes]), dist(prop.draft_logits[0])
        elif prop.origin is None and prop.logits is not None:  # the draft model's chain
            k = v.drafted[0]
            p, q = dist(v.logits[0, :k]), dist(prop.logits[0, :k])
        else:
            continue
        total += torch.minimum(p, q).sum().item()
        count += p.shape[0]
    assert count > 0
    assert eng.stats["alpha"] == pytest.approx(total / count, abs=1e-5)


@pytest.mark.slow
def test_sampled_joint_follows_target():
    """First three tokens of 50,000 requests, the draft proposing from 9 of 16 tokens:
    chi-square p > 1e-3 against the warped target's exact joint."""
    target, draft = _small_pair()
    prompt = [3, 1, 4, 1]
    sp = osd.SamplingParams(3, seed=99, temperature=0.8, top_k=0, top_p=0.95)
    small = load_model(draft).restrict_head(_kept(V_SMALL, 9, seed=5))
    eng = osd.Engine(
        load_model(target),
        draft=[small],
        spec=osd.SpecConfig(num_draft_tokens=2),
        max_batch_size=4096,
        max_seq_len=16,
    )
    assert_joint_follows_target(eng, target, prompt, sp)


def test_targets_map_into_the_heads_columns():
    head = torch.tensor([7, 2, 9, 4, 11, 0, 5, 13])  # column c holds token head[c]
    ids = torch.tensor([[2, 3, 13, 6], [0, 9, 1, 8], [4, 7, 2, 5]])
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.5, 0.2, 0.2, 0.1], [0.3, 0.3, 0.2, 0.2]])
    cols, p, none = to_head_vocab(head, ids, probs, None)
    assert none is None
    present = torch.isin(ids, head)
    torch.testing.assert_close(p, probs * present)
    column = {int(t): c for c, t in enumerate(head.tolist())}
    for r in range(3):
        assert len(set(cols[r].tolist())) == 4  # distinct, as distill_loss needs
        for j in range(4):
            if present[r, j]:
                assert int(cols[r, j]) == column[int(ids[r, j])]
    logits = torch.randn(3, 16)
    assert torch.equal(to_head_vocab(head, None, None, logits)[2], logits[:, head])
    with pytest.raises(ValueError, match="too small"):
        to_head_vocab(head[:5], ids, probs, None)


@pytest.mark.parametrize("topk", [8, None], ids=["topk", "logits"])
def test_learns_online_on_its_columns(pair, topk):
    draft = load_model(pair[1]).restrict_head(_kept(VOCAB, 100, seed=6))
    head_ids = draft.head_ids.clone()
    online = osd.OnlineConfig(
        update_every_requests=2,
        steps_per_update=2,
        lr=3e-3,
        background=False,
        holdout_every=4,
        guard_tolerance=1.0,
        topk=topk,
    )
    eng = _engine(pair[0], [draft], spec=osd.SpecConfig(num_draft_tokens=4), online=online)
    prompts = prompts_of([6, 9, 4, 7] * 3, seed=7)
    ref = _engine(pair[0], None).generate(prompts, osd.SamplingParams(20))
    before = draft.lm_head.weight.detach().clone()
    outs = serve_in_batches(eng, prompts, osd.SamplingParams(20))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert eng.stats["online"]["updates_applied"] >= 2
    serving = eng.speculators[0].drafter.model
    assert torch.equal(serving.head_ids, head_ids)
    assert not torch.equal(serving.lm_head.weight, before)


def test_checkpoint_carries_the_head_vocab(pair, tmp_path):
    pair[1].save_pretrained(tmp_path)
    assert load_model(tmp_path).head_vocab_size == VOCAB
    ids = sorted(_kept(VOCAB, 40, seed=8).tolist())
    (tmp_path / HEAD_VOCAB_FILE).write_text(json.dumps(ids))
    m = load_model(tmp_path)
    assert m.head_ids.tolist() == ids
    assert load_model(tmp_path, head_vocab=False).head_vocab_size == VOCAB
    eng = osd.Engine.from_pretrained(pair[0], draft=str(tmp_path), max_seq_len=64)
    assert eng.speculators[0].drafter.model.head_vocab_size == 40
    (tmp_path / HEAD_VOCAB_FILE).write_text('{"ids": 1}')
    with pytest.raises(ValueError, match=HEAD_VOCAB_FILE):
        load_model(tmp_path)
