"""One request running on the :class:`osd.AsyncEngine`, as the client sees it: text
deltas, stop strings, token ids and logprobs, and its abort when the client goes away."""

from dataclasses import dataclass

import anyio

from osd.request import stop_prefix_length
from osd.server.metrics import Counters
from osd.server.requests import APIError, GenRequest, _bad


@dataclass
class Step:
    """One engine snapshot as the client sees it."""

    text: str  # new visible text
    token_ids: list[int]  # new token ids
    finish_reason: str | None  # "stop" | "length" on the last step
    logprobs: list  # osd.TokenLogprobs of token_ids (when asked for)


class Generation:
    """One request running on the AsyncEngine, as a stream of :class:`Step`s.

    Text is decoded from the generated ids; in a stream the tail that could still become a
    stop string, and an unfinished UTF-8 character (decoded as U+FFFD), are held back, and
    a request cut by its length ends without one. The engine ends a request at a stop
    string (ids up to the token that completed it); the text is cut before the string.
    A Generation counts as running (``counters.running``, what admission compares with the
    queue limit) from its creation until it ends.
    """

    def __init__(
        self, async_engine, req: GenRequest, request_id: str, counters: Counters, params=None
    ) -> None:
        self.ae, self.req, self.id, self.counters = async_engine, req, request_id, counters
        counters.running += 1
        self.params = params or req.params  # this choice's (its own seed)
        self.tok = async_engine.engine.tokenizer
        self.stop_ids = frozenset(req.params.stop_token_ids or ())
        self.text = ""  # text sent so far
        self.ids: list[int] = []  # ids sent so far
        self.logprobs: list = []  # their osd.TokenLogprobs (when asked for)
        self.finish_reason: str | None = None
        self.done = False  # the engine request is over (finished or aborted)
        self._iter = None

    def _decode(self, ids: list[int], finish: str | None) -> str:
        if self.tok is None:
            return ""
        # A user stop token ends the output but is not part of its text (as in vLLM).
        if finish == "stop" and ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tok.decode(ids, skip_special_tokens=True)

    def _held_back(self, text: str) -> int:
        """How many trailing characters a stream must hold back for now: an unfinished
        UTF-8 character, or a tail that may still become a stop string."""
        return max(len(text) - len(text.rstrip("\ufffd")), stop_prefix_length(text, self.req.stop))

    async def start(self) -> Step:
        """Submit the request and wait for its first step. Bad input the engine refuses
        becomes a 400 here, before any response has started."""
        self.counters.prompt_tokens += len(self.req.prompt_ids)
        self._iter = self.ae.generate(
            self.req.prompt_ids, self.params, request_id=self.id, draft=self.req.draft
        ).__aiter__()
        return await self.next_step()

    async def next_step(self) -> Step:
        try:
            out = await self._iter.__anext__()
        except StopAsyncIteration:
            self._end()
            raise APIError(
                500, "the engine ended the request without a finish reason", type="server_error"
            ) from None
        except (ValueError, TypeError) as exc:  # input the engine refuses
            self._end()
            raise _bad(str(exc)) from None
        except RuntimeError as exc:  # osd.RequestError and the like
            self._end()
            raise APIError(500, f"generation failed: {exc}", type="server_error") from None
        ids, finish = list(out.token_ids), out.finish_reason
        if finish == "abort":
            self._end()
            raise APIError(
                503, "the request was aborted by the engine (shutting down?)", type="server_error"
            )
        # Mid-stream without stop strings the snapshot's text is this decode already
        # (Engine.output: the same ids, special tokens skipped): one decode per step,
        # not two (each decodes every id so far).
        if finish is None and not self.req.stop and out.text is not None:
            text = out.text
        else:
            text = self._decode(ids, finish)
        if finish == "length":  # bytes of a character the length cut off: not text
            text = text.rstrip("\ufffd")
        hits = (
            [i for i in (text.find(s) for s in self.req.stop) if i >= 0] if finish == "stop" else []
        )
        if hits:
            text = text[: min(hits)]
            self.counters.stop_strings += 1
        visible = (
            text
            if finish is not None or not self.req.stream
            else text[: len(text) - self._held_back(text)]
        )
        delta = visible[len(self.text) :] if visible.startswith(self.text) else ""
        if delta:
            self.text += delta
        new_ids = ids[len(self.ids) :]
        new_logprobs = (out.logprobs or [])[len(self.ids) : len(ids)]
        self.logprobs += new_logprobs
        self.ids = ids
        if finish is not None:
            self._end()
            if not self.req.stream:
                self.text = text
            self.finish_reason = finish
            self.counters.finished[finish] = self.counters.finished.get(finish, 0) + 1
            self.counters.completion_tokens += len(ids)
        return Step(delta, new_ids, finish, new_logprobs)

    def _end(self) -> None:
        if not self.done:
            self.done = True
            self.counters.running -= 1

    async def _abort(self) -> None:
        self._end()
        try:
            await self.ae.abort(self.id)
        finally:
            aclose = getattr(self._iter, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except RuntimeError:  # already running elsewhere: it ends by itself
                    pass

    async def cancel(self) -> None:
        """Abort the request if it is still running (the client went away). Shielded:
        this runs while the request's task is being cancelled."""
        if self.done:
            return
        if self._iter is None:  # never submitted (an earlier choice was refused)
            self._end()
            return
        self.counters.aborted["client_disconnect"] += 1
        with anyio.CancelScope(shield=True):
            await self._abort()
