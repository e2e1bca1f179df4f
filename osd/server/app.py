"""An OpenAI-compatible HTTP server over :class:`osd.AsyncEngine` (FastAPI + uvicorn).

    >>> app = build_app(osd.AsyncEngine.from_pretrained(target, draft), "my-model")
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)      # or: osd serve --target ...

(``osd serve`` itself is :mod:`osd.server.run`.)

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` sends server-sent events ending with ``data: [DONE]``), ``GET /health``
and ``GET /metrics`` (Prometheus text, vLLM's spec-decode metric names under ``osd:``).
``docs/serving.md`` lists the request fields and metrics.

Every request is validated before it reaches the engine (:mod:`osd.server.requests`), so
a bad one gets a 4xx with an OpenAI-style error body naming the field, and the engine
never sees it; bodies are parsed and prompts tokenized in a worker thread, so the event
loop never waits on one. What a client may take (API key, body size, queue, timeouts,
connections) is :class:`osd.server.limits.Limits`. Each choice runs as a
:class:`osd.server.generation.Generation`; the response bodies are built by
:mod:`osd.server.responses`. Stop strings go to the engine (``SamplingParams.stop``),
which ends the request at the token that completes one, so its row frees at once; the
text is cut before it.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations
# (``request: Request``) as objects, not strings.
import asyncio
import time
import uuid

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from osd.server.generation import Generation, Step
from osd.server.limits import Guard, Limits, error_response, parse_json, read_body
from osd.server.metrics import Counters, engine_snapshot, metrics_text
from osd.server.requests import APIError, GenRequest, _bad, parse_chat, parse_completion
from osd.server.responses import (
    choice,
    echo_only,
    echo_prompt,
    envelope,
    pairs,
    sse,
    token_text,
)


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
        echoes = [await echo_prompt(async_engine, r) if r.echo else ("", []) for r in reqs]
        for g in gens:
            firsts.append(await g.start())
    except BaseException:
        await cancel_all()
        raise
    slots = [(r, echo, i) for r, echo in zip(reqs, echoes) for i in range(r.n)]
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    if not req.generate:
        return echo_only(
            slots,
            envelope(req.kind, request_id, model_name, created, req.stream),
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
        body = envelope(req.kind, request_id, model_name, created, False)
        body["choices"] = [
            choice(
                tok,
                r,
                echo[0] + g.text,
                g.ids,
                g.finish_reason,
                False,
                echo[1] + pairs(g.logprobs),
                index=k,
            )
            for k, (g, (r, echo, _)) in enumerate(zip(gens, slots))
        ]
        body["usage"] = usage()
        return JSONResponse(body)

    async def events():
        head = envelope(req.kind, request_id, model_name, created, True)
        sent = [sum(len(token_text(tok, i)) for i, _ in echo[1]) for _, echo, _ in slots]
        tasks: dict = {}

        def chunk(k: int, step: Step) -> str | None:
            r = slots[k][0]
            if not (
                step.text
                or step.finish_reason is not None
                or ((r.return_token_ids or r.logprobs is not None) and step.token_ids)
            ):
                return None
            c = choice(
                tok,
                r,
                step.text,
                step.token_ids,
                step.finish_reason,
                True,
                pairs(step.logprobs),
                sent[k],
                index=k,
            )
            if r.logprobs is not None:  # the text offsets of the logprobs
                sent[k] += sum(len(token_text(tok, t)) for t in step.token_ids)
            return sse({**head, "choices": [c]})

        try:
            for k, (r, echo, _) in enumerate(slots):
                if req.kind == "chat":  # a chat choice's first chunk names the role
                    yield sse(
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
                    yield sse(
                        {
                            **head,
                            "choices": [choice(tok, r, echo[0], [], None, True, echo[1], index=k)],
                        }
                    )
            for i, step in enumerate(firsts):
                out = chunk(i, step)
                if out:
                    yield out
                if not gens[i].done and len(gens) > 1:
                    tasks[asyncio.ensure_future(gens[i].next_step())] = i
            # one choice (the usual request): its steps in turn, without a task each
            while len(gens) == 1 and not gens[0].done:
                try:
                    step = await gens[0].next_step()
                except APIError as exc:
                    counters.api_errors[(exc.status, exc.type)] = (
                        counters.api_errors.get((exc.status, exc.type), 0) + 1
                    )
                    yield sse(exc.body())
                    continue
                out = chunk(0, step)
                if out:
                    yield out
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
                        yield sse(exc.body())
                        continue
                    out = chunk(i, step)
                    if out:
                        yield out
                    if not gens[i].done:
                        tasks[asyncio.ensure_future(gens[i].next_step())] = i
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": usage()})
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
    model id ``model_name``, within ``limits`` (:class:`osd.server.limits.Limits`; the
    connection-level ones need :func:`osd.server.limits.uvicorn_config` too)."""
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
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(limits.allowed_origins),
            allow_methods=["GET", "POST", "HEAD", "OPTIONS"],
            allow_headers=["*"],
        )  # OpenAI's SDKs send their own headers
    return app
