"""An osd draft directory as a GGUF file for llama.cpp's draft-model mode (``-md``).

A draft directory (``osd draft build``, ``osd/zoo/weights/chat_draft``) holds a
Llama-shaped checkpoint in Hugging Face names (``config.json``, ``model.safetensors``).
llama.cpp's draft mode needs a GGUF model with the target's vocabulary and tokenizer, so
:func:`write_draft_gguf` gives the file the target GGUF's metadata (tokenizer, chat
template) with the draft's own shape keys, its weights in Q8_0 (norms in F32) and
llama.cpp's row order for the Q and K projections (each head's rotate-half rows as
interleaved pairs, what llama.cpp's converter writes;
:func:`~osd.models.gguf.convert.unpermute_rope_rows` is the inverse).

The architecture must be Llama's and the vocabulary the target's (ValueError otherwise). A
draft whose output head is restricted to a subset of the vocabulary (``head_vocab.json``)
with tied embeddings is written with its whole tied head (the embedding), since llama.cpp
compares the draft's vocabulary with the target's; the rows outside the subset were not
trained as an output head.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from osd.models.gguf.blocks import GGMLType
from osd.models.gguf.convert import _GLOBAL_NAMES, _LAYER_NAMES
from osd.models.gguf.format import GGUFFile, write_gguf

SHAPE_KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
}
# Hugging Face names -> the file's: the reader's tables inverted (Llama has no overrides).
# Where two file names read as one of ours, the first listed is Llama's (ffn_norm, not
# Gemma's post_attention_norm).
_HF_LAYER: dict[str, str] = {}
for _gguf, _hf in _LAYER_NAMES.items():
    _HF_LAYER.setdefault(_hf, _gguf)
_HF_GLOBAL = {hf: gguf for gguf, hf in _GLOBAL_NAMES.items()}


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order: per head, rotate-half rows as interleaved pairs."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_draft_gguf(target: str | os.PathLike, draft: str | os.PathLike, out) -> dict:
    """Write ``draft`` (a directory) as ``out`` with ``target``'s tokenizer; returns the
    draft's config."""
    with open(os.path.join(draft, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("architectures") != ["LlamaForCausalLM"]:
        raise ValueError(f"write_draft_gguf: {draft} is {cfg.get('architectures')}, not a Llama")
    g = GGUFFile(target)
    meta = dict(g.metadata)
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"write_draft_gguf: {target} is not a llama GGUF")
    vocab = meta.get("llama.vocab_size") or g.tensors["token_embd.weight"].shape[0]
    if int(vocab) != cfg["vocab_size"]:
        raise ValueError(
            f"write_draft_gguf: the draft's vocabulary ({cfg['vocab_size']}) is not the "
            f"target's ({vocab})"
        )
    for key, name in SHAPE_KEYS.items():
        meta[f"llama.{key}"] = int(cfg[name])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    meta["llama.rope.dimension_count"] = int(head_dim)
    meta["llama.attention.layer_norm_rms_epsilon"] = float(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    meta["llama.rope.freq_base"] = float(rope.get("rope_theta", cfg.get("rope_theta", 1e4)))
    meta["general.name"] = f"osd draft ({os.path.basename(os.path.normpath(draft))})"
    meta["general.file_type"] = 7  # mostly Q8_0
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tensors = {}
    with safe_open(os.path.join(draft, "model.safetensors"), "pt") as f:
        for name in f.keys():
            w = f.get_tensor(name).float()
            if name in _HF_GLOBAL:  # embedding, final norm, an untied head
                kind = GGMLType.F32 if w.dim() == 1 else GGMLType.Q8_0
                tensors[_HF_GLOBAL[name]] = (w, kind)
                continue
            _, _, i, *rest = name.split(".")
            part = ".".join(rest[:-1])
            if part == "self_attn.q_proj":
                w = permute_rope_rows(w, heads)
            elif part == "self_attn.k_proj":
                w = permute_rope_rows(w, kv_heads)
            kind = GGMLType.F32 if w.dim() == 1 else GGMLType.Q8_0
            tensors[f"blk.{i}.{_HF_LAYER[part]}.weight"] = (w, kind)
    write_gguf(out, meta, tensors)
    return cfg
