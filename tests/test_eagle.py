"""The EAGLE draft (``osd.models.eagle``, ``osd.spec_decode.eagle_drafter.EagleDrafter``): it
drafts from the target's features, and speculative decoding with it stays lossless (greedy equal to
plain, sampled joint equal to the target's); the drafter's root distribution at every step
equals a teacher-forced forward over the committed sequence (the feature plumbing through
prefill, staged long prompts, verify, prompt lookup and row moves); it trains with
``eagle_loss``; checkpoints load on top of a target; bad uses fail clearly."""

import pytest
import torch

import osd
from osd.demo import DemoConfig, draft_cost_ratio
from osd.spec_decode.eagle_drafter import EagleDrafter
from osd.models.eagle import (
    EagleLM,
    eagle_loss,
    head_probs,
    is_eagle_checkpoint,
    load_eagle,
    save_eagle,
)
from osd.models.loading import load_model
from tests.test_models import VOCAB, tiny_hf_model
from tests.test_speculative import (
    V_SMALL,
    _small_pair,
    assert_joint_follows_target,
    prompts_of,
    serve_in_batches,
)


# Draft trees: a chain of three with siblings at the first two depths; a dynamic one.
TREES = {
    "tree": [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)],
    "dynamic-tree": osd.DynamicTree(topk=2, depth=3, max_nodes=5),
}


def _eagle(target, seed: int, head_ids=None, std: float = 0.3) -> EagleLM:
    draft = EagleLM.from_target(target, num_layers=1, head_ids=head_ids)
    draft.init_draft(std=std, generator=torch.Generator().manual_seed(seed))
    return draft


def _trained(target, steps: int = 60, seed: int = 0, head_ids=None) -> EagleLM:
    """An EAGLE draft trained briefly on the target's own greedy continuations."""
    draft = _eagle(target, seed, head_ids, std=0.05)
    eng = osd.Engine(target, max_batch_size=8, max_seq_len=96)
    prompts = prompts_of([6, 9, 4, 11, 7, 5, 8, 10], seed=seed + 1)
    seqs = [p + o.token_ids for p, o in zip(prompts, eng.generate(prompts, osd.SamplingParams(24)))]
    T = max(map(len, seqs))
    tokens = torch.zeros(len(seqs), T, dtype=torch.int64)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = True
    with torch.no_grad():
        logits, feats = target.forward_train(tokens, mask.long(), return_hidden=True)
    probs = head_probs(draft, logits)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    draft.train()
    for _ in range(steps):
        out = eagle_loss(draft, tokens, feats, probs, mask, unroll=2)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    return draft.requires_grad_(False).eval()


@pytest.fixture(scope="module")
def target():
    return load_model(tiny_hf_model("llama", seed=31))


@pytest.fixture(scope="module")
def trained(target):
    return _trained(target)


def test_shares_the_targets_tensors_and_trains_only_its_own(target):
    draft = _eagle(target, seed=1)
    assert draft.embed_tokens.weight is target.embed_tokens.weight
    assert draft.norm.weight is target.norm.weight
    assert all(not p.requires_grad for p in draft.shared_parameters())
    own = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert own and all(n.startswith(("fc.", "feature_norm.", "layers.")) for n in own)
    assert set(draft.own_state_dict()) >= {"fc.weight", "feature_norm.weight"}


def test_training_lowers_the_loss_and_raises_agreement(target):
    before = _trained(target, steps=0, seed=3)
    after = _trained(target, steps=60, seed=3)
    # measured on the same data through the same helper
    eng = osd.Engine(target, max_batch_size=8, max_seq_len=96)
    prompts = prompts_of([6, 9, 4, 11, 7, 5, 8, 10], seed=4)
    seqs = [p + o.token_ids for p, o in zip(prompts, eng.generate(prompts, osd.SamplingParams(24)))]
    T = min(map(len, seqs))
    tokens = torch.tensor([s[:T] for s in seqs])
    with torch.no_grad():
        logits, feats = target.forward_train(tokens, return_hidden=True)
        lb = eagle_loss(before, tokens, feats, head_probs(before, logits))
        la = eagle_loss(after, tokens, feats, head_probs(after, logits))
    assert la["loss"] < 0.7 * lb["loss"]
    assert la["agree"] > lb["agree"] + 0.2


def _spy_roots(eng):
    """Record each step's committed sequence (prompt + output so far, root last) and the
    drafter's root logits."""
    spec = eng.speculators[0]
    drafter = spec.drafter.inner if hasattr(spec.drafter, "inner") else spec.drafter
    assert isinstance(drafter, EagleDrafter)
    seen = []
    root, step = drafter._root, spec.step

    def spy_root(B):
        logits = root(B)
        seen[-1][1].append(logits.detach().clone())
        return logits

    def spy_step(active, params):
        seen.append(([list(r.prompt + r.generated) for r in active], []))
        return step(active, params)

    drafter._root = spy_root
    spec.step = spy_step
    return seen


@pytest.mark.parametrize(
    "case", ["chain", "staged", "refill", "prefix", "prefix-staged", "tree", "dynamic-tree"]
)
def test_root_distribution_equals_a_teacher_forced_forward(target, trained, case):
    """At every step the draft's distribution at the root equals the EAGLE forward over the
    committed sequence with the target's features: the drafter's cache and pending pairs
    hold exactly ``(f_j, x_{j+1})``. ``prefix``: prompts that start alike, one at a time,
    with the prefix cache, so later ones take K/V and features of earlier ones (staged
    in ``prefix-staged``)."""
    kw = dict(max_batch_size=2 if case == "refill" else 4, max_seq_len=160)
    if case in ("staged", "prefix-staged"):
        kw["prefill_chunk"] = 8  # prompts of 20-40 tokens are staged piece by piece
    lengths = {
        "chain": [5, 1, 9],
        "staged": [23, 40, 6],
        "refill": [7, 3, 12, 5, 9],
        "prefix": [40, 7, 3],
        "prefix-staged": [40, 7, 3],
        "tree": [6, 9, 4, 11],
        "dynamic-tree": [6, 9, 4, 11],
    }[case]
    # Trees: the prompts the draft trained on, so that paths through siblings are accepted.
    prompts = prompts_of(lengths, seed=1 if "tree" in case else 5)
    if case.startswith("prefix"):
        kw.update(max_batch_size=1, prefix_cache=1024)
        base = prompts[0]
        prompts += [
            base[:33] + prompts[1],
            base + prompts[2],
            base[:20] + prompts[1][:4],
            base[:36],
        ]
    spec = osd.SpecConfig(num_draft_tokens=3, tree=TREES.get(case))
    eng = osd.Engine(target, draft=[trained], spec=spec, **kw)
    seen = _spy_roots(eng)
    eng.generate(prompts, osd.SamplingParams(12))
    if case.startswith("prefix"):
        # 32 + 32 + 16 + 32 (each prompt's last token always fed; 16-token blocks)
        assert eng.stats["prefix_cache"]["tokens_reused"] == 112
    checked = 0
    for seqs, roots in seen:
        if not roots:
            continue
        for b, seq in enumerate(seqs):
            tokens = torch.tensor([seq])
            with torch.no_grad():
                _, feats = target.forward_train(tokens[:, :-1], return_hidden=True)
                if len(seq) < 2:
                    continue
                ref = trained.forward_train(tokens[:, 1:], features=feats)[0, -1]
            torch.testing.assert_close(roots[0][b], ref, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize(
    "spec",
    [
        dict(num_draft_tokens=4),
        dict(num_draft_tokens=3, prompt_lookup=True),
        dict(num_draft_tokens=4, adaptive=True),
        dict(tree=TREES["tree"]),
        dict(tree=TREES["dynamic-tree"]),
        dict(num_draft_tokens=4, prompt_lookup=True, tree=TREES["tree"]),
        dict(num_draft_tokens=3, prompt_lookup=True, lookup_tokens=10, lookup_history=512),
        dict(num_draft_tokens=3, prompt_lookup=True, lookup_tree_below=4),
    ],
    ids=[
        "chain",
        "lookup",
        "adaptive",
        "tree",
        "dynamic-tree",
        "lookup-tree",
        "lookup-long",
        "lookup-beside",
    ],
)
def test_greedy_equals_plain(target, trained, spec):
    _assert_greedy_equals_plain(target, trained, spec)


def _assert_greedy_equals_plain(target, draft, spec: dict) -> None:
    """Five ragged prompts (one repeating itself, for lookup) on 3 rows with chunked
    prefill: the speculative engine's greedy output is the target's alone."""
    prompts = prompts_of([5, 12, 1, 8, 30], seed=6)
    prompts[0] = prompts[0] * 3
    ref = osd.Engine(target, max_batch_size=3, max_seq_len=128).generate(
        prompts, osd.SamplingParams(24)
    )
    eng = osd.Engine(
        target,
        draft=[draft],
        spec=osd.SpecConfig(**spec),
        max_batch_size=3,
        max_seq_len=128,
        prefill_chunk=16,
    )
    outs = eng.generate(prompts, osd.SamplingParams(24))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert 0 < eng.stats["accepted"] <= eng.stats["drafted"]


def test_trained_draft_is_accepted_more_than_an_untrained_one(target, trained):
    """On the prompts it was trained on (``_trained``'s first four), served through the
    engine, the trained draft is accepted far more often than an untrained one."""
    prompts = prompts_of([6, 9, 4, 11], seed=1)
    rates = []
    for draft in (_eagle(target, seed=8, std=0.05), trained):
        eng = osd.Engine(
            target,
            draft=[draft],
            spec=osd.SpecConfig(num_draft_tokens=4),
            max_batch_size=4,
            max_seq_len=96,
        )
        eng.generate(prompts, osd.SamplingParams(24))
        rates.append(eng.stats["accepted"] / eng.stats["drafted"])
    assert rates[1] > rates[0] + 0.1


@pytest.mark.slow
@pytest.mark.parametrize("tree", [None, [(0,), (1,), (0, 0)]], ids=["chain", "tree"])
def test_sampled_joint_follows_target(tree):
    """First three tokens of 50,000 requests with a restricted-head EAGLE draft, drafting a
    chain or a tree: chi-square p > 1e-3 against the warped target's exact joint."""
    hf_target, _ = _small_pair()
    target = load_model(hf_target)
    head = torch.randperm(V_SMALL, generator=torch.Generator().manual_seed(9))[:11]
    draft = _eagle(target, seed=10, head_ids=head, std=0.3)
    prompt = [3, 1, 4, 1]
    sp = osd.SamplingParams(3, seed=99, temperature=0.8, top_k=0, top_p=0.95)
    eng = osd.Engine(
        target,
        draft=[draft],
        spec=osd.SpecConfig(num_draft_tokens=2, tree=tree),
        max_batch_size=4096,
        max_seq_len=16,
    )
    assert_joint_follows_target(eng, hf_target, prompt, sp)


def test_checkpoint_round_trip_and_from_pretrained(tmp_path, trained):
    hf = tiny_hf_model("llama", seed=31)
    hf.save_pretrained(tmp_path / "target")
    head = torch.arange(0, VOCAB, 2)
    target = load_model(tmp_path / "target")
    draft = _trained(target, steps=20, seed=11, head_ids=head)
    save_eagle(draft, tmp_path / "eagle", meta={"note": "test"})
    assert is_eagle_checkpoint(tmp_path / "eagle")
    assert not is_eagle_checkpoint(tmp_path / "target")
    again = load_eagle(tmp_path / "eagle", target)
    assert torch.equal(again.head_ids, head)
    for name, value in draft.own_state_dict().items():
        torch.testing.assert_close(again.own_state_dict()[name], value.half().float())
    eng = osd.Engine.from_pretrained(str(tmp_path / "target"), draft=str(tmp_path / "eagle"))
    assert isinstance(eng.speculators[0].drafter, EagleDrafter)
    prompts = prompts_of([7, 4], seed=12)
    ref = osd.Engine(target).generate(prompts, osd.SamplingParams(16))
    outs = eng.generate(prompts, osd.SamplingParams(16))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert 0 < draft_cost_ratio(str(tmp_path / "target"), str(tmp_path / "eagle"), steps=3)


@pytest.mark.parametrize("lookup", [False, True, 4], ids=["chain", "lookup", "lookup-beside"])
def test_learns_online_from_the_targets_features(target, lookup):
    """Online distillation of an EAGLE draft: outputs stay plain greedy's, updates are
    applied, the draft's own tensors change and the target's never do; the collected
    features equal a teacher-forced target forward."""
    draft = _eagle(target, seed=13, std=0.05)
    own = {k: v.clone() for k, v in draft.own_state_dict().items()}
    embed = target.embed_tokens.weight.detach().clone()
    online = osd.OnlineConfig(
        update_every_requests=2,
        steps_per_update=3,
        lr=3e-3,
        background=False,
        holdout_every=4,
        guard_tolerance=1.0,
    )
    eng = osd.Engine(
        target,
        draft=[draft],
        online=online,
        max_batch_size=4,
        max_seq_len=128,
        spec=osd.SpecConfig(
            num_draft_tokens=3,
            prompt_lookup=bool(lookup),
            lookup_tree_below=4 if lookup == 4 else 0,
        ),
    )
    prompts = prompts_of([6, 9, 4, 7] * 3, seed=14)
    prompts[1] = prompts[1] * 3
    ref = osd.Engine(target, max_batch_size=4, max_seq_len=128).generate(
        prompts, osd.SamplingParams(20)
    )
    learner = eng.online.learners[0]
    seen = []
    observe = learner.observe
    learner.observe = lambda ex: (seen.append(ex), observe(ex))[-1]
    outs = serve_in_batches(eng, prompts, osd.SamplingParams(20))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert eng.stats["online"]["updates_applied"] >= 2
    assert torch.equal(target.embed_tokens.weight, embed)
    serving = eng.speculators[0].drafter.model
    assert serving.embed_tokens.weight is target.embed_tokens.weight
    assert not torch.equal(serving.own_state_dict()["fc.weight"], own["fc.weight"])
    assert seen and all(ex.features is not None for ex in seen)
    for ex in seen[:3]:
        with torch.no_grad():
            _, feats = target.forward_train(ex.tokens[None, :-1], return_hidden=True)
        torch.testing.assert_close(ex.features.float(), feats[0], rtol=1e-2, atol=1e-2)


def test_bad_uses_fail_clearly(tmp_path, target, trained):
    with pytest.raises(ValueError, match="needs the target's features"):
        trained(torch.zeros(1, 2, dtype=torch.int64), trained.new_cache(1, 8))
    with pytest.raises(ValueError, match="takes no input features"):
        target(
            torch.zeros(1, 2, dtype=torch.int64),
            target.new_cache(1, 8),
            features=torch.zeros(1, 2, 64),
        )
    with pytest.raises(ValueError, match="features must be"):
        trained(
            torch.zeros(1, 2, dtype=torch.int64),
            trained.new_cache(1, 8),
            features=torch.zeros(1, 3, 64),
        )
    other = load_model(tiny_hf_model("llama", seed=32))
    with pytest.raises(ValueError, match="not built for this target"):
        osd.Engine(other, draft=[trained])
    save_eagle(trained, tmp_path / "eagle")
    with pytest.raises(ValueError, match="built for hidden_size"):
        load_eagle(tmp_path / "eagle", load_model(_small_pair()[0]))
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_eagle(tmp_path / "nowhere", target)
    with pytest.raises(ValueError, match="draft must be one of"):
        DemoConfig(pair="builtin", draft="eagle")


def test_a_chain_shaped_tree_drafts_what_the_chain_drafts(target, trained):
    """Greedy, a static tree that is a chain (every node fed its parent's predicted feature
    through the tree forward) accepts exactly what the chain loop does, step by step."""
    prompts = prompts_of([5, 12, 8, 30], seed=16)
    stats = []
    for spec in (
        osd.SpecConfig(num_draft_tokens=3),
        osd.SpecConfig(tree=[(0,), (0, 0), (0, 0, 0)]),
    ):
        eng = osd.Engine(target, draft=[trained], spec=spec, max_batch_size=2, max_seq_len=96)
        outs = eng.generate(prompts, osd.SamplingParams(20))
        stats.append(([o.token_ids for o in outs], eng.stats["accepted"], eng.stats["drafted"]))
    assert stats[0] == stats[1]
    assert stats[0][1] > 0


@pytest.mark.parametrize(
    "family",
    ["qwen3", "granite", "olmo2", "phi3_longrope", "smollm3", "gemma2", "gemma3", "qwen3_moe"],
)
def test_family_target_eagle_draft_round_trips_and_stays_lossless(tmp_path, family):
    """A Qwen3 target (per-head q/k norms: its EAGLE draft's layer carries the norms too),
    a Granite one (residual multiplier, attention scale and logit scaling in the draft's
    layer and shared head), an OLMo-2 one (post-norm layer), a Phi-3 one (partial rotary,
    LongRoPE), a SmolLM3 one (a NoPE layer; the draft's own layer has RoPE), a Gemma 2 one
    (soft-capping), a Gemma 3 one (sliding and global layers, GeGLU, four norms a layer) and
    a Qwen3-MoE one (the draft's layer is a dense SwiGLU): the draft trains, saves and
    loads, and drafts losslessly."""
    target = load_model(tiny_hf_model(family, seed=33))
    draft = _trained(target, steps=20, seed=4)
    if family == "qwen3":
        assert any(k.endswith("q_norm.weight") for k in draft.own_state_dict())
    save_eagle(draft, tmp_path / "eagle")
    loaded = load_eagle(tmp_path / "eagle", target)
    for name, value in draft.own_state_dict().items():
        torch.testing.assert_close(loaded.own_state_dict()[name], value.half().float())
    prompts = prompts_of([5, 12, 8], seed=7)
    ref = osd.Engine(target, max_batch_size=3, max_seq_len=96).generate(
        prompts, osd.SamplingParams(20)
    )
    eng = osd.Engine(
        target,
        draft=[loaded],
        spec=osd.SpecConfig(num_draft_tokens=3),
        max_batch_size=3,
        max_seq_len=96,
    )
    outs = eng.generate(prompts, osd.SamplingParams(20))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert eng.stats["drafted"] > 0


cuda_only = pytest.mark.gpu


def _on_cuda(tmp_path, hf_target, draft):
    """The target (a transformers model) and an EAGLE draft for it, loaded on CUDA in
    fp32 through a checkpoint (the draft's own tensors round to fp16 there)."""
    save_eagle(draft, tmp_path / "eagle")
    target = load_model(hf_target, device="cuda")
    return target, load_eagle(tmp_path / "eagle", target)


@cuda_only
@pytest.mark.parametrize(
    "spec",
    [
        dict(num_draft_tokens=4),
        dict(tree=TREES["dynamic-tree"]),
        dict(num_draft_tokens=3, prompt_lookup=True),
    ],
    ids=["chain", "dynamic-tree", "lookup"],
)
def test_greedy_equals_plain_on_cuda(tmp_path, trained, spec):
    _assert_greedy_equals_plain(*_on_cuda(tmp_path, tiny_hf_model("llama", seed=31), trained), spec)


@cuda_only
@pytest.mark.parametrize("tree", [None, [(0,), (1,), (0, 0)]], ids=["chain", "tree"])
def test_sampled_joint_follows_target_on_cuda(tmp_path, tree):
    hf_target, _ = _small_pair()
    head = torch.randperm(V_SMALL, generator=torch.Generator().manual_seed(9))[:11]
    target, draft = _on_cuda(
        tmp_path, hf_target, _eagle(load_model(hf_target), seed=10, head_ids=head, std=0.3)
    )
    sp = osd.SamplingParams(3, seed=99, temperature=0.8, top_k=0, top_p=0.95)
    eng = osd.Engine(
        target,
        draft=[draft],
        spec=osd.SpecConfig(num_draft_tokens=2, tree=tree),
        max_batch_size=4096,
        max_seq_len=16,
    )
    assert_joint_follows_target(eng, hf_target, [3, 1, 4, 1], sp)


@cuda_only
@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_learns_online_on_cuda(tmp_path, background):
    """Online distillation of an EAGLE draft on CUDA: outputs stay plain greedy's and
    updates are applied, inline or from the background learner."""
    hf = tiny_hf_model("llama", seed=31)
    target, draft = _on_cuda(tmp_path, hf, _eagle(load_model(hf), seed=13, std=0.05))
    own = draft.own_state_dict()["fc.weight"].clone()
    online = osd.OnlineConfig(
        update_every_requests=2,
        steps_per_update=3,
        lr=3e-3,
        background=background,
        wait_for_update=background,
        holdout_every=4,
        guard_tolerance=1.0,
    )
    eng = osd.Engine(
        target,
        draft=[draft],
        online=online,
        max_batch_size=4,
        max_seq_len=128,
        spec=osd.SpecConfig(num_draft_tokens=3),
    )
    prompts = prompts_of([6, 9, 4, 7] * 3, seed=14)
    ref = osd.Engine(target, max_batch_size=4, max_seq_len=128).generate(
        prompts, osd.SamplingParams(20)
    )
    outs = serve_in_batches(eng, prompts, osd.SamplingParams(20))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert eng.stats["online"]["updates_applied"] >= 1
    serving = eng.speculators[0].drafter.model
    assert not torch.equal(serving.own_state_dict()["fc.weight"], own)
