"""A :class:`~osd.models.llama.DecoderLM` from a GGUF file (:func:`load_gguf_model`).

The top of the GGUF package: it imports the model (:mod:`osd.models.llama`), the
quantized layers (:mod:`osd.models.quant`) and the weight copier
(:mod:`osd.models.hf_weights`), none of which import it back.
"""

from __future__ import annotations

import os

import torch

from osd.models.gguf.convert import config_from_gguf, open_gguf_weights
from osd.models.gguf.format import GGUFFile
from osd.models.hf_weights import load_hf_state_dict
from osd.models.llama import DecoderLM
from osd.models.quant import quantize_gguf_linears, use_int8_activations
from osd_kernels import use_vnni


def load_gguf_model(
    path: str | os.PathLike,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
    quantized: bool | str = False,
) -> DecoderLM:
    """A :class:`~osd.models.llama.DecoderLM` with the weights of GGUF file ``path``,
    dequantized to ``dtype`` on ``device``.

    ``quantized``: keep the file's block-quantized linear weights (and output head) as
    they are stored, or as codes and factors, and compute with them
    (:mod:`osd.models.quant`; CPU and float32 only): the same outputs as the dequantized
    model, with 4-bit weights read at 0.75 bytes each instead of 4. The embedding stays
    float for lookups; float tensors stay float. ``quantized="int8"``: the same, every
    layer multiplied with int8 activations where the CPU has AVX-512 VNNI
    (:func:`~osd.models.quant.use_int8_activations`: not the dequantized model's float32
    product; few-row forwards much cheaper), and its caches then keep K/V in float16
    (``model.kv_dtype``; attention reads half the bytes a key) where the attention's
    AVX-512 path reads them so."""
    if quantized not in (False, True, "int8"):
        raise ValueError(f"quantized must be False, True or 'int8', got {quantized!r}")
    if quantized and (torch.device(device).type != "cpu" or dtype != torch.float32):
        raise ValueError(
            f"quantized=True computes with the CPU float32 kernels; got device "
            f"{str(device)!r}, dtype {dtype} (load dequantized weights there: "
            f"quantized=False)"
        )
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
        if quantized == "int8" and use_vnni() and use_int8_activations(model):
            # Where activations are already rounded to 8 bits, K/V in float16 (rounded at
            # 11 significant bits) cost little accuracy and halve what attention reads:
            # where tree_attention's AVX-512 path reads them as they are (head dims a
            # multiple of 16 up to 256, no soft-capped scores), not widened first.
            D = config.head_dim
            if D % 16 == 0 and D <= 256 and config.attn_logit_softcapping is None:
                model.kv_dtype = torch.float16
    return model.eval()
