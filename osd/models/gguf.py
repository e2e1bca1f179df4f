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
:mod:`osd.models.gguf_tokenizer` (:func:`tokenizer_from_gguf`, re-exported here). The
module also writes GGUF files (:func:`write_gguf`, with :func:`quantize` for
F32/F16/BF16/Q8_0/Q4_0/Q4_1), used by the tests to build small checkpoints.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from osd.models.config import ModelConfig
from osd.models.gguf_tokenizer import tokenizer_from_gguf

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32


# ggml tensor types: the ids a GGUF tensor info stores.
GGMLType = enum.IntEnum("GGMLType", [
    ("F32", 0), ("F16", 1), ("Q4_0", 2), ("Q4_1", 3), ("Q5_0", 6), ("Q5_1", 7), ("Q8_0", 8),
    ("Q8_1", 9), ("Q2_K", 10), ("Q3_K", 11), ("Q4_K", 12), ("Q5_K", 13), ("Q6_K", 14),
    ("Q8_K", 15), ("IQ2_XXS", 16), ("IQ2_XS", 17), ("IQ3_XXS", 18), ("IQ1_S", 19),
    ("IQ4_NL", 20), ("IQ3_S", 21), ("IQ2_S", 22), ("IQ4_XS", 23), ("I8", 24), ("I16", 25),
    ("I32", 26), ("I64", 27), ("F64", 28), ("IQ1_M", 29), ("BF16", 30)])

# (weights per block, bytes per block) of the types this module reads.
BLOCK_LAYOUT = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18),     # fp16 d, 16 bytes of nibbles
    GGMLType.Q4_1: (32, 20),     # fp16 d, fp16 m, 16 bytes of nibbles
    GGMLType.Q5_0: (32, 22),     # fp16 d, u32 high bits, 16 bytes of nibbles
    GGMLType.Q5_1: (32, 24),     # fp16 d, fp16 m, u32 high bits, 16 bytes of nibbles
    GGMLType.Q8_0: (32, 34),     # fp16 d, 32 int8
    GGMLType.Q2_K: (256, 84),    # 16 bytes of 4-bit scale/min pairs, 64 bytes of 2-bit codes,
    #                              fp16 d, fp16 dmin
    GGMLType.Q3_K: (256, 110),   # 32 bytes of high bits, 64 bytes of 2-bit codes, 12 bytes of
    #                              6-bit scales, fp16 d
    GGMLType.Q4_K: (256, 144),   # fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 nibbles
    GGMLType.Q5_K: (256, 176),   # Q4_K's fields, then 32 bytes of high bits before the nibbles
    GGMLType.Q6_K: (256, 210),   # 128 low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d
    GGMLType.IQ4_NL: (32, 18),   # fp16 d, 16 bytes of nibbles indexing IQ4_VALUES
    GGMLType.IQ4_XS: (256, 136),  # fp16 d, u16 high scale bits, 4 bytes of low scale nibbles,
    #                               128 bytes of nibbles indexing IQ4_VALUES
}
# The 16 levels a nibble of IQ4_NL and IQ4_XS selects (ggml's kvalues_iq4nl).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
SUPPORTED_TYPES = tuple(BLOCK_LAYOUT)

# GGUF metadata value types.
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, \
    _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR = {_UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I", _INT32: "<i",
           _FLOAT32: "<f", _BOOL: "<?", _UINT64: "<Q", _INT64: "<q", _FLOAT64: "<d"}
_NUMPY = {_UINT8: "<u1", _INT8: "<i1", _UINT16: "<u2", _INT16: "<i2", _UINT32: "<u4",
          _INT32: "<i4", _FLOAT32: "<f4", _BOOL: "<u1", _UINT64: "<u8", _INT64: "<i8",
          _FLOAT64: "<f8"}

# general.architecture -> (our architecture, whether Q/K rows carry llama.cpp's RoPE permutation).
# Mistral checkpoints are converted as "llama"; Qwen2's converter keeps the HF row order.
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False),
                 "qwen3": ("Qwen3ForCausalLM", False)}


def type_name(ggml_type: int) -> str:
    try:
        return GGMLType(ggml_type).name
    except ValueError:
        return f"unknown type {ggml_type}"


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file."""

    name: str
    shape: tuple[int, ...]     # torch order (the file's dims reversed)
    type: int                  # a GGMLType id
    offset: int                # absolute byte offset of its data in the file
    nbytes: int                # bytes of its data

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
                raise ValueError(f"{str(self.path)!r} is not a GGUF file (starts with "
                                 f"{head!r}, expected {GGUF_MAGIC!r})")
            raise ValueError(f"truncated GGUF file {str(self.path)!r}: {self.size} bytes, "
                             "shorter than the header")
        # Copy-on-write mapping: torch.from_numpy needs a writable array; nothing is copied
        # unless written, and nothing here writes.
        self._data = np.memmap(self.path, dtype=np.uint8, mode="c")
        self._buf = memoryview(self._data)   # cheap slicing while parsing the header
        self._pos = 0
        if bytes(self._data[:4]) != GGUF_MAGIC:
            raise ValueError(f"{str(self.path)!r} is not a GGUF file (starts with "
                             f"{bytes(self._data[:4])!r}, expected {GGUF_MAGIC!r})")
        self._pos = 4
        self.version = self._scalar(_UINT32)
        if self.version not in GGUF_VERSIONS:
            swapped = struct.unpack("<I", struct.pack(">I", self.version))[0]
            hint = " (a big-endian file)" if swapped in GGUF_VERSIONS else ""
            raise ValueError(f"unsupported GGUF version {self.version}{hint} in "
                             f"{str(self.path)!r}; supported: {GGUF_VERSIONS}")
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
                raise ValueError(f"corrupt GGUF file {str(self.path)!r}: tensor {name!r} has "
                                 f"{n_dims} dims")
            dims = tuple(self._scalar(_UINT64) for _ in range(n_dims))
            raw_infos.append((name, dims, self._scalar(_UINT32), self._scalar(_UINT64)))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment < 1:
            raise ValueError(f"corrupt GGUF file {str(self.path)!r}: alignment {alignment}")
        self.data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, offset in raw_infos:
            shape = tuple(int(d) for d in reversed(dims))
            info = GGUFTensorInfo(name, shape, ggml_type, self.data_start + offset,
                                  _nbytes(name, shape, ggml_type))
            if info.nbytes >= 0 and info.offset + info.nbytes > self.size:
                raise ValueError(f"truncated GGUF file {str(self.path)!r}: tensor {name!r} "
                                 f"ends at byte {info.offset + info.nbytes}, the file has "
                                 f"{self.size}")
            self.tensors[name] = info

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    # -- header parsing -------------------------------------------------------------------
    def _take(self, n: int, what: str) -> int:
        pos = self._pos
        if pos + n > self.size:
            raise ValueError(f"truncated GGUF file {str(self.path)!r}: the header ends while "
                             f"reading {what} at byte {pos}")
        self._pos = pos + n
        return pos

    def _scalar(self, vtype: int, what: str = "the header"):
        fmt = _SCALAR[vtype]
        pos = self._take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self._buf, pos)[0]

    def _string(self, what: str = "a string") -> str:
        n = self._scalar(_UINT64, what)
        pos = self._take(n, what)
        return str(self._buf[pos:pos + n], "utf-8", errors="replace")

    def _strings(self, count: int, key: str) -> list[str]:
        """``count`` strings (a vocabulary: tens of thousands), parsed in one tight loop."""
        buf, pos, size, out = self._buf, self._pos, self.size, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            n = unpack(buf, pos)[0] if pos + 8 <= size else size
            if pos + 8 + n > size:
                raise ValueError(f"truncated GGUF file {str(self.path)!r}: the header ends "
                                 f"while reading metadata {key!r} at byte {pos}")
            out.append(str(buf[pos + 8:pos + 8 + n], "utf-8", errors="replace"))
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
        raise ValueError(f"corrupt GGUF file {str(self.path)!r}: metadata {key!r} has unknown "
                         f"value type {vtype}")

    # -- tensors --------------------------------------------------------------------------
    def raw(self, name: str) -> torch.Tensor:
        """The stored bytes of tensor ``name``: a uint8 view of the mapped file."""
        info = self.tensors[name]
        if info.nbytes < 0:
            raise ValueError(unsupported_type_message(info))
        return torch.from_numpy(self._data[info.offset:info.offset + info.nbytes])

    def tensor(self, name: str, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor:
        """Tensor ``name`` dequantized to ``dtype`` on ``device`` (the bytes move first, so
        a GPU dequantizes its own tensors)."""
        info = self.tensors[name]
        if info.type not in BLOCK_LAYOUT:
            raise ValueError(unsupported_type_message(info))
        return dequantize(self.raw(name).to(device), info.type, info.shape, dtype)


def unsupported_type_message(info: GGUFTensorInfo) -> str:
    return (f"tensor {info.name!r} has quantization type {info.type_name}, which osd cannot "
            f"dequantize; supported: {', '.join(t.name for t in SUPPORTED_TYPES)}")


def _nbytes(name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    """Bytes of a tensor, or -1 for a type this module cannot read (reported on use)."""
    if ggml_type not in BLOCK_LAYOUT:
        return -1
    block, size = BLOCK_LAYOUT[ggml_type]
    if shape and shape[-1] % block:
        raise ValueError(f"corrupt GGUF tensor {name!r}: rows of {shape[-1]} weights are not "
                         f"whole {GGMLType(ggml_type).name} blocks of {block}")
    return math.prod(shape) // block * size


# -- dequantization ---------------------------------------------------------------------------
def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte ``start`` of every block, as float32 [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32]: low nibbles are elements 0..15, high 16..31."""
    return torch.cat([qs & 0xF, qs >> 4], dim=1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian u32 -> [n, 32] bits (bit j belongs to element j)."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _bit_planes(h: torch.Tensor) -> torch.Tensor:
    """[n, 32] bytes -> [n, 8, 32] bits: plane ``j`` holds bit ``j`` of every byte (the
    K-quants' high bits: sub-block ``j`` of 32 weights reads plane ``j``)."""
    shifts = torch.arange(8, device=h.device, dtype=torch.uint8).view(1, 8, 1)
    return (h.unsqueeze(1) >> shifts) & 1


def _k3_scales(s: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 bytes -> 16 signed six-bit scales [n, 16] int (stored with a +32 offset):
    the low four bits are the nibbles of bytes 0-7 (low nibbles first), the high two bits
    come from bytes 8-11, two bits at a time."""
    low = torch.cat([s[:, :8] & 0xF, s[:, :8] >> 4], dim=1)
    high = torch.cat([(s[:, 8:12] >> sh) & 3 for sh in (0, 2, 4, 6)], dim=1)
    return (low | (high << 4)).to(torch.int16) - 32


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, [n, 8] each."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=1)
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return scales, mins


K_QUANTS = (GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)


def k_quant_parts(b: torch.Tensor, ggml_type: int):
    """K-quant super-blocks ``[n, bytes_per_block]`` -> ``(codes, scales, mins)``: integer
    codes ``[n, 256]`` (int16, weight order) and float32 factors ``[n, G]`` per group of
    ``256 / G`` weights (32 for Q4_K and Q5_K, 16 for Q2_K, Q3_K and Q6_K), ``mins`` None
    for the types without one, such that a weight is ``code * scale + min``.

    The factors are computed in float32 as ggml's ``dequantize_row_*`` computes its
    ``d1 = d * sc`` and ``m1 = dmin * m`` (``min = -m1``); a factor is a float16 value times
    a small integer and a code has at most 6 bits, so ``code * scale`` is exact in float32
    and ``code * scale + min`` rounds once, as ggml's ``d1 * q - m1`` does.
    """
    n = b.shape[0]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    if ggml_type in (GGMLType.Q4_K, GGMLType.Q5_K):
        sc, mn = _k4_scales(b[:, 4:16])
        qs = b[:, 16:].reshape(n, 4, 32) if ggml_type == GGMLType.Q4_K \
            else b[:, 48:].reshape(n, 4, 32)
        q = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(n, 8, 32)
        if ggml_type == GGMLType.Q5_K:           # sub-block j's fifth bit: bit j of qh
            q = q | (_bit_planes(b[:, 16:48]) << 4)
        return (q.reshape(n, 256).to(torch.int16), _f16(b, 0) * sc.float(),
                -(_f16(b, 2) * mn.float()))
    if ggml_type == GGMLType.Q2_K:
        sc = b[:, :16]
        qs = b[:, 16:80].reshape(n, 2, 1, 32)    # [half, shift, 32 lanes] -> 16 groups of 16
        q = ((qs >> shifts) & 3).reshape(n, 256).to(torch.int16)
        # ggml: dl = d * (sc & 0xF), ml = dmin * (sc >> 4), y = dl * q - ml
        return q, _f16(b, 80) * (sc & 0xF).float(), -(_f16(b, 82) * (sc >> 4).float())
    if ggml_type == GGMLType.Q3_K:
        qs = b[:, 32:96].reshape(n, 2, 1, 32)
        low = ((qs >> shifts) & 3).reshape(n, 256).to(torch.int16)
        # a clear high bit subtracts 4 (ggml: (hm & m) ? 0 : 4)
        high = _bit_planes(b[:, :32]).reshape(n, 256).to(torch.int16)
        return low - ((high ^ 1) << 2), _f16(b, 108) * _k3_scales(b[:, 96:108]).float(), None
    if ggml_type == GGMLType.Q6_K:
        ql = b[:, :128].reshape(n, 2, 2, 32)     # [half, first/second 32 bytes, 32]
        qh = b[:, 128:192].reshape(n, 2, 32)
        low = torch.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4,
                           ql[:, :, 1] >> 4], dim=2)                      # [n, 2, 4, 32]
        high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2)  # [n, 2, 4, 32]
        q = (low | (high << 4)).reshape(n, 256).to(torch.int16) - 32
        # group g (16 weights) has scale sc[g]; ggml: d * sc[is] * q
        sc = b[:, 192:208].contiguous().view(torch.int8).float()
        return q, _f16(b, 208) * sc, None
    raise ValueError(f"{type_name(ggml_type)} is not a K-quant type")


def iq4_parts(b: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_NL blocks ``[n, 18]`` or IQ4_XS super-blocks ``[n, 136]`` -> ``(codes, scales)``:
    the level of each weight (:data:`IQ4_VALUES`, int16 ``[n, W]``, weight order) and a
    float32 scale per 32 weights ``[n, W / 32]``, such that a weight is ``code * scale``.

    As in ggml's ``dequantize_row_iq4_*``: IQ4_NL's scale is its ``d``; IQ4_XS's sub-block
    ``j`` has the six-bit scale ``ls`` (low four bits from nibble ``j`` of ``scales_l``,
    high two from bits ``2j`` of ``scales_h``) and the scale ``d * (ls - 32)`` in float32.
    Every ``code * scale`` is exact in float32 (at most 11 + 5 + 7 significant bits).
    """
    n = b.shape[0]
    levels = torch.tensor(IQ4_VALUES, dtype=torch.int16, device=b.device)
    if ggml_type == GGMLType.IQ4_NL:
        return levels[_nibbles(b[:, 2:]).long()], _f16(b, 0)
    if ggml_type != GGMLType.IQ4_XS:
        raise ValueError(f"{type_name(ggml_type)} is not an IQ4 type")
    q = levels[_nibbles(b[:, 8:].reshape(n * 8, 16)).long()].reshape(n, 256)
    low = torch.stack([b[:, 4:8] & 0xF, b[:, 4:8] >> 4], dim=2).reshape(n, 8).to(torch.int32)
    high = b[:, 2:4].to(torch.int32)
    high = high[:, 0] | (high[:, 1] << 8)                          # u16 scales_h
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)
    ls = low | (((high.unsqueeze(1) >> shifts) & 3) << 4)
    return q, _f16(b, 0) * (ls - 32).float()


def _dequant_blocks(b: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """[n, bytes_per_block] uint8 -> [n, weights_per_block] float32, as ggml computes it."""
    n = b.shape[0]
    if ggml_type == GGMLType.Q8_0:
        return _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()
    if ggml_type == GGMLType.Q4_0:
        return (_nibbles(b[:, 2:]).float() - 8) * _f16(b, 0)
    if ggml_type == GGMLType.Q4_1:
        return _nibbles(b[:, 4:]).float() * _f16(b, 0) + _f16(b, 2)
    if ggml_type == GGMLType.Q5_0:
        q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)
        return (q.float() - 16) * _f16(b, 0)
    if ggml_type == GGMLType.Q5_1:
        q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
        return q.float() * _f16(b, 0) + _f16(b, 2)
    if ggml_type in K_QUANTS:
        q, scales, mins = k_quant_parts(b, ggml_type)
        w = q.float().reshape(n, scales.shape[1], -1) * scales.unsqueeze(-1)
        if mins is not None:
            w = w + mins.unsqueeze(-1)
        return w.reshape(n, 256)
    if ggml_type in (GGMLType.IQ4_NL, GGMLType.IQ4_XS):
        q, scales = iq4_parts(b, ggml_type)
        return (q.float().reshape(n, scales.shape[1], 32) * scales.unsqueeze(-1)).reshape(n, -1)
    raise ValueError(f"cannot dequantize {type_name(ggml_type)}")


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored bytes of one tensor -> a ``dtype`` tensor of ``shape`` (torch order).

    Args:
        raw: uint8 [nbytes], the tensor's bytes as stored (any device).
        ggml_type: one of :data:`SUPPORTED_TYPES`.
        shape: the tensor's torch shape; the last dim is a whole number of blocks.
        dtype: result dtype. Block types dequantize in float32 first, as ggml does.
    """
    if ggml_type == GGMLType.F32:
        return raw.view(torch.float32).reshape(shape).to(dtype)
    if ggml_type == GGMLType.F16:
        return raw.view(torch.float16).reshape(shape).to(dtype)
    if ggml_type == GGMLType.BF16:
        return raw.view(torch.bfloat16).reshape(shape).to(dtype)
    if ggml_type not in BLOCK_LAYOUT:
        raise ValueError(f"cannot dequantize {type_name(ggml_type)}; supported: "
                         f"{', '.join(t.name for t in SUPPORTED_TYPES)}")
    _, size = BLOCK_LAYOUT[ggml_type]
    return _dequant_blocks(raw.reshape(-1, size), ggml_type).reshape(shape).to(dtype)


# -- quantization (ggml's reference quantizers) ----------------------------------------------
def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize(x: np.ndarray | torch.Tensor, ggml_type: int) -> np.ndarray:
    """Float weights -> their GGUF bytes (uint8 [nbytes]), as ggml's reference
    ``quantize_row_*_ref`` computes them. Types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1; the last dim must be a multiple of 32 for the block types."""
    if isinstance(x, torch.Tensor):
        if ggml_type == GGMLType.BF16:
            return x.detach().cpu().to(torch.bfloat16).contiguous().view(torch.uint8) \
                .numpy().reshape(-1)
        x = x.detach().cpu().float().numpy()
    x = np.ascontiguousarray(x, dtype=np.float32)
    if ggml_type == GGMLType.F32:
        return x.reshape(-1).view(np.uint8)
    if ggml_type == GGMLType.F16:
        return x.astype(np.float16).reshape(-1).view(np.uint8)
    if ggml_type == GGMLType.BF16:
        return quantize(torch.from_numpy(x), ggml_type)
    if ggml_type not in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
                         GGMLType.Q5_1):
        raise ValueError(f"quantize supports F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                         f"not {type_name(ggml_type)}")
    if x.shape[-1] % 32:
        raise ValueError(f"rows of {x.shape[-1]} weights are not whole blocks of 32")
    blocks = x.reshape(-1, 32)
    with np.errstate(divide="ignore"):
        if ggml_type == GGMLType.Q8_0:
            d = np.abs(blocks).max(axis=1) / 127
            inv = np.where(d != 0, 1 / d, 0).astype(np.float32)
            v = blocks * inv[:, None]
            # roundf (halves away from zero); + 0.5 in float64 is exact for float32 v
            q = (np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)).astype(np.int8)
            return np.concatenate([_fp16_bytes(d), q.view(np.uint8)], axis=1).reshape(-1)
        top = 31 if ggml_type in (GGMLType.Q5_0, GGMLType.Q5_1) else 15
        if ggml_type in (GGMLType.Q4_0, GGMLType.Q5_0):
            signed_max = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
            half = (top + 1) // 2                # the code of 0: 8 (Q4_0) or 16 (Q5_0)
            d = signed_max / -half
            inv = np.where(d != 0, 1 / d, 0).astype(np.float32)
            q = np.minimum(top, np.trunc(blocks * inv[:, None] + (half + 0.5))).astype(np.uint8)
        else:
            lo, hi = blocks.min(axis=1), blocks.max(axis=1)
            d = (hi - lo) / top
            inv = np.where(d != 0, 1 / d, 0).astype(np.float32)
            q = np.minimum(top, np.trunc((blocks - lo[:, None]) * inv[:, None] + 0.5)) \
                .astype(np.uint8)
    packed = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
    head = [_fp16_bytes(d)]
    if ggml_type in (GGMLType.Q4_1, GGMLType.Q5_1):
        head.append(_fp16_bytes(lo))
    if top == 31:                                # the fifth bits: bit j of a u32, element j
        bits = (q >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)
        head.append(bits.sum(axis=1, dtype=np.uint32).astype("<u4")[:, None].view(np.uint8))
    return np.concatenate(head + [packed], axis=1).reshape(-1)


# -- writing ----------------------------------------------------------------------------------
def _pack_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value_type(v) -> int:
    if isinstance(v, (bool, np.bool_)):
        return _BOOL
    if isinstance(v, (int, np.integer)):
        return _UINT32 if 0 <= v < 2 ** 32 else _INT64
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
    items = list(v)
    kinds = {_value_type(i) for i in items}
    if kinds <= {_UINT32, _INT64}:                 # ints (or an empty list)
        etype = _INT64 if _INT64 in kinds else _UINT32
    elif kinds <= {_UINT32, _INT64, _FLOAT32}:
        etype = _FLOAT32
    elif len(kinds) == 1 and kinds != {_ARRAY}:
        etype = kinds.pop()
    else:
        raise TypeError("a GGUF array holds values of one scalar type")
    body = b"".join(_pack_value(i, etype) for i in items)
    return struct.pack("<IQ", etype, len(items)) + body


def write_gguf(path: str | os.PathLike, metadata: Mapping[str, Any],
               tensors: Mapping[str, tuple[np.ndarray | torch.Tensor, int]], *,
               alignment: int = DEFAULT_ALIGNMENT) -> None:
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
                raise ValueError(f"tensor {name!r}: {len(data)} bytes of "
                                 f"{type_name(ggml_type)} do not hold shape {shape}")
        else:
            shape = tuple(array.shape)
            data = quantize(array, ggml_type).tobytes()
        out += [_pack_string(name), struct.pack("<I", len(shape)),
                struct.pack(f"<{len(shape)}Q", *reversed(shape)),
                struct.pack("<IQ", int(ggml_type), offset)]
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
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors that carry no weights of ours: precomputed RoPE factors (read into the config).
_CONFIG_TENSORS = ("rope_freqs.weight",)


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor name (unknown names come back as is,
    so the loader reports them as unexpected)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return gguf_name


def config_from_gguf(g: GGUFFile, *, attention_backend: str = "auto") -> ModelConfig:
    """The :class:`ModelConfig` the metadata of ``g`` describes (ValueError when the
    architecture is not one of :data:`ARCHITECTURES` or a required key is missing)."""
    arch = g.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {str(g.path)!r}; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    meta = g.metadata

    def key(name: str, default=None, required: bool = False):
        value = meta.get(f"{arch}.{name}", default)
        if required and value is None:
            raise ValueError(f"GGUF file {str(g.path)!r} has no metadata {arch}.{name}")
        return value

    heads = int(key("attention.head_count", required=True))
    hidden = int(key("embedding_length", required=True))
    embed = g.tensors.get("token_embd.weight")
    vocab = (embed.shape[0] if embed else None) or key("vocab_size") \
        or len(meta.get("tokenizer.ggml.tokens", ()))
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch][0]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", required=True)),
        "num_hidden_layers": int(key("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": arch != "qwen2" and "blk.0.attn_q.bias" in g.tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in g.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": sorted({int(meta[k]) for k in (
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id") if meta.get(k) is not None}),
    }
    scaling = key("rope.scaling.type", "none")
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear",
                              "factor": float(key("rope.scaling.factor", 1.0))}
    elif scaling not in ("none", None):
        raise ValueError(f"unsupported RoPE scaling {scaling!r} in {str(g.path)!r}; "
                         "supported: none, linear, llama3 (rope_freqs)")
    if "rope_freqs.weight" in g.tensors:
        hf["rope_scaling"] = _llama3_rope(g.tensor("rope_freqs.weight").double(),
                                          hf["rope_theta"], hf["head_dim"], g.path)
    try:
        return ModelConfig.from_hf(hf, attention_backend=attention_backend)
    except ValueError as exc:
        raise ValueError(f"GGUF file {str(g.path)!r}: {exc}") from None


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_positions: int) -> torch.Tensor:
    """The per-frequency divisors llama.cpp stores as ``rope_freqs.weight`` for Llama-3
    RoPE scaling: float64 [head_dim // 2]."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original_max_positions / wavelen - low_freq_factor) \
        / (high_freq_factor - low_freq_factor)
    mid = 1 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen < original_max_positions / high_freq_factor, 1.0, mid)
    return torch.where(wavelen > original_max_positions / low_freq_factor, factor, out)


def _llama3_rope(stored: torch.Tensor, theta: float, head_dim: int, path) -> dict:
    """Llama-3 RoPE parameters that reproduce the stored factors. The file keeps only the
    factors; the common parameters (low 1, high 4, 8192 positions, as in every Llama-3.x
    release) are tried with the stored maximum as the scaling factor."""
    factor = float(stored.max())
    params = dict(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_positions=8192)
    if stored.shape == (head_dim // 2,) and torch.allclose(
            llama3_rope_factors(theta, head_dim, **params), stored, rtol=1e-5, atol=1e-6):
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    raise ValueError(f"GGUF file {str(path)!r}: rope_freqs.weight does not match Llama-3 RoPE "
                     "scaling with low_freq_factor 1, high_freq_factor 4 and 8192 original "
                     "positions; other RoPE factor tables are not supported")


def open_gguf_weights(g: GGUFFile, config: ModelConfig, device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.float32):
    """``(keys, get)`` over the Hugging Face names of ``g``'s weights, for
    :func:`osd.models.loading.load_hf_state_dict`: ``get`` dequantizes one tensor (on
    ``device``, to ``dtype``) and restores the Q/K row order. Unsupported quantization
    types raise ValueError up front, naming the type."""
    bad = [info for info in g.tensors.values() if info.type not in BLOCK_LAYOUT]
    if bad:
        raise ValueError(f"GGUF file {str(g.path)!r}: {unsupported_type_message(bad[0])}"
                         + (f" ({len(bad)} such tensors)" if len(bad) > 1 else ""))
    permuted = ARCHITECTURES[g.architecture][1]
    names = {hf_name(n): n for n in g.tensors if n not in _CONFIG_TENSORS}

    def get(key: str) -> torch.Tensor:
        name = names[key]
        w = g.tensor(name, dtype=dtype, device=device)
        if permuted and ".attn_q." in name:
            w = unpermute_rope_rows(w, config.num_heads)
        elif permuted and ".attn_k." in name:
            w = unpermute_rope_rows(w, config.num_kv_heads)
        return w

    return set(names), get


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
        raise ValueError(f"directory {str(path)!r} holds {len(found)} GGUF files "
                         f"({', '.join(p.name for p in found[:4])}); pass one file's path")
    return found[0] if found else None


def load_gguf_model(path: str | os.PathLike, *, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, attention_backend: str = "auto",
                    quantized: bool = False):
    """A :class:`~osd.models.llama.DecoderLM` with the weights of GGUF file ``path``,
    dequantized to ``dtype`` on ``device``.

    ``quantized``: keep the file's Q4_0 / Q4_1 / Q8_0 linear weights (and output head) as
    they are stored and compute with them (:mod:`osd.models.quant`; CPU and float32 only):
    the same outputs as the dequantized model, with 4-bit weights read at 0.75 bytes each
    instead of 4. The embedding stays float for lookups; other types stay float."""
    from osd.models.llama import DecoderLM
    from osd.models.loading import load_hf_state_dict
    from osd.models.quant import quantize_gguf_linears

    if quantized and (torch.device(device).type != "cpu" or dtype != torch.float32):
        raise ValueError(f"quantized=True computes with the CPU float32 kernels; got device "
                         f"{str(device)!r}, dtype {dtype} (load dequantized weights there: "
                         f"quantized=False)")
    g = GGUFFile(path)
    config = config_from_gguf(g, attention_backend=attention_backend)
    keys, get = open_gguf_weights(g, config, device=device, dtype=dtype)
    model = DecoderLM(config, device=device, dtype=dtype)
    try:
        load_hf_state_dict(model, keys, get)
    except ValueError as exc:
        raise ValueError(f"GGUF file {str(path)!r}: {exc}") from None
    if quantized:
        quantize_gguf_linears(model, g)
    return model.eval()


__all__ = ["GGUFFile", "GGUFTensorInfo", "GGMLType", "SUPPORTED_TYPES", "ARCHITECTURES",
           "dequantize", "quantize", "write_gguf", "unpermute_rope_rows", "hf_name",
           "config_from_gguf", "open_gguf_weights", "find_gguf", "tokenizer_from_gguf",
           "load_gguf_model", "llama3_rope_factors"]
