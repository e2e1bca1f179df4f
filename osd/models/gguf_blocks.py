"""The GGUF tensor types, now :mod:`osd.models.gguf.blocks` (this path re-exports it)."""

from osd.models.gguf.blocks import (
    BLOCK_LAYOUT,
    IQ4_VALUES,
    K_QUANTS,
    SUPPORTED_TYPES,
    GGMLType,
    dequantize,
    high_bits,
    iq4_parts,
    k_quant_parts,
    nibbles,
    quantize,
    type_name,
)

__all__ = [
    "BLOCK_LAYOUT",
    "IQ4_VALUES",
    "K_QUANTS",
    "SUPPORTED_TYPES",
    "GGMLType",
    "dequantize",
    "high_bits",
    "iq4_parts",
    "k_quant_parts",
    "nibbles",
    "quantize",
    "type_name",
]
