"""Prompt lookup across requests (LookupHistory): the latest occurrence of the longest
suffix, continuations that stop at a request's end, a bounded store, and an engine whose
output stays the target's while a repeated request is drafted from the earlier answer."""

import pytest

import osd
from osd.spec_decode.lookup_drafter import NGramDrafter
from osd.spec_decode.lookup_history import LookupHistory
from tests.test_models import tiny_hf_model
from tests.test_speculative import perturbed, prompts_of


def test_latest_occurrence_and_request_boundaries():
    h = LookupHistory(1000, 1, 3)
    h.add([9, 9, 1, 2], [3, 4, 5, 6])  # kept: prompt tail [9, 1, 2], then the output
    h.add([7], [1, 2, 8, 8])
    assert h.requests == 2 and len(h) == 3 + 4 + 1 + 1 + 4 + 1
    assert h.lookup([1, 2], 5) == [8, 8]  # the latest occurrence wins
    assert h.lookup([9, 1, 2], 5) == [3, 4, 5, 6]  # never crosses into the next request
    assert h.lookup([4], 2) == [5, 6]
    assert h.lookup([6], 3) == []  # the end of a request has no continuation
    assert h.lookup([8, 8], 3) == []
    assert h.lookup([3, 3], 3) == [] and h.lookup([1, 2], 0) == []
    h.add([5], [])  # nothing generated: nothing kept
    assert h.requests == 2


def test_capacity_drops_the_oldest_half():
    h = LookupHistory(20, 1, 2)
    for i in range(10):
        h.add([100 + i], [200 + i, 300 + i, 400 + i])
    assert len(h) <= 20
    assert h.lookup([209], 2) == [309, 409]  # the newest request is kept
    assert h.lookup([200], 2) == []  # the oldest is gone, from the index too
    with pytest.raises(ValueError, match="capacity"):
        LookupHistory(0, 1, 3)
    with pytest.raises(ValueError, match="ngram_min"):
        LookupHistory(10, 3, 2)


def test_own_text_first_then_the_history_longest_suffix_first():
    h = LookupHistory(100, 1, 3)
    h.add([50], [1, 2, 3, 60, 61])
    d = NGramDrafter(1, 3, h)
    # [2, 3] is only in the history: it beats the own text's shorter match [3]
    assert d.lookup([5, 3, 70, 9, 2, 3], 2) == [60, 61]
    assert NGramDrafter(1, 3).lookup([5, 3, 70, 9, 2, 3], 2) == [70, 9]
    # [2, 3] in both: the request's own text first
    assert d.lookup([2, 3, 80, 81, 2, 3], 2) == [80, 81]


def test_a_repeated_request_is_drafted_from_the_earlier_answer():
    target = tiny_hf_model("llama", seed=96)
    draft = perturbed(target, 0.35, seed=97)
    prompt = prompts_of([11], seed=95)[0]
    plain = osd.Engine.from_pretrained(target, max_batch_size=1, max_seq_len=96)
    ref = plain.generate([prompt], osd.SamplingParams(40))[0].token_ids
    forwards = {}
    for history in (0, 4096):
        eng = osd.Engine.from_pretrained(
            target,
            draft=draft,
            spec=osd.SpecConfig(num_draft_tokens=4, prompt_lookup=True, lookup_history=history),
            max_batch_size=2,
            max_seq_len=96,
        )
        first = eng.generate([prompt], osd.SamplingParams(40))[0]
        before = eng.stats["target_forwards"]
        again = eng.generate([prompt, prompt], osd.SamplingParams(40))
        assert first.token_ids == ref and [o.token_ids for o in again] == [ref, ref]
        forwards[history] = eng.stats["target_forwards"] - before
    # The history holds the whole answer: chains of 4 accepted (about 40 / 5 forwards).
    assert forwards[4096] <= 12 < forwards[0], forwards
