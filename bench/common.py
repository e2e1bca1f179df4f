"""Helpers shared by the benchmark files: the sweep switch, torch's thread count, each
provider's device and dtype, moving cases between devices, and the GB/s rate.

``OSD_BENCH_FULL=1`` selects the full sweeps. ``OSD_BENCH_THREADS`` sets torch's CPU thread
count in the files that pin it (the ``torch_threads`` fixture of ``bench/conftest.py``).
"""

import os

import pytest
import torch
from torch.utils._pytree import tree_map

from osd_kernels._ops import native_available

FULL = os.environ.get("OSD_BENCH_FULL", "0") == "1"
# The 2 cores of the benchmark machine are shared with other jobs; intra-op threads then
# spin against each other and every provider becomes erratic, so torch runs on one thread.
THREADS = int(os.environ.get("OSD_BENCH_THREADS", "1"))
# provider -> the ``backend`` argument of the op wrappers
BACKENDS = {"reference": "reference", "cpp": "native", "cuda": "native", "triton": "triton"}


def provider_device(provider: str) -> tuple[str, torch.dtype]:
    """Device and dtype a provider is timed on: ``("cuda", bfloat16)`` for ``triton`` and
    ``cuda``, ``("cpu", float32)`` for the others. Skips the test when the provider cannot
    run here (no CUDA device; ``cpp`` and ``cuda`` without the native extension)."""
    on_gpu = provider in ("triton", "cuda")
    if on_gpu and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if provider in ("cpp", "cuda") and not native_available():
        pytest.skip("osd_kernels._C is not built")
    return ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)


def to_device(tree, device: str):
    """``tree`` (tensors, None and numbers in tuples, lists and dicts) with every tensor
    moved to ``device``."""
    return tree_map(lambda x: x.to(device) if torch.is_tensor(x) else x, tree)


def assert_same(got, want, provider: str) -> None:
    """Each output tensor of ``got`` (any device) equals the CPU tensor of ``want``."""
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w), provider


def tensor_bytes(*tensors) -> int:
    """Bytes of the given tensors (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def gbps(nbytes: int, benchmark) -> float | None:
    """``nbytes`` moved once per round, over the median round time, in GB/s; None when
    timing is off (``--benchmark-disable`` runs each benchmark once, untimed)."""
    if benchmark.stats is None:
        return None
    return nbytes / benchmark.stats.stats.median / 1e9


def chat_target_or_skip() -> str:
    """The chat GGUF's path (``osd.zoo.chat.fetch_target()``: downloaded on first use); the
    calling test is skipped, naming why, only when it cannot be fetched (no network and
    nothing cached)."""
    from osd.zoo import chat  # the chat zoo is only needed by the benchmarks that use it

    try:
        return chat.fetch_target()
    except RuntimeError as exc:
        pytest.skip(f"the chat GGUF cannot be fetched: {exc}")


def chat_pair_or_skip(threads: int) -> tuple[str, str | None]:
    """``osd.zoo.chat.chat_pair()`` (fetched on first use) with torch on ``threads`` threads
    (``OSD_BENCH_THREADS`` overrides); the calling test is skipped when the model cannot
    be fetched (no network and nothing cached)."""
    from osd.zoo import chat  # the chat zoo is only needed by the benchmarks that use it

    try:
        pair = chat.chat_pair()
    except RuntimeError as exc:
        pytest.skip(f"the chat model is not available: {exc}")
    torch.set_num_threads(int(os.environ.get("OSD_BENCH_THREADS", str(threads))))
    return pair


def bench_target(default: str) -> str:
    """The target a chat benchmark runs: ``OSD_BENCH_CHAT_TARGET`` (a GGUF file or model
    directory; ``gemma`` fetches the Gemma 3 270M GGUF, ``osd.zoo.gemma``) or
    ``default``."""
    name = os.environ.get("OSD_BENCH_CHAT_TARGET") or default
    if name == "gemma":
        from osd.zoo import gemma  # fetched only by the runs that ask for it

        return gemma.fetch_target()
    return name


def bench_draft(default: str | None) -> str | None:
    """The draft directory a chat benchmark runs: ``OSD_BENCH_CHAT_DRAFT`` (``none``: no
    draft) or ``default``."""
    name = os.environ.get("OSD_BENCH_CHAT_DRAFT") or default
    return None if name == "none" else name
