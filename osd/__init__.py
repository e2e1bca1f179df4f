"""osd: online speculative decoding on a lean Llama-family runtime.

``Engine.from_pretrained(target, draft=None, ...)`` loads a checkpoint directory or a
transformers model; ``Engine.generate(prompts, SamplingParams(...))`` returns one
``Output`` per prompt.
"""

import os

# PyTorch's OpenMP runtime (libgomp) keeps the threads of a parallel region spinning after
# it ends. A decode step runs hundreds of short regions; on a CPU shared with anything else
# (a server's event loop, another process) a team member that lost its core stalls every
# region, and decoding falls to a few tokens/s (bench/bench_wait_policy.py). Sleeping
# threads degrade gracefully. libgomp reads this when torch loads, so it applies when osd is
# imported first; an explicit OMP_WAIT_POLICY is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from osd import _moved, zoo  # after the OpenMP setting: this loads torch
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
