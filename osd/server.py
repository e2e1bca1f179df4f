"""An OpenAI-compatible HTTP server over :class:`osd.AsyncEngine` (FastAPI + uvicorn).

    >>> app = build_app(osd.AsyncEngine.from_pretrained(target, draft), "my-model")
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)      # or: osd serve --target ...

(``osd serve`` itself is :mod:`osd.server_run`.)

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` sends server-sent events ending with ``data: [DONE]``), ``GET /health``
and ``GET /metrics`` (Prometheus text, vLLM's spec-decode metric names under ``osd:``).
``docs/serving.md`` lists the request fields and metrics.

Every request is validated before it reaches the engine (:mod:`osd.server_requests`), so
a bad one gets a 4xx with an OpenAI-style error body naming the field, and the engine
never sees it; bodies are parsed and prompts tokenized in a worker thread, so the event
loop never waits on one. What a client may take (API key, body size, queue, timeouts,
connections) is :class:`osd.server_limits.Limits`. Stop strings go to the engine
(``SamplingParams.stop``), which ends the request at the token that completes one, so
its row frees at once; the text is cut before it. fastapi is imported lazily (only
:func:`build_app` and ``osd serve`` need it), so ``import osd`` works without it.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations
# (``request: Request``, imported lazily inside build_app) as objects, not strings.
import json
import time
import uuid
from dataclasses import dataclass

from osd.request import stop_prefix_length
from osd.server_limits import Guard, Limits, error_response, parse_json, read_body
from osd.server_metrics import Counters, engine_snapshot, metrics_text
from osd.server_requests import APIError, GenRequest, _bad, parse_chat, parse_completion

# ---- Driving one request: text deltas, stop strings, abort ----


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
        import anyio

        if self.done:
            return
        if self._iter is None:  # never submitted (an earlier choice was refused)
            self._end()
            return
        self.counters.aborted["client_disconnect"] += 1
        with anyio.CancelScope(shield=True):
            await self._abort()


# ---- Responses ----


def _token_text(tok, token_id: int) -> str:
    return f"token_id:{token_id}" if tok is None else tok.decode([token_id])


def _logprobs_body(tok, req: GenRequest, pairs: list, offset: int):
    """OpenAI's ``logprobs`` object of a choice from ``(token id, osd.TokenLogprobs or
    None)`` pairs (None: an echoed prompt's first token): chat's ``content`` list, or the
    completions' parallel lists (``text_offset`` from ``offset``, the characters sent
    before these tokens)."""
    if req.logprobs is None:
        return None
    if req.kind == "chat":

        def entry(i, lp):
            t = _token_text(tok, i)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

        return {
            "content": [
                {**entry(e.token_id, e.logprob), "top_logprobs": [entry(i, lp) for i, lp in e.top]}
                for _, e in pairs
            ]
        }
    tokens = [_token_text(tok, i) for i, _ in pairs]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e and e.logprob for _, e in pairs],
        "top_logprobs": [e and {_token_text(tok, i): lp for i, lp in e.top} for _, e in pairs],
        "text_offset": offsets,
    }


def _pairs(logprobs: list) -> list:
    return [(e.token_id, e) for e in logprobs]


def _choice(
    tok,
    req: GenRequest,
    text: str,
    ids: list[int],
    finish: str | None,
    stream: bool,
    pairs: list,
    offset: int = 0,
    index: int = 0,
) -> dict:
    lp = _logprobs_body(tok, req, pairs, offset)
    if req.kind == "chat":
        if stream:
            c = {
                "index": index,
                "delta": {"content": text} if text else {},
                "logprobs": lp,
                "finish_reason": finish,
            }
        else:
            c = {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": finish,
            }
    else:
        c = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
    if req.return_token_ids:
        c["token_ids"] = ids
        if not stream or finish is not None:
            c["prompt_token_ids"] = req.prompt_ids
    return c


def _envelope(kind: str, request_id: str, model_name: str, created: int, stream: bool) -> dict:
    obj = {
        "chat": ("chat.completion", "chat.completion.chunk"),
        "completion": ("text_completion", "text_completion"),
    }[kind][int(stream)]
    return {"id": request_id, "object": obj, "created": created, "model": model_name}


async def _echo(async_engine, req: GenRequest) -> tuple[str, list]:
    """The echoed prompt: its text and its ``(token id, logprobs)`` pairs (scored by the
    target only when logprobs are asked for)."""
    tok = async_engine.engine.tokenizer
    text = "" if tok is None else tok.decode(req.prompt_ids)
    scores = (
        [None] * len(req.prompt_ids)
        if req.logprobs is None
        else await async_engine.score(req.prompt_ids, req.logprobs)
    )
    return text, list(zip(req.prompt_ids, scores))


def _echo_only(slots: list, head: dict, tok, usage: dict):
    """The response to ``echo`` with ``max_tokens`` 0: each choice's prompt alone."""
    from fastapi.responses import JSONResponse, StreamingResponse

    req = slots[0][0]
    choices = [
        _choice(tok, r, echo[0], [], "length", req.stream, echo[1], index=k)
        for k, (r, echo, _) in enumerate(slots)
    ]
    if not req.stream:
        return JSONResponse({**head, "choices": choices, "usage": usage})
    events = [_sse({**head, "choices": [c]}) for c in choices]
    if req.include_usage:
        events.append(_sse({**head, "choices": [], "usage": usage}))
    return StreamingResponse(iter(events + ["data: [DONE]\n\n"]), media_type="text/event-stream")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _admit(async_engine, counters: Counters, limits: Limits, wanted: int) -> None:
    """Refuse (429, ``Retry-After``) generations that would queue more than
    ``limits.max_waiting`` beyond the engine's rows."""
    engine = async_engine.engine
    rows = engine.max_batch_size * len(engine.lanes)
    if counters.running + wanted <= rows + limits.max_waiting:
        return
    if wanted > rows + limits.max_waiting:
        raise _bad(
            f"this request asks for {wanted} generations (prompts x n); this server "
            f"runs or queues at most {rows + limits.max_waiting} at a time",
            "n",
        )
    raise APIError(
        429,
        f"the server is at capacity: {counters.running} generations running "
        f"or queued ({rows} rows, at most {limits.max_waiting} waiting, "
        f"--max-waiting); retry shortly",
        code="queue_full",
        type="rate_limit_error",
        headers={"Retry-After": "1"},
    )


async def _respond(
    request,
    async_engine,
    model_name: str,
    counters: Counters,
    reqs: list[GenRequest],
    limits: Limits,
):
    """Serve ``reqs`` (one per prompt; they share every option): ``n`` choices of each,
    choice ``k`` being prompt ``k // n``'s choice ``k % n``, each its own engine request."""
    import asyncio

    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.background import BackgroundTask

    req = reqs[0]
    prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    tok = async_engine.engine.tokenizer
    choices = [(r, i) for r in reqs for i in range(r.n)]
    gens = []
    if req.generate:  # checked and counted (by the Generations) with no await between
        _admit(async_engine, counters, limits, len(choices))
        gens = [
            Generation(
                async_engine,
                r,
                request_id if len(choices) == 1 else f"{request_id}-{k}",
                counters,
                r.choice_params(i),
            )
            for k, (r, i) in enumerate(choices)
        ]

    async def cancel_all() -> None:
        for g in gens:
            await g.cancel()

    firsts = []
    try:
        echoes = [await _echo(async_engine, r) if r.echo else ("", []) for r in reqs]
        for g in gens:
            firsts.append(await g.start())
    except BaseException:
        await cancel_all()
        raise
    slots = [(r, echo, i) for r, echo in zip(reqs, echoes) for i in range(r.n)]
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    if not req.generate:
        return _echo_only(
            slots,
            _envelope(req.kind, request_id, model_name, created, req.stream),
            tok,
            {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens},
        )

    def usage() -> dict:
        c = sum(len(g.ids) for g in gens)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": c,
            "total_tokens": prompt_tokens + c,
        }

    if not req.stream:
        try:
            while not all(g.done for g in gens):
                if await request.is_disconnected():
                    await cancel_all()
                    return JSONResponse({}, status_code=499)
                await asyncio.gather(*(g.next_step() for g in gens if not g.done))
        except BaseException:
            await cancel_all()
            raise
        body = _envelope(req.kind, request_id, model_name, created, False)
        body["choices"] = [
            _choice(
                tok,
                r,
                echo[0] + g.text,
                g.ids,
                g.finish_reason,
                False,
                echo[1] + _pairs(g.logprobs),
                index=k,
            )
            for k, (g, (r, echo, _)) in enumerate(zip(gens, slots))
        ]
        body["usage"] = usage()
        return JSONResponse(body)

    async def events():
        head = _envelope(req.kind, request_id, model_name, created, True)
        sent = [sum(len(_token_text(tok, i)) for i, _ in echo[1]) for _, echo, _ in slots]
        tasks: dict = {}

        def chunk(k: int, step: Step) -> str | None:
            r = slots[k][0]
            if not (
                step.text
                or step.finish_reason is not None
                or ((r.return_token_ids or r.logprobs is not None) and step.token_ids)
            ):
                return None
            c = _choice(
                tok,
                r,
                step.text,
                step.token_ids,
                step.finish_reason,
                True,
                _pairs(step.logprobs),
                sent[k],
                index=k,
            )
            sent[k] += sum(len(_token_text(tok, t)) for t in step.token_ids)
            return _sse({**head, "choices": [c]})

        try:
            for k, (r, echo, _) in enumerate(slots):
                if req.kind == "chat":  # a chat choice's first chunk names the role
                    yield _sse(
                        {
                            **head,
                            "choices": [
                                {
                                    "index": k,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                        }
                    )
                if req.echo:  # the prompt first, as its own chunk
                    yield _sse(
                        {
                            **head,
                            "choices": [_choice(tok, r, echo[0], [], None, True, echo[1], index=k)],
                        }
                    )
            for i, step in enumerate(firsts):
                out = chunk(i, step)
                if out:
                    yield out
                if not gens[i].done:
                    tasks[asyncio.ensure_future(gens[i].next_step())] = i
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = tasks.pop(task)
                    try:
                        step = task.result()
                    except APIError as exc:
                        counters.api_errors[(exc.status, exc.type)] = (
                            counters.api_errors.get((exc.status, exc.type), 0) + 1
                        )
                        yield _sse(exc.body())
                        continue
                    out = chunk(i, step)
                    if out:
                        yield out
                    if not gens[i].done:
                        tasks[asyncio.ensure_future(gens[i].next_step())] = i
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": usage()})
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            await cancel_all()

    # The generator's finally covers a cancelled stream; the background task covers a
    # generator that never resumes after the client left (it is not closed at once).
    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
        background=BackgroundTask(cancel_all),
    )


# ---- The app ----


def build_app(async_engine, model_name: str, limits: Limits | None = None):
    """The FastAPI app serving ``async_engine`` (an :class:`osd.AsyncEngine`) under the
    model id ``model_name``, within ``limits`` (:class:`osd.server_limits.Limits`; the
    connection-level ones need :func:`osd.server_limits.uvicorn_config` too)."""
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    limits = limits or Limits()
    engine = async_engine.engine
    counters = Counters()
    created = int(time.time())
    max_chars = limits.prompt_chars(engine.max_seq_len)
    # Parsing (JSON, tokenizing, chat templates) runs off the event loop, one request at
    # a time: a long prompt costs its own request time, never the loop's or the engine's
    # CPU beyond one thread.
    parsing = anyio.CapacityLimiter(1)
    app = FastAPI(title="osd", description="OpenAI-compatible speculative decoding server")
    app.state.async_engine = async_engine
    app.state.counters = counters
    app.state.limits = limits

    def count(exc: APIError) -> None:
        counters.api_errors[(exc.status, exc.type)] = (
            counters.api_errors.get((exc.status, exc.type), 0) + 1
        )

    def error(exc: APIError):
        count(exc)
        return error_response(exc)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(
            APIError(
                exc.status_code,
                f"{request.method} {request.url.path[:200]}: {exc.detail}",
                type=kind,
            )
        )

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        return error(
            APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        )

    async def parsed(request: Request, parse):
        raw = await read_body(request, limits)

        def work():
            return parse(parse_json(raw), engine, model_name, max_chars)

        return await anyio.to_thread.run_sync(work, limiter=parsing)

    def model_card() -> dict:
        return {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "osd",
            "max_model_len": engine.max_seq_len,
        }

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != model_name:
            raise APIError(
                404,
                f"the model {model[:200]!r} does not exist; this server serves {model_name!r}",
                "model",
                "model_not_found",
            )
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        reqs = await parsed(request, parse_completion)
        return await _respond(request, async_engine, model_name, counters, reqs, limits)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parsed(request, parse_chat)
        return await _respond(request, async_engine, model_name, counters, [req], limits)

    @app.get("/metrics")
    async def metrics():
        # AsyncEngine.stats waits for the engine's current step to end: in a thread, so
        # the event loop (which alone touches the counters) never stalls.
        snapshot = await anyio.to_thread.run_sync(engine_snapshot, async_engine)
        return PlainTextResponse(
            metrics_text(snapshot, counters), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    # Outermost last: CORS answers preflights before the key is asked for.
    app.add_middleware(Guard, limits=limits, on_error=count)
    if limits.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(limits.allowed_origins),
            allow_methods=["GET", "POST", "HEAD", "OPTIONS"],
            allow_headers=["*"],
        )  # OpenAI's SDKs send their own headers
    return app
