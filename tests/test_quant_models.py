"""Models with block-quantized linear layers (``osd.models.quant``): a GGUF target loaded
with ``quantized=True`` gives the dequantized model's logits bit for bit in forwards of up
to 16 tokens (decode, verify, short prefill: both go through the few-row kernels) and to
float rounding in longer ones; plain, speculative (standalone, EAGLE, self) and sampled
decoding emit the dequantized model's tokens; float models quantize in place; drafts quantize
at load (``quantize_draft``); online EAGLE learning shares the quantized head; bad uses fail
clearly."""

import json

import numpy as np
import pytest
import torch
from torch import nn

import osd
from osd.loader import LEARNING_CHAIN
from osd.models.eagle import EagleLM, save_eagle
from osd.models.gguf import BLOCK_LAYOUT, write_gguf
from osd.models.loading import load_model
from osd.models.quant import (
    QuantLinear,
    own_quant_layers,
    quantize_linears,
    quantize_weight,
    quantized_state,
    serving_drafts,
)
from osd_kernels import use_vnni
from osd_kernels.quant_x16 import X16_TYPES
from tests.test_gguf import T, VOCAB, tiny_hf_model, to_gguf
from tests.test_gguf_blocks import random_blocks
from tests.test_speculative import prompts_of

QTYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1]


def _linears(model):
    return [
        getattr(layer, n) for layer in model.layers for n in ("wqkv", "wo", "w_gate_up", "w_down")
    ] + [model.lm_head]


def _forward(model, ids, tokens):
    """Logits of a prefill of ``ids`` then a cached forward of ``tokens`` more."""
    cache = model.new_cache(1, 128)
    with torch.no_grad():
        first = model.prefill(
            torch.tensor([ids]), cache, torch.tensor([len(ids)], dtype=torch.int32)
        )
        return first, model(torch.tensor([tokens]), cache)


@pytest.mark.parametrize(
    "family,tie",
    [
        ("llama", True),
        ("llama", False),
        ("qwen2", False),
        ("qwen3", False),
        ("granite", True),
        ("olmo2", False),
        ("phi3_longrope", False),
        ("gemma2", True),
        ("gemma3", True),
    ],
)
@pytest.mark.parametrize("t", QTYPES, ids=lambda t: t.name)
def test_quantized_target_equals_its_dequantized_model(tmp_path, t, family, tie):
    path = to_gguf(tiny_hf_model(family, tie=tie, seed=41), tmp_path / "m.gguf", t)
    float_model = load_model(path)
    quant = load_model(path, quantized=True)
    assert all(isinstance(layer, QuantLinear) and layer.fmt == t.name for layer in _linears(quant))
    assert torch.equal(quant.embed_tokens.weight, float_model.embed_tokens.weight)
    ids = prompts_of([13], vocab=VOCAB, seed=42)[0]
    for tokens in ([5], [7, 8, 9, 10, 11]):  # a decode step, a verify forward
        for a, b in zip(_forward(quant, ids, tokens), _forward(float_model, ids, tokens)):
            assert torch.equal(a, b)
    long_ids = prompts_of([70], vocab=VOCAB, seed=43)[0]  # prefill rows past the kernels
    for a, b in zip(_forward(quant, long_ids, [5]), _forward(float_model, long_ids, [5])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def k_quant_gguf(path, linear_type, v_type=None, seed: int = 0, vocab: int = VOCAB):
    """A random 2-layer Llama GGUF as wide as a K-quant super-block (hidden 256, 4 heads /
    2 KV heads, SwiGLU 512, ``vocab`` 300) whose linear weights and head are random
    ``linear_type`` blocks (``v_type`` for ``attn_v``, as Q4_K_M files keep some in Q6_K),
    scaled to keep activations moderate; embedding and norms float32."""
    rng = np.random.default_rng(seed)
    H, F, V = 256, 512, vocab
    meta = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.context_length": 256,
        "llama.embedding_length": H,
        "llama.feed_forward_length": F,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
    }

    def blocks(t, shape):
        n = shape[0] * shape[1] // BLOCK_LAYOUT[t][0]
        b = random_blocks(t, n, seed=int(rng.integers(1 << 30))).reshape(n, -1)
        for at in {
            T.Q2_K: (80, 82),
            T.Q3_K: (108,),
            T.Q4_K: (0, 2),
            T.Q5_K: (0, 2),
            T.Q6_K: (208,),
            T.Q5_0: (0,),
            T.Q8_0: (0,),
            T.IQ4_NL: (0,),
            T.IQ4_XS: (0,),
        }[t]:  # d (and dmin)
            b[:, at : at + 2] = (
                (rng.uniform(-1, 1, n) * 5e-4).astype(np.float16).view(np.uint8).reshape(n, 2)
            )
        return b.reshape(-1), t, shape

    def norm(n):
        return torch.from_numpy(1 + 0.1 * rng.standard_normal(n).astype(np.float32)), T.F32

    tensors = {
        "token_embd.weight": (
            torch.from_numpy(0.3 * rng.standard_normal((V, H)).astype(np.float32)),
            T.F32,
        ),
        "output_norm.weight": norm(H),
        "output.weight": blocks(linear_type, (V, H)),
    }
    for i in range(2):
        for name, shape in (
            ("attn_q", (H, H)),
            ("attn_k", (H // 2, H)),
            ("attn_v", (H // 2, H)),
            ("attn_output", (H, H)),
            ("ffn_gate", (F, H)),
            ("ffn_up", (F, H)),
            ("ffn_down", (H, F)),
        ):
            t = v_type if name == "attn_v" and v_type is not None else linear_type
            tensors[f"blk.{i}.{name}.weight"] = blocks(t, shape)
        tensors[f"blk.{i}.attn_norm.weight"] = norm(H)
        tensors[f"blk.{i}.ffn_norm.weight"] = norm(H)
    write_gguf(path, meta, tensors)
    return path


@pytest.mark.parametrize(
    "t,v,qkv",
    [
        (T.Q2_K, None, "Q2_K"),
        (T.Q3_K, None, "Q3_K"),
        (T.Q4_K, None, "Q4_K"),
        (T.Q5_K, None, "Q5_K"),
        (T.Q6_K, None, "Q6_K"),
        (T.Q4_K, T.Q6_K, "Q4_K+Q6_K"),
        (T.Q3_K, T.Q4_K, "Q3_K+Q4_K"),
        (T.Q5_0, T.Q8_0, "Q5_0+Q8_0"),
        (T.IQ4_NL, None, "IQ4_NL"),
        (T.IQ4_XS, None, "IQ4_XS"),
        (T.IQ4_XS, T.Q4_K, "IQ4_XS+Q4_K"),
    ],
    ids=[
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q4_K-v-Q6_K",
        "Q3_K-v-Q4_K",
        "Q5_0-v-Q8_0",
        "IQ4_NL",
        "IQ4_XS",
        "IQ4_XS-v-Q4_K",
    ],
)
def test_k_quant_target_equals_its_dequantized_model(tmp_path, t, v, qkv):
    """K-quant weights stay quantized (their 16- or 32-weight groups as 4- or 8-bit codes
    with float32 factors) and give the dequantized model's logits bit for bit in decode and
    verify forwards; a fused projection whose parts differ in type is widened to one form
    (Q4_K with Q6_K: 8-bit codes, groups of 16; Q3_K with Q4_K: groups of 16; Q5_0 with
    Q8_0: mins)."""
    path = k_quant_gguf(tmp_path / "k.gguf", t, v, seed=int(t))
    float_model = load_model(path)
    quant = load_model(path, quantized=True)
    for layer in quant.layers:
        assert (layer.wqkv.fmt if isinstance(layer.wqkv, QuantLinear) else None) == qkv
        assert all(
            isinstance(getattr(layer, n), QuantLinear) and getattr(layer, n).fmt == t.name
            for n in ("wo", "w_gate_up", "w_down")
        )
    assert isinstance(quant.lm_head, QuantLinear)
    for a, b in zip(_linears(quant), _linears(float_model)):
        if isinstance(a, QuantLinear):
            assert torch.equal(a.dequantize(), b.weight)
    ids = prompts_of([13], vocab=VOCAB, seed=44)[0]
    for tokens in ([5], [7, 8, 9, 10, 11]):  # a decode step, a verify forward
        for a, b in zip(_forward(quant, ids, tokens), _forward(float_model, ids, tokens)):
            assert torch.isfinite(b).all() and torch.equal(a, b)
    long_ids = prompts_of([70], vocab=VOCAB, seed=45)[0]  # prefill rows past the kernels
    # the prefill GEMM sums in another order than F.linear: rounding, grown by the layers
    for a, b in zip(_forward(quant, long_ids, [5]), _forward(float_model, long_ids, [5])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4 * float(b.abs().max()))


def test_float_tensors_stay_float(tmp_path):
    path = to_gguf(tiny_hf_model("llama", seed=43), tmp_path / "m.gguf", T.F16)
    model = load_model(path, quantized=True)
    assert not any(isinstance(layer, QuantLinear) for layer in _linears(model))


@pytest.fixture(scope="module")
def q41(tmp_path_factory):
    path = tmp_path_factory.mktemp("q41") / "m.gguf"
    return str(to_gguf(tiny_hf_model("llama", seed=44), path, T.Q4_1))


def test_a_gguf_target_stays_quantized_by_default_on_the_cpu(q41):
    """``Engine.from_pretrained(gguf)`` keeps the file's blocks quantized on the CPU in
    float32 (``quantized=None``), dequantizes them with ``quantized=False`` or another
    dtype; with float32 activations (``quantized=True``; the default multiplies int8 ones
    where the CPU has VNNI, ``tests/test_quant_x16.py``) both emit the same greedy tokens."""

    def quantized(model):
        return any(isinstance(m, QuantLinear) for m in model.modules())

    default = osd.Engine.from_pretrained(q41, max_batch_size=2, max_seq_len=48)
    fp32 = osd.Engine.from_pretrained(q41, max_batch_size=2, max_seq_len=48, quantized=False)
    assert quantized(default.model) and not quantized(fp32.model)
    bf16 = osd.Engine.from_pretrained(q41, max_batch_size=2, max_seq_len=48, dtype=torch.bfloat16)
    assert not quantized(bf16.model)
    exact = osd.Engine.from_pretrained(q41, max_batch_size=2, max_seq_len=48, quantized=True)
    prompts = prompts_of([9, 4], vocab=VOCAB, seed=48)
    params = osd.SamplingParams(12)
    assert [o.token_ids for o in exact.generate(prompts, params)] == [
        o.token_ids for o in fp32.generate(prompts, params)
    ]


@pytest.mark.parametrize(
    "params",
    [osd.SamplingParams(12), osd.SamplingParams(12, temperature=0.9, top_p=0.9, seed=3)],
    ids=["greedy", "sampled"],
)
def test_decoding_emits_the_dequantized_targets_tokens(q41, params):
    """Each decoding mode on the quantized target emits what the same mode emits on the
    dequantized one (greedy: also what plain decoding emits)."""
    prompts = prompts_of([9, 4, 13], vocab=VOCAB, seed=45)
    draft = load_model(tiny_hf_model("llama", seed=47))

    def engines(target):
        eagle = EagleLM.from_target(target, num_layers=1)
        eagle.init_draft(std=0.3, generator=torch.Generator().manual_seed(46))
        kw = dict(max_batch_size=3, max_seq_len=64)
        return {
            "plain": osd.Engine(target, **kw),
            "draft": osd.Engine(target, draft=[draft], **kw),
            "eagle": osd.Engine(target, draft=[eagle], **kw),
            "self": osd.Engine(
                target,
                spec=osd.SpecConfig(drafter="self", skip_layers=(1,), num_draft_tokens=3),
                **kw,
            ),
        }

    quant = load_model(q41, quantized=True)
    want = {k: e.generate(prompts, params) for k, e in engines(load_model(q41)).items()}
    for name, eng in engines(quant).items():
        got = eng.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want[name]], name
        if params.temperature == 0:
            assert [o.token_ids for o in got] == [o.token_ids for o in want["plain"]], name
    assert engines(quant)["eagle"].draft.lm_head is quant.lm_head


def test_restricted_eagle_head_keeps_quantized_rows(q41):
    quant = load_model(q41, quantized=True)
    ids = torch.arange(0, VOCAB, 3)
    eagle = EagleLM.from_target(quant, num_layers=1, head_ids=ids)
    assert isinstance(eagle.lm_head, QuantLinear) and eagle.head_vocab_size == len(ids)
    assert torch.equal(eagle.lm_head.dequantize(), quant.lm_head.dequantize()[ids])
    assert set(eagle.state_dict()) == set(eagle.own_state_dict()) | {"head_ids"}


def test_online_eagle_learning_shares_the_quantized_head(q41):
    quant = load_model(q41, quantized=True)
    eagle = EagleLM.from_target(quant, num_layers=1)
    eagle.init_draft(std=0.05, generator=torch.Generator().manual_seed(48))
    online = osd.OnlineConfig(
        update_every_requests=2, steps_per_update=2, lr=3e-3, background=False, guard_tolerance=1.0
    )
    eng = osd.Engine(quant, draft=[eagle], online=online, max_batch_size=4, max_seq_len=96)
    prompts = prompts_of([6, 9, 4, 7] * 2, vocab=VOCAB, seed=49)
    want = osd.Engine(quant, max_batch_size=4, max_seq_len=96).generate(
        prompts, osd.SamplingParams(12)
    )
    outs = eng.generate(prompts[:4], osd.SamplingParams(12)) + eng.generate(
        prompts[4:], osd.SamplingParams(12)
    )
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert eng.stats["online"]["updates_applied"] >= 1
    assert eng.online.learners[0].model.lm_head is quant.lm_head
    assert eng.speculators[0].drafter.model.lm_head is quant.lm_head


def test_quantize_linears_on_a_float_model():
    model = load_model(tiny_hf_model("llama", seed=50))
    ref = osd.Engine(model, max_batch_size=2, max_seq_len=64)
    ids = prompts_of([11], vocab=VOCAB, seed=51)[0]
    before = _forward(model, ids, [3, 4])[1]
    quantize_linears(model, "Q8_0")
    assert all(isinstance(layer, QuantLinear) for layer in _linears(model))
    after = _forward(model, ids, [3, 4])[1]
    assert (after.softmax(-1) - before.softmax(-1)).abs().max() < 0.05  # 8-bit rounding
    prompts = prompts_of([5, 8], vocab=VOCAB, seed=52)
    plain = ref.generate(prompts, osd.SamplingParams(10))
    spec = osd.Engine(
        model,
        spec=osd.SpecConfig(drafter="self", skip_layers=(0,)),
        max_batch_size=2,
        max_seq_len=64,
    ).generate(prompts, osd.SamplingParams(10))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]  # ref shares model
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize_linears(model, "Q5_K")


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
def test_quantize_draft_keeps_the_targets_tokens(tmp_path, fmt):
    """``quantize_draft`` quantizes a standalone draft's and an EAGLE draft's layers and
    heads (not the target's); greedy outputs stay plain decoding's."""
    target = str(to_gguf(tiny_hf_model("llama", seed=60), tmp_path / "t.gguf"))
    draft = str(to_gguf(tiny_hf_model("llama", seed=61), tmp_path / "d.gguf"))
    eagle = EagleLM.from_target(load_model(target), num_layers=1)
    eagle.init_draft(generator=torch.Generator().manual_seed(62))
    save_eagle(eagle, tmp_path / "eagle")
    prompts = prompts_of([6, 9, 4], vocab=VOCAB, seed=63)
    want = [
        o.token_ids
        for o in osd.Engine.from_pretrained(target, max_seq_len=64).generate(
            prompts, osd.SamplingParams(12)
        )
    ]
    for d in (draft, str(tmp_path / "eagle")):
        eng = osd.Engine.from_pretrained(
            target, draft=d, max_batch_size=3, max_seq_len=64, quantize_draft=fmt
        )
        assert all(
            isinstance(layer, QuantLinear) and layer.fmt == fmt for layer in _linears(eng.draft)
        )
        assert not any(isinstance(m, QuantLinear) for m in eng.model.modules())
        assert [o.token_ids for o in eng.generate(prompts, osd.SamplingParams(12))] == want
        sampled = eng.generate(prompts, osd.SamplingParams(12, temperature=0.8, top_k=40, seed=5))
        assert all(len(o.token_ids) == 12 or o.finish_reason == "stop" for o in sampled)
    with pytest.raises(ValueError, match="quantize_draft must be one of"):
        osd.Engine.from_pretrained(target, draft=draft, quantize_draft="Q5_K")
    with pytest.raises(ValueError, match="no draft was given"):
        osd.Engine.from_pretrained(target, quantize_draft=fmt)
    with pytest.raises(ValueError, match="CPU kernels"):
        osd.Engine.from_pretrained(target, draft=draft, quantize_draft=fmt, dtype=torch.bfloat16)
    quant_draft = quantize_linears(load_model(draft), fmt)
    with pytest.raises(ValueError, match="cannot learn"):
        osd.Engine(load_model(target), draft=quant_draft, online=osd.OnlineConfig())


def test_draft_directory_recommends_its_serving_settings(tmp_path):
    """A draft directory's ``serving.json`` gives ``from_pretrained`` its spec and block
    format when the caller passes no spec and leaves ``quantize_draft="auto"``; the
    caller's own settings win, the format applies to float32 CPU drafts only, outputs stay
    plain decoding's, and a malformed file raises ValueError naming it."""
    target = str(to_gguf(tiny_hf_model("llama", seed=70), tmp_path / "t.gguf"))
    draft = tmp_path / "draft"
    draft.mkdir()
    to_gguf(tiny_hf_model("llama", seed=71), draft / "d.gguf")
    settings = draft / "serving.json"
    settings.write_text(
        json.dumps(
            {
                "spec": {"num_draft_tokens": 2, "prompt_lookup": True, "lookup_tree_below": 3},
                "quantize_draft": "Q8_0",
            }
        )
    )
    prompts = prompts_of([7, 5], vocab=VOCAB, seed=72)
    want = [
        o.token_ids
        for o in osd.Engine.from_pretrained(target, max_seq_len=64).generate(
            prompts, osd.SamplingParams(12)
        )
    ]
    eng = osd.Engine.from_pretrained(target, draft=str(draft), max_batch_size=2, max_seq_len=64)
    assert eng.spec == osd.SpecConfig(num_draft_tokens=2, prompt_lookup=True, lookup_tree_below=3)
    assert all(
        isinstance(layer, QuantLinear) and layer.fmt == "Q8_0" for layer in _linears(eng.draft)
    )
    assert [o.token_ids for o in eng.generate(prompts, osd.SamplingParams(12))] == want
    mine = osd.Engine.from_pretrained(
        target,
        draft=str(draft),
        max_seq_len=64,
        spec=osd.SpecConfig(num_draft_tokens=3),
        quantize_draft=None,
    )
    assert mine.spec.num_draft_tokens == 3 and not mine.spec.prompt_lookup
    assert not any(isinstance(m, QuantLinear) for m in mine.draft.modules())
    bf16 = osd.Engine.from_pretrained(
        target, draft=str(draft), max_seq_len=64, dtype=torch.bfloat16
    )
    assert bf16.spec.lookup_tree_below == 3
    assert not any(isinstance(m, QuantLinear) for m in bf16.draft.modules())
    plain_file = osd.Engine.from_pretrained(target, draft=str(draft / "d.gguf"), max_seq_len=64)
    assert plain_file.spec == osd.SpecConfig()
    for bad in [
        "{not json",
        '["spec"]',
        '{"sepc": {}}',
        '{"spec": {"num_draft_tokens": 0}}',
        '{"spec": {"k": 4}}',
        '{"spec": 4}',
        '{"quantize_draft": 8}',
    ]:
        settings.write_text(bad)
        with pytest.raises(ValueError, match="bad draft serving settings in .*serving.json"):
            osd.Engine.from_pretrained(target, draft=str(draft), max_seq_len=64)


def test_a_draft_recommends_other_settings_beside_a_quantized_target(tmp_path, q41):
    """``serving.json``'s ``quantized_target`` applies when the target keeps quantized
    weights; a draft-free recommendation there leaves the draft unserved, except when
    learning online, which takes the draft's float-target settings with ``auto_k`` (its
    arm 0 then the lookup the draft recommends)."""
    draft = tmp_path / "draft"
    tiny_hf_model("llama", seed=73).save_pretrained(draft)
    (draft / "serving.json").write_text(
        json.dumps(
            {
                "spec": {"num_draft_tokens": 2},
                "quantized_target": {"spec": {"drafter": "ngram", "num_draft_tokens": 5}},
            }
        )
    )
    kw = dict(max_batch_size=2, max_seq_len=48)
    eng = osd.Engine.from_pretrained(q41, draft=str(draft), **kw)
    assert eng.spec.drafter == "ngram" and eng.spec.num_draft_tokens == 5 and eng.draft is None
    fp32 = osd.Engine.from_pretrained(q41, draft=str(draft), quantized=False, **kw)
    assert fp32.spec == osd.SpecConfig(num_draft_tokens=2) and fp32.draft is not None
    online = osd.Engine.from_pretrained(
        q41, draft=str(draft), online=osd.OnlineConfig(background=False), **kw
    )
    assert online.spec == osd.SpecConfig(num_draft_tokens=2, auto_k=True)
    assert online.draft is not None
    online.close()
    prompts = prompts_of([9, 4], vocab=VOCAB, seed=74)
    params = osd.SamplingParams(10)
    assert [o.token_ids for o in eng.generate(prompts, params)] == [
        o.token_ids for o in fp32.generate(prompts, params)
    ]
    # lookup alone recommended beside both targets (as `osd draft build` writes where its
    # draft did not pay): learning online serves a chain behind that lookup, with auto_k
    lookup = {"drafter": "ngram", "num_draft_tokens": 5, "lookup_history": 64}
    (draft / "serving.json").write_text(
        json.dumps({"spec": lookup, "quantized_target": {"spec": lookup}})
    )
    online = osd.Engine.from_pretrained(
        q41, draft=str(draft), online=osd.OnlineConfig(background=False), **kw
    )
    assert online.draft is not None and online.spec.drafter == "model"
    assert online.spec.auto_k and online.spec.num_draft_tokens == LEARNING_CHAIN
    assert online.spec.lookup is not None and online.spec.lookup.history == 64
    assert online.spec.lookup.tokens == 5  # lookup alone's steps draft as many as before
    assert [o.token_ids for o in online.generate(prompts, params)] == [
        o.token_ids for o in eng.generate(prompts, params)
    ]
    online.close()
    (draft / "serving.json").write_text(json.dumps({"quantized_target": {"k": 1}}))
    with pytest.raises(ValueError, match="quantized_target"):
        osd.Engine.from_pretrained(q41, draft=str(draft), **kw)


@pytest.mark.parametrize("kind", ["standalone", "eagle"])
def test_quantized_draft_learns_online_through_its_float_master(tmp_path, kind):
    """With ``online``, the learner trains the float draft and publishes each update
    quantized: the serving draft's blocks change, stay quantized, and equal the learner's
    weights quantized; outputs stay plain decoding's."""
    target = str(to_gguf(tiny_hf_model("llama", seed=64), tmp_path / "t.gguf"))
    if kind == "standalone":
        draft = str(to_gguf(tiny_hf_model("llama", seed=65), tmp_path / "d.gguf"))
    else:
        eagle = EagleLM.from_target(load_model(target), num_layers=1)
        eagle.init_draft(std=0.05, generator=torch.Generator().manual_seed(66))
        save_eagle(eagle, tmp_path / "eagle")
        draft = str(tmp_path / "eagle")
    online = osd.OnlineConfig(
        update_every_requests=2,
        steps_per_update=2,
        lr=3e-3,
        background=False,
        guard_tolerance=1.0,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=1,
    )
    eng = osd.Engine.from_pretrained(
        target, draft=draft, online=online, quantize_draft="Q8_0", max_batch_size=4, max_seq_len=96
    )
    serving, learner = eng.draft, eng.online.learners[0]
    wqkv = serving.layers[0].wqkv
    before = wqkv.qweight.clone()
    prompts = prompts_of([6, 9, 4, 7] * 2, vocab=VOCAB, seed=67)
    want = osd.Engine.from_pretrained(target, max_batch_size=4, max_seq_len=96).generate(
        prompts, osd.SamplingParams(12)
    )
    outs = eng.generate(prompts[:4], osd.SamplingParams(12)) + eng.generate(
        prompts[4:], osd.SamplingParams(12)
    )
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert eng.stats["online"]["updates_applied"] >= 1
    assert isinstance(wqkv, QuantLinear) and serving.layers[0].wqkv is wqkv
    assert not torch.equal(wqkv.qweight, before)
    assert not any(isinstance(m, QuantLinear) for m in learner.model.modules())
    learner.maybe_swap()  # the newest update, if not swapped in yet
    want_q = quantize_weight(learner.model.layers[0].wqkv.weight, "Q8_0")
    assert torch.equal(wqkv.qweight, want_q.qweight) and torch.equal(wqkv.scales, want_q.scales)
    # A new engine resumes from the checkpoint of the newest applied update, quantized.
    learner.checkpoint()
    again = osd.Engine.from_pretrained(
        target, draft=draft, online=online, quantize_draft="Q8_0", max_batch_size=4, max_seq_len=96
    )
    assert torch.equal(again.draft.layers[0].wqkv.qweight, wqkv.qweight)


def test_bad_uses_fail_clearly(tmp_path, q41):
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(tiny_hf_model("llama", seed=53), quantized=True)
    with pytest.raises(ValueError, match="CPU float32"):
        osd.Engine.from_pretrained(q41, dtype=torch.bfloat16, quantized=True)
    layer = load_model(q41, quantized=True).lm_head
    with pytest.raises(ValueError, match="holds Q4_0, Q4_1, Q8_0"):
        QuantLinear.from_gguf_blocks(torch.zeros(8, dtype=torch.uint8), "IQ2_XXS", (1, 32))
    with pytest.raises(ValueError, match="whole super-blocks of 256"):
        QuantLinear.from_gguf_blocks(torch.zeros(8, dtype=torch.uint8), "Q6_K", (1, 32))
    with pytest.raises(ValueError, match="IQ4_XS rows hold whole blocks of 256"):
        QuantLinear.from_gguf_blocks(torch.zeros(8, dtype=torch.uint8), "IQ4_XS", (1, 32))
    assert not isinstance(layer, nn.Linear)


def test_served_draft_copies_compute_with_int8_activations_and_learn_so():
    """A draft served quantized (``quantize_draft``) computes with int8 activations where
    the CPU has VNNI, as a quantized target does (its layers regrouped; it shares none of
    the target's), and the learner's updates are published regrouped alike: each layer
    then holds exactly the learner's weights quantized and regrouped."""
    draft = load_model(osd.zoo.default_pair()[1])
    (served,) = serving_drafts([draft], "Q8_0", torch.device("cpu"), learning=True)
    layers = own_quant_layers(served)
    assert layers and all((q.ggml_type in X16_TYPES) == use_vnni() for q in layers.values())
    gen = torch.Generator().manual_seed(5)
    state = {
        k: v + 0.01 * torch.randn(v.shape, generator=gen) if k.endswith(".weight") else v
        for k, v in draft.state_dict().items()
    }
    published = quantized_state(state, layers)
    with torch.no_grad():
        for name, p in served.state_dict().items():
            if name in published:
                p.copy_(published[name])
    x = torch.randn(3, draft.config.hidden_size, generator=gen)
    for name in ("layers.0.wqkv", "lm_head"):
        want = quantize_weight(state[f"{name}.weight"], "Q8_0")
        if use_vnni():
            want.use_int8_activations()
        got = layers[name]
        assert torch.equal(got.qweight, want.qweight) and got.ggml_type == want.ggml_type
        torch.testing.assert_close(got(x), want(x), atol=0, rtol=0)
