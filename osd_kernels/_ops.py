"""Loading of the native extension and backend selection shared by every op.

Every op in ``osd_kernels`` has up to four implementations that share one name:

- ``reference``: pure PyTorch, product code, the ground truth in tests;
- ``native``: ``torch.ops.osd.<op>``, the C++ CPU kernel or the CUDA kernel, dispatched
  on the device of the inputs;
- ``triton``: a Triton kernel (on CPU tensors it runs under ``TRITON_INTERPRET=1``);
- ``auto`` (default): the fastest one available for the inputs' device.

If ``osd_kernels._C`` is missing, ``native`` falls back to ``reference`` with a one-time
warning, so the package imports and runs without a compiler.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

BACKENDS = ("auto", "reference", "native", "triton")


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
    """True when ``osd_kernels._C`` imported and registered its ops."""
    if os.environ.get("OSD_DISABLE_NATIVE", "0") == "1":
        return False
    try:
        from osd_kernels import _C  # noqa: F401  (registers torch.ops.osd.*)
    except ImportError as exc:  # pragma: no cover - exercised only without a build
        warnings.warn(
            f"osd_kernels._C is not built ({exc}); falling back to the PyTorch reference "
            "ops. Run `make build` (or `pip install -e .`) for the native kernels.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def use_avx512() -> bool:
    """True when the C++ CPU kernels run their AVX-512 paths: the native build is loaded,
    the CPU has AVX-512 (F, DQ, VL, BW), and neither ``OSD_NO_AVX512`` nor ``OSD_NO_AVX2``
    is set (read per call, as the kernels read them)."""
    if not native_available():
        return False
    from osd_kernels import _C  # the optional native build: imports once native_available()

    return (
        bool(getattr(_C, "CPU_AVX512", 0))
        and "OSD_NO_AVX512" not in os.environ
        and "OSD_NO_AVX2" not in os.environ
    )


def use_vnni() -> bool:
    """True when ``quant_linear``'s int8-activation types (:mod:`osd_kernels.quant_x16`)
    run on AVX-512 VNNI here: :func:`use_avx512` and the CPU has VNNI. Elsewhere they run
    a portable loop with the same results, many times slower than the float32 path."""
    if not use_avx512():
        return False
    from osd_kernels import _C  # the optional native build: imports once native_available()

    return bool(getattr(_C, "CPU_AVX512_VNNI", 0))


def use_amx() -> bool:
    """True when ``quant_linear``'s int8-activation types run calls of many rows (prefill
    pieces, batched verify forwards) on AMX-INT8 tiles: :func:`use_vnni`, the CPU has AMX
    and the OS gives the process its tile state, and ``OSD_NO_AMX`` is not set (read per
    call, as the kernel reads it). Results are the VNNI path's, bit for bit."""
    if not use_vnni():
        return False
    from osd_kernels import _C  # the optional native build: imports once native_available()

    return bool(getattr(_C, "CPU_AMX_INT8", 0)) and "OSD_NO_AMX" not in os.environ


def native_has_device(device: torch.device) -> bool:
    """True when the native extension has kernels for ``device`` (CPU always, CUDA if built)."""
    if not native_available():
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        from osd_kernels import _C  # the optional native build: imports once native_available()

        return bool(getattr(_C, "WITH_CUDA", False))
    return False


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when triton imports (on CPU it is usable only under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(
    backend: str,
    device: torch.device,
    *,
    has_triton: bool = True,
    prefer_triton_on_gpu: bool = True,
) -> str:
    """Turn ``backend`` (one of BACKENDS) into a concrete one for tensors on ``device``.

    ``auto`` picks Triton on CUDA when the op has a Triton kernel (and the caller prefers
    it), else the native kernel, else the reference. An explicit ``native`` without a
    build falls back to ``reference`` (the one-time warning was already given).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        if device.type == "cuda" and has_triton and prefer_triton_on_gpu and triton_available():
            return "triton"
        return "native" if native_has_device(device) else "reference"
    if backend == "native" and not native_has_device(device):
        return "reference"
    if backend == "triton":
        if not has_triton:
            raise ValueError("this op has no Triton kernel")
        if device.type == "cpu" and not triton_interpret():
            raise ValueError("Triton on CPU tensors needs TRITON_INTERPRET=1")
    return backend
