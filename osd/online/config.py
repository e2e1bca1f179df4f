"""Configuration of online distillation: ``osd.OnlineConfig``, made of an
:class:`OnlineRecipe` (what the draft learns and when) and an :class:`OnlineRuntime` (how
the learner runs beside serving), plus the router's ``RouterConfig``."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch

from osd.online.router import RouterConfig

LOSSES = ("fkl", "rkl", "jsd", "tvd")
POSITION_POLICIES = ("all", "corrected")
AUTOCAST_DTYPES = (None, "bfloat16", "float16", "auto")


def _at_least_one(part, names) -> None:
    for name in names:
        if getattr(part, name) < 1:
            raise ValueError(
                f"{type(part).__name__}.{name} must be >= 1, got {getattr(part, name)}"
            )


@dataclass(frozen=True)
class OnlineRecipe:
    """What the draft learns, from which of the target's verdicts, and when.

    The defaults are the recipe tuned on the chat pair with the learner on one CPU core
    beside serving (``docs/online.md`` gives the reasons): forward KL against the target's
    stored top-k distribution, small frequent updates that rehearse older requests beside
    the newest, each request's newest tokens, the responses only, and a held-out guard that
    rolls back an update that lowers acceptance. A draft directory can carry its own
    recipe (:func:`draft_online_recipe`).
    """

    loss: str = "fkl"  # fkl | rkl | jsd | tvd (osd_kernels.distill_loss)
    beta: float = 0.5  # JSD mixing weight beta (jsd only)
    positions: str = "all"  # "all" verified positions, or "corrected" (OSD's choice)
    prompt_positions: int = 0  # ... and the target's at a prompt's last n positions (the
    # prefill computes them anyway; prompt lookup already drafts text copied from prompts)
    topk: int | None = 32  # target top-k stored per position; None = full logits
    update_every_requests: int = 8  # an update after this many finished requests ...
    update_every_tokens: int | None = None  # ... or after this many collected positions
    steps_per_update: int = 4  # optimizer steps per update
    eagle_passes: int = 2  # EAGLE drafts: forward passes per step, each after the
    # first reading the draft's own predicted features
    batch_positions: int = 1536  # buffered positions used per update ...
    replay_fraction: float = 0.75  # ... this share drawn at random from older requests
    # (rehearsal), the rest the newest
    buffer_positions: int = 65536  # replay buffer capacity, in stored positions: how far
    # back rehearsal reaches
    max_train_len: int = 256  # newest tokens of a request fed to the draft
    lr: float = 3e-4  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping (<= 0 disables)
    autocast: str | None = "auto"  # "bfloat16" | "float16": the draft's forward in this
    # dtype under torch.autocast, its weights and AdamW state fp32 (eager steps: no CUDA
    # graph capture); "auto": bf16 on a CPU with native bf16 matmuls, otherwise none
    # (resolve_autocast)
    holdout_every: int = 5  # every n-th request goes to the held-out slice ...
    holdout_requests: int = 8  # ... of the newest n such; older ones retire into the
    # training set
    guard_tolerance: float = 0.02  # keep an update unless held-out alpha drops by more
    seed: int = 0  # seed of the learner's sampling of batches

    def __post_init__(self):
        name = type(self).__name__
        if self.loss not in LOSSES:
            raise ValueError(f"{name}.loss must be one of {LOSSES}, got {self.loss!r}")
        if self.positions not in POSITION_POLICIES:
            raise ValueError(
                f"{name}.positions must be one of {POSITION_POLICIES}, got {self.positions!r}"
            )
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"{name}.beta must be in [0, 1], got {self.beta}")
        if self.topk is not None and self.topk < 1:
            raise ValueError(f"{name}.topk must be >= 1 or None, got {self.topk}")
        if self.prompt_positions < 0:
            raise ValueError(f"{name}.prompt_positions must be >= 0, got {self.prompt_positions}")
        _at_least_one(
            self,
            (
                "update_every_requests",
                "steps_per_update",
                "eagle_passes",
                "batch_positions",
                "buffer_positions",
                "max_train_len",
                "holdout_requests",
            ),
        )
        if not 0.0 <= self.replay_fraction < 1.0:
            raise ValueError(
                f"{name}.replay_fraction must be in [0, 1), got {self.replay_fraction}"
            )
        if self.lr <= 0:
            raise ValueError(f"{name}.lr must be > 0, got {self.lr}")
        if self.autocast not in AUTOCAST_DTYPES:
            raise ValueError(
                f"{name}.autocast must be one of {AUTOCAST_DTYPES}, got {self.autocast!r}"
            )


@dataclass(frozen=True)
class OnlineRuntime:
    """How the learner runs beside serving: in a thread or inline, CUDA graphs, the C
    heap, the size of its statistics, and checkpoints."""

    background: bool = True  # train in a thread (CPU) / side stream (GPU)
    wait_for_update: bool = False  # serving waits for each update to finish
    cuda_graphs: bool = True  # capture the training step on CUDA (bucketed shapes)
    max_train_graphs: int = 8  # captured training steps kept (least recently used go)
    trim_after_update: bool = True  # hand the heap's free pages back to the system after
    # each update (glibc malloc_trim; osd/online/memory.py)
    mmap_threshold: int | None = None  # pin glibc's mmap threshold at this many bytes
    # (flat memory, but every large block is mapped anew)
    history_requests: int = 4096  # newest requests whose (draft, alpha) stats are kept
    history_updates: int = 256  # newest update records kept per draft
    checkpoint_dir: str | None = None  # where learned weights are checkpointed (and resumed)
    checkpoint_every: int = 10  # applied updates between checkpoints

    def __post_init__(self):
        _at_least_one(
            self, ("max_train_graphs", "history_requests", "history_updates", "checkpoint_every")
        )
        if self.mmap_threshold is not None and self.mmap_threshold < 1:
            raise ValueError(
                f"OnlineRuntime.mmap_threshold must be >= 1 or None, got {self.mmap_threshold}"
            )


RECIPE_FIELDS = tuple(f.name for f in dataclasses.fields(OnlineRecipe))
RUNTIME_FIELDS = tuple(f.name for f in dataclasses.fields(OnlineRuntime))


@dataclass(init=False)
class OnlineConfig:
    """How the draft(s) learn from the target's verdicts while serving:
    ``OnlineConfig(recipe=OnlineRecipe(...), runtime=OnlineRuntime(...),
    router=RouterConfig(...))``, each part its defaults when left out.

    Every field of the recipe and of the runtime is also a keyword and an attribute of the
    config itself: ``OnlineConfig(lr=1e-3, background=False)`` replaces those fields of the
    parts given (or of the default parts), ``cfg.lr`` reads ``cfg.recipe.lr``, and
    ``dataclasses.replace(cfg, lr=1e-3)`` works. The parts are frozen, so configs may share
    them; assigning ``cfg.lr = ...`` replaces ``cfg.recipe`` with a checked copy.
    """

    recipe: OnlineRecipe
    runtime: OnlineRuntime
    router: RouterConfig  # used with several drafts

    def __init__(
        self,
        recipe: OnlineRecipe | None = None,
        runtime: OnlineRuntime | None = None,
        router: RouterConfig | None = None,
        **fields,
    ):
        parts = (
            ("recipe", OnlineRecipe, recipe, RECIPE_FIELDS),
            ("runtime", OnlineRuntime, runtime, RUNTIME_FIELDS),
        )
        unknown = set(fields).difference(RECIPE_FIELDS, RUNTIME_FIELDS)
        if unknown:
            raise TypeError(f"OnlineConfig got unexpected keyword arguments {sorted(unknown)}")
        for name, cls, part, names in parts:
            if part is None:
                part = cls()
            elif not isinstance(part, cls):
                raise TypeError(f"OnlineConfig.{name} must be an {cls.__name__}, got {part!r}")
            mine = {k: v for k, v in fields.items() if k in names}
            setattr(self, name, dataclasses.replace(part, **mine) if mine else part)
        if router is not None and not isinstance(router, RouterConfig):
            raise TypeError(f"OnlineConfig.router must be a RouterConfig, got {router!r}")
        self.router = RouterConfig() if router is None else router


def _field_of(part: str, name: str) -> property:
    def get(self):
        return getattr(getattr(self, part), name)

    def put(self, value):
        setattr(self, part, dataclasses.replace(getattr(self, part), **{name: value}))

    return property(get, put, doc=f"``{part}.{name}``")


for _name in RECIPE_FIELDS:
    setattr(OnlineConfig, _name, _field_of("recipe", _name))
for _name in RUNTIME_FIELDS:
    setattr(OnlineConfig, _name, _field_of("runtime", _name))
del _name

# Names a flat recipe (serving.json, with_recipe) may set.
FLAT_FIELDS = (*RECIPE_FIELDS, *RUNTIME_FIELDS, "router")
ONLINE_KEY = "online"  # the recipe's key in a draft directory's serving.json


def draft_online_recipe(path) -> dict | None:
    """The online-learning recipe a draft directory recommends: the ``"online"`` object of
    its ``serving.json`` (flat :class:`OnlineConfig` keywords, normally
    :class:`OnlineRecipe` fields), or None (no file, no key, not a directory). ValueError
    naming the file when it is malformed."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    file = os.path.join(os.fspath(path), "serving.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            recipe = json.load(f).get(ONLINE_KEY)
        if recipe is None:
            return None
        if not isinstance(recipe, dict):
            raise ValueError(f"{ONLINE_KEY!r} must be an object of OnlineConfig fields")
        OnlineConfig(**recipe)  # every field known and valid
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"bad online recipe in {file}: {exc}") from None
    return recipe


def with_recipe(config: OnlineConfig, recipe: dict | None) -> OnlineConfig:
    """``recipe`` (flat :class:`OnlineConfig` keywords) under ``config``: a field the caller
    changed from its default keeps the caller's value, every other field takes the
    recipe's."""
    if not recipe:
        return config
    default = OnlineConfig()
    mine = {
        name: getattr(config, name)
        for name in FLAT_FIELDS
        if getattr(config, name) != getattr(default, name)
    }
    return OnlineConfig(**{**recipe, **mine})


def cpu_has_fast_bf16() -> bool:
    """True when oneDNN reports bf16 matmul support on this CPU (AVX-512 class cores).
    On AVX2-only CPUs it does not, and a bf16 autocast training step there measured many
    times slower than fp32 (``docs/online.md``)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_autocast(autocast: str | None, device) -> str | None:
    """The autocast dtype name a learner on ``device`` uses for ``OnlineRecipe.autocast``:
    ``"auto"`` is bf16 on a CPU with fast bf16 (:func:`cpu_has_fast_bf16`) and none
    elsewhere (on CUDA the fp32 step is captured in a CUDA graph instead); other values
    are used as given."""
    if autocast != "auto":
        return autocast
    if torch.device(device).type == "cpu" and cpu_has_fast_bf16():
        return "bfloat16"
    return None
