"""libgomp's wait settings for osd's processes, set before torch loads (``osd/__init__.py``
imports this first)."""

import ctypes
import os

# PyTorch's OpenMP runtime (libgomp) decides what a parallel region's threads do after it
# ends. A decode step runs hundreds of short regions a few microseconds apart. Threads that
# sleep at once (OMP_WAIT_POLICY=PASSIVE) pay a wake-up at every region, about half the
# speed on an idle CPU; threads that spin long (libgomp's default, 300,000 rounds) hold
# the cores when anything else wants them, and a member that lost its core stalls every
# region. osd lets them spin SPIN_COUNT rounds and then sleep (GOMP_SPINCOUNT): enough to
# bridge the gaps inside a step and between its ops' calls, short enough to leave a shared
# core within a fraction of a millisecond (bench/bench_wait_policy.py; on an Intel Xeon,
# whose PAUSE takes over 100 cycles, 1,000 rounds let the threads fall asleep between a
# step's calls). The policy is set ACTIVE as well, because libgomp cuts the spinning to 100
# rounds (about a sleep at once) whenever it manages more threads than there are cores,
# which is the case as soon as a second thread has run parallel regions: a server's
# engine thread beside the main thread that loaded the model. With ACTIVE the cut stops at
# 1,000 (or the spin count, if lower); release_thread_pool below avoids the cut. libgomp
# reads these when torch loads, so they apply when osd is imported first; an
# OMP_WAIT_POLICY or GOMP_SPINCOUNT the user set is kept (and then neither is set here).
SPIN_COUNT = "10000"
SET: tuple[str, ...] = ()  # what this sets (benchmarks start peers without it)
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    SET = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (``omp_pause_resource_all``, soft),
    so that another thread's team is the only one libgomp manages. Returns whether it did.

    Once more threads are managed than there are cores (the team of the thread that loaded
    a model beside the team of the thread that runs its steps: a server's engine thread),
    libgomp cuts the spinning after each region to at most 1,000 rounds, whatever the spin
    count, and a step's threads then fall asleep between its calls. The workers of the
    loading thread's team are idle from then on, so releasing them (they are made again
    if that thread runs a parallel region) gives the stepping thread's team its spin count
    back. A no-op without libgomp (another OpenMP runtime, another OS)."""
    try:
        import torch  # loaded by now: its libgomp is the one to ask

        path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
        lib = ctypes.CDLL(path if os.path.exists(path) else "libgomp.so.1")
        return lib.omp_pause_resource_all(1) == 0  # omp_pause_soft
    except (OSError, AttributeError):
        return False
