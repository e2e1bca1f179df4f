"""``osd draft build`` (``osd.draft_build``): its command line, and its stages on the
built-in pair's small target (teacher data, training, the checkpoint) so that no GGUF
and no long build is needed."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import osd
from osd import cli, zoo
from osd.draft_build import cli as draft_cli
from osd.draft_build.tune import LOOKUP_HISTORY, with_history
from osd.draft_build.build import write_head_vocab
from osd.draft_build.common import ThreadTuner, split_heldout
from osd.draft_build.data import teacher_data
from osd.draft_build.prompts import Prompt
from osd.draft_build.recipe import DataRecipe, DraftShape, TrainRecipe
from osd.draft_build.train import evaluate, init_draft, save_draft, train_draft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_describes_inputs_and_outputs(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["draft", "build", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    for words in ("inputs:", "outputs:", "--out", "--minutes", "--reuse-data", "--measure"):
        assert words in out


def test_arguments_parse_and_reach_the_build():
    args = cli.build_parser().parse_args(
        ["draft", "build", "--minutes", "4", "--prompts", "48", "--out", "/tmp/d"]
    )
    assert args.func is draft_cli.run
    assert (args.minutes, args.prompts, args.out, args.threads) == (4.0, 48, "/tmp/d", 2)
    assert not (args.measure or args.shapes or args.data_only or args.head_vocab_only)
    assert draft_cli.command_line(args) == "osd draft build --out /tmp/d --minutes 4.0 --prompts 48"
    default = cli.build_parser().parse_args(["draft", "build"])
    assert draft_cli.command_line(default) == "osd draft build"
    assert default.out == os.path.join(zoo.locate.SOURCE_DIR, "chat_draft")
    measure = cli.build_parser().parse_args(["draft", "build", "--measure", "--ks", "4"])
    assert draft_cli.command_line(measure) == "osd draft build --measure --ks 4"


@pytest.mark.parametrize(
    "bad",
    [
        ["--minutes", "0"],
        ["--data-share", "1.5"],
        ["--prompts", "-3"],
        ["--head-vocab", "-1"],
        ["--data-sets", "4"],
        ["--measure", "--shapes"],
        ["--data-only", "--head-vocab-only"],
    ],
)
def test_bad_arguments_are_refused(bad, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.build_parser().parse_args(["draft", "build", *bad])
    assert exit.value.code == 2
    assert "osd draft build: error" in capsys.readouterr().err


def test_script_wraps_the_command():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "build_chat_draft.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("usage: osd draft build") and "outputs:" in out


def test_stages_on_a_small_target(tmp_path):
    """Teacher data from the built-in target (continuous batching over more prompts than
    rows), a tiny draft trained on it, saved and loaded back with its head vocabulary."""
    target = osd.load_model(zoo.default_pair()[0])
    prompts = [[0, *range(5, 5 + n)] for n in (6, 9, 4, 7, 5)]
    meta = [Prompt(text="", kind="test", temperature=t) for t in (0.0, 0.7, 0.0, 0.0, 0.7)]
    recipe = DataRecipe(batch_size=2, prefill_group=2, max_new_tokens=6, topk=4)
    examples, stopped = teacher_data(
        target, prompts, meta, 1, recipe, time.monotonic() + 600, ThreadTuner(1)
    )
    assert not stopped and len(examples) == len(prompts)
    for p, e in zip(prompts, examples):
        assert e.tokens[: len(p)].tolist() == p and e.prompt_len == len(p)
        assert e.topk_ids.shape == (e.tokens.numel() - 1, 4)
        assert e.features.shape == (e.tokens.numel() - 1, target.config.hidden_size)
        assert torch.all(e.topk_probs[:, :-1] >= e.topk_probs[:, 1:])

    shape = DraftShape(
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
    )
    train_recipe = TrainRecipe(tokens_per_batch=32, warmup=2, epochs=2.0, bf16_autocast=False)
    model = init_draft(shape, target, seed=0, final_norm=0.3)
    train, heldout = split_heldout(examples, 0.2, seed=0)
    assert len(heldout) == 1 and len(train) == 4
    info = train_draft(model, train, heldout, train_recipe, time.monotonic() + 600, ThreadTuner(1))
    assert info["steps"] >= 3 and info["final_loss"] > 0 and len(info["history"]) >= 1
    assert 0 <= evaluate(model, heldout, 32)["overlap"] <= 1

    out = tmp_path / "draft"
    save_draft(model, str(out), {"command": "test"})
    assert json.loads((out / "build.json").read_text()) == {"command": "test"}
    write_head_vocab(str(out), [0, 1, 5, 7, 9])
    loaded = osd.load_model(str(out))
    assert loaded.head_vocab_size == 5 and loaded.vocab_size == target.vocab_size
    write_head_vocab(str(out), None)
    assert osd.load_model(str(out)).head_vocab_size == target.vocab_size


def test_a_chosen_prompt_lookup_also_searches_earlier_answers():
    assert with_history(None) is None
    assert with_history({"num_draft_tokens": 3}) == {"num_draft_tokens": 3}
    assert with_history({"drafter": "ngram", "num_draft_tokens": 6}) == {
        "drafter": "ngram",
        "num_draft_tokens": 6,
        "lookup_history": LOOKUP_HISTORY,
    }
    got = with_history({"num_draft_tokens": 3, "prompt_lookup": True})
    assert got["lookup_history"] == LOOKUP_HISTORY
    osd.SpecConfig(**got)  # a valid configuration
