"""Prompt lookup's draft lengths from each request's record
(``osd.spec_decode.lookup_lengths``): the record's counting from the request's tokens,
the lengths it allows, and an engine whose lookup drafts are cut short still giving the
target's greedy output token for token."""

from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

import osd
from osd.models.config import ModelConfig
from osd.models.llama import DecoderLM
from osd.spec import MIN_REACH, PromptLookup
from osd.spec_decode.lookup_drafter import NGramDrafter
from osd.spec_decode.lookup_lengths import (
    EXPLORE_EVERY,
    explores,
    MAX_REACH,
    PRIOR_ACCEPTED,
    PRIOR_REACHED,
    LookupRecord,
    batch_reach,
)


def test_prior_sets_the_first_lengths():
    rec = LookupRecord()
    p = PRIOR_ACCEPTED / PRIOR_REACHED
    want = max(i for i in range(1, 9) if p**i >= 0.2)
    assert rec.length(2, 8, 0.2) == want
    assert rec.length(2, 8, 0.0) == 8  # 0: the whole continuation
    assert rec.length(2, 1, 0.2) == 1


def test_settle_counts_reached_and_accepted_positions():
    rec = LookupRecord()
    tokens = [5, 6, 7]
    rec.propose(3, [1, 2, 3, 4], len(tokens))
    rec.settle(tokens)  # the step has not emitted yet: nothing counted
    assert rec.pending is not None
    rec.settle(tokens + [1, 2, 9])  # two drafts accepted, the third rejected
    assert rec.pending is None
    assert rec.reached[3] == [PRIOR_REACHED + 1] * 3 + [PRIOR_REACHED]
    assert rec.accepted[3] == [PRIOR_ACCEPTED + 1] * 2 + [PRIOR_ACCEPTED] * 2


def test_lengths_follow_the_record():
    good, bad = LookupRecord(), LookupRecord()
    for step in range(30):
        good.propose(1, [1, 2, 3, 4], 10 * step)
        good.settle(list(range(10 * step)) + [1, 2, 3, 4, 0])
        bad.propose(1, [1, 2, 3, 4], 10 * step)
        bad.settle(list(range(10 * step)) + [0])
    assert good.length(1, 6, 0.2) == 6  # every position accepted: draft it all (up to
    # the positions with only the prior, 5 and 6, still likely enough after 4 sure ones)
    assert bad.length(1, 6, 0.2) == 0  # first drafts always wrong: stop drafting
    assert good.length(2, 6, 0.2) == bad.length(2, 6, 0.2)  # per suffix length


def test_min_reach_checks_and_device_defaults():
    with pytest.raises(ValueError, match="min_reach"):
        PromptLookup(min_reach=1.0)
    assert PromptLookup().min_reach is None
    assert 0 < MIN_REACH["cuda"] < MIN_REACH["cpu"] < 1


@pytest.mark.parametrize("reach", [None, 0.0, 0.5, 0.9])
def test_cut_drafts_keep_greedy_output(reach):
    target, _ = osd.zoo.default_pair()
    torch.manual_seed(0)
    plain = osd.Engine.from_pretrained(target, max_batch_size=3)
    lookup = osd.Engine.from_pretrained(
        target,
        max_batch_size=3,
        spec=osd.SpecConfig(
            drafter="ngram", num_draft_tokens=5, lookup=PromptLookup(min_reach=reach)
        ),
    )
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 8, 9] * 5, list(range(10, 40))]
    params = osd.SamplingParams(40, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in lookup.generate(prompts, params)] == want


def test_the_bar_rises_with_the_batch():
    assert batch_reach(0.2, 1) == 0.2
    assert batch_reach(0.2, 3) == pytest.approx(0.6)
    assert batch_reach(0.2, 8) == MAX_REACH
    assert batch_reach(0.0, 8) == 0.0


def test_sampled_tokens_after_cut_lookup_drafts_keep_the_target_distribution():
    """Sampled (T 1, top-p 0.9) on a random 8-token model, prompt lookup drafting cut
    continuations: the second generated token, the first one a lookup step verifies, is
    distributed as the target's p(t1) p(t2 | t1) over the 64 pairs (chi-square, 1e-4)."""
    torch.manual_seed(0)
    cfg = ModelConfig("LlamaForCausalLM", 8, 32, 64, 2, 2, 1, 16)
    model = DecoderLM(cfg)
    model.init_weights(generator=torch.Generator().manual_seed(3))
    model.requires_grad_(False)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]  # lookup always has a continuation
    spec = osd.SpecConfig(drafter="ngram", num_draft_tokens=4, lookup=PromptLookup(min_reach=0.2))
    eng = osd.Engine(model, spec=spec, max_batch_size=16, max_seq_len=32)
    n = 4000
    params = osd.SamplingParams(2, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    outs = eng.generate([prompt] * n, params)
    assert eng.stats["drafted"] > 0
    pairs = torch.tensor([o.token_ids[0] * 8 + o.token_ids[1] for o in outs])
    counts = torch.bincount(pairs, minlength=64).double()

    def warped(ids):
        logits = model.forward_train(torch.tensor([ids]))[0, -1].double()
        return _top_p(torch.softmax(logits, -1), 0.9)

    p1 = warped(prompt)
    exact = torch.cat([p1[a] * warped(prompt + [a]) for a in range(8)])
    support = exact > 0
    assert counts[~support].sum() == 0
    _, p_value = chisquare(counts[support].numpy(), (exact[support] / exact.sum() * n).numpy())
    assert p_value > 1e-4


def _top_p(probs, top_p):
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for i in order.tolist():
        keep[i] = True
        mass += float(probs[i])
        if mass >= top_p:
            break
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


def test_exploration_is_rarer_in_a_batch():
    """Alone every EXPLORE_EVERY-th step explores; in a batch of B rows every
    EXPLORE_EVERY * B-th (a drafted row costs the whole batch)."""
    alone = [s for s in range(1, 200) if explores(s, 1)]
    assert alone == list(range(EXPLORE_EVERY, 200, EXPLORE_EVERY))
    assert [s for s in range(1, 300) if explores(s, 8)] == [8 * EXPLORE_EVERY, 16 * EXPLORE_EVERY]
    assert explores(0, 3) and explores(EXPLORE_EVERY, 0)


def test_a_batch_row_drafts_up_to_the_longest_row():
    """The verify forward is [B, 1 + the longest chain]: a row under the bar still drafts
    its continuation up to that length (those positions are computed anyway), and none
    past it; alone, the bar alone decides."""
    drafter = NGramDrafter(1, 3, None, min_reach=0.45)  # the bar of a batch of 2: 0.9

    def rows(*steps):  # step 0 explores (one position past the bar), the others do not
        return [
            SimpleNamespace(prompt=[1, 2, 3], generated=[], lookup_record=None, spec_steps=s)
            for s in steps
        ]

    found = [(2, [7, 8, 9]), (2, [4, 5, 6])]
    prop = drafter.propose(rows(0, 1), torch.zeros(2, dtype=torch.int64), None, None, None,
                           k=3, found=found)  # fmt: skip
    assert prop.num_drafted.tolist() == [1, 1]
    assert prop.tokens[:, :1].tolist() == [[7], [4]]
    prop = drafter.propose(rows(1, 1), torch.zeros(2, dtype=torch.int64), None, None, None,
                           k=3, found=found)  # fmt: skip
    assert prop.num_drafted.tolist() == [0, 0]
    prop = drafter.propose(rows(1), torch.zeros(1, dtype=torch.int64), None, None, None,
                           k=3, found=found[1:])  # fmt: skip
    assert prop.num_drafted.tolist() == [1]  # alone the bar is 0.45, under the prior's 0.67


def test_may_draft_is_whether_some_match_drafts():
    """``LookupRecord.may_draft(bar)`` is True exactly when ``length`` gives 1 or more for
    some matched length, recorded or not (an unrecorded one starts from the prior)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        rec = LookupRecord()
        for n in range(1, 4):
            if torch.rand((), generator=gen) < 0.3:
                continue  # this length never matched
            reached, acc = rec._rows(n, 3)
            for i in range(3):
                hits = int(torch.randint(0, 30, (), generator=gen))
                reached[i] += hits
                acc[i] += int(torch.randint(0, hits + 1, (), generator=gen))
        for bar in (0.0, 0.3, 0.6, 0.7, 0.8, 0.9):
            some = any(rec.length(n, 3, bar) >= 1 for n in range(1, 6))
            assert rec.may_draft(bar) == some, (bar, rec.reached, rec.accepted)


def test_a_batch_no_record_clears_skips_the_search():
    """Under a bar no row's record clears (a batch's), a step that explores nowhere drafts
    nothing without searching the rows' contexts, and settles their pending drafts as the
    search would; once a row's record clears the bar, or a row explores, the rows are
    searched again."""
    drafter = NGramDrafter(1, 3, None, min_reach=0.2)  # a batch of 8: the bar is 0.9
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]

    def rows(steps):
        return [
            SimpleNamespace(prompt=list(prompt), generated=[7], lookup_record=None,
                            spec_steps=s, ngram_index=None)
            for s in steps
        ]  # fmt: skip

    def propose(active):
        roots = torch.zeros(len(active), dtype=torch.int64)
        return drafter.propose(active, roots, None, None, None, k=3)

    searched = []
    real = drafter.matches
    drafter.matches = lambda *a, **kw: searched.append(1) or real(*a, **kw)
    active = rows([1] * 8)
    active[0].lookup_record = LookupRecord()
    active[0].lookup_record.propose(3, [5, 6, 7], len(prompt))
    active[0].generated = [5, 6, 8]  # the step emitted: 2 drafts accepted, the third not
    prop = propose(active)
    assert prop.num_drafted.tolist() == [0] * 8 and not searched
    record = active[0].lookup_record
    assert record.pending is None  # settled as the search would have
    assert record.reached[3] == [PRIOR_REACHED + 1] * 3
    assert record.accepted[3] == [PRIOR_ACCEPTED + 1] * 2 + [PRIOR_ACCEPTED]
    assert propose(rows([8 * EXPLORE_EVERY] + [1] * 7)).num_drafted.tolist()[0] == 1
    assert searched
    searched.clear()
    confident = rows([1] * 8)
    confident[3].lookup_record = LookupRecord()
    reached, acc = confident[3].lookup_record._rows(3, 3)
    reached[0] += 40
    acc[0] += 40  # (2 + 40) / (3 + 40) >= 0.9
    prop = propose(confident)
    assert searched and prop.num_drafted.tolist()[3] == 1


def test_idle_is_whether_propose_drafts_nothing():
    """Where ``NGramDrafter.idle(active, k)`` is True, ``propose`` with chains of ``k``
    drafts nothing for any row and leaves the records as ``idle`` does (False: no row's
    record rules drafting out, though its match may still draft nothing)."""
    rng = torch.Generator().manual_seed(0)
    seen = set()
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    for trial in range(40):
        B = int(torch.randint(1, 9, (1,), generator=rng))
        k = int(torch.randint(0, 4, (1,), generator=rng))
        reach = [0.0, 0.1, 0.2][trial % 3]
        twins = []
        for _ in range(2):
            active = []
            g = torch.Generator().manual_seed(trial)
            for _ in range(B):
                record = LookupRecord()
                reached, acc = record._rows(3, 3)
                bonus = float(torch.randint(0, 60, (1,), generator=g))
                reached[0] += bonus
                acc[0] += bonus * float(torch.rand(1, generator=g))
                step = int(torch.randint(1, 3 * EXPLORE_EVERY, (1,), generator=g))
                active.append(
                    SimpleNamespace(prompt=list(prompt), generated=[7], lookup_record=record,
                                    spec_steps=step, ngram_index=None)
                )  # fmt: skip
            twins.append(active)
        drafter = NGramDrafter(1, 3, None, min_reach=reach)
        idle = drafter.idle(twins[0], k)
        roots = torch.zeros(B, dtype=torch.int64)
        prop = NGramDrafter(1, 3, None, min_reach=reach).propose(
            twins[1], roots, None, None, None, k=k
        )
        seen.add(idle)
        if idle:
            assert prop.num_drafted.sum() == 0, (trial, B, k, reach)
            for a, b in zip(*twins):
                assert (a.lookup_record.reached, a.lookup_record.accepted) == (
                    b.lookup_record.reached,
                    b.lookup_record.accepted,
                )
    assert seen == {False, True}


@pytest.mark.parametrize("sampled", [False, True, "mixed"])
def test_idle_steps_equal_steps_through_the_verify_path(sampled):
    """A step in which prompt lookup drafts nothing runs as a plain step (``Speculator.
    _plain_step`` when no row's record can clear the bar, ``_plain_tail`` after a proposal
    that drafts nothing); it gives the same tokens (seeded samples included), statistics
    and records as the same step through the propose / verify / commit path."""
    target, _ = osd.zoo.default_pair()
    spec = osd.SpecConfig(drafter="ngram", num_draft_tokens=4, lookup=PromptLookup(min_reach=0.2))
    engines = [osd.Engine.from_pretrained(target, max_batch_size=4, spec=spec) for _ in range(2)]
    idle_steps = []
    first = engines[0].speculators[0]
    real, tail = first._plain_step, first._plain_tail
    first._plain_step = lambda *a: idle_steps.append(1) or real(*a)
    first._plain_tail = lambda *a: idle_steps.append(2) or tail(*a)
    engines[1].speculators[0]._idle = lambda active, k: False
    engines[1].speculators[0]._nothing_drafted = lambda prop: False
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 8, 9] * 5, list(range(10, 40)), [3, 4] * 6]
    if sampled == "mixed":  # greedy and sampled rows, each with its own settings
        params = [
            osd.SamplingParams(48, ignore_eos=True, logprobs=2),
            osd.SamplingParams(48, temperature=0.8, top_p=0.9, seed=1),
            osd.SamplingParams(48, temperature=1.2, top_k=5, seed=2),
            osd.SamplingParams(48, temperature=0.5, seed=3, repetition_penalty=1.3),
        ]
    elif sampled:
        params = [osd.SamplingParams(48, temperature=0.8, top_p=0.9, seed=s) for s in range(4)]
    else:
        params = osd.SamplingParams(48, ignore_eos=True)
    # batch 4 (the bar 0.8: most steps idle), then the last prompt alone (the bar 0.2:
    # proposals, some of which find nothing to draft)
    for rows in (slice(0, 4), slice(2, 3)):
        batch = prompts[rows]
        p = params[rows] if isinstance(params, list) else params
        outs = [e.generate(batch, p) for e in engines]
        assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
        assert [o.logprobs for o in outs[0]] == [o.logprobs for o in outs[1]]
        if sampled == "mixed" and rows.start == 0:
            assert len(outs[0][0].logprobs) == len(outs[0][0].token_ids)
    assert 1 in idle_steps
    assert idle_steps.count(2) > idle_steps.count(1)  # some after a proposal
    stats = [e.stats for e in engines]
    for key in ("target_forwards", "drafted", "accepted", "generated_tokens", "lookup_steps"):
        assert stats[0][key] == stats[1][key], key
