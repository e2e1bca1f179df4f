"""What every stage of the draft builds shares: logging, progress bars, the thread-count
tuner, the teacher-data cache directory and the checkpoint writer (also used by
``scripts/build_chat_eagle.py``)."""

from __future__ import annotations

import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

from osd.zoo import chat as zoo_chat

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - tqdm comes with transformers
    tqdm = None


def log(msg: str) -> None:
    print(f"[osd draft build] {msg}", file=sys.stderr, flush=True)


def progress_bar(total, desc, unit):
    """A tqdm bar (None without tqdm)."""
    if tqdm is None:
        return None
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, mininterval=2.0)


class ThreadTuner:
    """Keeps torch's CPU thread count at whichever of 1 and ``max_threads`` runs the work
    faster now.

    On a shared machine, an OpenMP team larger than the free cores can run many times
    slower than one thread (measured here: a batch-1 target decode step took 36 ms with
    one thread and 730 ms with two while another process held a core), and the load
    changes during a build. After every ``every`` seconds the other setting runs one
    trial step and is kept if its pace (seconds per unit of work) beats the median pace
    of the current setting's recent steps.
    """

    def __init__(self, max_threads: int, every: float = 90.0) -> None:
        self.options = sorted({1, max(1, max_threads)})
        self.current = self.options[-1]
        self.every = every
        self.paces: list[float] = []
        self.trial_of: int | None = None  # the setting a trial step would replace
        self.last_trial = time.monotonic() - every + 5.0  # first trial after 5 s
        self.switches = 0
        torch.set_num_threads(self.current)

    def record(self, seconds: float, work: float) -> None:
        """Report one step of ``work`` units (rows, positions) that took ``seconds``."""
        pace = seconds / max(work, 1e-9)
        if self.trial_of is not None:
            if pace < statistics.median(self.paces):
                self.paces, self.switches = [pace], self.switches + 1
            else:
                self.current = self.trial_of
                torch.set_num_threads(self.current)
            self.trial_of = None
            self.last_trial = time.monotonic()
            return
        self.paces = (self.paces + [pace])[-5:]
        if len(self.options) > 1 and time.monotonic() - self.last_trial > self.every:
            self.trial_of = self.current
            self.current = self.options[0] if self.current == self.options[-1] else self.options[-1]
            torch.set_num_threads(self.current)


def cache_dir() -> str:
    """``$OSD_CACHE/chat_draft`` (default ``~/.cache/osd/chat_draft``): the teacher data."""
    return os.path.join(os.path.dirname(zoo_chat.cache_dir()), "chat_draft")


def write_checkpoint_dir(path: str, write) -> None:
    """Call ``write(tmp)`` on a fresh directory beside ``path``, then move it into place
    (readable by all), replacing ``path``."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".chat-checkpoint-", dir=os.path.dirname(path))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def split_heldout(examples: list, fraction: float, seed: int) -> tuple[list, list]:
    """``(train, heldout)``: a seeded shuffle, at least one example held out."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_held = max(1, round(fraction * len(examples)))
    return [examples[i] for i in order[n_held:]], [examples[i] for i in order[:n_held]]
