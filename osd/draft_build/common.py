"""What every stage of the draft builds shares: logging, progress bars and status lines,
the thread-count tuner, the teacher-data cache directory and the checkpoint writer (also
used by ``scripts/build_chat_eagle.py``)."""

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


def clock(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour)."""
    s = max(0, int(round(seconds)))
    return (
        f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


class Progress:
    """Status lines of one stage with its ETA: on a terminal one line rewritten in place,
    elsewhere (logs, pipes) a line every ``every`` seconds.

    The ETA is the sooner of the work's pace (what is left of ``total`` at the rate so
    far) and the stage's ``deadline`` (``time.monotonic()``); ``build_end`` is when the
    whole build's budget ends."""

    def __init__(
        self,
        stage: str,
        total: float,
        unit: str,
        deadline: float,
        build_end: float,
        every: float | None = None,
        stream=None,
    ) -> None:
        self.stage, self.total, self.unit = stage, total, unit
        self.deadline, self.build_end = deadline, build_end
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every if every is not None else (2.0 if self.tty else 20.0)
        self.t0 = time.monotonic()
        self.done0: float | None = None  # work already done when the stage (re)started
        self.last = -1e9
        self.line = ""

    def line_for(self, done: float, extra: str = "", now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        if self.done0 is None:
            self.done0 = done
        rate = (done - self.done0) / max(now - self.t0, 1e-9)
        left = self.deadline - now
        if rate > 0 and self.total > done:
            left = min(left, (self.total - done) / rate)
        elif done >= self.total:
            left = 0.0
        parts = [f"{self.stage}: {done:.0f}/{self.total:.0f} {self.unit}"]
        if extra:
            parts.append(extra)
        parts.append(f"stage ETA {clock(left)}")
        parts.append(f"build ends in {clock(self.build_end - now)} at the latest")
        return "[osd draft build] " + " | ".join(parts)

    def update(self, done: float, extra: str = "", force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every:
            return
        self.last = now
        self.line = self.line_for(done, extra, now)
        if self.tty:
            print("\r" + self.line.ljust(120)[: max(120, len(self.line))], end="", file=self.stream)
            self.stream.flush()
        else:
            print(self.line, file=self.stream, flush=True)

    def close(self, done: float, extra: str = "") -> None:
        """The stage's last line (and the terminal's line break)."""
        self.update(done, extra, force=True)
        if self.tty:
            print(file=self.stream, flush=True)


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
