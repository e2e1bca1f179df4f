"""Hugging Face named tensors into :class:`~osd.models.llama.DecoderLM`'s parameters.

Our decoder stores some weights fused (``wqkv = [q; k; v]``, ``w_gate_up = [gate; up]``,
a mixture of experts' stacked ``gate_up`` and ``down``); :func:`load_hf_state_dict`
fills each parameter from the Hugging Face tensors that make it up, whatever holds them:
a checkpoint directory, an in-memory transformers model or a GGUF file
(:func:`osd.models.gguf.open_gguf_weights` names its tensors this way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from osd.models.llama import DecoderLM

# Checkpoint tensors that carry no weights (old checkpoints saved the RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _hf_sources(name: str, keys=(), num_experts: int = 0) -> list[str]:
    """Hugging Face tensor names that make up our parameter ``name`` (concatenated along
    its first dim, or along its first two for per-expert tensors): the fused ``qkv_proj``
    and ``gate_up_proj`` of Phi-3 checkpoints when ``keys`` has them; a mixture of
    experts from transformers' fused ``experts.gate_up_proj`` / ``down_proj``, Granite-MoE
    checkpoints' ``input_linear`` / ``output_linear``, or the checkpoints' per-expert
    tensors (Mixtral's ``block_sparse_moe.experts.E.w1/w3/w2``, Qwen-MoE's and OLMoE's
    ``mlp.experts.E.gate_proj/up_proj/down_proj``)."""
    if not name.startswith("layers."):
        return {
            "embed_tokens.weight": ["model.embed_tokens.weight"],
            "norm.weight": ["model.norm.weight"],
            "lm_head.weight": ["lm_head.weight"],
        }[name]
    parts = name.split(".")
    pre = f"model.layers.{parts[1]}."
    if parts[2] == "moe":
        return _moe_sources(pre, parts[3], keys, num_experts)
    _, index, module, kind = parts
    fused = {"wqkv": "self_attn.qkv_proj", "w_gate_up": "mlp.gate_up_proj"}.get(module)
    if fused and pre + fused + "." + kind in keys:
        return [pre + fused + "." + kind]
    return {
        "input_norm": [pre + "input_layernorm." + kind],
        "post_attention_norm": [pre + "post_attention_layernorm." + kind],
        "pre_feedforward_norm": [pre + "pre_feedforward_layernorm." + kind],
        "post_feedforward_norm": [pre + "post_feedforward_layernorm." + kind],
        "wqkv": [pre + f"self_attn.{p}_proj.{kind}" for p in "qkv"],
        "q_norm": [pre + "self_attn.q_norm." + kind],
        "k_norm": [pre + "self_attn.k_norm." + kind],
        "wo": [pre + "self_attn.o_proj." + kind],
        "w_gate_up": [pre + f"mlp.{p}_proj.{kind}" for p in ("gate", "up")],
        "w_down": [pre + "mlp.down_proj." + kind],
    }[module]


def _moe_sources(pre: str, part: str, keys, num_experts: int) -> list[str]:
    """The sources of :class:`~osd.models.llama.MoE` parameter ``part`` of layer ``pre``."""
    mixtral = pre + "block_sparse_moe.gate.weight" in keys
    granite = (
        pre + "block_sparse_moe.router.layer.weight" in keys
        or pre + "block_sparse_moe.router.weight" in keys
    )
    moe = pre + ("block_sparse_moe." if mixtral or granite else "mlp.")
    fused = {
        "gate_up": [moe + "experts.gate_up_proj", moe + "input_linear.weight"],
        "down": [moe + "experts.down_proj", moe + "output_linear.weight"],
    }
    for name in fused.get(part, ()):
        if name in keys:
            return [name]
    if granite and part == "router":
        return [
            moe
            + ("router.layer.weight" if moe + "router.layer.weight" in keys else "router.weight")
        ]
    names = (
        {"gate_up": ("w1", "w3"), "down": ("w2",)}
        if mixtral
        else {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
    )
    if part in names:
        return [f"{moe}experts.{e}.{p}.weight" for e in range(num_experts) for p in names[part]]
    return {
        "router": [moe + "gate.weight"],
        "shared_gate_up": [pre + f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up")],
        "shared_down": [pre + "mlp.shared_expert.down_proj.weight"],
        "shared_gate": [pre + "mlp.shared_expert_gate.weight"],
    }[part]


def load_hf_state_dict(
    model: DecoderLM, keys, get: Callable[[str], torch.Tensor], *, norm_shift: float = 0.0
) -> None:
    """Copy Hugging Face named tensors into ``model``'s (fused) parameters.

    Args:
        model: the decoder to fill (in place).
        keys: the tensor names available.
        get: returns the tensor of a name.
        norm_shift: added to every RMSNorm weight (in float32): 1 for Gemma checkpoints,
            whose norms multiply by ``1 + weight`` (GGUF files store the sum).

    Raises ValueError naming missing, unexpected or mis-shaped tensors.
    """
    keys = set(keys)
    used: set[str] = set()
    missing: list[str] = []
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for name, param in model.named_parameters(remove_duplicate=True):
            sources = _hf_sources(name, keys, model.config.num_experts)
            absent = [s for s in sources if s not in keys]
            if absent:
                missing += absent
                continue
            offset = 0
            dst = param
            for src in sources:
                tensor = get(src)
                if norm_shift and name.endswith("norm.weight"):
                    tensor = tensor.float() + norm_shift
                if tensor.dim() == param.dim() - 1 and param.dim() == 3:
                    dst = param.flatten(0, 1)  # per-expert [rows, K] into [E * rows, K]
                rows = tensor.shape[0]
                want = (rows,) + tuple(dst.shape[1:])
                if tuple(tensor.shape) != want or offset + rows > dst.shape[0]:
                    raise ValueError(
                        f"tensor {src} has shape {tuple(tensor.shape)}, expected "
                        f"{want} for this config"
                    )
                dst[offset : offset + rows].copy_(tensor)
                offset += rows
                used.add(src)
            if offset != dst.shape[0]:
                raise ValueError(f"tensors {sources} give {offset} rows, expected {dst.shape[0]}")
    if tied:
        used.add("lm_head.weight")
    if missing:
        raise ValueError(
            f"checkpoint is missing {len(missing)} tensors: "
            f"{', '.join(sorted(missing)[:8])}{' ...' if len(missing) > 8 else ''}"
        )
    unexpected = sorted(k for k in keys - used if not k.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(
            f"checkpoint has {len(unexpected)} tensors this architecture does not "
            f"use: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}"
        )
