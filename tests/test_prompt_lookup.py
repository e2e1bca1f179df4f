"""Prompt lookup beside a draft model: steps where every row has a match verify lookup's
drafts, the others the draft model's chain or tree (or both as branches of one tree);
greedy output equals the target's alone, and the draft's cache catches up on the tokens
it skipped."""

import pytest
import torch

import osd
from osd.spec_decode.lookup_drafter import lookup_tree
from osd.spec_decode.model_drafter import ChainProposal, ModelDrafter, TreeProposal
from osd.spec_decode.proposals import FROM_LOOKUP, FROM_MODEL
from osd.tree import depths_from_parents, mask_from_parents
from tests.test_models import tiny_hf_model
from tests.test_speculative import perturbed, prompts_of, record_verdicts


@pytest.fixture(scope="module")
def llama_pair():
    target = tiny_hf_model("llama", seed=11)
    return target, perturbed(target, 0.35, seed=12)


@pytest.fixture(scope="module")
def plain(llama_pair):
    return osd.Engine.from_pretrained(llama_pair[0], max_batch_size=8, max_seq_len=96)


def test_steps_where_no_row_drafts(llama_pair, plain):
    """Prompt lookup on prompts without repeats: whole steps draft nothing (a plain
    one-token verify) and the output is still the target's."""
    target, _ = llama_pair
    prompts = [list(range(10, 30)), list(range(40, 47))]
    ref = plain.generate(prompts, osd.SamplingParams(12))
    eng = osd.Engine.from_pretrained(
        target, spec=osd.SpecConfig(drafter="ngram"), max_batch_size=2, max_seq_len=96
    )
    outs = eng.generate(prompts, osd.SamplingParams(12))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_prompt_lookup_with_a_model_draft(llama_pair, plain):
    """prompt_lookup: steps where every row has a match are drafted by lookup alone, the
    others by the draft model; output equals the target's, and a perfect draft is still
    accepted in full after lookup steps (its cache caught up on the skipped tokens)."""
    target, draft = llama_pair
    prompts = [prompts_of([7], seed=81)[0] * 5, prompts_of([9], seed=82)[0] * 3]
    ref = plain.generate(prompts, osd.SamplingParams(40))
    for d in (draft, target):
        eng = osd.Engine.from_pretrained(
            target,
            draft=d,
            spec=osd.SpecConfig(num_draft_tokens=4, prompt_lookup=True),
            max_batch_size=2,
            max_seq_len=96,
        )
        outs = [eng.generate([p], osd.SamplingParams(40))[0] for p in prompts]
        outs += eng.generate(prompts, osd.SamplingParams(40))
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref] * 2
        st = eng.stats
        assert 0 < st["lookup_steps"] < st["target_forwards"]
        assert sum(o.stats["lookup_steps"] for o in outs[:2]) > 0
        # tokens per sequence per verify step, the batched run's two rows counted apart
        assert st["target_forwards"] < st["sequence_steps"]
        assert 1 <= st["mean_accepted_length"] <= 5
    # Perfect draft: the draft model's own steps accept everything (α is over them only).
    assert st["alpha"] == pytest.approx(1.0, abs=1e-4)


def test_prompt_lookup_rows_beside_model_rows(llama_pair, plain):
    """In a batch where some rows have a lookup match and others do not, the matched rows
    verify their lookup continuation while the draft model drafts the rest; the output
    equals the target's, and the draft's cache stays in step for both kinds of row."""
    target, draft = llama_pair
    prompts = [
        prompts_of([7], seed=81)[0] * 5,
        list(range(40, 60)),
        prompts_of([5], seed=85)[0] * 4,
    ]
    ref = plain.generate(prompts, osd.SamplingParams(40))
    eng = osd.Engine.from_pretrained(
        target,
        draft=draft,
        spec=osd.SpecConfig(num_draft_tokens=4, prompt_lookup=True, ngram_min=2),
        max_batch_size=3,
        max_seq_len=96,
    )
    verdicts = record_verdicts(eng)
    outs = eng.generate(prompts, osd.SamplingParams(40))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    # a chain whose rows with a match verify lookup's drafts, the others the model's
    mixed = [
        v.proposal.origin.tolist()
        for v in verdicts
        if v.proposal.origin is not None and v.proposal.logits is not None
    ]
    assert mixed and all(set(rows) == {FROM_LOOKUP, FROM_MODEL} for rows in mixed)
    assert outs[0].stats["lookup_steps"] > 0


@pytest.mark.parametrize(
    "tree", [[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)], osd.DynamicTree(topk=2, depth=3, max_nodes=5)]
)
def test_prompt_lookup_in_front_of_a_tree(llama_pair, plain, tree):
    """prompt_lookup with a tree: matched steps verify the lookup chain (k = 6, wider than
    the tree), the others the draft's tree; greedy output equals the target's, alone and
    in a ragged batch, and the draft's cache catches up across both kinds of step."""
    target, draft = llama_pair
    prompts = [prompts_of([7], seed=83)[0] * 5, prompts_of([9], seed=84)[0] * 3]
    ref = plain.generate(prompts, osd.SamplingParams(40))
    eng = osd.Engine.from_pretrained(
        target,
        draft=draft,
        spec=osd.SpecConfig(num_draft_tokens=6, prompt_lookup=True, tree=tree),
        max_batch_size=2,
        max_seq_len=112,
    )
    outs = [eng.generate([p], osd.SamplingParams(40))[0] for p in prompts]
    outs += eng.generate(prompts, osd.SamplingParams(40))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref] * 2
    st = eng.stats
    assert 0 < st["lookup_steps"] < st["target_forwards"]


@pytest.mark.parametrize("k,below", [(3, 2), (4, 4), (1, 2)])
def test_lookup_tree_beside_the_model(llama_pair, plain, k, below):
    """lookup_tree_below: steps with a short match (or a row without one) verify lookup's
    continuation and the draft model's chain as two branches of one tree, rows of a batch
    padded to one width; matches of ``below`` or more tokens in every row still draft
    alone (none are when ``below`` passes ``ngram_max``); a branch of lookup runs up to
    ``lookup_tokens``, past k. Greedy output equals the target's, alone and in a ragged
    batch; α is measured
    along the model's branch (1 for a perfect draft, whose branch is then always taken)."""
    target, draft = llama_pair
    prompts = [
        prompts_of([7], seed=81)[0] * 5,
        list(range(40, 60)),
        prompts_of([5], seed=85)[0] * 4,
    ]
    ref = plain.generate(prompts, osd.SamplingParams(40))
    sources = set()
    for d in (draft, target):
        eng = osd.Engine.from_pretrained(
            target,
            draft=d,
            spec=osd.SpecConfig(
                num_draft_tokens=k, prompt_lookup=True, lookup_tokens=6, lookup_tree_below=below
            ),
            max_batch_size=3,
            max_seq_len=112,
        )
        verdicts = record_verdicts(eng)
        outs = [eng.generate([p], osd.SamplingParams(40))[0] for p in prompts]
        outs += eng.generate(prompts, osd.SamplingParams(40))
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref] * 2
        trees = [v for v in verdicts if isinstance(v.proposal, TreeProposal)]
        assert trees and all(v.proposal.origin is not None for v in trees)
        lookup_rows = [[bool(o & FROM_LOOKUP) for o in v.proposal.origin.tolist()] for v in trees]
        assert any(any(rows) for rows in lookup_rows)
        # a batched tree step whose rows hold a lookup branch beside rows without one
        assert any(any(rows) and not all(rows) for rows in lookup_rows)
        assert eng.stats["alpha"] is not None
        sources |= {
            "lookup"
            for v in verdicts
            if isinstance(v.proposal, ChainProposal)
            and v.proposal.origin is not None
            and set(v.proposal.origin.tolist()) == {FROM_LOOKUP}
        }
    assert eng.stats["alpha"] == pytest.approx(1.0, abs=1e-4)
    assert ("lookup" in sources) == (below == 2)  # 2-token matches draft alone
    # beside the model, a match's branch runs as far as a lookup step's (lookup_tokens)
    assert any(v.proposal.max_depth > k for v in trees)


def test_lookup_tree_layout():
    """lookup_tree: the lookup branch first, the model's chain sharing its common prefix
    (rows without the model's branch verify the lookup chain alone), narrower rows padded
    with children of the root repeating node 1's token."""
    chain = ChainProposal(
        torch.tensor([[5, 6, 9], [7, 8, 9], [1, 1, 1]]), None, torch.zeros(3, 3, 11), None, 3
    )
    prop = lookup_tree(
        torch.tensor([1, 2, 3]), chain, [[5, 6, 7], [], [4, 4, 4, 4, 4]], [True, True, False]
    )
    assert prop.tokens.tolist() == [[1, 5, 6, 7, 9, 5], [2, 7, 8, 9, 7, 7], [3, 4, 4, 4, 4, 4]]
    assert prop.parents.tolist() == [[-1, 0, 1, 2, 2, 0], [-1, 0, 1, 2, 0, 0], [-1, 0, 1, 2, 3, 4]]
    assert prop.depths.tolist() == [[0, 1, 2, 3, 3, 1], [0, 1, 2, 3, 1, 1], [0, 1, 2, 3, 4, 5]]
    assert prop.draft_nodes.tolist() == [[1, 2, 4], [1, 2, 3], [0, 0, 0]]
    assert prop.max_depth == 5
    assert prop.origin.tolist() == [FROM_LOOKUP | FROM_MODEL, FROM_MODEL, FROM_LOOKUP]
    assert torch.equal(prop.mask, mask_from_parents(prop.parents))
    assert torch.equal(prop.depths, depths_from_parents(prop.parents))
    # a 63-draft lookup chain: the last node's ancestor bit is bit 63 (int64's sign bit)
    wide = lookup_tree(
        torch.tensor([1, 2]),
        ChainProposal(chain.tokens[:2], None, chain.logits[:2], None, 3),
        [list(range(63)), [5]],
        [False, True],
    )
    assert wide.tokens.shape == (2, 64)
    assert torch.equal(wide.mask, mask_from_parents(wide.parents))


@pytest.mark.parametrize("tree", [None, osd.DynamicTree(topk=2, depth=2, max_nodes=4)])
def test_lookup_steps_verify_longer_chains(llama_pair, plain, tree):
    """lookup_tokens: a step whose rows all match verifies up to lookup_tokens drafts (12,
    past k = 3 and past the tree). Asked again, the requests are looked up in the history
    of their first answers, so steps accept up to 13 tokens at once; every output equals
    the target's, alone and in a batch. (``min_reach=0``: whole continuations, not cut by
    the requests' records.)"""
    target, draft = llama_pair
    prompts = [prompts_of([7], seed=86)[0] * 3, prompts_of([9], seed=87)[0] * 2]
    ref = plain.generate(prompts, osd.SamplingParams(40))
    eng = osd.Engine.from_pretrained(
        target,
        draft=draft,
        spec=osd.SpecConfig(
            num_draft_tokens=3,
            lookup=osd.PromptLookup(tokens=12, history=1024, min_reach=0.0),
            tree=tree,
        ),
        max_batch_size=2,
        max_seq_len=96,
    )
    verdicts = record_verdicts(eng)
    outs = [eng.generate([p], osd.SamplingParams(40))[0] for p in prompts]
    outs += eng.generate(prompts, osd.SamplingParams(40))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref] * 2
    steps = [
        (v.proposal.max_drafted, max(v.emitted))
        for v in verdicts
        if isinstance(v.proposal, ChainProposal)
        and v.proposal.origin is not None
        and set(v.proposal.origin.tolist()) == {FROM_LOOKUP}
    ]
    assert max(width for width, _ in steps) == 12
    assert max(emitted for _, emitted in steps) == 13


@pytest.mark.parametrize("limit", [6, ModelDrafter.PENDING_LIMIT])
def test_draft_cache_catches_up_after_lookup_steps(llama_pair, monkeypatch, limit):
    """Tokens queued over several skipped steps (fed early once past the pending limit)
    leave the draft cache as if the draft had read them: its next root logits equal a
    cacheless forward over the whole sequence."""
    monkeypatch.setattr(ModelDrafter, "PENDING_LIMIT", limit)
    model = osd.Engine.from_pretrained(llama_pair[1], max_batch_size=2).model
    prompts = prompts_of([9, 5], seed=91)
    chunks = [prompts_of([3, 5], seed=92), prompts_of([5, 1], seed=93), prompts_of([2, 4], seed=94)]
    drafter = ModelDrafter(model, max_batch_size=2, capacity=64)
    first = torch.tensor([7, 8])
    drafter.prefill(prompts, 0, first)
    seqs = [p + [int(t)] for p, t in zip(prompts, first)]
    for pair in chunks:
        width = max(len(c) for c in pair)
        tokens = torch.full((2, width), -1, dtype=torch.int64)
        for b, c in enumerate(pair):
            tokens[b, : len(c)] = torch.tensor(c)
            seqs[b] += c
        drafter.queue(2, tokens, torch.tensor([len(c) for c in pair]), width)
    root = drafter._root(2)
    for b, seq in enumerate(seqs):
        with torch.no_grad():
            want = model.forward_train(torch.tensor([seq]))[0, -1]
        torch.testing.assert_close(root[b], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("batch", [1, 3])
def test_model_drafts_where_the_records_leave_lookup_nothing(llama_pair, plain, batch):
    """With the requests' records on (``min_reach > 0``, the default), a chain step is
    lookup's alone when every row's record makes some of its match worth drafting, with
    those lengths; otherwise the model drafts, and only then (the rows with lookup drafts
    verifying those instead). A row whose record cuts its match to nothing gets the
    model's chain, not a plain step. Greedy output equals the target's."""
    target, draft = llama_pair
    prompts = [
        prompts_of([7], seed=95)[0] * 4,
        list(range(40, 60)),
        prompts_of([5], seed=96)[0] * 3,
    ]
    prompts = prompts[:batch]
    ref = plain.generate(prompts, osd.SamplingParams(40))
    eng = osd.Engine.from_pretrained(
        target,
        draft=draft,
        spec=osd.SpecConfig(num_draft_tokens=3, lookup=osd.PromptLookup(tokens=6)),
        max_batch_size=3,
        max_seq_len=112,
    )
    drafter = eng.speculators[0].drafter
    assert drafter.lookup.min_reach > 0
    seen = []
    worth, model_propose = drafter.lookup.worth_drafting, drafter.inner.propose

    def recorded_worth(*args):
        conts = worth(*args)
        seen.append(("lookup", [list(c) for c in conts]))
        return conts

    def recorded_model(*args, **kw):
        seen.append(("model", kw["k"]))
        return model_propose(*args, **kw)

    drafter.lookup.worth_drafting, drafter.inner.propose = recorded_worth, recorded_model
    verdicts = record_verdicts(eng)
    outs = eng.generate(prompts, osd.SamplingParams(40))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    steps = [v.proposal for v in verdicts]
    # pair each lookup decision with what followed it: the model only after an empty row
    i, lookup_steps, model_steps = 0, 0, 0
    for prop in steps:
        kind, conts = seen[i]
        assert kind == "lookup"
        if all(conts):  # every row drafts lookup's continuation, as long as its record says
            assert prop.tokens.shape[1] == max(map(len, conts))
            assert prop.num_drafted.tolist() == [len(c) for c in conts]
            lookup_steps += 1
            i += 1
        else:
            assert seen[i + 1] == ("model", 3)
            rows = prop.num_drafted.tolist() if prop.num_drafted is not None else [3] * batch
            for b, c in enumerate(conts):
                if c:  # a row with lookup drafts verifies those, cut to the chain
                    assert rows[b] == min(len(c), 3)
                    assert prop.tokens[b, : rows[b]].tolist() == c[: rows[b]]
            model_steps += 1
            i += 2
    assert i == len(seen) and lookup_steps > 0 and model_steps > 0
    # the records cut lookup's drafts: some step drafted less than a match offered
    assert any(len(c) < 6 for kind, x in seen if kind == "lookup" for c in x if c)


def test_without_records_lookup_drafts_every_match(llama_pair, plain):
    """``min_reach=0``: lookup in front of the model drafts whole continuations and the
    model drafts only when some row has no match at all."""
    target, draft = llama_pair
    prompts = [prompts_of([7], seed=97)[0] * 4]
    ref = plain.generate(prompts, osd.SamplingParams(40))
    eng = osd.Engine.from_pretrained(
        target,
        draft=draft,
        spec=osd.SpecConfig(num_draft_tokens=3, lookup=osd.PromptLookup(tokens=6, min_reach=0.0)),
        max_batch_size=1,
        max_seq_len=112,
    )
    verdicts = record_verdicts(eng)
    assert eng.generate(prompts, osd.SamplingParams(40))[0].token_ids == ref[0].token_ids
    widths = [
        v.proposal.tokens.shape[1]
        for v in verdicts
        if v.proposal.origin is not None and set(v.proposal.origin.tolist()) == {FROM_LOOKUP}
    ]
    assert widths and max(widths) == 6


def test_a_stale_row_catches_up_through_its_pending_tokens(llama_pair):
    """A deferred draft's rows that sat out steps (``defer``): one that missed a few tokens
    gets them as pending tokens, fed with its root by the next forward; one that missed
    many (its whole prompt) is prefilled. Either way its root logits equal a cacheless
    forward over the whole sequence, and a second catch-up continues from there."""
    model = osd.Engine.from_pretrained(llama_pair[1], max_batch_size=2).model
    drafter = ModelDrafter(model, max_batch_size=2, capacity=96, defer=True)
    short, long = prompts_of([6], seed=98)[0], prompts_of([40], seed=99)[0]
    drafter.prefill([short, long], 0, torch.tensor([3, 4]))  # deferred: rows left empty
    seqs = [short + [3], long + [4]]
    assert len(seqs[0]) <= ModelDrafter.PENDING_LIMIT < len(seqs[1])
    for extra in ([], [[5, 6, 7], [8, 9]]):
        for b, more in enumerate(extra):
            seqs[b] += more
        drafter.resync([0, 1], [list(s) for s in seqs])
        root = drafter._root(2)
        drafter._pending_len.zero_()
        drafter._pending_max = 0
        for b, seq in enumerate(seqs):
            with torch.no_grad():
                want = model.forward_train(torch.tensor([seq]))[0, -1]
            torch.testing.assert_close(root[b], want, atol=1e-4, rtol=1e-4)
        assert drafter.cache.lens[:2].tolist() == [len(s) for s in seqs]
