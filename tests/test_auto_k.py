"""``SpecConfig(auto_k=True)``: each step's chain length comes from the goodput measured
at its batch size; where drafting does not pay the steps become plain decoding, and the
output is still the target's."""

import pytest

import osd
from osd.spec_decode.step import DraftLengthController
from tests.test_models import tiny_hf_model
from tests.test_speculative import perturbed, prompts_of


def test_controller_takes_the_best_arm_and_keeps_measuring():
    ctl = DraftLengthController(4, explore_every=8)
    assert ctl.arms == [0, 1, 2, 4]
    rate = {0: 100.0, 1: 150.0, 2: 180.0, 4: 120.0}  # tokens/s per arm
    picks = []
    for step in range(200):
        k = ctl.choose(3)
        picks.append(k)
        # the first measurement of an arm pays one-time costs: it must be ignored
        first = ctl._seen.get(4, {}).get(k, 0) == 0
        ctl.observe(3, k, 10, 10 / (1.0 if first else rate[k]))
    assert ctl.bucket(3) == 4 and set(ctl.goodput) == {4}
    assert ctl.goodput[4] == pytest.approx(rate)  # first (slow) steps dropped
    late = picks[50:]
    assert late.count(2) > 0.8 * len(late)  # the best arm
    assert set(late) == {1, 2, 4}  # its neighbours are re-measured
    # ... less and less often while the best arm stays best: spacing 8, 16, ... up to 64
    assert ctl._spacing[4] == ctl.explore_max == 64
    assert len(late) - late.count(2) < 10
    # goodput changes (say the draft got better): the controller follows within a few
    # explorations
    rate[4] = 400.0
    for _ in range(300):
        k = ctl.choose(3)
        ctl.observe(3, k, 10, 10 / rate[k])
    assert max(ctl.goodput[4], key=ctl.goodput[4].get) == 4
    assert ctl.summary()[4]["steps"][4] > 0


def test_auto_k_with_a_useless_draft_decodes_plainly_and_stays_lossless():
    target = tiny_hf_model("llama", seed=5)
    junk = perturbed(target, 4.0, seed=6)  # almost never agrees
    prompts = prompts_of([9, 14, 6, 11, 7, 12, 5, 10], seed=7)
    sp = osd.SamplingParams(40)
    plain = osd.Engine.from_pretrained(target, max_batch_size=8, max_seq_len=96)
    ref = [o.token_ids for o in plain.generate(prompts, sp)]
    eng = osd.Engine.from_pretrained(
        target,
        draft=junk,
        max_batch_size=8,
        max_seq_len=96,
        spec=osd.SpecConfig(num_draft_tokens=4, auto_k=True),
    )
    for _ in range(3):
        assert [o.token_ids for o in eng.generate(prompts, sp)] == ref
    summary = eng.stats["auto_k"][0][8]
    good = summary["goodput"]
    assert max(good, key=good.get) == 0, summary
    assert summary["steps"][0] > summary["steps"][4], summary


def test_auto_k_refuses_trees_and_adaptive():
    with pytest.raises(ValueError, match="auto_k"):
        osd.SpecConfig(auto_k=True, tree=[(0,), (0, 0)])
    with pytest.raises(ValueError, match="auto_k"):
        osd.SpecConfig(auto_k=True, adaptive=True)
