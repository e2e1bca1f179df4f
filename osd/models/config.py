"""``ModelConfig``: the few numbers our decoder needs, parsed from a Hugging Face config.

Accepts a ``config.json`` dict (old style ``rope_theta`` / ``rope_scaling`` or the newer
``rope_parameters``) or a transformers config object. Only Llama-family decoders are
supported: see :data:`SUPPORTED_ARCHITECTURES`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
    "Phi3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "GraniteMoeForCausalLM",
)
# Mixture-of-experts decoders: routed SwiGLU experts in place of the MLP.
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "GraniteMoeForCausalLM",
)

# model_type -> architecture, for configs that do not list ``architectures``.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
}

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)

ROPE_TYPES = ("default", "linear", "llama3", "longrope")

QK_NORMS = ("none", "head", "full")

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gate's activation: SwiGLU, GeGLU (Gemma)

# Multimodal checkpoints whose language model we load on its own: wrapper -> text model.
TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}

ATTENTION_BACKENDS = ("auto", "reference", "native", "triton", "flash")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, Llama-3, Mistral, Qwen2, Qwen3,
    Granite, OLMo-2, Phi-3, SmolLM3, Gemma 2, Gemma 3; Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
    Granite-MoE)."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int  # rows of the embedding and of the LM head
    hidden_size: int  # model width
    intermediate_size: int  # SwiGLU width
    num_layers: int  # decoder blocks
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention)
    head_dim: int  # per-head width (may differ from hidden / heads)
    rms_norm_eps: float = 1e-6  # epsilon inside every RMSNorm
    rope_theta: float = 10000.0  # RoPE base
    rope_type: str = "default"  # one of ROPE_TYPES
    rope_factor: float = 1.0  # "linear" and "llama3": frequency division factor
    rope_low_freq_factor: float = 1.0  # "llama3" only
    rope_high_freq_factor: float = 4.0  # "llama3" only
    rope_original_max_positions: int = 8192  # "llama3", "longrope": pre-training context
    # "longrope" (Phi-3.5, Phi-4-mini): per-frequency divisors [rotary_dim / 2] for contexts
    # of up to rope_original_max_positions (short) and longer ones (long), and the factor on
    # cos and sin
    rope_short_factor: tuple[float, ...] = ()
    rope_long_factor: tuple[float, ...] = ()
    rope_attention_factor: float = 1.0
    rotary_dim: int | None = None  # leading dims of each head that RoPE rotates (None: all)
    nope_layers: tuple[int, ...] = ()  # decoder layers whose attention has no RoPE (SmolLM3)
    max_position_embeddings: int = 2048  # the context the checkpoint was trained for
    tie_word_embeddings: bool = False  # LM head shares the embedding matrix
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama attention_bias)
    mlp_bias: bool = False  # bias on gate/up/down (Llama mlp_bias)
    qk_norm: str = "none"  # RMSNorm on queries and keys before RoPE: "head" over
    #                                   each head (Qwen3), "full" over each token's whole
    #                                   projection (OLMo-2), one of QK_NORMS
    pre_norm: bool = True  # norms on each block's input, x + block(norm(x))
    post_norm: bool = False  # norms on each block's output, x + norm(block(x))
    #                                   (OLMo-2: post only; Gemma 3: both)
    hidden_act: str = "silu"  # the MLP gate's activation, one of ACTIVATIONS
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers (Gemma 3;
    #                                        None: rope_theta, with the global scaling)
    attn_logit_softcapping: float | None = None  # scores -> c * tanh(scores / c) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c) (Gemma 2)
    # Granite's scalars: embeddings times embedding_multiplier, each block's output times
    # residual_multiplier before its residual add, attention_multiplier as the softmax scale
    # (None: head_dim ** -0.5), logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    sliding_window: int | None = None  # attention window of the sliding-window layers
    window_layers: tuple[int, ...] | None = None  # the layers with the window (None: all)
    # Mixture of experts (Mixtral, Qwen-MoE): each token's MLP is the weighted sum of the
    # num_experts_per_tok experts its router scores highest (softmax over all experts, the
    # top ones renormalized to sum 1 when norm_topk_prob), plus a shared expert gated by a
    # sigmoid when shared_expert_intermediate_size (Qwen2-MoE).
    num_experts: int = 0  # experts per MoE layer (0: dense MLPs)
    num_experts_per_tok: int = 0  # experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] | None = None  # the layers with experts (None: all)
    eos_token_ids: tuple[int, ...] = ()  # every id that ends a sequence
    bos_token_id: int | None = None
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS (see osd.models.attention)
    prefill_chunk: int = 512  # prefill feeds prompts in pieces of at most this many
    #                                   tokens, so its activations stay bounded (DecoderLM.prefill)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(unsupported_message(self.architecture))
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {self.rope_type!r}; supported: {ROPE_TYPES}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}; expected "
                f"one of {ATTENTION_BACKENDS}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "prefill_chunk",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"config {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        rot = self.rotary_dim
        if rot is not None and not (0 < rot <= self.head_dim and rot % 2 == 0):
            raise ValueError(
                f"rotary_dim must be even and in 1..head_dim ({self.head_dim}), got {rot}"
            )
        if self.rope_type == "longrope" and not (
            len(self.rope_short_factor) == len(self.rope_long_factor) == self.rope_dim // 2
        ):
            raise ValueError(
                f"longrope needs {self.rope_dim // 2} short and long factors, got "
                f"{len(self.rope_short_factor)} and {len(self.rope_long_factor)}"
            )
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            raise ValueError(
                f"nope_layers must index layers 0..{self.num_layers - 1}, got {self.nope_layers}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {ACTIVATIONS}"
            )
        if not (self.pre_norm or self.post_norm):
            raise ValueError("a decoder needs pre_norm or post_norm")
        if isinstance(self.qk_norm, bool):  # the older boolean: per-head norms or none
            object.__setattr__(self, "qk_norm", "head" if self.qk_norm else "none")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if not self.logits_scaling > 0:
            raise ValueError(f"logits_scaling must be > 0, got {self.logits_scaling}")
        if self.num_experts and not (
            0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ValueError(
                f"a mixture of experts needs 1 <= num_experts_per_tok <= "
                f"num_experts ({self.num_experts}) and moe_intermediate_size >= 1, "
                f"got {self.num_experts_per_tok} and {self.moe_intermediate_size}"
            )

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` routes its tokens to experts."""
        return self.num_experts > 0 and (self.moe_layers is None or index in self.moe_layers)

    @property
    def rope_dim(self) -> int:
        """The dims of each head that RoPE rotates (``rotary_dim``, or all of them)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def attention_scale(self) -> float:
        """The softmax scale of attention: ``attention_multiplier`` or ``head_dim ** -0.5``."""
        return self.attention_multiplier or self.head_dim**-0.5

    @property
    def num_parameters(self) -> int:
        """Parameter count of the decoder described by this config."""
        d, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = (
            d * (q + 2 * kv)
            + q * d
            + (q + 2 * kv) * self.qkv_bias
            + d * self.o_bias
            + {"none": 0, "head": 2 * self.head_dim, "full": q + kv}[self.qk_norm]
        )
        mlp = 3 * d * i + (2 * i + d) * self.mlp_bias
        moe = self.num_experts * (d + 3 * d * self.moe_intermediate_size) + (
            3 * self.shared_expert_intermediate_size + 1
        ) * d * bool(self.shared_expert_intermediate_size)
        layers = sum(
            attn + (moe if self.is_moe_layer(n) else mlp) + 2 * d for n in range(self.num_layers)
        )
        return v * d * (1 if self.tie_word_embeddings else 2) + layers + d

    @classmethod
    def from_hf(
        cls,
        config: Mapping[str, Any] | Any,
        *,
        architecture: str | None = None,
        attention_backend: str = "auto",
    ) -> "ModelConfig":
        """Parse a ``config.json`` dict or a transformers ``PretrainedConfig``.

        ``architecture`` overrides the one named in the config (e.g. the class name of an
        in-memory model). Raises ValueError for unsupported architectures, rope types or
        activations.
        """
        d = dict(config) if isinstance(config, Mapping) else config.to_dict()
        arch = architecture or _architecture_of(d)
        if arch in TEXT_MODELS:
            d, arch = text_config(d), TEXT_MODELS[arch]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(unsupported_message(arch))
        missing = [k for k in _REQUIRED if d.get(k) is None]
        if missing:
            raise ValueError(f"config is missing {', '.join(missing)}")
        act = d.get("hidden_act") or d.get("hidden_activation") or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {act!r}: only SwiGLU (silu) and GeGLU "
                f"(gelu_pytorch_tanh) decoders"
            )
        gemma = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
        if gemma:
            d = _gemma(d)
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        rope = _rope_parameters(d)
        head_dim = int(d.get("head_dim") or hidden // heads)
        partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor")) or 1.0)
        original = int(
            rope.get("original_max_position_embeddings")
            or d.get("original_max_position_embeddings")
            or d.get("max_position_embeddings", 8192)
        )
        eos = d.get("eos_token_id")
        eos = [] if eos is None else eos if isinstance(eos, (list, tuple)) else [eos]
        is_qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        is_qwen = arch in (
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
            "SmolLM3ForCausalLM",
            "Qwen2MoeForCausalLM",
            "Qwen3MoeForCausalLM",
        )
        attention_bias = bool(d.get("attention_bias", False))
        window = d.get("sliding_window")
        if is_qwen and not d.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_type=rope.get("rope_type", "default"),
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_positions=original,
            rope_short_factor=tuple(float(f) for f in rope.get("short_factor") or ()),
            rope_long_factor=tuple(float(f) for f in rope.get("long_factor") or ()),
            rope_attention_factor=_longrope_attention_factor(rope, d, original),
            rotary_dim=None if partial == 1.0 else int(head_dim * partial),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm={
                "Qwen3ForCausalLM": "head",
                "Olmo2ForCausalLM": "full",
                "Gemma3ForCausalLM": "head",
                "Qwen3MoeForCausalLM": "head",
                "OlmoeForCausalLM": "full",
            }.get(arch, "none"),
            pre_norm=arch != "Olmo2ForCausalLM",
            post_norm=arch == "Olmo2ForCausalLM" or gemma,
            attn_logit_softcapping=_float_or_none(d.get("attn_logit_softcapping")),
            final_logit_softcapping=_float_or_none(d.get("final_logit_softcapping")),
            hidden_act=act,
            rope_local_theta=d.get("rope_local_base_freq"),
            nope_layers=_nope_layers(d) if arch == "SmolLM3ForCausalLM" else (),
            embedding_multiplier=float(d.get("embedding_multiplier") or 1.0),
            residual_multiplier=float(d.get("residual_multiplier") or 1.0),
            attention_multiplier=None
            if d.get("attention_multiplier") is None
            else float(d["attention_multiplier"]),
            logits_scaling=float(d.get("logits_scaling") or 1.0),
            sliding_window=None if window is None else int(window),
            window_layers=_window_layers(d) if window is not None else None,
            eos_token_ids=tuple(int(e) for e in eos),
            bos_token_id=d.get("bos_token_id"),
            attention_backend=attention_backend,
            **(_moe(d, arch) if arch in MOE_ARCHITECTURES else {}),
        )


def unsupported_message(architecture: str | None) -> str:
    return (
        f"unsupported architecture {architecture!r}; supported architectures: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def text_config(d: Mapping[str, Any]) -> dict:
    """The language model's config inside a multimodal one (:data:`TEXT_MODELS`): its
    ``text_config``, with the token ids and embedding tying of the outer config where the
    inner one lacks them."""
    text = dict(d.get("text_config") or {})
    if not text:
        raise ValueError("multimodal config without a text_config")
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if text.get(key) is None and d.get(key) is not None:
            text[key] = d[key]
    return text


def _architecture_of(d: Mapping[str, Any]) -> str | None:
    archs = d.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if archs:
        return archs[0]
    return _MODEL_TYPES.get(d.get("model_type"), d.get("model_type"))


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)


def _gemma(d: Mapping[str, Any]) -> dict:
    """A Gemma 2 or Gemma 3 text config in the keys :meth:`ModelConfig.from_hf` reads:
    embeddings times ``sqrt(hidden_size)``, attention scale
    ``query_pre_attn_scalar ** -0.5``, the sliding layers from ``layer_types`` or
    ``sliding_window_pattern`` (Gemma 2: every other layer). Gemma 3: the global layers'
    RoPE as ``rope_theta`` / ``rope_scaling`` and the sliding layers' base as
    ``rope_local_base_freq`` (from per-layer-type ``rope_parameters`` or the older keys)."""
    d = dict(d)
    gemma2 = d.get("model_type") == "gemma2" or "Gemma2ForCausalLM" in (
        d.get("architectures") or ()
    )
    d["embedding_multiplier"] = d["hidden_size"] ** 0.5
    d["attention_multiplier"] = float(d.get("query_pre_attn_scalar") or 256) ** -0.5
    rope = d.get("rope_parameters")
    if isinstance(rope, Mapping) and "full_attention" in rope:
        full, local = dict(rope["full_attention"]), rope.get("sliding_attention") or {}
        d["rope_theta"] = full.pop("rope_theta", d.get("rope_theta"))
        d["rope_parameters"] = full if full.get("rope_type", "default") != "default" else None
        d["rope_local_base_freq"] = local.get("rope_theta", d.get("rope_local_base_freq"))
    if not gemma2:
        d.setdefault("rope_local_base_freq", 10000.0)
    if not d.get("layer_types"):
        pattern = int(d.get("sliding_window_pattern") or (2 if gemma2 else 6))
        d["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(int(d["num_hidden_layers"]))
        ]
    return d


def _moe(d: Mapping[str, Any], arch: str) -> dict:
    """The mixture-of-experts fields of a Mixtral, Qwen-MoE, OLMoE or Granite-MoE config.
    Mixtral and Granite-MoE (whose router's softmax over its top-k logits is the same
    thing): every layer, experts as wide as ``intermediate_size``, top-k weights
    renormalized. OLMoE: the same width, ``norm_topk_prob``. Qwen-MoE:
    ``moe_intermediate_size``, ``norm_topk_prob``, dense MLPs in ``mlp_only_layers`` and
    off the ``decoder_sparse_step`` grid, and Qwen2-MoE's shared expert."""
    experts = d.get("num_local_experts") or d.get("num_experts")
    if not experts or not d.get("num_experts_per_tok"):
        raise ValueError(
            f"{arch} config needs num_experts (num_local_experts) and num_experts_per_tok"
        )
    if d.get("clip_qkv") is not None:
        raise ValueError(f"{arch} config with clip_qkv={d['clip_qkv']} is not supported")
    out = {
        "num_experts": int(experts),
        "num_experts_per_tok": int(d["num_experts_per_tok"]),
        "moe_intermediate_size": int(d["intermediate_size"]),
    }
    if arch in ("MixtralForCausalLM", "GraniteMoeForCausalLM"):
        return out
    if arch == "OlmoeForCausalLM":
        return {**out, "norm_topk_prob": bool(d.get("norm_topk_prob", False))}
    n, step = int(d["num_hidden_layers"]), int(d.get("decoder_sparse_step") or 1)
    dense = set(d.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
    return {
        **out,
        "moe_intermediate_size": int(d.get("moe_intermediate_size") or d["intermediate_size"]),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(d.get("shared_expert_intermediate_size") or 0)
        if arch == "Qwen2MoeForCausalLM"
        else 0,
        "moe_layers": None if len(layers) == n else layers,
    }


def _window_layers(d: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The sliding-window layers a config's ``layer_types`` names (None: every layer)."""
    types = d.get("layer_types")
    if not types:
        return None
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def _nope_layers(d: Mapping[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: the zeros of ``no_rope_layers`` (1 = RoPE), or every
    ``no_rope_layer_interval``-th layer (default 4) when the list is absent."""
    flags = d.get("no_rope_layers")
    if flags is None:
        step = int(d.get("no_rope_layer_interval") or 4)
        return tuple(i for i in range(int(d["num_hidden_layers"])) if (i + 1) % step == 0)
    return tuple(i for i, rope in enumerate(flags) if not rope)


def _longrope_attention_factor(
    rope: Mapping[str, Any], d: Mapping[str, Any], original: int
) -> float:
    """LongRoPE's factor on cos and sin, as transformers derives it: ``attention_factor``
    when given, else ``sqrt(1 + ln(s) / ln(original))`` for ``s`` = ``factor`` or the
    context ratio ``max_position_embeddings / original`` (1 when ``s <= 1``)."""
    if rope.get("rope_type") != "longrope":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    s = rope.get("factor") or d.get("max_position_embeddings", original) / original
    return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(original))


def _rope_parameters(d: Mapping[str, Any]) -> dict:
    """Merge the new ``rope_parameters`` and the old ``rope_theta`` + ``rope_scaling``."""
    rope: dict = {}
    if d.get("rope_theta") is not None:
        rope["rope_theta"] = d["rope_theta"]
    for key in ("rope_scaling", "rope_parameters"):
        extra = d.get(key)
        if isinstance(extra, Mapping):
            rope.update({k: v for k, v in extra.items() if v is not None})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    return rope
