"""``AsyncEngine``: request-level serving with continuous batching, for asyncio servers.

One background thread owns the :class:`~osd.Engine` and steps it while any request is
waiting or running. ``await``-ing callers only enqueue work and read results:

- :meth:`AsyncEngine.generate` validates the request on the caller's side (a bad one
  raises at once, the batch never sees it), hands it to the loop, and yields an
  :class:`~osd.Output` snapshot whenever the request gains tokens;
- the loop admits new requests and aborts at step boundaries: a request joins the running
  batch at the next step (its prompt prefilled, in ``prefill_chunk`` pieces, into a free
  row), a finished or aborted one leaves its row at once;
- every request keeps its own sampling parameters, seed and stop ids in the shared batch,
  and requests routed to different drafts advance in the same steps (one lane per draft,
  see ``osd.engine``).

A request's tokens do not depend on what shares its batch: each draw is keyed on the
request's own seed and token position. ``seed=s`` gives the tokens
``Engine.generate([prompt], SamplingParams(..., seed=s))`` gives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid

from osd._openmp import release_thread_pool
from osd.chat_template import apply_chat_template
from osd.engine import Engine
from osd.request import RequestError, RequestState
from osd.sampling import Output, SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Stream:
    """A request and where its snapshots go (an asyncio queue on the caller's loop)."""

    request_id: str
    request: RequestState
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: int = -1  # tokens in the last snapshot sent
    sent_at: float = 0.0  # time.monotonic() of the last snapshot sent


class AsyncEngine:
    """Continuous-batching front of an :class:`~osd.Engine` for asyncio code.

    Args:
        engine: the engine to serve; the AsyncEngine's thread steps it from now on (plain
            ``engine.generate`` calls still work: they take turns with the loop's steps).
        stream_interval: seconds. A running request whose last snapshot is younger than
            this gets its new tokens in a later one (its first token and its last
            snapshot are never held). 0 sends every step's tokens at once; more sends
            fewer, larger snapshots, which on a CPU the engine shares with the serving
            code and its clients leaves more of the cores to the steps.

    Attributes:
        engine: the wrapped :class:`~osd.Engine`.
        tokenizer: ``engine.tokenizer``.
    """

    def __init__(self, engine: Engine, stream_interval: float = 0.0) -> None:
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be an osd.Engine, got {type(engine).__name__}")
        if not stream_interval >= 0:
            raise ValueError(f"stream_interval must be >= 0 seconds, got {stream_interval!r}")
        self.stream_interval = float(stream_interval)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._lock = threading.Lock()  # guards the three fields below
        self._streams: dict[str, _Stream] = {}  # every request not yet finished
        self._inbox: list[_Stream] = []  # submitted, not yet in the engine
        self._aborts: list[_Stream] = []
        self._wake = threading.Event()
        self._closed = False
        if engine.device.type == "cpu":
            # the steps run on the loop thread below: this thread's OpenMP team (the load's)
            # would otherwise cut the loop team's spinning (osd._openmp.release_thread_pool)
            release_thread_pool()
        self._thread = threading.Thread(target=self._loop, name="osd-async-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(
        cls, target, draft=None, stream_interval: float = 0.0, **kwargs
    ) -> "AsyncEngine":
        """``AsyncEngine(Engine.from_pretrained(target, draft, **kwargs),
        stream_interval)``: the same arguments as :meth:`osd.Engine.from_pretrained`."""
        return cls(Engine.from_pretrained(target, draft, **kwargs), stream_interval)

    # -- the caller's side --------------------------------------------------------------
    async def generate(
        self,
        prompt,
        params: SamplingParams,
        request_id: str | None = None,
        draft: int | None = None,
    ):
        """Generate a continuation of one prompt, as an async iterator of
        :class:`~osd.Output` snapshots.

        Args:
            prompt: a list of token ids or (with a tokenizer) a string.
            params: its :class:`~osd.SamplingParams`.
            request_id: a name for :meth:`abort`; a fresh one when None.
            draft: serve it with this draft (an index into the engine's drafts) instead
                of the router's choice.

        Yields:
            ``Output`` with every token generated so far (``token_ids``, ``text``,
            ``prompt_token_ids``), ``finish_reason`` None until the last snapshot, which
            has ``"stop"``, ``"length"`` or ``"abort"``.

        Raises:
            ValueError / TypeError: bad input (prompt, parameters, a prompt plus
                ``max_new_tokens`` over ``max_seq_len``, an unknown draft, a request id in
                use), at the
                first iteration; the engine never sees the request.
            osd.RequestError: the request failed while it ran (the others go on).
        """
        if self._closed:
            raise RuntimeError("this AsyncEngine is closed")
        request = self._request(prompt, params, draft)
        request_id = str(uuid.uuid4()) if request_id is None else str(request_id)
        stream = _Stream(request_id, request, asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                self.engine.errors["bad_request"] += 1
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._inbox.append(stream)
        self._wake.set()
        finished = False
        try:
            while True:
                out = await stream.queue.get()
                if out.finish_reason == "error":
                    finished = True
                    raise RequestError(f"request {request_id}: {out.error}")
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            if not finished:  # the caller stopped listening (closed, cancelled)
                self._abort(request_id)

    async def chat(
        self,
        messages: list[dict],
        params: SamplingParams,
        request_id: str | None = None,
        draft: int | None = None,
    ):
        """:meth:`generate` on one conversation formatted with the tokenizer's chat
        template (generation prompt added)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this engine has none")
        prompt = apply_chat_template(self.tokenizer, [messages])[0]
        async for out in self.generate(prompt, params, request_id, draft):
            yield out

    async def abort(self, request_id: str) -> None:
        """Stop request ``request_id`` at the next step boundary (its row and cache are
        freed); its iterator ends with ``finish_reason="abort"``. Unknown or finished ids
        are ignored."""
        self._abort(str(request_id))

    def _abort(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None:
                self._aborts.append(stream)
        self._wake.set()

    def _request(self, prompt, params: SamplingParams, draft: int | None) -> RequestState:
        request = self.engine.requests([prompt], params, draft=draft)[0]
        limit = self.engine.max_seq_len
        if len(request.prompt) + request.max_new_tokens > limit:
            self.engine.errors["bad_request"] += 1
            raise ValueError(
                f"the prompt has {len(request.prompt)} tokens and max_new_tokens "
                f"is {request.max_new_tokens}: together they exceed the maximum "
                f"context max_seq_len={limit}"
            )
        return request

    async def score(self, prompt, logprobs: int = 0) -> list:
        """:meth:`osd.Engine.score` of one prompt, run in a worker thread between the
        loop's steps."""
        return (await asyncio.to_thread(self.engine.score, [prompt], logprobs))[0]

    @property
    def stats(self) -> dict:
        """``engine.stats`` (errors by kind included), taken between steps."""
        with self.engine._exclusive():
            return self.engine.stats

    def close(self) -> None:
        """Stop the loop (running requests end with ``finish_reason="abort"``) and the
        engine's learners."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join()
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            self._inbox.clear()
        self.engine.abort([s.request for s in streams])
        for s in streams:
            self._send(s, self.engine.output(s.request))
        self.engine.close()

    # -- the loop's side ------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while not self._closed:
            self._wake.clear()
            with self._lock:
                new, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            if not (new or aborts or engine.has_work()):
                self._wake.wait(0.5)
                continue
            with engine._exclusive():
                if new:
                    engine.submit([s.request for s in new])
                if aborts:
                    engine.abort([s.request for s in aborts])
                if engine.has_work():
                    try:
                        engine.step()
                    except Exception:  # not a row's (osd.isolation handles those): serve on
                        log.exception("osd: engine step failed")
                self._publish()

    def _publish(self) -> None:
        """Send a snapshot of every request that gained tokens or finished."""
        with self._lock:
            streams = list(self._streams.values())
        done = []
        now = time.monotonic()
        for s in streams:
            r = s.request
            if r.finish_reason is None and (
                len(r.generated) == s.sent
                or (s.sent > 0 and now - s.sent_at < self.stream_interval)
            ):
                continue
            s.sent, s.sent_at = len(r.generated), now
            self._send(s, self.engine.output(r))
            if r.finish_reason is not None:
                done.append(s.request_id)
        if done:
            with self._lock:
                for request_id in done:
                    self._streams.pop(request_id, None)

    def _send(self, stream: _Stream, out: Output) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except RuntimeError:  # the caller's event loop is gone
            if out.finish_reason is None:
                self._abort(stream.request_id)
