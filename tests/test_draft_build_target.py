"""``osd draft build --target``: the draft's shape from the target's config, the head
vocabulary and its mapping, the saved draft as osd loads it, resuming (teacher shards,
training checkpoints, the build's state), the command line, and (slow) a whole build for
the built-in pair's target."""

import collections
import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

import osd
from osd import cli, zoo
from osd.draft_build import cli as draft_cli
from osd.draft_build import target_build
from osd.draft_build.common import Progress, ThreadTuner
from osd.draft_build.data import Example
from osd.draft_build.recipe import DATA, DRAFT, DataRecipe, DraftShape, TrainRecipe
from osd.draft_build.shape import choose_head_vocab, choose_shape, teacher_batch
from osd.draft_build.target_data import (
    TeacherStore,
    answer,
    head_vocab_ids,
    make_prompts,
    token_mass,
)
from osd.draft_build.target_train import (
    evaluate,
    init_draft,
    map_examples,
    projection,
    save_draft,
    train,
)
from osd.models.loading import load_tokenizer
from osd.spec import draft_serving_defaults


def _config(**kw):
    base = dict(
        hidden_size=576,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        num_layers=30,
        intermediate_size=1536,
        moe_intermediate_size=0,
        num_experts_per_tok=0,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    return SimpleNamespace(**{**base, **kw})


def test_shape_of_smollm2_is_the_chat_recipe():
    assert choose_shape(_config()) == DRAFT
    assert choose_head_vocab(49152) == 8192


@pytest.mark.parametrize(
    "family",
    [
        # Qwen2.5-0.5B-like: 14 heads on 2 KV heads, large vocabulary
        dict(hidden_size=896, num_heads=14, num_kv_heads=2, num_layers=24, intermediate_size=4864),
        # Gemma-2-2B-like: head width 256
        dict(hidden_size=2304, num_heads=8, num_kv_heads=4, head_dim=256, num_layers=26),
        # Llama-3-8B-like: width capped
        dict(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, num_layers=32),
        # the built-in pair's target and a tiny one
        dict(hidden_size=320, num_heads=5, num_kv_heads=5, num_layers=6, intermediate_size=864),
        dict(hidden_size=64, num_heads=1, num_kv_heads=1, num_layers=2, intermediate_size=128),
        # a mixture of experts (dense MLP width 0)
        dict(intermediate_size=0, moe_intermediate_size=512, num_experts_per_tok=2),
    ],
)
def test_shape_follows_the_family(family):
    cfg = _config(**family)
    s = choose_shape(cfg)
    assert s.hidden_size == s.num_heads * cfg.head_dim <= max(cfg.hidden_size, cfg.head_dim)
    assert s.hidden_size <= 1024 and s.num_heads % s.num_kv_heads == 0
    assert 1 <= s.num_layers <= 4 and (s.num_layers < cfg.num_layers or cfg.num_layers == 1)
    assert s.intermediate_size % 64 == 0 and 2 * s.hidden_size <= s.intermediate_size + 64
    assert s.rope_theta == cfg.rope_theta and s.max_position_embeddings == 8192
    # the target's grouping of query heads on key/value heads, rounded up
    group = cfg.num_heads // cfg.num_kv_heads
    assert s.num_kv_heads <= -(-s.num_heads // group)


def test_head_vocab_size_and_teacher_batch():
    assert [choose_head_vocab(v) for v in (2048, 16384, 32000, 151936, 256000)] == [
        0,
        0,
        8192,
        25600,
        32768,
    ]
    assert teacher_batch(_config(), 320) == (32, 7)
    big = _config(vocab_size=151936, hidden_size=1536, num_layers=28)  # about 1.5B
    assert teacher_batch(big, 320) == (16, 2)


def _examples(n, V, k=8, seed=0, length=(12, 30)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(length[0], length[1], (1,), generator=g))
        tokens = torch.randint(0, V, (L,), generator=g, dtype=torch.int64).to(torch.int32)
        logits = torch.randn(L - 1, V, generator=g) * 3
        probs, ids = torch.softmax(logits, -1).topk(k, -1)
        out.append(
            Example(
                tokens=tokens,
                prompt_len=L // 2,
                start=1,
                topk_ids=ids.to(torch.int32),
                topk_probs=probs.to(torch.float16),
                kind="t",
                temperature=0.0,
            )
        )
    return out


def test_head_vocab_from_teacher_frequencies():
    teacher = collections.Counter({5: 3.0, 9: 2.0, 7: 2.0, 11: 0.5})
    fill = collections.Counter({40: 10, 5: 9, 41: 1})
    assert head_vocab_ids(teacher, fill, {0, 99}, 5, 100, min_size=0) == [0, 5, 7, 9, 99]
    assert head_vocab_ids(teacher, fill, {0}, 7, 100, min_size=0) == [0, 5, 7, 9, 11, 40, 41]
    # too small a head for top-k targets is filled up with low ids; ids past V ignored
    assert head_vocab_ids(collections.Counter({500: 1}), fill, set(), 3, 50, min_size=6) == [
        0,
        1,
        2,
        5,
        40,
        41,
    ]
    ex = _examples(3, 50)
    mass = token_mass(ex)
    assert sum(mass.values()) == pytest.approx(
        sum(e.topk_probs.float().sum().item() for e in ex), rel=1e-3
    )


def test_mapped_targets_and_saved_draft_match_osd(tmp_path):
    """The trained draft (head = rows of its tied embedding) saved and loaded by osd gives
    the same logits over the head vocabulary; targets map to head columns."""
    V = 300
    cfg = _config(vocab_size=V)
    shape = DraftShape(
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
    )
    embed = torch.randn(V, 48, generator=torch.Generator().manual_seed(1))
    P, scale = projection(embed, 32)
    assert P.shape == (32, 48) and torch.allclose(P @ P.T, torch.eye(32), atol=1e-4)
    head = sorted(torch.randperm(V, generator=torch.Generator().manual_seed(2))[:100].tolist())
    head_ids = torch.tensor(head)
    model = init_draft(shape, cfg, head_ids, P, scale, embed, seed=0, final_norm=0.3)
    ex = _examples(4, V)
    mapped = map_examples(ex, head_ids)
    for e, m in zip(ex, mapped):
        kept = (m.topk_probs > 0).flatten()
        assert torch.equal(
            head_ids[m.topk_ids.long()].flatten()[kept], e.topk_ids.long().flatten()[kept]
        )
        assert torch.equal(kept, torch.isin(e.topk_ids.long(), head_ids).flatten())
    with torch.no_grad():  # the saved fp16 weights are the model's
        for p in model.parameters():
            p.copy_(p.half().float())
        model.embed_rest.copy_(model.embed_rest.half().float())
    save_draft(model, str(tmp_path / "d"), head)
    loaded = osd.load_model(str(tmp_path / "d"))
    assert loaded.head_vocab_size == 100 and loaded.vocab_size == V
    ids = torch.stack([e.tokens[:12].long() for e in ex])
    mask = torch.ones_like(ids)
    rows = torch.arange(ids.numel())
    with torch.no_grad():
        ours = model(ids, mask, rows)
        theirs = loaded.forward_train(ids, mask, rows=rows, full_vocab=False)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-3)
    assert 0 <= evaluate(model, mapped, 64)["overlap"] <= 1
    save_draft(model, str(tmp_path / "d"), None)  # whole head: no head_vocab.json
    assert not (tmp_path / "d" / "head_vocab.json").exists()


def test_training_resumes_where_it_stopped(tmp_path):
    """Three steps, a checkpoint, then the rest: the weights of an uninterrupted run."""
    torch.set_num_threads(1)
    V = 64
    cfg = _config(vocab_size=V)
    shape = DraftShape(
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
    )
    embed = torch.randn(V, 40, generator=torch.Generator().manual_seed(3))
    P, scale = projection(embed, 32)
    ex = _examples(10, V, k=4)
    recipe = TrainRecipe(tokens_per_batch=64, warmup=2, epochs=2.0, bf16_autocast=False, lr=1e-2)
    far = time.monotonic() + 3600

    def fresh():
        return init_draft(shape, cfg, torch.arange(V), P, scale, embed, seed=0, final_norm=0.3)

    whole = fresh()
    info = train(whole, ex, ex[:2], recipe, far, far, ThreadTuner(1), str(tmp_path / "a.pt"))
    assert info["steps"] == info["planned_steps"] > 4 and info["resumed_at_step"] is None
    part = fresh()
    ck = str(tmp_path / "b.pt")
    assert train(part, ex, ex[:2], recipe, far, far, ThreadTuner(1), ck, stop_after=3) is None
    resumed = fresh()
    info2 = train(resumed, ex, ex[:2], recipe, far, far, ThreadTuner(1), ck)
    assert info2["resumed_at_step"] == 3 and info2["steps"] == info["steps"]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_teacher_answers_are_saved_and_not_asked_again(tmp_path):
    target_dir = zoo.default_pair()[0]
    target = osd.load_model(target_dir)
    recipe = DataRecipe(
        prompts=6, batch_size=2, prefill_group=2, max_new_tokens=4, topk=4, features=False
    )
    prompts = make_prompts(load_tokenizer(target_dir), recipe)
    assert not prompts["chat"] and prompts["start"] == 1 and len(prompts["ids"]) >= 4
    prompts = {**prompts, "ids": [p[:20] for p in prompts["ids"]]}
    store = TeacherStore(str(tmp_path / "teacher"), flush_every=0.0)
    far = time.monotonic() + 600
    n, stopped = answer(target, prompts, recipe, store, far, far, ThreadTuner(1))
    assert n == len(prompts["ids"]) and not stopped and len(store.shards) >= 2
    again = TeacherStore(str(tmp_path / "teacher"))
    saved = again.load()
    assert sorted(saved) == list(range(n))
    for i, e in saved.items():
        assert e.tokens[: e.prompt_len].tolist() == prompts["ids"][i]
        assert e.topk_ids.shape == (e.tokens.numel() - 1, 4)
    assert answer(target, prompts, recipe, again, far, far, ThreadTuner(1)) == (0, False)
    # a lost shard: only its prompts are answered again
    os.remove(os.path.join(again.path, again.shards[0]))
    third = TeacherStore(again.path)
    missing = n - len(third.load())
    assert answer(target, prompts, recipe, third, far, far, ThreadTuner(1))[0] == missing > 0


def test_build_state_budget_and_identity(tmp_path):
    target = tmp_path / "t.gguf"
    target.write_bytes(b"x" * 10)
    out = tmp_path / "out"
    args = SimpleNamespace(target=str(target), fresh=False, reuse_data=False)
    state = target_build.start_state(args, str(out), str(out / ".build"))
    assert state["stage"] == "data" and state["spent_seconds"] == 0.0
    state["spent_seconds"] = 30.0
    target_build.save_state(str(out / ".build"), state)
    again = target_build.start_state(args, str(out), str(out / ".build"))
    budget = target_build.Budget(2.0, again["spent_seconds"])
    assert budget.total == 120.0 and 29.0 < budget.spent() < 31.0
    assert budget.end - time.monotonic() == pytest.approx(90.0, abs=1.0)
    # a killed run's time counts through the heartbeat's file
    (out / ".build" / "clock.json").write_text('{"spent_seconds": 50.0}')
    assert target_build.load_state(str(out / ".build"))["spent_seconds"] == 50.0
    with target_build.Heartbeat(str(out / ".build"), budget, every=0.01):
        time.sleep(0.1)
    beat = json.loads((out / ".build" / "clock.json").read_text())["spent_seconds"]
    assert 29.0 < beat < 40.0
    with pytest.raises(KeyboardInterrupt):
        target_build._terminate(15, None)
    target.write_bytes(b"y" * 11)  # another target at the same path
    with pytest.raises(SystemExit, match="another target"):
        target_build.start_state(args, str(out), str(out / ".build"))
    fresh = target_build.start_state(
        SimpleNamespace(**{**vars(args), "fresh": True}), str(out), str(out / ".build")
    )
    assert fresh["stage"] == "data" and not (out / ".build").exists()
    fresh["stage"] = "done"
    target_build.save_state(str(out / ".build"), fresh)
    assert target_build.start_state(args, str(out), str(out / ".build")) is None
    other = tmp_path / "other"
    other.mkdir()
    (other / "weights.bin").write_text("not ours")
    with pytest.raises(SystemExit, match="already holds files"):
        target_build.start_state(args, str(other), str(other / ".build"))
    assert target_build.default_out("/m/SmolLM2.Q4_1.gguf").endswith(
        os.path.join("osd", "drafts", "SmolLM2.Q4_1")
    )
    assert target_build.measure_reserve(90) == 15.0 and target_build.measure_reserve(1800) == 216.0
    assert (
        target_build.measure_reserve(480, 2) == pytest.approx(115.2)
        and target_build.measure_reserve(1800, 2) == 240
    )


def test_command_line_and_refusals(capsys):
    args = cli.build_parser().parse_args(
        ["draft", "build", "--target", "/m/x.gguf", "--minutes", "5", "--fresh"]
    )
    assert args.target == "/m/x.gguf" and args.fresh and args.head_vocab is None
    assert (
        draft_cli.command_line(args) == "osd draft build --target /m/x.gguf --minutes 5.0 --fresh"
    )
    bad = cli.build_parser().parse_args(["draft", "build", "--target", "/m/x.gguf", "--measure"])
    assert draft_cli.run(bad) == 2
    assert "--target does not combine with --measure" in capsys.readouterr().err
    missing = cli.build_parser().parse_args(["draft", "build", "--target", "/nonexistent.gguf"])
    assert draft_cli.run(missing) == 2
    assert "no target at" in capsys.readouterr().err


def test_progress_lines_show_the_eta():
    class Out:
        lines: list = []

        def write(self, s):
            self.lines.append(s)

        def flush(self):
            pass

    now = time.monotonic()
    p = Progress("teacher data", 100, "prompts", now + 300, now + 900, every=0.0, stream=Out())
    p.t0 = now - 10
    p.done0 = 0
    line = p.line_for(20, "50 tokens/s", now=now)
    # 20 in 10 s: 80 more need 40 s, sooner than the stage's 300 s
    assert "teacher data: 20/100 prompts | 50 tokens/s | stage ETA 0:40" in line
    assert "build ends in 15:00" in line
    # 1 in 10 s: 990 s more, later than the stage's deadline
    assert "stage ETA 5:00" in p.line_for(1, now=now)


@pytest.mark.slow
def test_whole_build_for_the_builtin_target(tmp_path):
    """Teacher data only (stopped), then the rest in a second run, within one budget; the
    draft loads with Engine.from_pretrained and carries serving.json and build.json."""
    target = zoo.default_pair()[0]
    out = tmp_path / "draft"
    common = ["draft", "build", "--target", target, "--out", str(out), "--prompts", "32"]
    t0 = time.monotonic()
    assert cli.main([*common, "--minutes", "1.5", "--data-only"]) == 0
    state = json.loads((out / ".build" / "state.json").read_text())
    assert state["stage"] == "train" and len(state["runs"]) == 1
    shards = sorted(os.listdir(out / ".build" / "teacher"))
    assert shards and not (out / "config.json").exists()
    assert cli.main([*common, "--minutes", "1.5"]) == 0
    wall = time.monotonic() - t0
    assert sorted(os.listdir(out / ".build" / "teacher")) == shards  # not generated again
    meta = json.loads((out / "build.json").read_text())
    assert meta["command"].startswith(f"osd draft build --target {target} --out {out}")
    assert len(meta["runs"]) == 2 and meta["training"]["steps"] >= 1
    assert meta["build_seconds"] <= 90 + 45, meta["build_seconds"]  # the measurement may run over
    assert wall < 300
    assert not (out / ".build" / "train.pt").exists()
    spec, _ = draft_serving_defaults(str(out))
    assert spec is not None
    engine = osd.Engine.from_pretrained(target, draft=str(out), max_batch_size=1)
    plain = osd.Engine.from_pretrained(target, max_batch_size=1)
    prompt = [0, *range(10, 30)]
    params = osd.SamplingParams(max_new_tokens=12)
    assert (
        engine.generate([prompt], params)[0].token_ids
        == plain.generate([prompt], params)[0].token_ids
    )
    # a finished build is not built again
    t = time.monotonic()
    assert cli.main([*common, "--minutes", "1.5"]) == 0
    assert time.monotonic() - t < 30


def test_chat_prompts_use_the_template():
    """A target whose tokenizer has a chat template gets the chat requests in it."""
    chat_gguf = os.path.expanduser("~/.cache/osd/chat/SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(chat_gguf):
        pytest.skip("the chat target is not fetched")
    tok = load_tokenizer(chat_gguf)
    prompts = make_prompts(tok, DataRecipe(prompts=8, seed=0))
    assert prompts["chat"] and prompts["start"] > 1
    text = tok.decode(prompts["ids"][0])
    assert "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n")
    assert DATA.prompts >= 1000
