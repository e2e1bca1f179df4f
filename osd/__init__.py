"""osd: online speculative decoding on a lean Llama-family runtime.

``Engine.from_pretrained(target, draft=None, ...)`` loads a checkpoint directory or a
transformers model; ``Engine.generate(prompts, SamplingParams(...))`` returns one
``Output`` per prompt.
"""

from osd import _openmp  # noqa: F401  first: sets libgomp's spin count before torch loads
from osd import _moved, zoo  # after _openmp: this loads torch
from osd.cache import KVCache
from osd.async_engine import AsyncEngine
from osd.engine import Engine
from osd.request import RequestError
from osd.models import DecoderLM, EagleLM, ModelConfig, load_eagle, load_model
from osd.online.config import OnlineConfig, OnlineRecipe, OnlineRuntime
from osd.online.router import RouterConfig
from osd.sampling import Output, SamplingParams, TokenLogprobs
from osd.spec import DynamicTree, PromptLookup, SpecConfig

__all__ = [
    "Engine",
    "AsyncEngine",
    "RequestError",
    "SamplingParams",
    "Output",
    "TokenLogprobs",
    "SpecConfig",
    "DynamicTree",
    "PromptLookup",
    "OnlineConfig",
    "OnlineRecipe",
    "OnlineRuntime",
    "RouterConfig",
    "KVCache",
    "DecoderLM",
    "ModelConfig",
    "load_model",
    "EagleLM",
    "load_eagle",
    "zoo",
]

_moved.install()  # old module paths (osd._moved.MOVED) keep importing
