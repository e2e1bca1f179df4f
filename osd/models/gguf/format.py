"""The GGUF file format (llama.cpp's single-file checkpoints): reading and writing.

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
``(in, out)``. Quantized types store each row as whole blocks (32 or 256 weights), whose
layouts and (de)quantizers are in :mod:`osd.models.gguf.blocks`.

The file is memory-mapped once; tensors are read and dequantized one at a time, so loading
needs the file plus one float32 tensor of working memory beyond the model itself.
:func:`write_gguf` writes GGUF files (the tests build small checkpoints with it).

This module and :mod:`osd.models.gguf.blocks` are the format layer: they import nothing
else of osd.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from osd.models.gguf.blocks import (
    BLOCK_LAYOUT,
    SUPPORTED_TYPES,
    GGMLType,
    dequantize,
    quantize,
    type_name,
)

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
