"""GGUF loading against transformers and against straightforward per-block references.

Tiny random transformers models are converted to GGUF here the way llama.cpp's converter
does it (its llama.cpp tensor names, its Q/K row permutation), then loaded with osd:
F32 logits match transformers to 1e-4, and quantized files match transformers holding the
dequantized weights. Every block type's dequantizer equals a per-block loop written from
ggml's C code, and the quantizers equal ggml's reference quantizers byte for byte
(``tests/test_gguf_blocks.py``); the file format's metadata types and errors are tested in
``tests/test_gguf_format.py``.
"""

import copy
import math

import pytest
import torch
from transformers import (
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
)

import osd
from osd.models import gguf
from osd.models.gguf import GGMLType, GGUFFile, quantize, write_gguf
from osd.models.loading import load_model, load_tokenizer
from osd.zoo import chat as zoo_chat
from osd.chat_template import apply_chat_template
from osd.models.quant import QuantLinear
from tests.test_gguf_blocks import ref_dequantize
from tests.test_gguf_tokenizer import bpe_metadata, trained_bpe
from tests.test_models import GRANITE, phi3_config

T = GGMLType
ATOL = 1e-4
VOCAB = 300


# -- tiny models and the llama.cpp-style conversion ---------------------------------------
def tiny_hf_model(family: str = "llama", *, tie: bool = False, seed: int = 0, vocab: int = VOCAB):
    """A random 2-layer model: hidden 64, 4 heads, 2 KV heads (head dim 16), SwiGLU 96,
    vocab 300 (or ``vocab``). Rows are whole 32-blocks so every type can quantize them."""
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=None,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=10000.0, **common))
    elif family == "llama_bias":
        model = LlamaForCausalLM(LlamaConfig(attention_bias=True, mlp_bias=True, **common))
    elif family == "llama3":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        model = LlamaForCausalLM(LlamaConfig(rope_scaling=rope, rope_theta=500000.0, **common))
    elif family == "llama_linear":
        rope = {"rope_type": "linear", "factor": 2.5}
        model = LlamaForCausalLM(LlamaConfig(rope_scaling=rope, **common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif family == "qwen3":  # head_dim 32, not hidden / heads = 16
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=32, **common))
    elif family == "granite":
        model = GraniteForCausalLM(GraniteConfig(**GRANITE, **common))
    elif family == "olmo2":
        model = Olmo2ForCausalLM(Olmo2Config(**common))
    elif family.startswith("phi3"):  # longrope: short factors up to 128 of 256 positions
        model = Phi3ForCausalLM(phi3_config(family, common, original=128))
    elif family == "gemma2":  # sliding, then global; soft caps that bend
        model = Gemma2ForCausalLM(
            Gemma2Config(
                **{**common, "pad_token_id": None},
                head_dim=16,
                query_pre_attn_scalar=16,
                sliding_window=5,
                attn_logit_softcapping=5.0,
                final_logit_softcapping=3.0,
            )
        )
    elif family == "gemma3":  # 6 layers: llama.cpp's 5 sliding, then 1 global
        model = Gemma3ForCausalLM(
            Gemma3TextConfig(
                **{**common, "num_hidden_layers": 6, "pad_token_id": None},
                sliding_window=5,
                head_dim=16,
                query_pre_attn_scalar=16,
            )
        )  # llama.cpp scales by the head width
    elif family == "smollm3":  # 4 layers: llama.cpp's NoPE on every 4th
        model = SmolLM3ForCausalLM(SmolLM3Config(**{**common, "num_hidden_layers": 4}))
    elif family == "mixtral":  # the llama architecture with 4 experts
        model = MixtralForCausalLM(
            MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        )
    elif family == "qwen2_moe":  # routing weights as they are, a shared expert
        model = Qwen2MoeForCausalLM(
            Qwen2MoeConfig(
                num_experts=5,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=64,
                norm_topk_prob=False,
                **common,
            )
        )
    elif family == "qwen3_moe":  # routing weights summing to 1
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                num_experts=6,
                num_experts_per_tok=3,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                head_dim=32,
                **common,
            )
        )
    elif family == "olmoe":  # q/k norms over whole projections
        model = OlmoeForCausalLM(OlmoeConfig(num_experts=5, num_experts_per_tok=2, **common))
    elif family == "granite_moe":  # Granite's multipliers
        model = GraniteMoeForCausalLM(
            GraniteMoeConfig(num_local_experts=4, num_experts_per_tok=2, **GRANITE, **common)
        )
    else:
        raise ValueError(family)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def llama_cpp_permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, as written there."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "pre_feedforward_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "block_sparse_moe.router": "ffn_gate_inp",
}


def _rope_theta(cfg) -> float:
    """The (global layers') RoPE base of a transformers config."""
    rope = getattr(cfg, "rope_parameters", None)
    if not rope:
        return float(cfg.rope_theta)
    return float(
        rope["full_attention"]["rope_theta"] if "full_attention" in rope else rope["rope_theta"]
    )


PERMUTED = ("llama", "granite", "granitemoe", "smollm3")  # Q/K rows reordered by llama.cpp


def to_gguf(hf, path, qtype=T.F32, *, extra: dict | None = None, skip=()):
    """Write ``hf`` as llama.cpp would: its tensor names, Q/K rows permuted (Llama), 2-D
    weights as ``qtype`` and 1-D ones as F32, ``output.weight`` left out when tied.
    ``extra`` adds metadata (a None value removes the key); ``skip`` leaves tensors out."""
    cfg = hf.config
    arch = {
        Qwen2ForCausalLM: "qwen2",
        Qwen3ForCausalLM: "qwen3",
        GraniteForCausalLM: "granite",
        Olmo2ForCausalLM: "olmo2",
        Phi3ForCausalLM: "phi3",
        SmolLM3ForCausalLM: "smollm3",
        Gemma2ForCausalLM: "gemma2",
        Gemma3ForCausalLM: "gemma3",
        Qwen2MoeForCausalLM: "qwen2moe",
        Qwen3MoeForCausalLM: "qwen3moe",
        OlmoeForCausalLM: "olmoe",
        GraniteMoeForCausalLM: "granitemoe",
    }.get(type(hf), "llama")
    meta = {
        "general.architecture": arch,
        "general.name": "tiny",
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.key_length": getattr(cfg, "head_dim", None),
        f"{arch}.attention.value_length": getattr(cfg, "head_dim", None),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.rope.freq_base": _rope_theta(cfg),
    }
    if arch in ("gemma2", "gemma3"):
        meta[f"{arch}.attention.sliding_window"] = cfg.sliding_window
    if arch == "gemma2":
        meta["gemma2.attn_logit_softcapping"] = float(cfg.attn_logit_softcapping)
        meta["gemma2.final_logit_softcapping"] = float(cfg.final_logit_softcapping)
    if arch in ("granite", "granitemoe"):
        meta.update(
            {
                f"{arch}.{k}": float(getattr(cfg, name))
                for k, name in (
                    ("embedding_scale", "embedding_multiplier"),
                    ("residual_scale", "residual_multiplier"),
                    ("attention.scale", "attention_multiplier"),
                    ("logit_scale", "logits_scaling"),
                )
            }
        )
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        meta.update(
            {
                f"{arch}.expert_count": experts,
                f"{arch}.expert_used_count": cfg.num_experts_per_tok,
                f"{arch}.expert_feed_forward_length": getattr(cfg, "moe_intermediate_size", None),
                f"{arch}.expert_shared_feed_forward_length": getattr(
                    cfg, "shared_expert_intermediate_size", None
                ),
            }
        )
    meta.update(extra or {})
    meta = {k: v for k, v in meta.items() if v is not None}
    tensors = {}
    for name, w in hf.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H] -> gate and up
            i = name.split(".")[2]
            gate, up = w.chunk(2, dim=1)
            tensors[f"blk.{i}.ffn_gate_exps.weight"] = (gate, T.F32)
            tensors[f"blk.{i}.ffn_up_exps.weight"] = (up, T.F32)
            continue
        if name.endswith("experts.down_proj"):
            tensors[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = (w, T.F32)
            continue
        if name.endswith("mlp.shared_expert_gate.weight"):  # stored as [hidden]
            w = w.reshape(-1)
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        elif name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{_NAMES[module]}.{kind}"
            if arch in ("olmo2", "gemma2", "gemma3") and module == "post_attention_layernorm":
                gname = f"blk.{i}.post_attention_norm.{kind}"  # after attention
            if arch in PERMUTED and module == "self_attn.q_proj":
                w = llama_cpp_permute(w, cfg.num_attention_heads, cfg.num_attention_heads)
            elif arch in PERMUTED and module == "self_attn.k_proj":
                w = llama_cpp_permute(w, cfg.num_attention_heads, cfg.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp stores Gemma's 1 + weight
        if gname not in skip:
            tensors[gname] = (w, qtype if w.dim() == 2 else T.F32)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if arch == "phi3":  # as llama.cpp's Phi3MiniModel writes them
        meta["phi3.rope.dimension_count"] = (
            int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
        )
        meta["phi3.rope.scaling.original_context_length"] = rope.get(
            "original_max_position_embeddings", cfg.max_position_embeddings
        )
        if rope.get("rope_type") == "longrope":
            scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
            meta["phi3.rope.scaling.attn_factor"] = math.sqrt(
                1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])
            )
            for kind in ("long", "short"):
                tensors[f"rope_factors_{kind}.weight"] = (
                    torch.tensor(rope[f"{kind}_factor"], dtype=torch.float32),
                    T.F32,
                )
    elif rope.get("rope_type") == "llama3":
        factors = gguf.llama3_rope_factors(
            rope["rope_theta"],
            16,
            rope["factor"],
            rope["low_freq_factor"],
            rope["high_freq_factor"],
            rope["original_max_position_embeddings"],
        )
        tensors["rope_freqs.weight"] = (factors.float(), T.F32)
    elif rope.get("rope_type") == "linear":
        meta.update(
            {
                "llama.rope.scaling.type": "linear",
                "llama.rope.scaling.factor": float(rope["factor"]),
            }
        )
    write_gguf(path, meta, tensors)
    return path


def dequantized_copy(hf, qtype):
    """``hf`` with every 2-D weight replaced by the reference dequantization of its
    ``qtype`` bytes (what a ``qtype`` GGUF of it holds)."""
    out = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if p.dim() == 2 and qtype in (T.F16, T.BF16):
                p.copy_(p.to(torch.float16 if qtype == T.F16 else torch.bfloat16))
            elif p.dim() == 2:
                raw = quantize(p.detach(), qtype)
                p.copy_(torch.from_numpy(ref_dequantize(raw, qtype)).reshape(p.shape))
    return out


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def osd_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), model.new_cache(1, len(ids)))[0].float()


# -- tests ----------------------------------------------------------------------------------
def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(4 * 16, 8)
    for heads, kv in ((4, None), (4, 2)):
        rows = w[: (kv or heads) * 16]
        stored = llama_cpp_permute(rows, 4, kv)
        assert not torch.equal(stored, rows)
        assert torch.equal(gguf.unpermute_rope_rows(stored, kv or heads), rows)


@pytest.mark.parametrize(
    "family,tie",
    [
        ("llama", False),
        ("llama", True),
        ("llama_bias", False),
        ("llama3", False),
        ("llama_linear", True),
        ("qwen2", True),
        ("qwen3", True),
        ("qwen3", False),
        ("granite", True),
        ("granite", False),
        ("olmo2", True),
        ("olmo2", False),
        ("phi3", False),
        ("phi3_longrope", False),
        ("smollm3", True),
        ("gemma2", True),
        ("gemma3", True),
        ("mixtral", False),
        ("qwen2_moe", False),
        ("qwen3_moe", True),
        ("olmoe", False),
        ("granite_moe", True),
    ],
)
def test_f32_logits_match_transformers(family, tie, tmp_path):
    hf = tiny_hf_model(family, tie=tie)
    path = to_gguf(hf, tmp_path / "m.gguf")
    model = load_model(path)
    assert model.config.tie_word_embeddings == tie
    if family in ("llama3", "llama_linear"):
        assert (model.config.rope_type, model.config.rope_factor) == (
            {"llama3": ("llama3", 8.0), "llama_linear": ("linear", 2.5)}[family]
        )
    ids = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 0, 299]
    torch.testing.assert_close(osd_logits(model, ids), hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_0, T.Q4_1, T.F16, T.BF16], ids=lambda t: t.name)
def test_quantized_file_matches_transformers_with_dequantized_weights(t, tmp_path):
    hf = tiny_hf_model("llama", tie=t == T.Q4_1, seed=3)
    path = to_gguf(hf, tmp_path / "m.gguf", t)
    want = dequantized_copy(hf, t)
    ids = [1, 2, 3, 200, 150, 42, 42, 9]
    torch.testing.assert_close(
        osd_logits(load_model(path), ids), hf_logits(want, ids), atol=ATOL, rtol=0
    )


def test_quantized_moe_file_keeps_its_linear_layers_quantized(tmp_path):
    """A Qwen2-MoE file in Q8_0 with ``quantized=True``: attention, the shared expert and the
    head stay in their blocks (the routed experts, F32 in the file, stay float); logits
    equal the dequantized model's, and speculative greedy equals plain."""
    hf = tiny_hf_model("qwen2_moe", seed=6)
    path = to_gguf(hf, tmp_path / "m.gguf", T.Q8_0)
    quant, plain = load_model(path, quantized=True), load_model(path)
    kept = [n for n, m in quant.named_modules() if isinstance(m, QuantLinear)]
    assert {n.split(".")[-1] for n in kept} == {
        "wqkv",
        "wo",
        "shared_gate_up",
        "shared_down",
        "lm_head",
    }
    ids = [1, 2, 3, 200, 150, 42, 42, 9]
    torch.testing.assert_close(osd_logits(quant, ids), osd_logits(plain, ids), atol=ATOL, rtol=0)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want = osd.Engine(plain, max_batch_size=2, max_seq_len=64).generate(
        prompts, osd.SamplingParams(16)
    )
    got = osd.Engine(
        quant,
        draft=load_model(tiny_hf_model("qwen3_moe", seed=7)),
        max_batch_size=2,
        max_seq_len=64,
        spec=osd.SpecConfig(num_draft_tokens=3),
    ).generate(prompts, osd.SamplingParams(16))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_dtype_and_directory_loading(tmp_path):
    hf = tiny_hf_model("llama", seed=4)
    to_gguf(hf, tmp_path / "weights.gguf", T.Q8_0)
    fp32 = load_model(tmp_path)  # a directory holding one .gguf
    bf16 = load_model(tmp_path / "weights.gguf", dtype=torch.bfloat16)
    for (name, a), (_, b) in zip(fp32.named_parameters(), bf16.named_parameters()):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), name


def test_engine_from_pretrained_generates_like_transformers(tmp_path):
    hf = tiny_hf_model("llama", seed=5)
    to_gguf(hf, tmp_path / "m.gguf", extra=bpe_metadata(trained_bpe()))
    engine = osd.Engine.from_pretrained(str(tmp_path), max_batch_size=2, max_seq_len=64)
    assert engine.tokenizer is not None
    prompt = engine.tokenizer.encode("def fibonacci(n):")
    out = engine.generate([prompt], osd.SamplingParams(max_new_tokens=8))[0]
    ids = list(prompt)
    for _ in range(len(out.token_ids)):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
        if ids[-1] == 2:
            break
    assert out.token_ids == ids[len(prompt) :]


# -- the real model -----------------------------------------------------------------------
@pytest.mark.skipif(
    zoo_chat.cached_target() is None, reason="SmolLM2 GGUF not cached; run osd.zoo.chat_pair() once"
)
@pytest.mark.slow
def test_smollm2_real_greedy_matches_transformers():
    """osd's greedy answer on a chat prompt equals transformers' LlamaForCausalLM holding
    the same dequantized weights, and is the right answer."""
    path = zoo_chat.cached_target()
    g = GGUFFile(path)
    model = load_model(path)
    tok = load_tokenizer(path)
    cfg = model.config
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            tie_word_embeddings=True,
            max_position_embeddings=cfg.max_position_embeddings,
        )
    ).eval()
    keys, get = gguf.open_gguf_weights(g, cfg)
    missing, unexpected = hf.load_state_dict({k: get(k) for k in keys}, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    [prompt] = apply_chat_template(
        tok, [[{"role": "user", "content": "What is the capital of France?"}]]
    )
    engine = osd.Engine(model, tokenizer=tok, max_batch_size=1, max_seq_len=256)
    out = engine.generate([prompt], osd.SamplingParams(max_new_tokens=16))[0]
    with torch.no_grad():
        want = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )[0, len(prompt) :].tolist()
    assert out.token_ids == want
    assert "Paris" in out.text
