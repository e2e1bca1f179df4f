"""Online distillation: learning changes speed, never output; updates are guarded,
non-finite losses are discarded, and what was learned survives a restart."""

import copy
import threading

import pytest
import torch

import osd
from osd.online import config as online_config
from osd.online import learner as online_learner
from osd.online.buffer import Example, ReplayBuffer
from osd.online.distill import heldout_alpha
from osd.online.router import Router, RouterConfig
from osd.online.update_thread import UpdateThread
from tests.test_models import tiny_hf_model
from tests.test_speculative import perturbed, prompts_of, serve_in_batches


@pytest.fixture(scope="module")
def pair():
    target = tiny_hf_model("llama", seed=81)
    return target, perturbed(target, 0.6, seed=82)


def _engine(pair, **online):
    cfg = dict(
        update_every_requests=2,
        steps_per_update=2,
        lr=3e-3,
        background=False,
        holdout_every=4,
        guard_tolerance=0.02,
    )
    cfg.update(online)
    return osd.Engine.from_pretrained(
        pair[0],
        draft=pair[1],
        spec=osd.SpecConfig(num_draft_tokens=4),
        online=osd.OnlineConfig(**cfg),
        max_batch_size=4,
        max_seq_len=96,
    )


def _draft_state(engine):
    return {k: v.clone() for k, v in engine.speculators[0].drafter.model.state_dict().items()}


def test_outputs_unchanged_and_alpha_rises(pair):
    prompts = prompts_of([6, 9, 4, 7] * 6, seed=83)
    plain = osd.Engine.from_pretrained(pair[0], max_batch_size=4, max_seq_len=96)
    ref = plain.generate(prompts, osd.SamplingParams(24))
    eng = _engine(pair)
    before = _draft_state(eng)
    outs = serve_in_batches(eng, prompts, osd.SamplingParams(24))  # a stream of small batches
    # learning never changes the output
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    hist = eng.stats["online"]
    assert hist["updates_applied"] >= 3
    after = _draft_state(eng)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # weights were swapped in
    # held-out alpha (against the stored target distributions) rose over the start
    learner = eng.online.learners[0]
    start = copy.deepcopy(learner.serving)
    start.load_state_dict(before)
    holdout = learner.buffer.holdout()
    assert len(holdout) >= 3
    a0 = heldout_alpha(start, holdout, 512, "cpu")
    a1 = heldout_alpha(learner.serving, holdout, 512, "cpu")
    assert a1 > a0 + 0.01, (a0, a1)
    assert len(hist["alpha_per_window"]) >= 2 and hist["loss"][0]


def test_guard_rejects_an_update_that_hurts(pair):
    # Updates start once the held-out slice holds a request, so the first one is guarded.
    eng = _engine(pair, lr=3.0, steps_per_update=3, guard_tolerance=0.0, update_every_requests=5)
    before = _draft_state(eng)
    eng.generate(prompts_of([5, 8, 6, 7, 9, 4, 5, 6, 8, 7], seed=84), osd.SamplingParams(20))
    hist = eng.stats["online"]
    reasons = [u["reason"] for u in hist["drafts"][0]["updates"]]
    assert "guard" in reasons and hist["updates_rejected"] >= 1
    if hist["updates_applied"] == 0:
        after = _draft_state(eng)
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_non_finite_loss_is_discarded(pair, monkeypatch):
    eng = _engine(pair)
    learner = eng.online.learners[0]
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    monkeypatch.setattr(
        learner, "_loss", lambda batch: torch.tensor(float("nan"), requires_grad=True)
    )
    prompts = prompts_of([5, 8, 6, 7], seed=85)
    plain = osd.Engine.from_pretrained(pair[0], max_batch_size=4, max_seq_len=96)
    outs = eng.generate(prompts, osd.SamplingParams(16))
    assert [o.token_ids for o in outs] == [
        o.token_ids for o in plain.generate(prompts, osd.SamplingParams(16))
    ]
    hist = eng.stats["online"]
    assert hist["updates_applied"] == 0 and hist["updates_rejected"] >= 1
    assert {u["reason"] for u in hist["drafts"][0]["updates"]} == {"non-finite loss"}
    after = learner.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_checkpoint_resume(pair, tmp_path):
    ck = str(tmp_path / "ckpt")
    eng = _engine(pair, checkpoint_dir=ck, checkpoint_every=1)
    eng.generate(prompts_of([5, 8, 6, 7, 9, 4, 6, 5], seed=86), osd.SamplingParams(20))
    eng.close()
    learned = {k: v.clone() for k, v in eng.online.learners[0].model.state_dict().items()}
    assert eng.stats["online"]["updates_applied"] >= 1
    resumed = _engine(pair, checkpoint_dir=ck)
    state = resumed.speculators[0].drafter.model.state_dict()
    assert all(torch.allclose(state[k], learned[k]) for k in learned)
    assert (
        resumed.online.learners[0].history.updates_applied
        == eng.online.learners[0].history.updates_applied
    )


def test_background_learning_swaps_between_steps(pair):
    eng = _engine(pair, background=True, wait_for_update=True)
    prompts = prompts_of([6, 5, 7, 8] * 3, seed=87)
    plain = osd.Engine.from_pretrained(pair[0], max_batch_size=4, max_seq_len=96)
    ref = plain.generate(prompts, osd.SamplingParams(20))
    outs = []
    for i in range(0, len(prompts), 2):
        outs += eng.generate(prompts[i : i + 2], osd.SamplingParams(20))
    eng.close()
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert eng.stats["online"]["updates_applied"] >= 1


def test_paused_learner_holds_until_resumed(pair):
    """Inside ``learning_paused`` the background learner starts no update (they queue),
    ``wait`` does not block on the held thread, and serving is unchanged; after the block
    the queued updates run. ``close`` inside the block resumes the learner to finish."""
    prompts = prompts_of([6, 5, 7, 8] * 2, seed=88)
    plain = osd.Engine.from_pretrained(pair[0], max_batch_size=4, max_seq_len=96)
    ref = plain.generate(prompts, osd.SamplingParams(12))
    eng = _engine(pair, background=True)
    learner = eng.online.learners[0]
    with eng.learning_paused():
        assert learner.paused
        outs = [eng.generate([p], osd.SamplingParams(12))[0] for p in prompts]
        eng.online.wait()  # returns: the thread holds
        assert learner.history.as_dict()["attempts"] == 0
        assert learner.busy  # the due updates are queued
    assert not learner.paused
    eng.online.wait()
    assert learner.history.as_dict()["attempts"] >= 1
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    with eng.learning_paused():
        eng.generate(prompts[:2], osd.SamplingParams(12))
        eng.close()
    assert learner._thread is None
    with plain.learning_paused():  # no learners: nothing to pause
        assert plain.generate(prompts[:1], osd.SamplingParams(12))[0].token_ids == ref[0].token_ids


def test_corrected_positions_policy_and_full_logits(pair):
    eng = _engine(pair, positions="corrected", topk=None)
    eng.generate(prompts_of([6, 9, 4, 7], seed=88), osd.SamplingParams(20))
    ex = eng.online.learners[0].buffer.recent(10_000)
    assert ex and all(e.logits is not None and e.topk_ids is None for e in ex)


@pytest.mark.parametrize("m", [0, 5, 256])
def test_prompt_positions_are_kept(pair, m):
    """``prompt_positions = m``: each request's example holds the target's logits at its
    prompt's last m positions (from the prefill) and at every generated position, all
    equal to a cacheless target forward."""
    eng = _engine(pair, topk=None, prompt_positions=m, update_every_requests=100, holdout_every=0)
    prompts = prompts_of([9, 3], seed=89)
    eng.generate(prompts, osd.SamplingParams(10))
    examples = eng.online.learners[0].buffer.recent(10**6)
    assert len(examples) == 2
    for ex in examples:
        L = next(len(p) for p in prompts if ex.tokens[: len(p)].tolist() == p)
        n = ex.tokens.numel()
        first = max(1, L - m + 1) if m else L + 1
        assert sorted(ex.positions.tolist()) == list(range(first, n))
        with torch.no_grad():
            want = eng.model.forward_train(ex.tokens[None])[0, ex.positions - 1]
        torch.testing.assert_close(ex.logits, want, atol=1e-4, rtol=1e-4)


def test_lookup_tree_steps_teach_the_accepted_path(pair):
    """With lookup trees (``SpecConfig.lookup_tree_below``) the teacher is read along each
    step's accepted path: every generated position's stored logits equal a cacheless
    target forward, and the outputs equal the target alone's."""
    online = osd.OnlineConfig(
        update_every_requests=100, background=False, holdout_every=0, topk=None, prompt_positions=0
    )
    eng = osd.Engine.from_pretrained(
        pair[0],
        draft=pair[1],
        spec=osd.SpecConfig(num_draft_tokens=3, prompt_lookup=True, lookup_tree_below=4),
        online=online,
        max_batch_size=4,
        max_seq_len=96,
    )
    prompts = [prompts_of([5], seed=90)[0] * 4, prompts_of([9], seed=91)[0] * 2]
    ref = osd.Engine.from_pretrained(pair[0], max_batch_size=4, max_seq_len=96).generate(
        prompts, osd.SamplingParams(16)
    )
    outs = eng.generate(prompts, osd.SamplingParams(16))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert sum(o.stats["lookup_steps"] for o in outs) > 0  # trees with a lookup branch
    for ex in eng.online.learners[0].buffer.recent(10**6):
        L = next(len(p) for p in prompts if ex.tokens[: len(p)].tolist() == p)
        assert sorted(ex.positions.tolist()) == list(range(L + 1, ex.tokens.numel()))
        with torch.no_grad():
            want = eng.model.forward_train(ex.tokens[None])[0, ex.positions - 1]
        torch.testing.assert_close(ex.logits, want, atol=1e-4, rtol=1e-4)


def test_top_k_teacher_rows_from_every_arm_of_auto_k(pair):
    """Top-k teacher rows (osd_kernels.topk_probs on the serving thread) equal the top-k of a
    cacheless target forward at every generated position, whichever arm of ``auto_k``
    drafted the step (lookup alone, with the model unfed, or the model's tree)."""
    online = osd.OnlineConfig(
        update_every_requests=100, background=False, holdout_every=0, topk=8, prompt_positions=0
    )
    spec = osd.SpecConfig(num_draft_tokens=3, prompt_lookup=True, lookup_tree_below=2, auto_k=True)
    eng = osd.Engine.from_pretrained(
        pair[0], draft=pair[1], spec=spec, online=online, max_batch_size=4, max_seq_len=96
    )
    prompts = [prompts_of([5], seed=92)[0] * 4, prompts_of([9], seed=93)[0] * 2, [3, 1, 4]]
    ref = osd.Engine.from_pretrained(pair[0], max_batch_size=4, max_seq_len=96).generate(
        prompts, osd.SamplingParams(24)
    )
    outs = eng.generate(prompts, osd.SamplingParams(24))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    examples = eng.online.learners[0].buffer.recent(10**6)
    assert len(examples) == len(prompts)
    for ex in examples:
        L = next(len(p) for p in prompts if ex.tokens[: len(p)].tolist() == p)
        assert sorted(ex.positions.tolist()) == list(range(L + 1, ex.tokens.numel()))
        with torch.no_grad():
            want = eng.model.forward_train(ex.tokens[None])[0, ex.positions - 1]
        probs, ids = torch.topk(torch.softmax(want.float(), -1), 8)
        assert torch.equal(ex.topk_ids.long(), ids)
        torch.testing.assert_close(ex.topk_probs, probs, atol=1e-5, rtol=1e-4)


def test_auto_k_measures_its_arms_apart_while_the_learner_trains(pair):
    """Steps taken while a learner trains beside serving are chosen and measured by a
    controller of their own (``Speculator.k_control_loaded``); the others by
    ``k_control``. Outputs stay the target's either way."""
    online = osd.OnlineConfig(update_every_requests=100, background=False, holdout_every=0)
    spec = osd.SpecConfig(num_draft_tokens=3, auto_k=True)
    eng = osd.Engine.from_pretrained(
        pair[0], draft=pair[1], spec=spec, online=online, max_batch_size=2, max_seq_len=96
    )
    sp = eng.speculators[0]
    (collector,) = [x for x in sp.listeners if hasattr(x, "loaded")]
    assert sp.k_control_loaded is not None and not collector.loaded()
    prompts = prompts_of([5, 9], seed=94)
    ref = osd.Engine.from_pretrained(pair[0], max_batch_size=2, max_seq_len=96).generate(
        prompts, osd.SamplingParams(20)
    )
    outs = eng.generate(prompts, osd.SamplingParams(20))
    idle = sum(sp.k_control.chosen[2].values())
    assert idle > 0 and not sp.k_control_loaded.chosen
    collector.training = lambda: True  # as while the background learner runs an update
    outs += eng.generate(prompts, osd.SamplingParams(20))
    assert sum(sp.k_control.chosen[2].values()) == idle
    assert sum(sp.k_control_loaded.chosen[2].values()) > 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref] * 2
    assert eng.stats["auto_k_learning"][0][2]["steps"]


def test_learner_rejects_bad_configs():
    with pytest.raises(ValueError, match="loss"):
        osd.OnlineConfig(loss="kl")
    with pytest.raises(ValueError, match="positions"):
        osd.OnlineConfig(positions="some")
    with pytest.raises(ValueError, match="beta"):
        osd.OnlineConfig(beta=1.5)
    with pytest.raises(ValueError, match="lr"):
        osd.OnlineConfig(lr=0)
    with pytest.raises(ValueError, match="prompt_positions must be >= 0"):
        osd.OnlineConfig(prompt_positions=-1)
    with pytest.raises(ValueError, match="replay_fraction"):
        osd.OnlineConfig(replay_fraction=1.0)
    with pytest.raises(ValueError, match="autocast"):
        osd.OnlineConfig(autocast="float8")


def test_held_out_requests_retire_into_training():
    """The held-out slice keeps the newest ``holdout_capacity`` held-out requests; an
    older one joins the training set rather than being dropped."""
    buf = ReplayBuffer(capacity_positions=1000, holdout_every=2, holdout_capacity=2)

    def ex(i):
        return Example(
            tokens=torch.full((4,), i),
            positions=torch.arange(3),
            topk_ids=torch.zeros(3, 2, dtype=torch.int32),
            topk_probs=torch.ones(3, 2) / 2,
            logits=None,
        )

    for i in range(1, 11):
        buf.add(ex(i))
    held = [int(e.tokens[0]) for e in buf.holdout()]
    train = [int(e.tokens[0]) for e in buf.recent(10_000)]
    assert held == [8, 10]
    assert sorted(train) == [1, 2, 3, 4, 5, 6, 7, 9]  # 2, 4, 6 held out, then retired
    assert not set(held) & set(train)
    with pytest.raises(ValueError, match="holdout_requests"):
        osd.OnlineConfig(holdout_requests=0)


def test_update_batch_mixes_newest_and_replayed_requests():
    buf = ReplayBuffer(capacity_positions=1000, holdout_every=0)
    for i in range(20):  # request i: 10 positions, token i
        buf.add(Example(torch.full((12,), i), torch.arange(1, 11), None, None, torch.zeros(10, 4)))
    tag = lambda exs: [int(ex.tokens[0]) for ex in exs]  # noqa: E731
    assert tag(buf.batch(50)) == [15, 16, 17, 18, 19]
    g = torch.Generator().manual_seed(0)
    mixed = tag(buf.batch(60, replay_fraction=0.5, generator=g))
    assert mixed[-3:] == [17, 18, 19] and len(mixed) == 6
    assert len(set(mixed)) == 6 and all(i < 17 for i in mixed[:3])
    seen = set()
    for _ in range(30):
        seen.update(tag(buf.batch(60, replay_fraction=0.5, generator=g))[:3])
    assert len(seen) > 10  # replay reaches the whole buffer
    assert tag(buf.batch(5, replay_fraction=0.5, generator=g))[-1] == 19


def test_online_needs_a_model_drafter(pair):
    with pytest.raises(ValueError, match="online learning needs a model drafter"):
        osd.Engine.from_pretrained(
            pair[0], spec=osd.SpecConfig(drafter="ngram"), online=osd.OnlineConfig()
        )


@pytest.mark.parametrize("feedback", ["score", "bandit"])
def test_router_learns_which_draft_suits_which_prompts(feedback):
    """Two kinds of prompts (disjoint token ranges); draft d is better on kind d."""
    router = Router(2, RouterConfig(feedback=feedback))
    gen = torch.Generator().manual_seed(0)
    correct = 0
    for i in range(120):
        kind = i % 2
        prompt = (torch.randint(0, 60, (40,), generator=gen) + 60 * kind).tolist()
        x = router.features(prompt)
        choice = router.choose(x)
        correct += i >= 40 and choice == kind
        alphas = [0.7 if d == kind else 0.4 for d in range(2)]
        if feedback == "score":
            router.update_all(x, alphas)
        else:
            router.update(x, choice, alphas[choice])
    assert correct >= 0.9 * 80
    with pytest.raises(ValueError, match="feedback"):
        RouterConfig(feedback="oracle")


def test_self_speculation_learns_a_copy_never_the_target():
    """Self-speculation with online learning trains a copy of the kept layers: after
    updates the output still equals a fresh plain engine's, and the target is untouched."""
    target = tiny_hf_model("llama", seed=85)
    prompts = prompts_of([7, 5, 9, 6] * 3, seed=86)
    sp = osd.SamplingParams(16)
    ref = osd.Engine.from_pretrained(target, max_batch_size=4, max_seq_len=96).generate(prompts, sp)
    eng = osd.Engine.from_pretrained(
        target,
        spec=osd.SpecConfig(drafter="self", skip_layers=(1,), num_draft_tokens=3),
        online=osd.OnlineConfig(
            update_every_requests=2,
            steps_per_update=2,
            lr=3e-2,
            background=False,
            guard_tolerance=1.0,
        ),
        max_batch_size=4,
        max_seq_len=96,
    )
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    draft = eng.speculators[0].drafter.model
    assert draft is not eng.model and draft.config.num_layers == 1
    draft_before = {k: v.clone() for k, v in draft.state_dict().items()}
    outs = serve_in_batches(eng, prompts, sp)
    assert eng.stats["online"]["updates_applied"] >= 2
    assert any(not torch.equal(draft_before[k], v) for k, v in draft.state_dict().items())
    assert all(torch.equal(before[k], v) for k, v in eng.model.state_dict().items())
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_half_precision_draft_learns_in_fp32(pair):
    """A bf16 draft trains on fp32 master weights and optimizer state; the serving draft
    receives them cast to bf16."""
    eng = osd.Engine.from_pretrained(
        pair[0],
        draft=pair[1],
        spec=osd.SpecConfig(num_draft_tokens=3),
        dtype=torch.bfloat16,
        online=osd.OnlineConfig(
            update_every_requests=2,
            steps_per_update=2,
            lr=1e-3,
            background=False,
            guard_tolerance=1.0,
        ),
        max_batch_size=4,
        max_seq_len=96,
    )
    learner = eng.online.learners[0]
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())
    serving = eng.speculators[0].drafter.model
    assert all(p.dtype == torch.bfloat16 for p in serving.parameters())
    eng.generate(prompts_of([6, 8, 5, 7], seed=87), osd.SamplingParams(12))
    assert eng.stats["online"]["updates_applied"] >= 1
    assert all(st["exp_avg"].dtype == torch.float32 for st in learner.optim.state.values())
    eng.online.swap(0)  # publish the newest update (as the next step would)
    for name, p in serving.state_dict().items():
        assert torch.equal(p, learner.model.state_dict()[name].to(torch.bfloat16)), name


def test_autocast_auto_uses_bf16_only_where_the_cpu_has_it(pair, monkeypatch):
    """``autocast="auto"`` trains in bf16 on a CPU with fast bf16 matmuls and in fp32 on
    one without (there a bf16 step is many times slower); on CUDA it is fp32 (graphs)."""
    assert online_config.resolve_autocast("float16", "cpu") == "float16"
    assert online_config.resolve_autocast(None, "cpu") is None
    assert online_config.resolve_autocast("auto", "cuda") is None
    for fast in (False, True):
        monkeypatch.setattr(online_config, "cpu_has_fast_bf16", lambda: fast)
        assert online_config.resolve_autocast("auto", "cpu") == ("bfloat16" if fast else None)
    monkeypatch.setattr(online_config, "cpu_has_fast_bf16", lambda: False)
    eng = _engine(pair, autocast="auto")
    assert eng.online.learners[0].autocast is None
    eng.close()


def test_autocast_steps_learn_with_fp32_weights(pair):
    """``autocast="bfloat16"`` runs the draft's training forward in bf16 under
    ``torch.autocast``; weights and AdamW state stay fp32, outputs stay the target's, and
    the held-out α still rises."""
    prompts = prompts_of([6, 9, 4, 7] * 6, seed=88)
    plain = osd.Engine.from_pretrained(pair[0], max_batch_size=4, max_seq_len=96)
    ref = plain.generate(prompts, osd.SamplingParams(24))
    eng = _engine(pair, autocast="bfloat16")
    before = _draft_state(eng)
    learner = eng.online.learners[0]
    seen = []
    forward = learner.model.forward_train

    def spy(*args, **kw):
        if torch.is_grad_enabled():  # a training step, not the guard's scoring
            seen.append(torch.is_autocast_enabled("cpu"))
        return forward(*args, **kw)

    learner.model.forward_train = spy
    outs = serve_in_batches(eng, prompts, osd.SamplingParams(24))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert seen and all(seen)
    assert eng.stats["online"]["updates_applied"] >= 3
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())
    assert all(st["exp_avg"].dtype == torch.float32 for st in learner.optim.state.values())
    start = copy.deepcopy(learner.serving)
    start.load_state_dict(before)
    holdout = learner.buffer.holdout()
    a0 = heldout_alpha(start, holdout, 512, "cpu")
    a1 = heldout_alpha(learner.serving, holdout, 512, "cpu")
    assert a1 > a0 + 0.01, (a0, a1)


def test_a_cpu_learner_beside_serving_on_every_core_warns_once(monkeypatch, caplog):
    """torch's thread count is the process's: a background learner on the CPU trains on
    serving's threads, so more than half the cores each makes them contend; that is
    logged once per process, naming the remedy."""
    monkeypatch.setattr(online_learner, "_warned_cores", False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with caplog.at_level("WARNING", logger="osd.online"):
        assert not online_learner.warn_if_cores_shared(cores=4)  # 2 + 2 threads on 4 cores
        assert online_learner.warn_if_cores_shared(cores=2)
        assert not online_learner.warn_if_cores_shared(cores=2)  # once
    assert "torch.set_num_threads(1)" in caplog.text


def test_update_thread_says_when_it_trains():
    """``UpdateThread.training``: true while the background thread runs an update, false
    while idle or while it holds, paused (what ``auto_k`` reads as the learner's load)."""

    class Slow(UpdateThread):
        def __init__(self):
            self._init_thread()
            self.started, self.release = threading.Event(), threading.Event()
            self._start_thread("slow-learner")

        def _run_update(self):
            self.started.set()
            self.release.wait(10)
            self._hold()  # a step boundary

        def _fault(self, kind, error):
            raise AssertionError(f"{kind}: {error}")

    t = Slow()
    try:
        assert not t.training
        with t._lock:
            t._due = 1
            t._wake.notify_all()
        assert t.started.wait(10) and t.training
        t.pause()
        t.release.set()
        for _ in range(1000):  # held at its step boundary: no load beside serving
            if t._parked:
                break
            threading.Event().wait(0.01)
        assert t._parked and not t.training
        t.resume()
        t.wait()
        assert not t.training
    finally:
        t.close()
