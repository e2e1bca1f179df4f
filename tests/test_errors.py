"""Bad input (issue 2 section 5): each case raises ValueError / TypeError /
FileNotFoundError naming the problem, and afterwards the same Engine serves the next valid
request correctly."""

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import osd
from osd.models import load_model
from tests.test_models import VOCAB, tiny_hf_model

SUPPORTED = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
VALID_PROMPTS = [[3, 14, 15, 92, 65], [35, 89]]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama3", seed=20)


@pytest.fixture(scope="module")
def engine(hf):
    return osd.Engine.from_pretrained(hf, max_batch_size=2, max_seq_len=24)


@pytest.fixture(scope="module")
def expected(engine):
    return [o.token_ids for o in engine.generate(VALID_PROMPTS, osd.SamplingParams(8))]


@pytest.fixture(scope="module")
def checkpoint(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    hf.save_pretrained(path)
    return path


def _still_serves(engine, expected):
    outs = engine.generate(VALID_PROMPTS, osd.SamplingParams(8))
    assert [o.token_ids for o in outs] == expected


def _copy_checkpoint(src, dst, skip=()):
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_checkpoint_directory(engine, expected, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        osd.Engine.from_pretrained(tmp_path / "nowhere")
    _still_serves(engine, expected)


def test_checkpoint_without_config_or_weights(engine, expected, checkpoint, tmp_path):
    no_config = _copy_checkpoint(checkpoint, tmp_path / "a", skip=("config.json",))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        osd.Engine.from_pretrained(no_config)
    no_weights = _copy_checkpoint(checkpoint, tmp_path / "b", skip=("model.safetensors",))
    with pytest.raises(FileNotFoundError, match="no weights"):
        osd.Engine.from_pretrained(no_weights)
    _still_serves(engine, expected)


def test_corrupt_checkpoint(engine, expected, checkpoint, tmp_path):
    bad_config = _copy_checkpoint(checkpoint, tmp_path / "a")
    (bad_config / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ValueError, match="corrupt config.json"):
        osd.Engine.from_pretrained(bad_config)
    bad_weights = _copy_checkpoint(checkpoint, tmp_path / "b")
    (bad_weights / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ValueError, match="corrupt checkpoint file"):
        osd.Engine.from_pretrained(bad_weights)
    bad_bin = _copy_checkpoint(checkpoint, tmp_path / "d", skip=("model.safetensors",))
    (bad_bin / "pytorch_model.bin").write_bytes(b"not a pickle" * 10)
    with pytest.raises(ValueError, match="corrupt checkpoint file .*pytorch_model.bin"):
        osd.Engine.from_pretrained(bad_bin)
    truncated = _copy_checkpoint(checkpoint, tmp_path / "c")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt checkpoint file"):
        osd.Engine.from_pretrained(truncated)
    _still_serves(engine, expected)


def test_checkpoint_with_missing_tensor(engine, expected, hf, tmp_path):
    hf.config.save_pretrained(tmp_path)
    state = {k: v for k, v in hf.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="missing 1 tensors: model.layers.1.mlp.up_proj.weight"):
        osd.Engine.from_pretrained(tmp_path)
    _still_serves(engine, expected)


def test_unsupported_architecture(engine, expected, checkpoint, tmp_path):
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(
        ValueError, match=f"'GPT2LMHeadModel'; supported architectures: {SUPPORTED}"
    ):
        osd.Engine.from_pretrained(gpt2)
    renamed = _copy_checkpoint(checkpoint, tmp_path / "a")
    config = json.loads((renamed / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (renamed / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=f"'FalconForCausalLM'; supported architectures: {SUPPORTED}"
    ):
        osd.Engine.from_pretrained(renamed)
    _still_serves(engine, expected)


def test_draft_vocabulary_differs(engine, expected, hf):
    draft = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    )
    with pytest.raises(
        ValueError, match="draft vocabulary size 97 differs from the target vocabulary size 131"
    ):
        osd.Engine.from_pretrained(hf, draft=draft)
    same = osd.Engine.from_pretrained(
        hf, draft=tiny_hf_model("qwen2", seed=21), max_batch_size=2, max_seq_len=24
    )
    assert same.draft is not None and same.draft.vocab_size == VOCAB
    _still_serves(engine, expected)


def test_prompt_longer_than_context(engine, expected):
    trained = engine.model.config.max_position_embeddings
    with pytest.raises(
        ValueError, match=f"prompt 1 has 24 tokens.*max_seq_len=24.*trained context: {trained}"
    ):
        engine.generate([[1, 2], [5] * 24], osd.SamplingParams(4))
    with pytest.raises(ValueError, match="prompt 0 has 40 tokens"):
        engine.generate([[5] * 40], osd.SamplingParams(4))
    _still_serves(engine, expected)


def test_empty_prompt_list_or_prompt(engine, expected):
    with pytest.raises(ValueError, match="prompts is empty"):
        engine.generate([], osd.SamplingParams(4))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], osd.SamplingParams(4))
    with pytest.raises(TypeError, match="no tokenizer"):
        engine.generate(["hello"], osd.SamplingParams(4))
    with pytest.raises(TypeError, match="list of prompts"):
        engine.generate("hello", osd.SamplingParams(4))
    _still_serves(engine, expected)


def test_token_ids_out_of_range(engine, expected):
    with pytest.raises(ValueError, match=r"token id 131 outside the vocabulary \[0, 131\)"):
        engine.generate([[1, 2], [4, 131]], osd.SamplingParams(4))
    with pytest.raises(ValueError, match="token id -1 outside"):
        engine.generate([[-1, 2]], osd.SamplingParams(4))
    with pytest.raises(TypeError, match="non-integer token 1.5"):
        engine.generate([[1.5, 2]], osd.SamplingParams(4))
    _still_serves(engine, expected)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -0.5}, "temperature must be"),
        ({"temperature": float("nan")}, "temperature must be"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ],
)
def test_bad_sampling_params(engine, expected, kwargs, match):
    with pytest.raises(ValueError, match=match):
        osd.SamplingParams(**{"max_new_tokens": 4, **kwargs})
    _still_serves(engine, expected)


def test_wrong_param_types(engine, expected):
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        osd.SamplingParams(2.5)
    with pytest.raises(TypeError, match="params must be an osd.SamplingParams"):
        engine.generate(VALID_PROMPTS, {"max_new_tokens": 4})
    _still_serves(engine, expected)


def test_unknown_device(engine, expected, hf):
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        osd.Engine.from_pretrained(hf, device="gpu0")
    with pytest.raises(ValueError, match="unsupported device 'meta'"):
        load_model(hf, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            osd.Engine.from_pretrained(hf, device="cuda")
    with pytest.raises(TypeError, match="unsupported dtype"):
        osd.Engine.from_pretrained(hf, dtype=torch.int8)
    _still_serves(engine, expected)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(drafter="ngram", prompt_lookup=True), "drafter='ngram' already is prompt lookup"),
        (dict(drafter="eagle"), "SpecConfig.drafter must be one of"),
        (dict(ngram_min=3, ngram_max=2), "1 <= ngram_min <= ngram_max"),
        (
            dict(lookup_history=-5, prompt_lookup=True),
            "lookup_history \\(PromptLookup.history\\) must be >= 0",
        ),
        (dict(lookup_history=1000), "lookup_history shapes prompt lookup"),
        (
            dict(lookup_tokens=-1, prompt_lookup=True),
            "lookup_tokens \\(PromptLookup.tokens\\) must be in 0..63",
        ),
        (
            dict(lookup_tokens=64, prompt_lookup=True),
            "lookup_tokens \\(PromptLookup.tokens\\) must be",
        ),
        (dict(lookup_tokens=8), "lookup_tokens shapes prompt lookup"),
        (
            dict(lookup_tree_below=5, prompt_lookup=True),
            "lookup_tree_below \\(PromptLookup.tree_below\\) must be in 0..ngram_max",
        ),
        (
            dict(lookup_tree_below=-1, prompt_lookup=True),
            "lookup_tree_below \\(PromptLookup.tree_below\\) must be in",
        ),
        (dict(lookup_tree_below=3), "lookup_tree_below shapes prompt lookup"),
        (dict(lookup_tree_below=3, prompt_lookup=True, adaptive=True), "does not combine"),
        (dict(lookup_tree_below=3, prompt_lookup=True, tree=[(0,), (1,)]), "does not combine"),
        (
            dict(lookup_tree_below=3, prompt_lookup=True, num_draft_tokens=40),
            "up to 1 \\+ max\\(num_draft_tokens, lookup_tokens\\) \\+ num_draft_tokens",
        ),
        (
            dict(lookup_tree_below=3, prompt_lookup=True, num_draft_tokens=3, lookup_tokens=61),
            "lookup_tokens=61",
        ),
    ],
)
def test_bad_spec_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        osd.SpecConfig(**kwargs)
