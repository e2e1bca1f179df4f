"""Keeping a learning engine's resident memory flat: the C heap after each update.

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start) with
its own ``mmap`` and returns it to the system on ``free``. But the threshold is dynamic:
each time such a block is freed, glibc raises the threshold to that block's size (up to
32 MiB), so from then on blocks of that size come from the heap and stay there after
``free``. The online learner allocates large temporaries of a new shape at every update
(logits ``[rows * tokens, V]``, activations, gradients; the shapes follow the batch) from
a thread of its own, so from a heap of its own: that heap keeps hundreds of MB that are
free but resident, and the amount wanders upward as the shapes change, long after what
the learner keeps (replay buffer, optimizer state) has reached its bound.

Two remedies, both glibc only (elsewhere they do nothing):

- :func:`release_free_memory` (``OnlineRuntime.trim_after_update``, the default): after
  each update, ``malloc_trim(0)`` hands the free pages inside every heap back to the
  system. Within an update the heap is reused as before; the next update faults its
  working set in once. Measured on the built-in pair: flat memory at no measurable cost
  in throughput (``docs/soak.md``).
- :func:`pin_mmap_threshold` (``OnlineRuntime.mmap_threshold``): fixing the threshold turns
  the dynamic adjustment off, so every large block is mapped and unmapped again. Memory
  stays flat too, but each large allocation then pays its page faults: about 28% fewer
  requests per second in the same measurement. Not done unless asked, nor when the
  ``MALLOC_MMAP_THRESHOLD_`` environment variable already sets it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

logger = logging.getLogger("osd.online")

_M_MMAP_THRESHOLD = -3  # mallopt parameter number (glibc malloc.h)
_lock = threading.Lock()
_pinned: int | None = None
_trim = None  # glibc's malloc_trim once looked up; False where there is none


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
            libc.gnu_get_libc_version  # glibc only: its mallopt numbering
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        if mallopt(_M_MMAP_THRESHOLD, int(nbytes)) != 1:
            logger.warning(
                "mallopt(M_MMAP_THRESHOLD, %d) failed; resident memory may creep "
                "up while the draft learns",
                nbytes,
            )
            return False
        _pinned = int(nbytes)
        return True


def release_free_memory() -> bool:
    """Return the free pages inside glibc's heaps to the system (``malloc_trim(0)``).

    Pages freed this way cost a page fault when next used, so this is done once per
    update (the learner's whole working set is faulted in again at most once per update)
    rather than at every free. Returns False where there is no glibc ``malloc_trim``.
    """
    global _trim
    if _trim is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _trim = libc.malloc_trim
            _trim.argtypes = [ctypes.c_size_t]
            _trim.restype = ctypes.c_int
        except (OSError, AttributeError):
            _trim = False
    if _trim is False:
        return False
    _trim(0)
    return True
