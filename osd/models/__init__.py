"""Model runtime: our Llama-family decoder, its config, attention dispatch and loading."""

from osd.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from osd.models.eagle import EagleLM, load_eagle, save_eagle
from osd.models.llama import DecoderLM
from osd.models.loading import load_hf_state_dict, load_model, load_tokenizer
from osd.models.quant import QuantLinear, quantize_linears

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "DecoderLM",
    "EagleLM",
    "load_eagle",
    "save_eagle",
    "load_model",
    "load_hf_state_dict",
    "load_tokenizer",
    "QuantLinear",
    "quantize_linears",
]
