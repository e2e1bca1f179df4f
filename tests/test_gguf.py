"""GGUF loading against transformers and against straightforward per-block references.

Tiny random transformers models are converted to GGUF here the way llama.cpp's converter
does it (its llama.cpp tensor names, its Q/K row permutation), then loaded with osd:
F32 logits match transformers to 1e-4, and quantized files match transformers holding the
dequantized weights. Every block type's dequantizer equals a per-block loop written from
ggml's C code, and the quantizers equal ggml's reference quantizers byte for byte.
"""

import math
import struct

import numpy as np
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
from osd.models.gguf import GGMLType, GGUFFile, dequantize, quantize, write_gguf
from osd.models.loading import load_model, load_tokenizer
from osd.zoo import chat as zoo_chat
from osd.chat import apply_chat_template
from tests.test_gguf_tokenizer import bpe_metadata, trained_bpe

T = GGMLType
ATOL = 1e-4
VOCAB = 300


# -- tiny models and the llama.cpp-style conversion ---------------------------------------
def tiny_hf_model(family: str = "llama", *, tie: bool = False, seed: int = 0):
    """A random 2-layer model: hidden 64, 4 heads, 2 KV heads (head dim 16), SwiGLU 96,
    vocab 300. Rows are whole 32-blocks so every type can quantize them."""
    common = dict(
        vocab_size=VOCAB,
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
        from tests.test_models import GRANITE

        model = GraniteForCausalLM(GraniteConfig(**GRANITE, **common))
    elif family == "olmo2":
        model = Olmo2ForCausalLM(Olmo2Config(**common))
    elif family.startswith("phi3"):  # longrope: short factors up to 128 of 256 positions
        from tests.test_models import phi3_config

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
        from tests.test_models import GRANITE

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
    import copy

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


# -- reference dequantizers and quantizers (one block at a time, after ggml's C code) -----
K_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)  # 256-weight super-blocks
SUPER_TYPES = (*K_TYPES, T.IQ4_XS)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _h(b, i):
    return np.float32(np.frombuffer(bytes(b[i : i + 2]), np.float16)[0])


def _ref_block(b, t):
    f32 = np.float32
    y = np.zeros(256 if t in SUPER_TYPES else 32, np.float32)
    if t == T.Q8_0:
        d = _h(b, 0)
        for j in range(32):
            y[j] = f32(b[2 + j] - 256 if b[2 + j] > 127 else b[2 + j]) * d
    elif t in (T.Q4_0, T.Q4_1):
        d, qs = _h(b, 0), b[2:] if t == T.Q4_0 else b[4:]
        for j in range(16):
            if t == T.Q4_0:
                y[j], y[j + 16] = f32((qs[j] & 0xF) - 8) * d, f32((qs[j] >> 4) - 8) * d
            else:
                m = _h(b, 2)
                y[j], y[j + 16] = f32(qs[j] & 0xF) * d + m, f32(qs[j] >> 4) * d + m
    elif t in (T.Q5_0, T.Q5_1):
        d = _h(b, 0)
        qh = struct.unpack("<I", bytes(b[2:6] if t == T.Q5_0 else b[4:8]))[0]
        qs = b[6:] if t == T.Q5_0 else b[8:]
        for j in range(16):
            xh0 = ((qh >> j) << 4) & 0x10
            xh1 = (qh >> (j + 12)) & 0x10
            x0, x1 = (qs[j] & 0xF) | xh0, (qs[j] >> 4) | xh1
            if t == T.Q5_0:
                y[j], y[j + 16] = f32(x0 - 16) * d, f32(x1 - 16) * d
            else:
                m = _h(b, 2)
                y[j], y[j + 16] = f32(x0) * d + m, f32(x1) * d + m
    elif t in (T.Q4_K, T.Q5_K):
        d, dmin, sc = _h(b, 0), _h(b, 2), b[4:16]
        q, qh = (b[16:144], None) if t == T.Q4_K else (b[48:176], b[16:48])

        def scale_min(j):
            if j < 4:
                return sc[j] & 63, sc[j + 4] & 63
            return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | (
                (sc[j] >> 6) << 4
            )

        out, qi, is_ = 0, 0, 0
        for _ in range(0, 256, 64):
            s, m = scale_min(is_)
            d1, m1 = d * f32(s), dmin * f32(m)
            s, m = scale_min(is_ + 1)
            d2, m2 = d * f32(s), dmin * f32(m)
            u1, u2 = 1 << is_, 2 << is_  # Q5_K: the fifth bits of this 64
            for lane in range(32):
                h = 16 if qh is not None and qh[lane] & u1 else 0
                y[out + lane] = d1 * f32((q[qi + lane] & 0xF) + h) - m1
            for lane in range(32):
                h = 16 if qh is not None and qh[lane] & u2 else 0
                y[out + 32 + lane] = d2 * f32((q[qi + lane] >> 4) + h) - m2
            out, qi, is_ = out + 64, qi + 32, is_ + 2
    elif t == T.Q2_K:
        sc, q, d, dmin = b[0:16], b[16:80], _h(b, 80), _h(b, 82)
        out, is_ = 0, 0
        for qi in (0, 32):
            for shift in (0, 2, 4, 6):
                for part in (0, 16):
                    dl, ml = d * f32(sc[is_] & 0xF), dmin * f32(sc[is_] >> 4)
                    for lane in range(16):
                        y[out + lane] = dl * f32((q[qi + part + lane] >> shift) & 3) - ml
                    out, is_ = out + 16, is_ + 1
    elif t == T.Q3_K:
        hm, q, raw, d = b[0:32], b[32:96], b[96:108], _h(b, 108)
        aux = list(struct.unpack("<3I", bytes(raw))) + [0]
        k1, k2, tmp = 0x03030303, 0x0F0F0F0F, aux[2]
        aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4)
        aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4)
        aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4)
        aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4)
        scales = np.frombuffer(struct.pack("<4I", *aux), np.int8)
        out, is_, m = 0, 0, 1
        for qi in (0, 32):
            for shift in (0, 2, 4, 6):
                for part in (0, 16):
                    dl = d * f32(int(scales[is_]) - 32)
                    for lane in range(16):
                        low = (q[qi + part + lane] >> shift) & 3
                        y[out + lane] = dl * f32(low - (0 if hm[part + lane] & m else 4))
                    out, is_ = out + 16, is_ + 1
                m <<= 1
    elif t == T.Q6_K:
        ql, qh = b[0:128], b[128:192]
        sc = np.frombuffer(bytes(b[192:208]), np.int8)
        d = _h(b, 208)
        for half in range(2):
            o, L, H, S = half * 128, half * 64, half * 32, half * 8
            for lane in range(32):
                is_ = lane // 16
                q1 = ((ql[L + lane] & 0xF) | (((qh[H + lane] >> 0) & 3) << 4)) - 32
                q2 = ((ql[L + lane + 32] & 0xF) | (((qh[H + lane] >> 2) & 3) << 4)) - 32
                q3 = ((ql[L + lane] >> 4) | (((qh[H + lane] >> 4) & 3) << 4)) - 32
                q4 = ((ql[L + lane + 32] >> 4) | (((qh[H + lane] >> 6) & 3) << 4)) - 32
                y[o + lane] = d * f32(sc[S + is_]) * f32(q1)
                y[o + lane + 32] = d * f32(sc[S + is_ + 2]) * f32(q2)
                y[o + lane + 64] = d * f32(sc[S + is_ + 4]) * f32(q3)
                y[o + lane + 96] = d * f32(sc[S + is_ + 6]) * f32(q4)
    elif t == T.IQ4_NL:
        d, qs = _h(b, 0), b[2:18]
        for j in range(16):
            y[j] = d * f32(IQ4_VALUES[qs[j] & 0xF])
            y[j + 16] = d * f32(IQ4_VALUES[qs[j] >> 4])
    elif t == T.IQ4_XS:
        d, scales_h = _h(b, 0), struct.unpack("<H", bytes(b[2:4]))[0]
        scales_l, qs = b[4:8], b[8:136]
        for ib in range(8):
            ls = ((scales_l[ib // 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)
            dl = d * f32(ls - 32)
            for j in range(16):
                y[32 * ib + j] = dl * f32(IQ4_VALUES[qs[16 * ib + j] & 0xF])
                y[32 * ib + j + 16] = dl * f32(IQ4_VALUES[qs[16 * ib + j] >> 4])
    else:
        raise ValueError(t)
    return y


def ref_dequantize(raw: np.ndarray, t) -> np.ndarray:
    size = gguf.BLOCK_LAYOUT[t][1]
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1, size)
    return np.concatenate([_ref_block(row.tobytes(), t) for row in raw])


def _roundf(v: np.float32) -> int:
    return int(math.copysign(math.floor(abs(float(v)) + 0.5), float(v)))


def ref_quantize(x: np.ndarray, t) -> bytes:
    """ggml's quantize_row_{q8_0,q4_0,q4_1,q5_0,q5_1}_ref, one block at a time in float32."""
    f32, out = np.float32, b""
    for blk in np.asarray(x, np.float32).reshape(-1, 32):
        if t == T.Q8_0:
            amax = max(abs(v) for v in blk)
            d = f32(amax) / f32(127)
            inv = f32(1) / d if d else f32(0)
            q = [_roundf(v * inv) for v in blk]
            out += np.float16(d).tobytes() + np.array(q, np.int8).tobytes()
            continue
        five = t in (T.Q5_0, T.Q5_1)
        if t in (T.Q4_0, T.Q5_0):
            amax, mx = f32(0), f32(0)
            for v in blk:
                if amax < abs(v):
                    amax, mx = abs(v), v
            d = mx / f32(-16 if five else -8)
            inv = f32(1) / d if d else f32(0)
            q = [min(31 if five else 15, int(v * inv + f32(16.5 if five else 8.5))) for v in blk]
            head = np.float16(d).tobytes()
        else:
            lo, hi = min(blk), max(blk)
            d = (hi - lo) / f32(31 if five else 15)
            inv = f32(1) / d if d else f32(0)
            q = [min(31 if five else 15, int((v - lo) * inv + f32(0.5))) for v in blk]
            head = np.float16(d).tobytes() + np.float16(lo).tobytes()
        if five:
            qh = sum(((q[j] & 0x10) >> 4) << j for j in range(32))
            head += struct.pack("<I", qh)
        out += head + bytes((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4) for j in range(16))
    return out


def random_blocks(t, n: int, seed: int = 0) -> np.ndarray:
    """``n`` random blocks of type ``t`` with finite fp16 scale fields."""
    rng = np.random.default_rng(seed)
    size = gguf.BLOCK_LAYOUT[t][1]
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    halves = {
        T.Q8_0: [0],
        T.Q4_0: [0],
        T.Q5_0: [0],
        T.Q4_1: [0, 2],
        T.Q5_1: [0, 2],
        T.Q2_K: [80, 82],
        T.Q3_K: [108],
        T.Q4_K: [0, 2],
        T.Q5_K: [0, 2],
        T.Q6_K: [208],
        T.IQ4_NL: [0],
        T.IQ4_XS: [0],
    }[t]
    for at in halves:
        b[:, at : at + 2] = rng.uniform(-2, 2, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return b.reshape(-1)


# -- tests ----------------------------------------------------------------------------------
BLOCK_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, *SUPER_TYPES]


@pytest.mark.parametrize("t", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_per_block_reference(t):
    n = 7 if t in SUPER_TYPES else 21
    raw = random_blocks(t, n, seed=int(t))
    per_row = gguf.BLOCK_LAYOUT[t][0] * (1 if t in SUPER_TYPES else 3)
    shape = (n * gguf.BLOCK_LAYOUT[t][0] // per_row, per_row)
    got = dequantize(torch.from_numpy(raw.copy()), t, shape)
    want = torch.from_numpy(ref_dequantize(raw, t)).reshape(shape)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, want)
    half = dequantize(torch.from_numpy(raw.copy()), t, shape, torch.bfloat16)
    assert torch.equal(half, want.to(torch.bfloat16))


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_quantize_matches_ggml_reference(t):
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)) * 3
    x[0, :32] = 0.0  # an all-zero block: d = 0
    x[1, 32:64] = 1.5  # a constant block
    raw = quantize(x, t)
    assert raw.tobytes() == ref_quantize(x.numpy(), t)
    back = torch.from_numpy(ref_dequantize(raw, t)).reshape(-1, 32)
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(1, keepdim=True)
    # Worst error in steps: half a step (Q4_0, Q5_0: a whole one, the end at +8 / +16 is
    # clamped), plus the fp16 rounding of d (and of Q4_1's and Q5_1's minimum).
    spread = blocks.amax(1, True) - blocks.amin(1, True)
    step, steps = {
        T.Q8_0: (amax / 127, 0.5),
        T.Q4_0: (amax / 8, 1.0),
        T.Q4_1: (spread / 15, 0.5),
        T.Q5_0: (amax / 16, 1.0),
        T.Q5_1: (spread / 31, 0.5),
    }[t]
    assert ((back - blocks).abs() <= step * (steps + 0.1) + amax * 2**-10).all()


@pytest.mark.parametrize("t", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_types_round_trip(t):
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    raw = torch.from_numpy(quantize(x, t).copy())
    want = {T.F32: x, T.F16: x.half().float(), T.BF16: x.bfloat16().float()}[t]
    assert torch.equal(dequantize(raw, t, (3, 40)), want)


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
    from osd.models.quant import QuantLinear

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


def test_written_numpy_arrays_keep_their_element_type(tmp_path):
    """``write_gguf`` stores a numpy array with its dtype (llama.cpp reads token_type only
    as int32), a list of ints as u32."""
    meta = {
        "general.architecture": "llama",
        "i32": np.array([2, -3, 7], dtype=np.int32),
        "f32": np.array([0.5, -1.0], dtype=np.float32),
        "u8": np.array([1, 255], np.uint8),
        "ints": [1, 2, 3],
    }
    write_gguf(tmp_path / "a.gguf", meta, {})
    raw = (tmp_path / "a.gguf").read_bytes()
    for key, etype in (("i32", 5), ("f32", 6), ("u8", 0), ("ints", 4)):
        at = raw.index(key.encode()) + len(key)
        assert struct.unpack_from("<II", raw, at) == (9, etype), key  # array of etype
    back = GGUFFile(tmp_path / "a.gguf").metadata
    assert back["i32"].tolist() == [2, -3, 7] and back["f32"].tolist() == [0.5, -1.0]
    assert back["u8"].tolist() == [1, 255] and list(back["ints"]) == [1, 2, 3]


def test_metadata_value_types_and_alignment(tmp_path):
    """A hand-packed file with every metadata value type and a 64-byte alignment."""

    def s(x):
        return struct.pack("<Q", len(x.encode())) + x.encode()

    kv = [
        ("general.architecture", 8, s("llama")),
        ("u8", 0, struct.pack("<B", 200)),
        ("i8", 1, struct.pack("<b", -5)),
        ("u16", 2, struct.pack("<H", 60000)),
        ("i16", 3, struct.pack("<h", -300)),
        ("u32", 4, struct.pack("<I", 4000000000)),
        ("i32", 5, struct.pack("<i", -7)),
        ("f32", 6, struct.pack("<f", 0.5)),
        ("bool", 7, struct.pack("<?", True)),
        ("u64", 10, struct.pack("<Q", 2**40)),
        ("i64", 11, struct.pack("<q", -(2**40))),
        ("f64", 12, struct.pack("<d", 0.1)),
        ("general.alignment", 4, struct.pack("<I", 64)),
        ("arr_i16", 9, struct.pack("<IQ", 3, 3) + struct.pack("<3h", -1, 0, 1)),
        ("arr_str", 9, struct.pack("<IQ", 8, 2) + s("a b") + s("ü")),
        ("arr_arr", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 1) + struct.pack("<I", 9)),
    ]
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kv))
    header += b"".join(s(k) + struct.pack("<I", t) + v for k, t, v in kv)
    header += s("w") + struct.pack("<I", 2) + struct.pack("<2Q", 4, 2) + struct.pack("<IQ", 0, 0)
    data = np.arange(8, dtype=np.float32).tobytes()
    path = tmp_path / "types.gguf"
    path.write_bytes(header + b"\0" * (-len(header) % 64) + data)
    g = GGUFFile(path)
    m = g.metadata
    assert (m["u8"], m["i8"], m["u16"], m["i16"], m["u32"], m["i32"]) == (
        200,
        -5,
        60000,
        -300,
        4000000000,
        -7,
    )
    assert (m["f32"], m["bool"], m["u64"], m["i64"], m["f64"]) == (0.5, True, 2**40, -(2**40), 0.1)
    assert m["arr_i16"].tolist() == [-1, 0, 1] and m["arr_str"] == ["a b", "ü"]
    assert m["arr_arr"][0].tolist() == [9]
    assert g.data_start % 64 == 0 and g.tensors["w"].shape == (2, 4)
    assert torch.equal(g.tensor("w"), torch.arange(8.0).reshape(2, 4))


# -- errors ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    return to_gguf(
        tiny_hf_model("llama", seed=6), tmp_path_factory.mktemp("good") / "m.gguf", T.Q4_0
    )


def test_missing_and_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "absent.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(bad)
    bad.write_bytes(b"GG")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(bad)
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(ValueError, match="unsupported GGUF version 1"):
        load_model(bad)


def test_truncated_files(good_file, tmp_path):
    data = good_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    in_infos = data.index(b"blk.1.ffn_up.weight") + 5
    for size, where in (
        (40, "the header ends"),
        (in_infos, "the header ends"),
        (len(data) - 100, "tensor"),
    ):
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError, match=f"truncated GGUF file.*{where}"):
            load_model(cut)


def test_unsupported_architecture_and_quantization(good_file, tmp_path):
    data = good_file.read_bytes()
    other = tmp_path / "falcon.gguf"
    other.write_bytes(
        data.replace(
            b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00gpt-2", 1
        )
    )
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt-2'.*llama"):
        load_model(other)
    # Re-type one tensor as IQ2_XXS: its type field follows the name, n_dims and the dims.
    name = b"blk.1.ffn_up.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8
    assert struct.unpack_from("<I", data, at)[0] == T.Q4_0
    iq = tmp_path / "iq2_xxs.gguf"
    iq.write_bytes(data[:at] + struct.pack("<I", T.IQ2_XXS) + data[at + 4 :])
    with pytest.raises(ValueError, match="'blk.1.ffn_up.weight' has quantization type IQ2_XXS"):
        load_model(iq)
    iq.write_bytes(data[:at] + struct.pack("<I", 99) + data[at + 4 :])
    with pytest.raises(ValueError, match="unknown type 99"):
        load_model(iq)


def test_missing_metadata_tensor_and_ambiguous_directory(tmp_path):
    hf = tiny_hf_model("llama", seed=7)
    to_gguf(hf, tmp_path / "a.gguf", skip=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match="missing 1 tensors: model.layers.1.mlp.down_proj"):
        load_model(tmp_path / "a.gguf")
    to_gguf(hf, tmp_path / "b.gguf", extra={"llama.block_count": None})
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="no metadata llama.block_count"):
        load_model(tmp_path / "b.gguf")


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
