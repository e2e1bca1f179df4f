"""A step that raises fails only the request that made it raise.

Every request is validated before it joins a batch (``SamplingParams``,
``Engine.requests``), so a step should never raise because of one row; when one still
does (a kernel refusing a value, a bug), :func:`recover` finds the culprit instead of
failing the whole lane:

1. every request the lane held (running, staged, or admitted in the failed step) is
   *rewound* to where it stood before the step (:func:`mark_lane` records that): tokens
   the step appended, and its stop-string and Philox state, are undone;
2. the lane's rows are emptied, and each of these requests is *probed*: run alone in the
   lane for one step (resumed from its own tokens, see below). A probe that raises names a
   culprit: that request fails with ``finish_reason="error"`` and error kind
   ``step_error``. A lane that held a single request needs no probe: it is the culprit;
3. the others resume, first in the lane's queue. When no probe raised (the failure
   needs several rows together, or was transient), they rejoin the lane one at a time,
   a step after each: the one whose joining makes a step raise fails.

*Resuming* needs no replay: a request's row is prefilled with its prompt and all its
generated tokens but the last (``RequestState.context``), which becomes its next input,
exactly the state a decode or speculative step leaves. Nothing is sampled there, and
every later draw is keyed on the request's own seed and token position, so a survivor's
output is the one it would have had alone (greedy output is exact; the K/V come from a
prefill instead of the steps, equal up to rounding).

Every probe that passes is a step of real progress (the request keeps its tokens), so
failures that keep coming back still let every survivor advance.
"""

from __future__ import annotations

import collections
import contextlib
import logging

from osd.request import RequestState

log = logging.getLogger("osd.engine")


def _mark(r: RequestState) -> tuple:
    """Where a request stands: what a step may change (a plain tuple, made every step for
    every row: generated, logprobs, Philox offset, statistics, stop-string and teacher
    positions)."""
    return (
        len(r.generated),
        None if r.logprobs is None else len(r.logprobs),
        r.spec_steps,
        r.spec_stats,
        r.stop_checked,
        len(r.teacher),
    )


def mark_lane(lane) -> dict[int, tuple]:
    """Marks of the lane's running and staged requests, before a step."""
    marks = {id(r): _mark(r) for r in lane.active}
    if lane.staging is not None:
        marks[id(lane.staging)] = _mark(lane.staging)
    return marks


def _rewind(r: RequestState, mark: tuple | None) -> None:
    """Undo what a failed step did to ``r`` (``mark`` None: it joined in that step)."""
    generated, logprobs, steps, stats, checked, teacher = mark or (0, 0, 0, None, 0, 0)
    del r.generated[generated:]
    if r.logprobs is not None:
        del r.logprobs[logprobs or 0 :]
    del r.teacher[teacher:]
    r.spec_steps, r.spec_stats, r.stop_checked = steps, stats, checked
    r.finish_reason = r.error = r.error_kind = r.stop_text = None
    r.context = None


def resume(r: RequestState) -> None:
    """Prepare ``r`` (out of any row) to rejoin a lane where it left off."""
    r.context = r.prompt + r.generated[:-1] if r.generated else None


def _holds(lane, r: RequestState) -> bool:
    """Whether ``r`` is in one of the lane's rows (or its staging row)."""
    return r is lane.staging or any(r is x for x in lane.active)


def _clear(engine, lane) -> None:
    """Empty the lane's rows (their requests are accounted for by the caller)."""
    lane.active.clear()
    if lane.staging is not None:
        lane.unstage()
    engine._empty_lane(lane)


def _message(error: BaseException) -> str:
    return f"the engine step failed: {type(error).__name__}: {error}"


def _fail(engine, r: RequestState, message: str) -> None:
    r.fail(message, "step_error")
    engine._finished(r)


def _run_until_stepped(engine, lane, r: RequestState) -> None:
    """Step the lane until ``r`` (last in its queue) has taken a step or finished. A
    context longer than a prefill piece is staged first, one piece per call."""
    before = len(r.generated)
    chunk = max(engine.model.config.prefill_chunk, 1)
    queued = sum(len(x.prefill_ids) for x in lane.waiting)
    for _ in range(queued // chunk + len(lane.waiting) + 3):
        engine._step_lane(lane)
        if r.finish_reason is not None or len(r.generated) > before:
            return


def _probe(engine, lane, r: RequestState) -> BaseException | None:
    """Run ``r`` alone in the (empty) lane for one step (or until it finished); the
    exception that step raised (``r`` rewound to before it), else None. The lane is empty
    again afterwards; ``r`` keeps the step's tokens."""
    saved, lane.waiting = lane.waiting, collections.deque([r])
    mark = _mark(r)
    resume(r)
    try:
        _run_until_stepped(engine, lane, r)
        return None
    except Exception as e:  # this request's own step failed
        _rewind(r, mark)
        return e
    finally:
        lane.waiting = saved
        _clear(engine, lane)


def _grow(engine, lane, survivors: list[RequestState], error: Exception) -> None:
    """Admit ``survivors`` into the empty lane one at a time, a step after each: the one
    whose joining makes a step raise completes a failing combination of rows and fails.
    The others end up running in the lane, ahead of its queue."""
    saved = lane.waiting
    group: list[RequestState] = []  # running in the lane, or queued to rejoin it
    try:
        for i, r in enumerate(survivors):
            group = [x for x in group if x.finish_reason is None]
            marks = {id(x): _mark(x) for x in group + [r]}
            resume(r)
            lane.waiting = collections.deque(x for x in group if not _holds(lane, x))
            lane.waiting.append(r)
            try:
                _run_until_stepped(engine, lane, r)
            except Exception as e:
                joined = _holds(lane, r)
                _clear(engine, lane)
                for x in group + [r]:
                    _rewind(x, marks[id(x)])
                if not joined:
                    # The rows already admitted failed without it: nothing to blame here;
                    # everyone resumes, and a next failure is probed afresh.
                    for x in group + survivors[i:]:
                        resume(x)
                    lane.waiting = collections.deque(group + survivors[i:])
                    group = []
                    return
                _fail(engine, r, f"{_message(error)} (with the rows beside it: {_message(e)})")
                for x in group:
                    resume(x)
                continue
            if r.finish_reason is None:
                group.append(r)
    finally:
        lane.waiting.extend(
            x
            for x in group
            if x.finish_reason is None
            and not _holds(lane, x)
            and all(x is not y for y in lane.waiting)
        )
        lane.waiting.extend(saved)


def recover(engine, lane, error: Exception, marks: dict[int, tuple]) -> None:
    """After ``lane``'s step raised ``error``: fail the requests that cause it, resume
    the others (module docstring). ``marks``: :func:`mark_lane` before the step."""
    suspects = list(lane.active)
    if lane.staging is not None and all(r is not lane.staging for r in suspects):
        suspects.append(lane.staging)
    suspects = [r for r in suspects if r.finish_reason != "abort"]
    _clear(engine, lane)
    engine.errors["failed_steps"] += 1
    log.warning(
        "osd: a step failed with %d request(s) in its lane; finding the one that fails it",
        len(suspects),
        exc_info=error,
    )
    for r in suspects:
        _rewind(r, marks.get(id(r)))
    if len(suspects) == 1:
        _fail(engine, suspects[0], _message(error))
        return
    survivors, culprits = [], 0
    for r in suspects:
        e = _probe(engine, lane, r)
        if e is not None:
            _fail(engine, r, _message(e))
            culprits += 1
        elif r.finish_reason is None:
            survivors.append(r)
    if culprits:
        for r in survivors:
            resume(r)
        lane.waiting.extendleft(reversed(survivors))
    else:  # no row fails alone: a combination of rows, or transient
        _grow(engine, lane, survivors, error)


@contextlib.contextmanager
def resumed_prompts(requests: list[RequestState], speculator):
    """Around ``speculator.prefill``: resuming requests show their ``context`` as their
    prompt (the drafter prefills it; the first token is their next input), and keep their
    speculative state (Philox offset, statistics, collected teacher data), which a
    prefill would start afresh."""
    resumed = [
        (r, r.prompt, r.spec_steps, r.spec_stats, r.teacher)
        for r in requests
        if r.context is not None
    ]
    for r, *_ in resumed:
        r.prompt = r.context
    try:
        yield
    finally:
        for r, prompt, steps, stats, teacher in resumed:
            r.prompt, r.spec_steps, r.spec_stats, r.teacher = prompt, steps, stats, teacher
        if speculator is not None:
            speculator.stats.requests -= len(resumed)
