"""osd: online speculative decoding on a lean Llama-family runtime.

``Engine.from_pretrained(target, draft=None, ...)`` loads a checkpoint directory or a
transformers model; ``Engine.generate(prompts, SamplingParams(...))`` returns one
``Output`` per prompt.
"""

import os

# PyTorch's OpenMP runtime (libgomp) decides what a parallel region's threads do after it
# ends. A decode step runs hundreds of short regions a few microseconds apart. Threads that
# sleep at once (OMP_WAIT_POLICY=PASSIVE) pay a wake-up at every region, about half the
# speed on an idle CPU; threads that spin long (libgomp's default, 300,000 rounds) hold
# the cores when anything else wants them, and a member that lost its core stalls every
# region. osd lets them spin 1,000 rounds and then sleep (GOMP_SPINCOUNT, with the policy
# unset): enough to bridge the gaps inside a step, short enough to leave a shared core
# (bench/bench_wait_policy.py). libgomp reads these when torch loads, so they apply when osd
# is imported first; an OMP_WAIT_POLICY or GOMP_SPINCOUNT the user set is kept.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")

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
