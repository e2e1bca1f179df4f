"""``SpecConfig(auto_k=True)``: each step's chain length comes from the goodput measured
at its batch size; where drafting does not pay the steps become plain decoding, and the
output is still the target's."""

import collections
import itertools

import pytest

import osd
from osd.spec import learning_beside
from osd.spec_decode.step import DraftLengthController
from tests.test_models import tiny_hf_model
from tests.test_speculative import perturbed, prompts_of


def test_controller_takes_the_best_arm_and_keeps_measuring():
    ctl = DraftLengthController(4, explore_every=8, explore_max=64)
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
    assert len(late) - late.count(2) <= 3 * ctl.probe_steps
    # goodput changes (say the draft got better): the controller follows, once the
    # probes of that arm have filled enough of its window (an arm probed this often keeps
    # its window; one unmeasured for 4 windows' steps would start it afresh)
    rate[4] = 400.0
    for _ in range(1000):
        k = ctl.choose(3)
        ctl.observe(3, k, 10, 10 / rate[k])
    assert max(ctl.goodput[4], key=ctl.goodput[4].get) == 4
    assert ctl.summary()[4]["steps"][4] > 0


def test_a_lucky_probe_does_not_move_the_steps():
    """A probe that starts its arm's window afresh and wins over its first steps by chance
    goes on until a whole window holds; a win that does not last leaves the best arm."""
    ctl = DraftLengthController(4, explore_every=8, explore_max=64)
    rate = {0: 150.0, 1: 100.0, 2: 90.0, 4: 80.0}
    for _ in range(100):
        k = ctl.choose(1)
        ctl.observe(1, k, 10, 10 / rate[k])
    assert ctl._best[1] == 0
    # arm 1 unmeasured for long: its next probe starts its window afresh, and its first
    # probe's steps are fast by chance (the machine's other work paused)
    ctl._when[1][1] = -1000
    ctl._explored[1], ctl._spacing[1] = -1000, 8
    lucky, picks, best = 4, [], []
    for _ in range(40):
        k = ctl.choose(1)
        picks.append(k)
        fast = k == 1 and lucky > 0
        lucky -= k == 1
        ctl.observe(1, k, 10, 10 / (300.0 if fast else rate[k]))
        best.append(ctl._best[1])
    assert picks[picks.index(1) : picks.index(1) + 8] == [1] * 8  # the probe went on ...
    assert set(best) == {0}  # ... and the steps never left the best arm
    # a win that holds does move them
    rate[1] = 300.0
    for _ in range(400):
        k = ctl.choose(1)
        ctl.observe(1, k, 10, 10 / rate[k])
    assert ctl._best[1] == 1


@pytest.mark.parametrize("apart", [False, True])
def test_lookup_alone_is_every_chains_neighbour(apart):
    """Behind prompt lookup arm 0 is lookup alone, not the shortest chain (``zero_apart``):
    from a best chain of 3 it is probed directly, where chains of 2 and 1 that lose to 3
    would otherwise stand between them."""
    ctl = DraftLengthController(3, explore_every=8, explore_max=64, zero_apart=apart)
    rate = {0: 80.0, 1: 50.0, 2: 60.0, 3: 100.0}
    for _ in range(17):  # each arm's first probe, then a step on the best
        k = ctl.choose(1)
        ctl.observe(1, k, 10, 10 / rate[k])
    # lookup alone starts as the best; the chain of 3 must win a probe held a whole window
    assert ctl._best[1] == (0 if apart else 3)
    for _ in range(100):
        k = ctl.choose(1)
        ctl.observe(1, k, 10, 10 / rate[k])
    assert ctl._best[1] == 3
    rate[0] = 200.0  # lookup alone now wins (the text repeats itself)
    for _ in range(800):
        k = ctl.choose(1)
        ctl.observe(1, k, 10, 10 / rate[k])
    assert ctl._best[1] == (0 if apart else 3)


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


def test_auto_k_arm_0_behind_prompt_lookup_is_lookup_alone():
    """In front of a draft model, auto_k's arm 0 is prompt lookup alone: the model does
    not draft and is not fed (new rows and rows that sat out steps are fed what they
    missed when the model next drafts), lookup's continuations are verified, and steps of
    every arm interleaved keep the output the target's, in a continuous batch too."""
    target = tiny_hf_model("llama", seed=5)
    draft = perturbed(target, 0.3, seed=6)
    base = prompts_of([5, 7, 4, 6], seed=8)
    prompts = [p * 4 for p in base]  # text that repeats: lookup finds matches
    sp = osd.SamplingParams(40)
    plain = osd.Engine.from_pretrained(target, max_batch_size=4, max_seq_len=128)
    ref = [o.token_ids for o in plain.generate(prompts, sp)]
    spec = osd.SpecConfig(num_draft_tokens=3, prompt_lookup=True, lookup_tree_below=2, auto_k=True)
    eng = osd.Engine.from_pretrained(
        target, draft=draft, max_batch_size=4, max_seq_len=128, spec=spec
    )
    speculator = eng.speculators[0]
    drafter = speculator.drafter
    arms = itertools.cycle([0, 0, 3, 0, 1, 0, 0, 2])
    speculator.k_control.choose = lambda B: next(arms)
    calls = collections.Counter()
    lookup_alone, model_propose = drafter.propose_lookup, drafter.inner.propose

    def counted_lookup(*args, **kw):
        prop = lookup_alone(*args, **kw)
        calls["lookup alone"] += 1
        calls["lookup alone drafted"] += prop.tokens.shape[1] > 0
        return prop

    def counted_model(*args, **kw):
        calls[f"model k={kw['k']}"] += 1
        return model_propose(*args, **kw)

    resync = drafter.inner.resync

    def counted_resync(rows, histories):
        calls["rows fed late"] += len(rows)
        return resync(rows, histories)

    drafter.propose_lookup, drafter.inner.propose = counted_lookup, counted_model
    drafter.inner.resync = counted_resync
    plain_tail = speculator._plain_tail

    def counted_plain(*args):
        calls["plain steps"] += 1
        return plain_tail(*args)

    speculator._plain_tail = counted_plain
    assert drafter.inner.defer
    for p, want in zip(prompts, ref):
        assert eng.generate([p], sp)[0].token_ids == want
    assert [o.token_ids for o in eng.generate(prompts, sp)] == ref
    # more requests than rows, of other lengths: rows finish, move and are refilled
    # (a refilled row unfed until the model drafts for it)
    more = prompts + [base[0] * 3, base[2] * 5, base[1] * 2, base[3] * 3]
    each = [osd.SamplingParams(n) for n in [40, 17, 29, 8, 33, 21, 25, 12]]
    want = [o.token_ids for o in plain.generate(more, each)]
    got = eng.generate(more, each)
    assert [o.token_ids for o in got] == want
    assert calls["lookup alone"] > calls["lookup alone drafted"] > 0, calls
    # arm 0's steps where lookup drafted nothing ran as plain steps (the model catching
    # up after them as after any lookup step)
    assert calls["plain steps"] == calls["lookup alone"] - calls["lookup alone drafted"], calls
    assert calls["rows fed late"] > 0, calls
    assert "model k=0" not in calls and calls["model k=3"] > 0, calls
    sampled = osd.SamplingParams(40, temperature=0.8, top_p=0.9, seed=3)
    assert all(len(o.token_ids) == 40 for o in eng.generate(prompts, sampled))


def test_learning_beside_a_lookup_recommendation():
    """Online beside a target where lookup alone is recommended: the draft's own spec
    with auto_k, searching the recommendation's history, its chain steps drafting the
    model only where lookup drafts nothing (no lookup trees); trees stay as they are."""
    alone = osd.SpecConfig(drafter="ngram", num_draft_tokens=6, lookup_history=65536)
    spec = osd.SpecConfig(
        num_draft_tokens=3, prompt_lookup=True, lookup_tokens=8, lookup_tree_below=3
    )
    got = learning_beside(spec, alone)
    assert got.auto_k and got.num_draft_tokens == 3
    # its all-lookup steps draft as many as lookup alone would, not the float spec's 8
    assert (got.lookup.history, got.lookup.tokens, got.lookup.tree_below) == (65536, 6, 0)
    tree = osd.SpecConfig(num_draft_tokens=3, tree=[(0,), (1,), (0, 0)])
    assert learning_beside(tree, alone) == tree
    # a chain behind lookup: its all-lookup steps draft as many as lookup alone would
    chain = osd.SpecConfig(num_draft_tokens=3, prompt_lookup=True)
    got = learning_beside(chain, alone)
    assert (got.lookup.tokens, got.lookup.history, got.num_draft_tokens) == (6, 65536, 3)
    short = osd.SpecConfig(drafter="ngram", num_draft_tokens=2)
    assert learning_beside(chain, short).lookup.tokens == 0
