"""A GGUF checkpoint in our terms: the :class:`~osd.models.config.ModelConfig` its
metadata describes and its tensors under the Hugging Face names that
:func:`osd.models.hf_weights.load_hf_state_dict` fills.

Names map one to one (:func:`hf_name`), with one numerical change: llama.cpp's converter
reorders the rows of every Llama ``attn_q``/``attn_k`` weight (per head, from rotate-half
to interleaved RoPE pairs), and :func:`unpermute_rope_rows` undoes that so our RoPE (the
Hugging Face convention) applies. The metadata keys are read as llama.cpp reads them
(:func:`config_from_gguf`), including the RoPE factor tables some files store as tensors.

Imports from osd: the format layer (:mod:`osd.models.gguf.format`,
:mod:`osd.models.gguf.blocks`) and :mod:`osd.models.config`, both free of the model, so
:mod:`osd.models.quant` can use the architecture table and the row order from here.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from osd.models.config import ModelConfig
from osd.models.gguf.blocks import BLOCK_LAYOUT
from osd.models.gguf.format import GGUFFile, unsupported_type_message

# general.architecture -> (our architecture, whether Q/K rows carry llama.cpp's RoPE permutation).
# Mistral checkpoints are converted as "llama"; Qwen2's converter keeps the HF row order.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "granite": ("GraniteForCausalLM", True),
    "olmo2": ("Olmo2ForCausalLM", False),
    "phi3": ("Phi3ForCausalLM", False),
    "smollm3": ("SmolLM3ForCausalLM", True),
    "gemma2": ("Gemma2ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False),
    "olmoe": ("OlmoeForCausalLM", False),
    "granitemoe": ("GraniteMoeForCausalLM", True),
}
# Granite's scalars: GGUF key (after "granite.") -> transformers config name.
_GRANITE_SCALARS = {
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
}


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Llama Q/K row order.

    The converter stores ``w.reshape(n_heads, 2, d // 2, ...).swapaxes(1, 2)`` (``d`` the
    head dim): each head's rows go from rotate-half order (all first halves, then all
    second halves) to interleaved pairs. This is the inverse: [n_heads * d, ...] rows of
    one projection weight (or bias), ``n_heads`` being that projection's head count.
    """
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Experts stacked [E, rows, K] in the file, as transformers holds them: gate and up become
# one [E, 2I, H] tensor (each expert's gate rows, then its up rows).
_EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.gate_up_proj",
    "ffn_up_exps": None,
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Per architecture, layer tensors whose name means something else there: Phi-3's ffn_up
# holds the gate and up projections stacked; Gemma's ffn_norm is the norm before the MLP
# (its post_attention_norm is the one on attention's output).
_ARCH_LAYER_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors that carry no weights of ours: precomputed RoPE factors (read into the config).
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a llama.cpp tensor name in a file of architecture ``arch``
    (unknown names come back as is, so the loader reports them as unexpected)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return gguf_name


def config_from_gguf(g: GGUFFile, *, attention_backend: str = "auto") -> ModelConfig:
    """The :class:`ModelConfig` the metadata of ``g`` describes (ValueError when the
    architecture is not one of :data:`ARCHITECTURES` or a required key is missing)."""
    arch = g.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {str(g.path)!r}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    meta = g.metadata

    def key(name: str, default=None, required: bool = False):
        value = meta.get(f"{arch}.{name}", default)
        if required and value is None:
            raise ValueError(f"GGUF file {str(g.path)!r} has no metadata {arch}.{name}")
        return value

    heads = int(key("attention.head_count", required=True))
    hidden = int(key("embedding_length", required=True))
    head_dim = int(key("attention.key_length", hidden // heads))
    embed = g.tensors.get("token_embd.weight")
    vocab = (
        (embed.shape[0] if embed else None)
        or key("vocab_size")
        or len(meta.get("tokenizer.ggml.tokens", ()))
    )
    experts = int(key("expert_count", 0) or 0)
    hf: dict[str, Any] = {
        "architectures": [
            "MixtralForCausalLM" if arch == "llama" and experts else ARCHITECTURES[arch][0]
        ],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", required=True)),
        "num_hidden_layers": int(key("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": arch not in ("qwen2", "qwen2moe") and "blk.0.attn_q.bias" in g.tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in g.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": sorted(
            {
                int(meta[k])
                for k in (
                    "tokenizer.ggml.eos_token_id",
                    "tokenizer.ggml.eot_token_id",
                    "tokenizer.ggml.eom_token_id",
                )
                if meta.get(k) is not None
            }
        ),
    }
    if arch in ("gemma2", "gemma3"):
        # llama.cpp's reading of gemma2/gemma3 files: GeGLU, every second (gemma2) or sixth
        # (gemma3) layer global, gemma3's sliding layers' RoPE base 10,000 unless stored,
        # queries scaled by the head width (by hidden / heads in the 27B models: 46 and 62
        # layers)
        big = hf["num_hidden_layers"] == (46 if arch == "gemma2" else 62)
        hf.update(
            {
                "hidden_activation": "gelu_pytorch_tanh",
                "sliding_window_pattern": 2 if arch == "gemma2" else 6,
                "query_pre_attn_scalar": hidden // heads if big else head_dim,
                "final_logit_softcapping": key("final_logit_softcapping"),
                "attn_logit_softcapping": key("attn_logit_softcapping"),
            }
        )
        if arch == "gemma3":
            hf["rope_local_base_freq"] = float(key("rope.freq_base_swa", 10000.0))
    if arch in ("granite", "granitemoe"):
        hf.update(
            {name: float(key(k)) for k, name in _GRANITE_SCALARS.items() if key(k) is not None}
        )
    # llama.cpp's routing: Qwen2-MoE's top-k weights as they are, others' summing to 1
    if experts:
        hf.update(
            {
                "num_experts": experts,
                "num_experts_per_tok": int(key("expert_used_count", required=True)),
                "moe_intermediate_size": int(
                    key("expert_feed_forward_length", hf["intermediate_size"])
                ),
                "shared_expert_intermediate_size": int(
                    key("expert_shared_feed_forward_length", 0) or 0
                ),
                "norm_topk_prob": arch not in ("qwen2moe", "olmoe"),
            }
        )
    scaling = key("rope.scaling.type", "none")
    if scaling == "linear":
        hf["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(key("rope.scaling.factor", 1.0)),
        }
    elif scaling not in ("none", None):
        raise ValueError(
            f"unsupported RoPE scaling {scaling!r} in {str(g.path)!r}; "
            "supported: none, linear, llama3 (rope_freqs)"
        )
    rope_dims = key("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        hf["partial_rotary_factor"] = int(rope_dims) / head_dim
    if key("attention.sliding_window"):  # 0: none (Phi-4-mini)
        hf["sliding_window"] = int(key("attention.sliding_window"))
    if "rope_factors_short.weight" in g.tensors:  # LongRoPE (Phi-3.5, Phi-4-mini)
        hf["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": g.tensor("rope_factors_short.weight").tolist(),
            "long_factor": g.tensor("rope_factors_long.weight").tolist(),
            "original_max_position_embeddings": int(
                key("rope.scaling.original_context_length", hf["max_position_embeddings"])
            ),
            "attention_factor": key("rope.scaling.attn_factor"),
        }
    if "rope_freqs.weight" in g.tensors:
        hf["rope_scaling"] = _llama3_rope(
            g.tensor("rope_freqs.weight").double(), hf["rope_theta"], hf["head_dim"], g.path
        )
    try:
        return ModelConfig.from_hf(hf, attention_backend=attention_backend)
    except ValueError as exc:
        raise ValueError(f"GGUF file {str(g.path)!r}: {exc}") from None


def llama3_rope_factors(
    theta: float,
    head_dim: int,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_positions: int,
) -> torch.Tensor:
    """The per-frequency divisors llama.cpp stores as ``rope_freqs.weight`` for Llama-3
    RoPE scaling: float64 [head_dim // 2]."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original_max_positions / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    mid = 1 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen < original_max_positions / high_freq_factor, 1.0, mid)
    return torch.where(wavelen > original_max_positions / low_freq_factor, factor, out)


def _llama3_rope(stored: torch.Tensor, theta: float, head_dim: int, path) -> dict:
    """Llama-3 RoPE parameters that reproduce the stored factors. The file keeps only the
    factors; the common parameters (low 1, high 4, 8192 positions, as in every Llama-3.x
    release) are tried with the stored maximum as the scaling factor."""
    factor = float(stored.max())
    params = dict(
        factor=factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_positions=8192
    )
    if stored.shape == (head_dim // 2,) and torch.allclose(
        llama3_rope_factors(theta, head_dim, **params), stored, rtol=1e-5, atol=1e-6
    ):
        return {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    raise ValueError(
        f"GGUF file {str(path)!r}: rope_freqs.weight does not match Llama-3 RoPE "
        "scaling with low_freq_factor 1, high_freq_factor 4 and 8192 original "
        "positions; other RoPE factor tables are not supported"
    )


def open_gguf_weights(
    g: GGUFFile,
    config: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
):
    """``(keys, get)`` over the Hugging Face names of ``g``'s weights, for
    :func:`osd.models.hf_weights.load_hf_state_dict`: ``get`` dequantizes one tensor (on
    ``device``, to ``dtype``) and restores the Q/K row order. Unsupported quantization
    types raise ValueError up front, naming the type."""
    bad = [info for info in g.tensors.values() if info.type not in BLOCK_LAYOUT]
    if bad:
        raise ValueError(
            f"GGUF file {str(g.path)!r}: {unsupported_type_message(bad[0])}"
            + (f" ({len(bad)} such tensors)" if len(bad) > 1 else "")
        )
    permuted = ARCHITECTURES[g.architecture][1]
    names, experts = {}, {}
    for n in g.tensors:
        m = _LAYER_RE.fullmatch(n)
        if m and m.group(2) in _EXPERT_NAMES:
            if _EXPERT_NAMES[m.group(2)] is not None:
                experts[f"model.layers.{m.group(1)}.{_EXPERT_NAMES[m.group(2)]}"] = n
        elif n not in _CONFIG_TENSORS:
            names[hf_name(n, g.architecture)] = n

    def get(key: str) -> torch.Tensor:
        if key in experts:
            name = experts[key]
            w = g.tensor(name, dtype=dtype, device=device)
            if name.endswith("ffn_gate_exps.weight"):
                up = g.tensor(
                    name.replace("ffn_gate_exps", "ffn_up_exps"), dtype=dtype, device=device
                )
                w = torch.cat((w, up), dim=1)
            return w
        name = names[key]
        w = g.tensor(name, dtype=dtype, device=device)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            w = w.reshape(1, -1)  # stored as [hidden]
        if permuted and ".attn_q." in name:
            w = unpermute_rope_rows(w, config.num_heads)
        elif permuted and ".attn_k." in name:
            w = unpermute_rope_rows(w, config.num_kv_heads)
        return w

    return set(names) | set(experts), get
