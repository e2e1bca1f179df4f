"""The scheduling half of :class:`~osd.Engine`: lanes, admission, steps, retirement.

:class:`Scheduler` queues requests on the lane of their draft, and each :meth:`step`
advances every lane: staged long prompts take their next piece, waiting requests fill the
free rows (prefill through :class:`~osd.runner.ModelRunner`), every running row advances
by one decode or speculative step, and finished rows leave, the last running row moving
into each hole. A lane whose step raises fails only the requests that make it raise
(``osd.isolation``). The engine provides ``lanes``, ``model``, ``device``, ``online``,
``tokenizer``, ``lookup_history`` and the counters.
"""

from __future__ import annotations

import collections
import time

import torch

from osd.isolation import mark_lane, recover, resumed_prompts
from osd.lanes import Lane
from osd.request import RequestState
from osd.sampling import BatchParams
from osd.spec_decode.step import Speculator


class Scheduler:
    """Continuous batching over an engine's lanes (a mixin of ``Engine``)."""

    def submit(self, requests: list[RequestState]) -> None:
        """Queue ``requests``; each joins its draft's lane at the next :meth:`step`."""
        for r in requests:
            if r.pinned_draft is not None:
                r.draft_index = r.pinned_draft
            else:
                r.draft_index = self.online.choose(r.prompt) if self.online is not None else 0
            self.lanes[r.draft_index].waiting.append(r)

    def abort(self, requests: list[RequestState]) -> None:
        """End ``requests`` with ``finish_reason="abort"`` now: waiting ones are dropped,
        running ones leave their rows (cache rows freed at once)."""
        doomed = {id(r) for r in requests}
        for r in requests:
            if r.finish_reason is None:
                r.finish_reason = "abort"
        for lane in self.lanes:
            lane.waiting = collections.deque(r for r in lane.waiting if id(r) not in doomed)
            if lane.staging is not None and id(lane.staging) in doomed:
                lane.unstage()
            if any(id(r) in doomed for r in lane.active):
                self.retire(lane.active, lane=lane)

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return any(lane.active or lane.waiting or lane.staging for lane in self.lanes)

    def step(self) -> None:
        """One scheduling step over every lane: waiting requests fill the free rows
        (prefill, first token sampled), then every running row advances by one decode or
        speculative step, and finished rows leave. Each row samples with its own
        parameters, seed and offset, so its tokens do not depend on what shares the batch.

        A lane whose step raises does not fail as a whole: the requests that make it
        raise fail (``finish_reason="error"``, error kind ``step_error``) and the others
        resume from where they stood before the step (``osd.isolation.recover``); the
        other lanes keep their state. The exception is logged, not raised.
        """
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                for lane in self.lanes:
                    marks = mark_lane(lane)
                    try:
                        self._step_lane(lane)
                    except Exception as e:
                        recover(self, lane, e, marks)
        finally:
            self._wall += time.perf_counter() - t0

    def _empty_lane(self, lane: Lane) -> None:
        lane.cache.reset()
        if lane.speculator is not None:
            lane.speculator.reset()

    def _step_lane(self, lane: Lane) -> None:
        spec = lane.speculator
        m = spec.prompt_positions if spec is not None else 0
        staged = lane.advance_staging(self.model, m, self._empty_lane)
        new = lane.admit(
            self.max_batch_size,
            self.model.config.prefill_chunk,
            m,
            reserved=int(staged is not None),
        )
        if staged is not None or new:
            if not lane.active and staged is None:
                self._empty_lane(lane)
            start = len(lane.active)
            reused = [
                lane.load_prefix(r, m, lane.cache, start + b + (staged is not None))
                for b, r in enumerate(new)
            ]
            ready, done, early = new, [n for n, _ in reused], [h for _, h in reused]
            if staged is not None:
                ready, done, early = [staged[0]] + new, [staged[1]] + done, [staged[2]] + early
            lane.active += ready
            prompt_logits = self.prefill(
                ready,
                start_row=start,
                lane=lane,
                prompt_positions=m,
                done=done,
                early_hidden=early if lane.needs_hidden else None,
            )
            prompt_hidden = None
            if lane.needs_hidden:
                prompt_logits, prompt_hidden = prompt_logits
            lane.store_prefix(ready, start, prompt_hidden)
            if spec is not None:
                with resumed_prompts(ready, spec):
                    spec.prefill(
                        ready,
                        start,
                        lane.next_tokens[start : start + len(ready)],
                        prompt_logits,
                        prompt_hidden,
                    )
            for r in ready:
                r.context = None  # a resumed request's row holds its tokens
            self.retire(lane.active, lane=lane)
        if not lane.active:
            return
        params = BatchParams([r.params for r in lane.active], self.device)
        if spec is not None:
            spec.step(lane.active, params)
        else:
            self.decode_step(lane.active, params, lane=lane)
        self.retire(lane.active, lane=lane)

    def _count_error(self, kind: str, error) -> None:
        self.errors[kind] += 1
        self.last_error = f"{kind}: {error}"

    def retire(
        self,
        active: list[RequestState],
        speculator: Speculator | None = None,
        lane: Lane | None = None,
    ) -> None:
        """Drop finished sequences from ``lane`` (default the first; ``active`` is its
        list), moving the last active row into each hole (in the draft's cache too), hand
        requests that finished normally to online learning, and tighten the cache's
        host-side length bound to the exact longest cached sequence."""
        lane = lane or self.lanes[0]
        speculator = speculator or lane.speculator
        for r in active:
            r.check_stop_strings(self.tokenizer)
        for b in reversed(range(len(active))):
            r = active[b]
            if r.finish_reason is None:
                continue
            self._finished(r)
            last = len(active) - 1
            if b != last:
                lane.cache.move_row(last, b)
                if speculator is not None:
                    speculator.move_row(last, b)
                lane.next_tokens[b] = lane.next_tokens[last]
                active[b] = active[last]
            active.pop()
        lane.cache.set_bound(max((r.cached_length for r in active), default=0))

    def _finished(self, r: RequestState) -> None:
        """Account for a request that just finished (out of its row, or never in one):
        online learning, error and abort counts, the lookup history."""
        if self.online is not None and r.finish_reason != "error":
            st = r.spec_stats
            alpha = None if st is None else st.alpha if st.alpha is not None else st.acceptance_rate
            self.online.finish(r, r.draft_index, alpha)
        if r.finish_reason == "error":
            self.errors[r.error_kind] += 1
            self.last_error = f"{r.error_kind}: {r.error}"
        elif r.finish_reason == "abort":
            self._aborted += 1
        if self.lookup_history is not None and r.finish_reason != "error":
            self.lookup_history.add(r.prompt, r.generated)
        r.teacher = []  # the learner has its copy; free it now
        self._generated += len(r.generated)
        self._requests_served += 1
