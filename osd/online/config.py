"""Configuration of online distillation (``osd.OnlineConfig``)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from osd.online.router import RouterConfig

LOSSES = ("fkl", "rkl", "jsd", "tvd")
POSITION_POLICIES = ("all", "corrected")
AUTOCAST_DTYPES = (None, "bfloat16", "float16", "auto")


@dataclass
class OnlineConfig:
    """How the draft learns from the target's verdicts while serving.

    The defaults are the recipe measured on the chat pair on a 2-core CPU, where the
    learner has one core beside serving (``docs/online.md``): forward KL against the
    target's stored top-k distribution (as OSD), an update every 8 finished requests of 4
    AdamW steps at lr 3e-4 on batches of 1,536 positions, three quarters of them rehearsed
    from older requests (``replay_fraction``), each request's newest 256 tokens, the
    responses only (``prompt_positions=0``: prompt lookup covers text copied from the
    prompt), and a held-out guard over the newest 8 held-out requests that tolerates a
    drop of 0.02 in their α. A draft directory may carry its own recipe in its
    ``serving.json`` (:func:`draft_online_recipe`); ``Engine.from_pretrained`` applies it
    under the fields a caller sets. ``prompt_positions=n`` also distils the target's
    distributions at each prompt's last n positions, which the prefill computes anyway.
    """

    loss: str = "fkl"  # fkl | rkl | jsd | tvd (osd_kernels.distill_loss)
    beta: float = 0.5  # JSD mixing weight beta (jsd only)
    positions: str = "all"  # "all" verified positions, or "corrected" (OSD's choice)
    prompt_positions: int = 0  # ... and the target's at a prompt's last n positions
    topk: int | None = 32  # target top-k stored per position; None = full logits
    update_every_requests: int = 8  # an update after this many finished requests ...
    update_every_tokens: int | None = None  # ... or after this many collected positions
    steps_per_update: int = 4  # optimizer steps per update
    eagle_passes: int = 2  # EAGLE drafts: forward passes per step, each after the
    #                                    first reading the draft's own predicted features
    batch_positions: int = 1536  # buffered positions used per update ...
    replay_fraction: float = 0.75  # ... this share drawn at random from older requests
    # (rehearsal), the rest the newest
    lr: float = 3e-4  # AdamW learning rate
    autocast: str | None = "auto"  # "bfloat16" | "float16": the draft's forward in this
    # dtype under torch.autocast, its weights and AdamW
    # state fp32 (eager steps: no CUDA graph capture);
    # "auto": bf16 on a CPU with native bf16 matmuls,
    # otherwise none (resolve_autocast)
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping (<= 0 disables)
    buffer_positions: int = 65536  # replay buffer capacity, in stored positions
    holdout_every: int = 5  # every n-th request goes to the held-out slice ...
    holdout_requests: int = 8  # ... of the newest n such; older ones retire into
    # the training set
    guard_tolerance: float = 0.02  # keep an update unless held-out alpha drops by more
    background: bool = True  # train in a thread (CPU) / side stream (GPU)
    wait_for_update: bool = False  # serving waits for each update to finish
    checkpoint_dir: str | None = None  # where learned weights are checkpointed (and resumed)
    checkpoint_every: int = 10  # applied updates between checkpoints
    max_train_len: int = 256  # newest tokens of a request fed to the draft
    cuda_graphs: bool = True  # capture the training step on CUDA (bucketed shapes)
    max_train_graphs: int = 8  # captured training steps kept (least recently used go)
    trim_after_update: bool = True  # hand the heap's free pages back to the system after
    # each update (glibc malloc_trim; osd/online/memory.py)
    mmap_threshold: int | None = None  # pin glibc's mmap threshold at this many bytes
    # (flat memory, but every large block is mapped anew)
    seed: int = 0  # seed of the learner's sampling of batches
    history_requests: int = 4096  # newest requests whose (draft, alpha) stats keep
    history_updates: int = 256  # newest update records kept per draft
    router: RouterConfig = field(default_factory=RouterConfig)  # used with several drafts

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"OnlineConfig.loss must be one of {LOSSES}, got {self.loss!r}")
        if self.positions not in POSITION_POLICIES:
            raise ValueError(
                f"OnlineConfig.positions must be one of {POSITION_POLICIES}, got {self.positions!r}"
            )
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"OnlineConfig.beta must be in [0, 1], got {self.beta}")
        if self.topk is not None and self.topk < 1:
            raise ValueError(f"OnlineConfig.topk must be >= 1 or None, got {self.topk}")
        if self.prompt_positions < 0:
            raise ValueError(
                f"OnlineConfig.prompt_positions must be >= 0, got {self.prompt_positions}"
            )
        for name in (
            "update_every_requests",
            "steps_per_update",
            "eagle_passes",
            "batch_positions",
            "buffer_positions",
            "checkpoint_every",
            "max_train_len",
            "history_requests",
            "history_updates",
            "max_train_graphs",
            "holdout_requests",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"OnlineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.mmap_threshold is not None and self.mmap_threshold < 1:
            raise ValueError(
                f"OnlineConfig.mmap_threshold must be >= 1 or None, got {self.mmap_threshold}"
            )
        if not 0.0 <= self.replay_fraction < 1.0:
            raise ValueError(
                f"OnlineConfig.replay_fraction must be in [0, 1), got {self.replay_fraction}"
            )
        if self.lr <= 0:
            raise ValueError(f"OnlineConfig.lr must be > 0, got {self.lr}")
        if self.autocast not in AUTOCAST_DTYPES:
            raise ValueError(
                f"OnlineConfig.autocast must be one of {AUTOCAST_DTYPES}, got {self.autocast!r}"
            )


ONLINE_KEY = "online"  # the recipe's key in a draft directory's serving.json


def draft_online_recipe(path) -> dict | None:
    """The online-learning recipe a draft directory recommends: the ``"online"`` object of
    its ``serving.json`` (:class:`OnlineConfig` fields), or None (no file, no key, not a
    directory). ValueError naming the file when it is malformed."""
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
    """``recipe`` (OnlineConfig fields) under ``config``: a field the caller changed from
    its default keeps the caller's value, every other field takes the recipe's."""
    if not recipe:
        return config
    default = OnlineConfig()
    mine = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(OnlineConfig)
        if getattr(config, f.name) != getattr(default, f.name)
    }
    return dataclasses.replace(OnlineConfig(**recipe), **mine)


def cpu_has_fast_bf16() -> bool:
    """True when oneDNN reports bf16 matmul support on this CPU (AVX-512 class cores).
    On AVX2-only CPUs it does not, and a bf16 autocast training step there measured many
    times slower than fp32 (``docs/online.md``)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_autocast(autocast: str | None, device) -> str | None:
    """The autocast dtype name a learner on ``device`` uses for ``OnlineConfig.autocast``:
    ``"auto"`` is bf16 on a CPU with fast bf16 (:func:`cpu_has_fast_bf16`) and none
    elsewhere (on CUDA the fp32 step is captured in a CUDA graph instead); other values
    are used as given."""
    import torch

    if autocast != "auto":
        return autocast
    if torch.device(device).type == "cpu" and cpu_has_fast_bf16():
        return "bfloat16"
    return None
