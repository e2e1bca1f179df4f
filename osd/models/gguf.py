"""GGUF checkpoints (llama.cpp's single-file format) for our Llama-family decoder.

    >>> g = GGUFFile("SmolLM2-135M-Instruct.Q4_1.gguf")
    >>> g.metadata["general.architecture"], g.tensors["blk.0.attn_q.weight"].type_name
    ('llama', 'Q4_1')
    >>> w = g.tensor("blk.0.attn_q.weight", dtype=torch.float32)   # dequantized, [576, 576]

File layout (versions 2 and 3, little-endian)::

    "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x     (string key, u32 value_type, value)
    tensor_count x (string name, u32 n_dims, n_dims x u64 dims, u32 ggml_type, u64 offset)
    zero padding to the alignment (metadata ``general.alignment``, default 32)
    data section: tensor i starts at data_start + offset_i

A string is a u64 byte count and UTF-8 bytes; an array value is a u32 element type, a u64
count and the elements. ``dims`` are in ggml order (``dims[0]`` is the contiguous one), so
the torch shape is ``dims`` reversed: a ``[out, in]`` weight is stored with dims
``(in, out)``. Quantized types store each row as whole blocks (32 or 256 weights).

The file is memory-mapped once; tensors are read and dequantized one at a time, so loading
needs the file plus one float32 tensor of working memory beyond the model itself.

Weights map onto the Hugging Face names that :func:`osd.models.loading.load_hf_state_dict`
fills, with one numerical change: llama.cpp's converter reorders the rows of every Llama
``attn_q``/``attn_k`` weight (per head, from rotate-half to interleaved RoPE pairs), and
:func:`unpermute_rope_rows` undoes that so our RoPE (the Hugging Face convention) applies.

The tokenizer in the metadata becomes a transformers tokenizer in
:mod:`osd.models.gguf_tokenizer` (:func:`tokenizer_from_gguf`, re-exported here); the
tensor types' layouts, dequantizers and quantizers are in :mod:`osd.models.gguf_blocks`
(:func:`dequantize` and :func:`quantize` re-exported here). The module also writes GGUF
files (:func:`write_gguf`), used by the tests to build small checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from osd.models.config import ModelConfig
from osd.models.gguf_blocks import (
    BLOCK_LAYOUT,
    SUPPORTED_TYPES,
    GGMLType,  # noqa: F401
    dequantize,
    quantize,
    type_name,
)
from osd.models.gguf_tokenizer import tokenizer_from_gguf

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types.
(
    _UINT8,
    _INT8,
    _UINT16,
    _INT16,
    _UINT32,
    _INT32,
    _FLOAT32,
    _BOOL,
    _STRING,
    _ARRAY,
    _UINT64,
    _INT64,
    _FLOAT64,
) = range(13)
_SCALAR = {
    _UINT8: "<B",
    _INT8: "<b",
    _UINT16: "<H",
    _INT16: "<h",
    _UINT32: "<I",
    _INT32: "<i",
    _FLOAT32: "<f",
    _BOOL: "<?",
    _UINT64: "<Q",
    _INT64: "<q",
    _FLOAT64: "<d",
}
_NUMPY = {
    _UINT8: "<u1",
    _INT8: "<i1",
    _UINT16: "<u2",
    _INT16: "<i2",
    _UINT32: "<u4",
    _INT32: "<i4",
    _FLOAT32: "<f4",
    _BOOL: "<u1",
    _UINT64: "<u8",
    _INT64: "<i8",
    _FLOAT64: "<f8",
}

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


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file."""

    name: str
    shape: tuple[int, ...]  # torch order (the file's dims reversed)
    type: int  # a GGMLType id
    offset: int  # absolute byte offset of its data in the file
    nbytes: int  # bytes of its data

    @property
    def type_name(self) -> str:
        return type_name(self.type)


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> value; arrays as lists, or numpy arrays for
    numeric arrays), ``tensors`` (name -> :class:`GGUFTensorInfo`, file order) and the
    memory-mapped data.

    Raises FileNotFoundError for a missing path and ValueError for a file that is not GGUF,
    has an unsupported version, or is truncated or corrupt.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {str(self.path)!r} does not exist")
        self.size = self.path.stat().st_size
        if self.size < 24:
            with open(self.path, "rb") as f:
                head = f.read(4)
            if head != GGUF_MAGIC:
                raise ValueError(
                    f"{str(self.path)!r} is not a GGUF file (starts with "
                    f"{head!r}, expected {GGUF_MAGIC!r})"
                )
            raise ValueError(
                f"truncated GGUF file {str(self.path)!r}: {self.size} bytes, "
                "shorter than the header"
            )
        # Copy-on-write mapping: torch.from_numpy needs a writable array; nothing is copied
        # unless written, and nothing here writes.
        self._data = np.memmap(self.path, dtype=np.uint8, mode="c")
        self._buf = memoryview(self._data)  # cheap slicing while parsing the header
        self._pos = 0
        if bytes(self._data[:4]) != GGUF_MAGIC:
            raise ValueError(
                f"{str(self.path)!r} is not a GGUF file (starts with "
                f"{bytes(self._data[:4])!r}, expected {GGUF_MAGIC!r})"
            )
        self._pos = 4
        self.version = self._scalar(_UINT32)
        if self.version not in GGUF_VERSIONS:
            swapped = struct.unpack("<I", struct.pack(">I", self.version))[0]
            hint = " (a big-endian file)" if swapped in GGUF_VERSIONS else ""
            raise ValueError(
                f"unsupported GGUF version {self.version}{hint} in "
                f"{str(self.path)!r}; supported: {GGUF_VERSIONS}"
            )
        n_tensors, n_kv = self._scalar(_UINT64), self._scalar(_UINT64)
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar(_UINT32), key)
        raw_infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar(_UINT32)
            if n_dims > 8:
                raise ValueError(
                    f"corrupt GGUF file {str(self.path)!r}: tensor {name!r} has {n_dims} dims"
                )
            dims = tuple(self._scalar(_UINT64) for _ in range(n_dims))
            raw_infos.append((name, dims, self._scalar(_UINT32), self._scalar(_UINT64)))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment < 1:
            raise ValueError(f"corrupt GGUF file {str(self.path)!r}: alignment {alignment}")
        self.data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, offset in raw_infos:
            shape = tuple(int(d) for d in reversed(dims))
            info = GGUFTensorInfo(
                name, shape, ggml_type, self.data_start + offset, _nbytes(name, shape, ggml_type)
            )
            if info.nbytes >= 0 and info.offset + info.nbytes > self.size:
                raise ValueError(
                    f"truncated GGUF file {str(self.path)!r}: tensor {name!r} "
                    f"ends at byte {info.offset + info.nbytes}, the file has "
                    f"{self.size}"
                )
            self.tensors[name] = info

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    # -- header parsing -------------------------------------------------------------------
    def _take(self, n: int, what: str) -> int:
        pos = self._pos
        if pos + n > self.size:
            raise ValueError(
                f"truncated GGUF file {str(self.path)!r}: the header ends while "
                f"reading {what} at byte {pos}"
            )
        self._pos = pos + n
        return pos

    def _scalar(self, vtype: int, what: str = "the header"):
        fmt = _SCALAR[vtype]
        pos = self._take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self._buf, pos)[0]

    def _string(self, what: str = "a string") -> str:
        n = self._scalar(_UINT64, what)
        pos = self._take(n, what)
        return str(self._buf[pos : pos + n], "utf-8", errors="replace")

    def _strings(self, count: int, key: str) -> list[str]:
        """``count`` strings (a vocabulary: tens of thousands), parsed in one tight loop."""
        buf, pos, size, out = self._buf, self._pos, self.size, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            n = unpack(buf, pos)[0] if pos + 8 <= size else size
            if pos + 8 + n > size:
                raise ValueError(
                    f"truncated GGUF file {str(self.path)!r}: the header ends "
                    f"while reading metadata {key!r} at byte {pos}"
                )
            out.append(str(buf[pos + 8 : pos + 8 + n], "utf-8", errors="replace"))
            pos += 8 + n
        self._pos = pos
        return out

    def _value(self, vtype: int, key: str):
        if vtype in _SCALAR:
            return self._scalar(vtype, f"metadata {key!r}")
        if vtype == _STRING:
            return self._string(f"metadata {key!r}")
        if vtype == _ARRAY:
            etype, count = self._scalar(_UINT32, key), self._scalar(_UINT64, key)
            if etype in _NUMPY:  # numeric arrays are read in one go
                width = np.dtype(_NUMPY[etype]).itemsize
                pos = self._take(count * width, f"metadata {key!r}")
                arr = np.frombuffer(self._data, _NUMPY[etype], count, pos).copy()
                return arr.astype(bool) if etype == _BOOL else arr
            if etype == _STRING:
                return self._strings(count, key)
            return [self._value(etype, key) for _ in range(count)]
        raise ValueError(
            f"corrupt GGUF file {str(self.path)!r}: metadata {key!r} has unknown value type {vtype}"
        )

    # -- tensors --------------------------------------------------------------------------
    def raw(self, name: str) -> torch.Tensor:
        """The stored bytes of tensor ``name``: a uint8 view of the mapped file."""
        info = self.tensors[name]
        if info.nbytes < 0:
            raise ValueError(unsupported_type_message(info))
        return torch.from_numpy(self._data[info.offset : info.offset + info.nbytes])

    def tensor(
        self, name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """Tensor ``name`` dequantized to ``dtype`` on ``device`` (the bytes move first, so
        a GPU dequantizes its own tensors)."""
        info = self.tensors[name]
        if info.type not in BLOCK_LAYOUT:
            raise ValueError(unsupported_type_message(info))
        return dequantize(self.raw(name).to(device), info.type, info.shape, dtype)


def unsupported_type_message(info: GGUFTensorInfo) -> str:
    return (
        f"tensor {info.name!r} has quantization type {info.type_name}, which osd cannot "
        f"dequantize; supported: {', '.join(t.name for t in SUPPORTED_TYPES)}"
    )


def _nbytes(name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    """Bytes of a tensor, or -1 for a type this module cannot read (reported on use)."""
    if ggml_type not in BLOCK_LAYOUT:
        return -1
    block, size = BLOCK_LAYOUT[ggml_type]
    if shape and shape[-1] % block:
        raise ValueError(
            f"corrupt GGUF tensor {name!r}: rows of {shape[-1]} weights are not "
            f"whole {GGMLType(ggml_type).name} blocks of {block}"
        )
    return math.prod(shape) // block * size


# -- writing ----------------------------------------------------------------------------------
_FROM_NUMPY = {np.dtype(dtype): etype for etype, dtype in _NUMPY.items() if etype != _BOOL}


def _pack_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value_type(v) -> int:
    if isinstance(v, (bool, np.bool_)):
        return _BOOL
    if isinstance(v, (int, np.integer)):
        return _UINT32 if 0 <= v < 2**32 else _INT64
    if isinstance(v, (float, np.floating)):
        return _FLOAT32
    if isinstance(v, str):
        return _STRING
    if isinstance(v, (list, tuple, np.ndarray)):
        return _ARRAY
    raise TypeError(f"cannot store a {type(v).__name__} in GGUF metadata")


def _pack_value(v, vtype: int) -> bytes:
    if vtype == _STRING:
        return _pack_string(v)
    if vtype != _ARRAY:
        return struct.pack(_SCALAR[vtype], v)
    if isinstance(v, np.ndarray) and v.dtype.newbyteorder("<") in _FROM_NUMPY:
        # a numeric array keeps its element type (llama.cpp wants token_type as int32)
        dtype = v.dtype.newbyteorder("<")
        return struct.pack("<IQ", _FROM_NUMPY[dtype], v.size) + v.astype(dtype).tobytes()
    items = list(v)
    kinds = {_value_type(i) for i in items}
    if kinds <= {_UINT32, _INT64}:  # ints (or an empty list)
        etype = _INT64 if _INT64 in kinds else _UINT32
    elif kinds <= {_UINT32, _INT64, _FLOAT32}:
        etype = _FLOAT32
    elif len(kinds) == 1 and kinds != {_ARRAY}:
        etype = kinds.pop()
    else:
        raise TypeError("a GGUF array holds values of one scalar type")
    body = b"".join(_pack_value(i, etype) for i in items)
    return struct.pack("<IQ", etype, len(items)) + body


def write_gguf(
    path: str | os.PathLike,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, tuple[np.ndarray | torch.Tensor, int]],
    *,
    alignment: int = DEFAULT_ALIGNMENT,
) -> None:
    """Write a GGUF v3 file.

    Args:
        metadata: key -> bool, int (u32, or i64 when outside u32), float (f32), str, or a
            list of one of those.
        tensors: name -> (float weights in torch order, GGMLType), quantized with
            :func:`quantize`; or (stored bytes, GGMLType, torch shape) for blocks encoded
            elsewhere (uint8, the type's whole blocks).
        alignment: data alignment; stored as ``general.alignment`` when not the default.
    """
    meta = dict(metadata)
    if alignment != DEFAULT_ALIGNMENT:
        meta["general.alignment"] = alignment
    out = [GGUF_MAGIC, struct.pack("<IQQ", 3, len(tensors), len(meta))]
    for key, value in meta.items():
        vtype = _value_type(value)
        out += [_pack_string(key), struct.pack("<I", vtype), _pack_value(value, vtype)]
    blobs, offset = [], 0
    for name, (array, ggml_type, *stored) in tensors.items():
        if stored:
            shape = tuple(stored[0])
            data = np.asarray(array, dtype=np.uint8).tobytes()
            block, size = BLOCK_LAYOUT[ggml_type]
            if len(data) * block != math.prod(shape) * size:
                raise ValueError(
                    f"tensor {name!r}: {len(data)} bytes of "
                    f"{type_name(ggml_type)} do not hold shape {shape}"
                )
        else:
            shape = tuple(array.shape)
            data = quantize(array, ggml_type).tobytes()
        out += [
            _pack_string(name),
            struct.pack("<I", len(shape)),
            struct.pack(f"<{len(shape)}Q", *reversed(shape)),
            struct.pack("<IQ", int(ggml_type), offset),
        ]
        pad = -len(data) % alignment
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad
    header = b"".join(out)
    with open(path, "wb") as f:
        f.write(header + b"\0" * (-len(header) % alignment))
        f.writelines(blobs)


# -- model ------------------------------------------------------------------------------------
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
    :func:`osd.models.loading.load_hf_state_dict`: ``get`` dequantizes one tensor (on
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


def find_gguf(source: str | os.PathLike) -> Path | None:
    """The GGUF file ``source`` names: the path itself when it ends in ``.gguf``, or the
    single ``*.gguf`` in a directory; None when ``source`` is a directory without one.
    FileNotFoundError for a missing ``.gguf`` path; ValueError for a directory with
    several ``.gguf`` files (pass the file itself)."""
    path = Path(source)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
        return path
    if not path.is_dir():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        raise ValueError(
            f"directory {str(path)!r} holds {len(found)} GGUF files "
            f"({', '.join(p.name for p in found[:4])}); pass one file's path"
        )
    return found[0] if found else None


def __getattr__(name: str):
    # ``load_gguf_model`` builds a DecoderLM, so it lives in ``osd.models.loading`` (the
    # format module imports nothing else of osd); the old name stays importable from here.
    if name == "load_gguf_model":
        from osd.models.loading import load_gguf_model

        return load_gguf_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GGUFFile",
    "GGUFTensorInfo",
    "GGMLType",
    "SUPPORTED_TYPES",
    "ARCHITECTURES",
    "dequantize",
    "quantize",
    "write_gguf",
    "unpermute_rope_rows",
    "hf_name",
    "config_from_gguf",
    "open_gguf_weights",
    "find_gguf",
    "tokenizer_from_gguf",
    "llama3_rope_factors",
]
