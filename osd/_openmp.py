"""libgomp's wait settings for osd's processes, set before torch loads (``osd/__init__.py``
imports this first)."""

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
# the spin count itself. libgomp reads these when torch loads, so they apply when osd is
# imported first; an OMP_WAIT_POLICY or GOMP_SPINCOUNT the user set is kept (and then
# neither is set here).
SPIN_COUNT = "10000"
SET: tuple[str, ...] = ()  # what this sets (benchmarks start peers without it)
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    SET = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
