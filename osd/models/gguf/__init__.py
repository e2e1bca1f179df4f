"""GGUF checkpoints (llama.cpp's single-file format) for our Llama-family decoder.

Modules, each importing only those listed before it (and, where named, other osd
modules), so the dependencies run one way:

- :mod:`~osd.models.gguf.blocks`: the ggml tensor types, their block layouts,
  dequantizers and reference quantizers (stdlib, numpy and torch only);
- :mod:`~osd.models.gguf.format`: the file reader (:class:`GGUFFile`) and writer
  (:func:`write_gguf`), :func:`find_gguf` (nothing of osd but ``blocks``);
- :mod:`~osd.models.gguf.tokenizer`: the tokenizer in a file's metadata as a transformers
  tokenizer (:func:`tokenizer_from_gguf`; reads a ``GGUFFile``, imports nothing of osd);
- :mod:`~osd.models.gguf.convert`: the file in our terms: its :class:`ModelConfig`
  (:func:`config_from_gguf`, with :mod:`osd.models.config`) and its tensors under Hugging
  Face names (:func:`open_gguf_weights`, :func:`unpermute_rope_rows`);
- :mod:`~osd.models.gguf.load`: :func:`load_gguf_model`, a ``DecoderLM`` from a file (it
  imports :mod:`osd.models.llama`, :mod:`osd.models.quant` and
  :mod:`osd.models.hf_weights`);
- :mod:`~osd.models.gguf.export`: a draft directory written as a GGUF file for llama.cpp's
  draft mode (``write_draft_gguf``; ``blocks`` and ``format`` only), imported on use.

:mod:`osd.models.quant` imports ``blocks`` and ``convert``, and :mod:`osd.models.loading`
imports ``load``. Importing any submodule runs this ``__init__`` first, so it imports the
four modules below the model eagerly and ``load`` only on first use of
``load_gguf_model`` (eagerly, the import of ``quant`` would reach ``llama`` while
``llama`` itself is still importing ``quant``).
"""

from osd.models.gguf.blocks import (
    BLOCK_LAYOUT,
    SUPPORTED_TYPES,
    GGMLType,
    dequantize,
    quantize,
    type_name,
)
from osd.models.gguf.convert import (
    ARCHITECTURES,
    config_from_gguf,
    hf_name,
    llama3_rope_factors,
    open_gguf_weights,
    unpermute_rope_rows,
)
from osd.models.gguf.format import (
    GGUFFile,
    GGUFTensorInfo,
    find_gguf,
    unsupported_type_message,
    write_gguf,
)
from osd.models.gguf.tokenizer import tokenizer_from_gguf


def __getattr__(name: str):
    if name == "load_gguf_model":
        # load imports the model (llama, quant), which imports this package: loaded on
        # first use (see the module docstring)
        from osd.models.gguf.load import load_gguf_model

        return load_gguf_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GGUFFile",
    "GGUFTensorInfo",
    "GGMLType",
    "BLOCK_LAYOUT",
    "SUPPORTED_TYPES",
    "ARCHITECTURES",
    "type_name",
    "dequantize",
    "quantize",
    "write_gguf",
    "find_gguf",
    "unsupported_type_message",
    "unpermute_rope_rows",
    "hf_name",
    "config_from_gguf",
    "open_gguf_weights",
    "llama3_rope_factors",
    "tokenizer_from_gguf",
    "load_gguf_model",
]
