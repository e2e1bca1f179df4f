"""What a check module describes: :class:`Ptr` and :class:`Spec`, and shared settings."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from triton.runtime.jit import JITFunction


@dataclass(frozen=True)
class Ptr:
    """A tensor argument: its Triton element type (``fp32``, ``bf16``, ``i64``, ``u1``...)."""

    dtype: str


@dataclass
class Spec:
    """One compilation: a kernel, every runtime argument's representative value, the
    constexpr arguments and the launch options."""

    kernel: str  # "module.function" under osd_kernels.triton
    label: str
    args: dict
    constexprs: dict
    options: dict = field(default_factory=dict)


# Options the samplers launch with on a GPU (osd_kernels.triton.fpmath.launch_options).
SAMPLER_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}
FLOATS = ("fp32", "bf16", "fp16")


def load(path: str) -> JITFunction:
    """The kernel named ``"module.function"`` under ``osd_kernels.triton``."""
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"osd_kernels.triton.{module}"), name)
