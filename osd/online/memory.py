"""Keeping a learning engine's resident memory flat: glibc's mmap threshold.

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start) with
its own ``mmap`` and returns it to the system on ``free``. But the threshold is dynamic:
each time such a block is freed, glibc raises the threshold to that block's size (up to
32 MiB), so from then on blocks of that size come from the heap and stay there after
``free``. The online learner allocates many large temporaries of a new shape at every
update (logits ``[rows * tokens, V]``, activations, gradients; the shapes follow the
batch), from a thread of its own (so from a heap of its own); once the threshold has
risen, the heaps fill with holes of sizes that rarely fit the next update, and the
process's resident memory keeps creeping up, long after everything the learner keeps
(replay buffer, optimizer state) has reached its bound.

Setting the threshold explicitly turns the dynamic adjustment off: large temporaries are
mapped and unmapped again, and memory stays flat. Done once per process, only with glibc,
and not when the ``MALLOC_MMAP_THRESHOLD_`` environment variable already sets it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

logger = logging.getLogger("osd.online")

_M_MMAP_THRESHOLD = -3        # mallopt parameter number (glibc malloc.h)
_lock = threading.Lock()
_pinned: int | None = None


def pin_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for this process (first call wins).

    Returns True when the threshold is pinned (now or by an earlier call or the
    environment), False where there is no glibc ``mallopt`` (other C libraries, other
    systems): then nothing changes.
    """
    global _pinned
    with _lock:
        if _pinned is not None or os.environ.get("MALLOC_MMAP_THRESHOLD_"):
            return True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
            libc.gnu_get_libc_version         # glibc only: its mallopt numbering
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        if mallopt(_M_MMAP_THRESHOLD, int(nbytes)) != 1:
            logger.warning("mallopt(M_MMAP_THRESHOLD, %d) failed; resident memory may creep "
                           "up while the draft learns", nbytes)
            return False
        _pinned = int(nbytes)
        return True
