"""The tokenizer in a GGUF file's metadata, now :mod:`osd.models.gguf.tokenizer` (this
path re-exports it)."""

from osd.models.gguf.tokenizer import tokenizer_from_gguf

__all__ = ["tokenizer_from_gguf"]
