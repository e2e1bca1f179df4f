"""Prompt lookup's draft lengths from each request's record
(``osd.spec_decode.lookup_lengths``): the record's counting from the request's tokens,
the lengths it allows, and an engine whose lookup drafts are cut short still giving the
target's greedy output token for token."""

import pytest
import torch

import osd
from osd.spec import MIN_REACH, PromptLookup
from osd.spec_decode.lookup_lengths import (
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
