"""What the learner hears from serving: a listener on one speculator's steps.

:class:`TeacherCollector` keeps, per request, the target's distributions that decided
its tokens (compressed to top-k, ``osd.online.buffer.compress_target``): at prompt
positions from the prefill's logits, and at every verified position (or only the
corrected ones, OSD's policy) from each step's verdict. Nothing is recomputed later.
Before each step it lets the learner swap in the newest accepted weights, so a swap
never lands inside a step.

For an EAGLE draft (whose drafter ``needs_hidden``) it also keeps the target's features
at every position the target read (the prompt, then each step's root and accepted drafts),
the draft's inputs when it trains.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from osd.online.buffer import compress_target

# One thread, shared by every collector, compresses CPU teacher rows (a softmax and a
# top-k over the vocabulary: about 50 us a row at V = 49,152) off the serving thread, a
# row at a time (compress_rows); the torch ops release the GIL, so on a CPU it runs beside
# serving, on the learner's core.
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="osd-teacher")
        return _POOL


def compress_rows(logits: torch.Tensor, topk: int):
    """:func:`~osd.online.buffer.compress_target` of CPU ``logits [m, V]`` one row at a time
    (the same values): an op over one row runs on the calling thread, where one over
    several would start an OpenMP team of torch's threads beside serving's."""
    rows = [compress_target(row[None], topk) for row in logits]
    if not rows:
        return compress_target(logits, topk)
    return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]), None


def teacher_rows(teacher: list) -> list[tuple]:
    """A request's teacher entries as ``(positions, topk ids, topk probs, logits)``
    tuples, waiting for rows still being compressed (an entry is that tuple, or
    ``(positions, future, start, stop)`` while its rows are compressed off the serving
    thread). A compression that raised raises here."""
    out = []
    for entry in teacher:
        if len(entry) == 4 and hasattr(entry[1], "result"):
            pos, job, start, stop = entry
            ids, probs, full = job.result()
            sl = slice(start, stop)
            entry = (
                pos,
                None if ids is None else ids[sl],
                None if probs is None else probs[sl],
                None if full is None else full[sl],
            )
        out.append(entry)
    return out


class TeacherCollector:
    """Listener of a ``osd.spec_decode.step.Speculator`` for online learning.

    Args:
        topk: target probabilities kept per position (None: full logits).
        positions: ``"all"`` verified positions or ``"corrected"`` (the rejected one).
        prompt_positions: keep the prefill's logits at each prompt's last n positions.
        swap: called before every step (the learner publishes new weights there).
    """

    def __init__(self, topk: int | None, positions: str, prompt_positions: int, swap=None):
        self.topk = topk
        self.policy = positions
        self.prompt_positions = prompt_positions
        self.swap = swap

    def before_step(self) -> None:
        if self.swap is not None:
            self.swap()

    def on_prefill(
        self,
        requests,
        prompt_logits: torch.Tensor | None,
        prompt_hidden: torch.Tensor | None = None,
    ) -> None:
        """``prompt_logits [n, m, V]``: the target's logits at each prompt's last ``m``
        positions (a shorter prompt's row starts with copies), the requests' first
        teacher positions ``len(prompt) - m + 1 .. len(prompt)``. ``prompt_hidden
        [n, T, H]``: the target's features at the prompts' positions (EAGLE), or None."""
        for b, r in enumerate(requests):
            r.teacher = []  # (positions [m], topk ids, topk probs | logits)
            # [positions, H] float16 pieces covering positions 0, 1, ... in order
            r.features = (
                None
                if prompt_hidden is None
                else [prompt_hidden[b, : len(r.prompt)].detach().to("cpu", torch.float16)]
            )
        if prompt_logits is None:
            return
        m = prompt_logits.shape[1]
        keep = [min(m, len(r.prompt)) for r in requests]  # rows without the copies
        self._keep(
            [
                (r, torch.arange(len(r.prompt) - j + 1, len(r.prompt) + 1))
                for r, j in zip(requests, keep)
            ],
            [prompt_logits[b, m - j :] for b, j in enumerate(keep)],
        )

    def on_verdict(self, v) -> None:
        """Keep the target's distributions at the positions ``v`` (a ``Verdict``)
        decided: nodes ``0 .. accepted`` of each row's accepted path."""
        rows, where = [], []
        path_host = v.path.tolist() if v.path is not None else None
        feats = None if v.hidden is None else v.hidden.detach().to("cpu", torch.float16)
        for b, r in enumerate(v.active):
            if r.finish_reason == "error":
                continue
            n = v.accepted[b]
            if feats is not None and getattr(r, "features", None) is not None:
                r.features.append(feats[b, : n + 1])  # the root and the accepted drafts
            idx = (
                ([n] if n < v.drafted[b] else [])
                if self.policy == "corrected"
                else list(range(n + 1))
            )
            if not idx:
                continue
            base = r.length - v.emitted[b]  # position of the step's first token
            node = [path_host[b][j] for j in idx] if path_host is not None else idx
            rows.append(v.logits[b, node])
            where.append((r, torch.tensor([base + j for j in idx], dtype=torch.int64)))
        self._keep(where, rows)

    def _keep(self, where, rows) -> None:
        """Append the distributions ``rows`` (``[m_i, V]`` logits each) to the teacher
        lists of the requests in ``where`` (``(request, positions [m_i])``)."""
        if not rows:
            return
        logits = torch.cat(rows)  # a copy: the verify logits' buffer is not ours to keep
        if logits.device.type == "cpu" and self.topk is not None:
            job = _pool().submit(compress_rows, logits, self.topk)
            start = 0
            for r, pos in where:
                m = pos.numel()
                r.teacher.append((pos, job, start, start + m))
                start += m
            return
        ids, probs, full = compress_target(logits, self.topk)
        start = 0
        for r, pos in where:
            m = pos.numel()
            sl = slice(start, start + m)
            r.teacher.append(
                (
                    pos,
                    None if ids is None else ids[sl],
                    None if probs is None else probs[sl],
                    None if full is None else full[sl],
                )
            )
            start += m
