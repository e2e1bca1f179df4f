"""Online-learning recipes: ``OnlineConfig``'s defaults, a draft's ``serving.json`` recipe
applied under the caller's own fields, and the demo's recipes read from the drafts."""

import dataclasses
import json

import pytest

import osd
from osd.demo import online_recipe
from osd.online.config import draft_online_recipe, with_recipe
from osd.zoo import chat
from tests.test_models import tiny_hf_model


def test_a_recipe_goes_under_the_callers_fields():
    recipe = {"lr": 1e-3, "steps_per_update": 7, "max_train_len": 64}
    cfg = with_recipe(osd.OnlineConfig(steps_per_update=2), recipe)
    assert (cfg.lr, cfg.steps_per_update, cfg.max_train_len) == (1e-3, 2, 64)
    assert with_recipe(osd.OnlineConfig(), None) == osd.OnlineConfig()


def test_draft_online_recipe_reads_and_checks_serving_json(tmp_path):
    assert draft_online_recipe(tmp_path) is None
    (tmp_path / "serving.json").write_text(json.dumps({"quantize_draft": None}))
    assert draft_online_recipe(tmp_path) is None
    (tmp_path / "serving.json").write_text(json.dumps({"online": {"lr": 2e-4}}))
    assert draft_online_recipe(tmp_path) == {"lr": 2e-4}
    for bad in ({"online": {"lrr": 1}}, {"online": {"lr": -1}}, {"online": [1]}):
        (tmp_path / "serving.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="bad online recipe in .*serving.json"):
            draft_online_recipe(tmp_path)


def test_from_pretrained_applies_the_drafts_recipe(tmp_path):
    target = tiny_hf_model("llama", seed=31)
    draft_dir = tmp_path / "draft"
    tiny_hf_model("llama", seed=32).save_pretrained(draft_dir)
    (draft_dir / "serving.json").write_text(
        json.dumps({"online": {"lr": 7e-4, "update_every_requests": 3}})
    )
    eng = osd.Engine.from_pretrained(
        target,
        draft=str(draft_dir),
        max_batch_size=2,
        max_seq_len=64,
        online=osd.OnlineConfig(update_every_requests=5, background=False),
    )
    cfg = eng.online.config
    assert (cfg.lr, cfg.update_every_requests, cfg.background) == (7e-4, 5, False)
    eng.close()


def test_the_shipped_drafts_carry_their_recipes():
    c = online_recipe("chat")
    assert (c.lr, c.steps_per_update, c.replay_fraction, c.max_train_len) == (3e-4, 4, 0.75, 128)
    assert draft_online_recipe(chat.EAGLE_DIR) == draft_online_recipe(chat.DRAFT_DIR)
    b = online_recipe("builtin")
    assert (b.lr, b.steps_per_update, b.batch_positions, b.prompt_positions) == (5e-4, 8, 1024, 256)
    # the defaults are the chat recipe for general answer lengths
    assert dataclasses.replace(c, max_train_len=256) == osd.OnlineConfig()


def test_the_config_is_a_recipe_and_a_runtime():
    """``OnlineConfig`` is composed of an ``OnlineRecipe`` and an ``OnlineRuntime``; the
    flat keywords and attributes of either part keep working on the config itself."""
    cfg = osd.OnlineConfig(
        recipe=osd.OnlineRecipe(lr=1e-3, max_train_len=64),
        runtime=osd.OnlineRuntime(background=False),
    )
    assert cfg == osd.OnlineConfig(lr=1e-3, max_train_len=64, background=False)
    assert (cfg.lr, cfg.max_train_len, cfg.background) == (1e-3, 64, False)
    assert cfg.recipe.lr == 1e-3 and cfg.runtime.background is False
    # a flat keyword replaces that field of the part given
    both = osd.OnlineConfig(recipe=cfg.recipe, steps_per_update=2)
    assert (both.lr, both.steps_per_update, both.background) == (1e-3, 2, True)
    moved = dataclasses.replace(cfg, checkpoint_dir="ck", lr=2e-3)
    assert (moved.checkpoint_dir, moved.lr, moved.max_train_len) == ("ck", 2e-3, 64)
    assert cfg.checkpoint_dir is None and cfg.lr == 1e-3  # the original is unchanged
    moved.lr = 5e-4  # a checked copy of the recipe; configs may share parts
    assert moved.recipe.lr == 5e-4 and cfg.recipe.lr == 1e-3
    with pytest.raises(ValueError, match="OnlineRecipe.lr"):
        moved.lr = 0
    with pytest.raises(TypeError, match="lrr"):
        osd.OnlineConfig(lrr=1)
    with pytest.raises(TypeError, match="OnlineRecipe"):
        osd.OnlineConfig(recipe={"lr": 1e-3})
    with pytest.raises(ValueError, match="OnlineRuntime.history_updates"):
        osd.OnlineRuntime(history_updates=0)
    with pytest.raises(ValueError, match="OnlineRecipe.max_train_len"):
        osd.OnlineConfig(max_train_len=0)
    names = {f.name for f in dataclasses.fields(osd.OnlineRecipe)}
    assert not names & {f.name for f in dataclasses.fields(osd.OnlineRuntime)}
    # what a shipped draft carries is its recipe only
    recipe = draft_online_recipe(chat.DRAFT_DIR)
    assert set(recipe) <= names
