"""The shipped draft of the chat pair (``osd/zoo/weights/chat_draft``, built by
``osd draft build``): it loads with osd and transformers, shares the
SmolLM2-135M-Instruct vocabulary, and greedy speculative decoding with it reproduces
plain greedy decoding; the same for its EAGLE draft (``osd/zoo/weights/chat_eagle``).
Skipped when the GGUF target is not cached."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaForCausalLM

import osd
from osd.models.loading import load_model
from osd.models.quant import QuantLinear
from osd.spec import draft_serving_defaults
from osd.zoo import chat as zoo_chat

# Where osd.zoo finds the chat draft (the source checkout's, unless $OSD_ZOO_WEIGHTS says).
DRAFT_DIR = zoo_chat.DRAFT_DIR

needs_target = pytest.mark.skipif(
    zoo_chat.cached_target() is None, reason="SmolLM2 GGUF not cached; run osd.zoo.chat_pair() once"
)


def test_checkpoint_files():
    """config.json (Llama, tied, the target's vocabulary), fp16 safetensors under 40 MB
    without a separate LM head, and the build record."""
    with open(os.path.join(DRAFT_DIR, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    weights = os.path.join(DRAFT_DIR, "model.safetensors")
    assert os.path.getsize(weights) < 40e6
    with safe_open(weights, "pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
    with open(os.path.join(DRAFT_DIR, "build.json")) as f:
        build = json.load(f)
    assert build["target_sha256"] == zoo_chat.SHA256


def test_osd_matches_transformers():
    """osd's cacheless forward of the draft equals transformers' on the same checkpoint:
    everywhere with the full head, at the kept tokens (``-inf`` elsewhere) with the
    shipped reduced head (``head_vocab.json``, which transformers ignores)."""
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]])
    hf = LlamaForCausalLM.from_pretrained(DRAFT_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    full = load_model(DRAFT_DIR, head_vocab=False).forward_train(ids)
    torch.testing.assert_close(full, theirs, atol=1e-3, rtol=1e-4)
    reduced = load_model(DRAFT_DIR)
    with open(os.path.join(DRAFT_DIR, "head_vocab.json")) as f:
        kept = torch.tensor(json.load(f))
    assert reduced.head_vocab_size == kept.numel() < reduced.vocab_size
    assert torch.equal(reduced.head_ids, kept)
    logits = reduced.forward_train(ids)
    torch.testing.assert_close(logits[..., kept], theirs[..., kept], atol=1e-3, rtol=1e-4)
    outside = torch.ones(reduced.vocab_size, dtype=torch.bool)
    outside[kept] = False
    assert torch.isneginf(logits[..., outside]).all()


@needs_target
@pytest.mark.slow
def test_speculative_equals_plain_greedy():
    """``Engine.from_pretrained(gguf, draft=DRAFT_DIR)`` works unchanged, and its greedy
    answer to a chat prompt equals plain greedy decoding token for token; the draft gets
    some of its proposals accepted."""
    engine = osd.Engine.from_pretrained(
        zoo_chat.cached_target(),
        draft=DRAFT_DIR,
        max_batch_size=1,
        max_seq_len=256,
        spec=osd.SpecConfig(num_draft_tokens=4),
    )
    assert engine.draft.vocab_size == engine.model.vocab_size == len(engine.tokenizer)
    plain = osd.Engine(engine.model, tokenizer=engine.tokenizer, max_batch_size=1, max_seq_len=256)
    conv = [
        [
            {
                "role": "user",
                "content": "Write a Python function that returns the square of a number.",
            }
        ]
    ]
    params = osd.SamplingParams(max_new_tokens=32)
    want = plain.chat(conv, params)[0]
    got = engine.chat(conv, params)[0]
    assert got.token_ids == want.token_ids
    assert engine.stats["accepted"] > 0


def test_eagle_checkpoint_files():
    """The shipped EAGLE draft: its config names the chat target's shape, fp16 weights of
    its own tensors only (the target's embedding, norm and head are not stored), under
    40 MB, with the standalone draft's head vocabulary."""
    path = zoo_chat.chat_eagle()
    assert path is not None
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["OsdEagleDraft"]
    assert (config["hidden_size"], config["vocab_size"]) == (576, 49152)
    assert config["build"]["target_sha256"] == zoo_chat.SHA256
    weights = os.path.join(path, "model.safetensors")
    assert os.path.getsize(weights) < 40e6
    with safe_open(weights, "pt") as f:
        keys = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"F16"}
    assert "fc.weight" in keys and not keys & {"embed_tokens.weight", "lm_head.weight"}
    with (
        open(os.path.join(path, "head_vocab.json")) as f,
        open(os.path.join(DRAFT_DIR, "head_vocab.json")) as g,
    ):
        assert json.load(f) == json.load(g)


@needs_target
@pytest.mark.slow
def test_eagle_speculative_equals_plain_greedy():
    """``Engine.from_pretrained(gguf, draft=chat_eagle())``: greedy chat answers equal plain
    greedy decoding, with and without prompt lookup, and the EAGLE draft is accepted."""
    target = zoo_chat.cached_target()
    plain = osd.Engine.from_pretrained(target, max_batch_size=2, max_seq_len=256)
    convs = [
        [
            {
                "role": "user",
                "content": "Write a Python function that returns the square of a number.",
            }
        ],
        [{"role": "user", "content": "Explain what a linked list is in two sentences."}],
    ]
    params = osd.SamplingParams(max_new_tokens=32)
    want = [o.token_ids for o in plain.chat(convs, params)]
    for lookup in (False, True):
        engine = osd.Engine(
            plain.model,
            draft=osd.load_eagle(zoo_chat.chat_eagle(), plain.model),
            tokenizer=plain.tokenizer,
            max_batch_size=2,
            max_seq_len=256,
            spec=osd.SpecConfig(num_draft_tokens=4, prompt_lookup=lookup),
        )
        assert [o.token_ids for o in engine.chat(convs, params)] == want
        assert engine.stats["accepted"] > 0


@needs_target
@pytest.mark.slow
def test_shipped_drafts_serve_with_their_recommended_settings():
    """Both shipped drafts carry ``serving.json`` (prompt lookup in front, the draft in
    Q8_0): ``from_pretrained(target, draft=...)`` alone serves them that way, and greedy
    chat answers still equal plain greedy decoding."""
    target = zoo_chat.cached_target()
    kw = dict(max_batch_size=2, max_seq_len=256)
    plain = osd.Engine.from_pretrained(target, quantized=False, **kw)
    convs = [
        [
            {
                "role": "user",
                "content": "Write a Python function that returns the largest of three numbers.",
            }
        ],
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What does a hash map do?"},
        ],
    ]
    params = osd.SamplingParams(max_new_tokens=32)
    want = [o.token_ids for o in plain.chat(convs, params)]
    for path in (DRAFT_DIR, zoo_chat.chat_eagle()):
        spec, fmt = draft_serving_defaults(path)
        assert spec.prompt_lookup and fmt == "Q8_0"
        engine = osd.Engine.from_pretrained(target, draft=path, quantized=False, **kw)
        assert engine.spec == spec
        assert any(isinstance(m, QuantLinear) for m in engine.draft.modules())
        assert [o.token_ids for o in engine.chat(convs, params)] == want
        assert engine.stats["accepted"] > 0
    # beside the target kept quantized (the CPU default) the standalone draft recommends
    # prompt lookup alone, and is not served
    quant_plain = osd.Engine.from_pretrained(target, **kw)
    engine = osd.Engine.from_pretrained(target, draft=DRAFT_DIR, **kw)
    assert engine.spec.drafter == "ngram" and engine.draft is None
    assert engine.spec.lookup_history > 0  # it also searches earlier answers
    assert [o.token_ids for o in engine.chat(convs, params)] == [
        o.token_ids for o in quant_plain.chat(convs, params)
    ]
