"""Loading our decoder from a Hugging Face checkpoint directory, a GGUF file or a
transformers model.

A GGUF checkpoint is a ``.gguf`` file, or a directory whose only checkpoint is one
``.gguf`` file (no ``config.json``); see :mod:`osd.models.gguf`. A Hugging Face checkpoint
directory holds ``config.json`` and the weights in one of ``model.safetensors``,
``model.safetensors.index.json`` (sharded), ``pytorch_model.bin`` or
``pytorch_model.bin.index.json`` (sharded). Safetensors are read lazily, tensor by tensor,
straight into the preallocated parameters.

Errors name the problem: FileNotFoundError for a missing directory, config or weight
file; ValueError for a corrupt file, an unsupported architecture (listing the supported
ones), missing/unexpected/mis-shaped tensors, or an unknown device; TypeError for an
unsupported dtype or source type.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors import safe_open
from torch import nn

from osd.models.config import TEXT_MODELS, ModelConfig
from osd.models.gguf.format import GGUFFile, find_gguf
from osd.models.gguf.load import load_gguf_model
from osd.models.gguf.tokenizer import tokenizer_from_gguf
from osd.models.hf_weights import load_hf_state_dict
from osd.models.llama import DecoderLM

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``; ValueError for an unknown string or missing CUDA."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"unknown device {device!r}; expected 'cpu', 'cuda' or 'cuda:N' ({exc})"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; expected 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def check_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in DTYPES:
        raise TypeError(
            f"unsupported dtype {dtype!r}; expected one of torch.float32, "
            "torch.bfloat16, torch.float16"
        )
    return dtype


def is_transformers_model(obj) -> bool:
    """True for an in-memory transformers model (an ``nn.Module`` with a ``config``)."""
    return isinstance(obj, nn.Module) and hasattr(getattr(obj, "config", None), "to_dict")


# A checkpoint's reduced head vocabulary (see load_model).
HEAD_VOCAB_FILE = "head_vocab.json"


def load_model(
    source,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
    head_vocab: bool = True,
    quantized: bool | str = False,
) -> DecoderLM:
    """Build a :class:`DecoderLM` from ``source``: a checkpoint directory or GGUF file
    (str / PathLike) or an in-memory transformers ``*ForCausalLM`` model. Weights are
    converted (GGUF: dequantized) to ``dtype`` and placed on ``device``.

    A checkpoint directory may hold :data:`HEAD_VOCAB_FILE`, a JSON list of token ids: with
    ``head_vocab`` (the default) the model keeps only those rows of its output head
    (:meth:`DecoderLM.restrict_head`, a draft's reduced vocabulary). Other loaders, such
    as transformers, ignore the file and see the full head.

    ``quantized``: a GGUF file's block-quantized weights stay quantized (True, or
    ``"int8"`` to multiply them with int8 activations; see :func:`load_gguf_model`);
    other sources raise ValueError."""
    device = resolve_device(device)
    check_dtype(dtype)
    gguf_file = _gguf_source(source)
    if gguf_file is not None:
        return load_gguf_model(
            gguf_file,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            quantized=quantized,
        )
    if quantized:
        name = str(source) if isinstance(source, (str, os.PathLike)) else type(source).__name__
        raise ValueError(
            f"quantized=True keeps a GGUF file's quantized weights, but {name!r} "
            f"is not a GGUF file (osd.models.quant.quantize_linears quantizes a "
            f"loaded float model)"
        )
    if is_transformers_model(source):
        config = ModelConfig.from_hf(
            source.config, architecture=type(source).__name__, attention_backend=attention_backend
        )
        state = source.state_dict()
        getter: Callable[[str], torch.Tensor] = state.__getitem__
        keys = set(state)
        if type(source).__name__ in TEXT_MODELS:
            keys, getter = language_model_view(keys, getter)
    elif isinstance(source, (str, os.PathLike)):
        path = checkpoint_dir(source)
        raw = read_config(path)
        try:
            config = ModelConfig.from_hf(raw, attention_backend=attention_backend)
        except ValueError as exc:
            raise ValueError(f"checkpoint {str(path)!r}: {exc}") from None
        keys, getter = _open_weights(path)
        if set(raw.get("architectures") or ()) & set(TEXT_MODELS):
            keys, getter = language_model_view(keys, getter)
    else:
        raise TypeError(
            f"expected a checkpoint directory path or a transformers model, got "
            f"{type(source).__name__}"
        )
    model = DecoderLM(config, device=device, dtype=dtype)
    gemma = config.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
    load_hf_state_dict(model, keys, getter, norm_shift=1.0 if gemma else 0.0)
    if head_vocab and isinstance(source, (str, os.PathLike)):
        ids = read_head_vocab(checkpoint_dir(source))
        if ids is not None:
            model.restrict_head(ids)
    return model.eval()


def read_head_vocab(path: Path) -> list[int] | None:
    """The token ids of ``path / HEAD_VOCAB_FILE``, or None when the file is absent."""
    file = path / HEAD_VOCAB_FILE
    if not file.is_file():
        return None
    try:
        ids = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"corrupt {HEAD_VOCAB_FILE} in {str(path)!r}: {exc}") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(
            f"corrupt {HEAD_VOCAB_FILE} in {str(path)!r}: expected a JSON list of token ids"
        )
    return ids


def is_gguf_source(source) -> bool:
    """Whether ``source`` is (or is a directory holding) a GGUF file."""
    return _gguf_source(source) is not None


def _gguf_source(source) -> Path | None:
    """The GGUF file behind ``source``: a ``.gguf`` path, or the one ``.gguf`` in a
    directory without ``config.json``; None for anything else."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    path = Path(source)
    if path.suffix.lower() != ".gguf" and (not path.is_dir() or (path / "config.json").exists()):
        return None
    return find_gguf(path)


def checkpoint_dir(source: str | os.PathLike) -> Path:
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint path {str(path)!r} is not a directory")
    return path


def read_config(path: Path) -> dict:
    """The parsed ``config.json`` of a checkpoint directory."""
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {str(path)!r}")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"corrupt config.json in {str(path)!r}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"corrupt config.json in {str(path)!r}: not a JSON object")
    return config


def _open_weights(path: Path):
    """``(keys, get)`` over the checkpoint's tensors, reading lazily where possible."""
    present = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if not present:
        raise FileNotFoundError(
            f"no weights in checkpoint directory {str(path)!r}; expected "
            f"one of {', '.join(WEIGHT_FILES)}"
        )
    name = present[0]
    if name.endswith(".index.json"):
        try:
            weight_map = json.loads((path / name).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"corrupt index {str(path / name)!r}: {exc}") from None
        files = sorted(set(weight_map.values()))
    else:
        files = [name]
    readers = {}
    for file in files:
        full = path / file
        if not full.is_file():
            raise FileNotFoundError(
                f"checkpoint shard {str(full)!r} listed in the index is missing"
            )
        readers[file] = _read_file(full)
    owner = {key: file for file, reader in readers.items() for key in reader.keys()}

    def get(key: str) -> torch.Tensor:
        try:
            return readers[owner[key]].get_tensor(key)
        except Exception as exc:  # a damaged tensor surfaces only when it is read
            raise ValueError(
                f"corrupt checkpoint file {str(path / owner[key])!r}: tensor {key}: {exc}"
            ) from None

    return set(owner), get


class _BinReader:
    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = state

    def keys(self):
        return self.state.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.state[key]


def _read_file(file: Path):
    try:
        if file.suffix == ".safetensors":
            return safe_open(str(file), framework="pt", device="cpu")
        try:
            state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) .bin files cannot be memory-mapped
            state = torch.load(str(file), map_location="cpu", weights_only=True)
        return _BinReader(state)
    except Exception as exc:  # safetensors / pickle raise many types for a corrupt file
        raise ValueError(f"corrupt checkpoint file {str(file)!r}: {exc}") from None


# Where a multimodal checkpoint keeps its language model's tensors (older and newer
# transformers layouts), and what these names are in a text-only checkpoint.
_LANGUAGE_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def language_model_view(keys, get: Callable[[str], torch.Tensor]):
    """``(keys, get)`` over a multimodal checkpoint's language-model tensors under their
    text-only names (``model.layers...``, ``lm_head.weight``); the vision tower and the
    projector are left out."""
    names = {}
    for key in keys:
        for prefix, text in _LANGUAGE_PREFIXES:
            if key.startswith(prefix):
                names[text + key[len(prefix) :]] = key
        if key == "lm_head.weight":
            names[key] = key
    return set(names), lambda name: get(names[name])


def load_tokenizer(source):
    """The tokenizer saved in checkpoint directory ``source`` (local files only) or built
    from a GGUF checkpoint's metadata, or None when there is none (or ``source`` is not a
    path)."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    gguf_file = _gguf_source(source)
    if gguf_file is not None:
        return tokenizer_from_gguf(GGUFFile(gguf_file))
    path = Path(source)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    # transformers is slow to import and only tokenizers need it: kept off `import osd`
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # A plain tokenizers-library tokenizer (tokenizer.json) is loaded as is: AutoTokenizer
    # would rebuild it as the model type's tokenizer class.
    generic = _tokenizer_class(path) in ("PreTrainedTokenizerFast", "TokenizersBackend")
    try:
        if generic and (path / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot load the tokenizer in {str(path)!r}: {exc}") from None


def _tokenizer_class(path: Path) -> str | None:
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
