"""An OpenAI-compatible HTTP server over :class:`osd.AsyncEngine` (FastAPI + uvicorn).

    >>> app = build_app(osd.AsyncEngine.from_pretrained(target, draft), "my-model")
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)      # or: osd serve --target ...

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` sends server-sent events ending with ``data: [DONE]``), ``GET /health``
and ``GET /metrics`` (Prometheus text, vLLM's spec-decode metric names under ``osd:``).
``docs/serving.md`` lists the request fields and metrics.

Every request is validated before it reaches the engine (:mod:`osd.server_requests`), so
a bad one gets a 4xx with an OpenAI-style error body naming the field, and the engine
never sees it. Stop strings go to the engine (``SamplingParams.stop``), which ends the
request at the token that completes one, so its row frees at once; the text is cut
before it. fastapi is imported lazily (only :func:`build_app` and :func:`serve` need it),
so ``import osd`` works without it.
"""
# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations
# (``request: Request``, imported lazily inside build_app) as objects, not strings.
import json
import time
import uuid
from dataclasses import dataclass

import osd
from osd.models.quant import own_quant_layers
from osd.request import stop_prefix_length
from osd.server_metrics import Counters, engine_snapshot, metrics_text
from osd.server_requests import APIError, GenRequest, _bad, parse_chat, parse_completion
from osd.spec import describe

# ---- Driving one request: text deltas, stop strings, abort ----

@dataclass
class Step:
    """One engine snapshot as the client sees it."""

    text: str                  # new visible text
    token_ids: list[int]       # new token ids
    finish_reason: str | None  # "stop" | "length" on the last step
    logprobs: list             # osd.TokenLogprobs of token_ids (when asked for)


class Generation:
    """One request running on the AsyncEngine, as a stream of :class:`Step`s.

    Text is decoded from the generated ids; in a stream the tail that could still become a
    stop string, and an unfinished UTF-8 character (decoded as U+FFFD), are held back. The
    engine ends a request at a stop string (ids up to the token that completed it); the
    text is cut before the string.
    """

    def __init__(self, async_engine, req: GenRequest, request_id: str,
                 counters: Counters, params=None) -> None:
        self.ae, self.req, self.id, self.counters = async_engine, req, request_id, counters
        self.params = params or req.params          # this choice's (its own seed)
        self.tok = async_engine.engine.tokenizer
        self.stop_ids = frozenset(req.params.stop_token_ids or ())
        self.text = ""             # text sent so far
        self.ids: list[int] = []   # ids sent so far
        self.logprobs: list = []   # their osd.TokenLogprobs (when asked for)
        self.finish_reason: str | None = None
        self.done = False          # the engine request is over (finished or aborted)
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
        return max(len(text) - len(text.rstrip("\ufffd")),
                   stop_prefix_length(text, self.req.stop))

    async def start(self) -> Step:
        """Submit the request and wait for its first step. Bad input the engine refuses
        becomes a 400 here, before any response has started."""
        self.counters.running += 1
        self.counters.prompt_tokens += len(self.req.prompt_ids)
        self._iter = self.ae.generate(self.req.prompt_ids, self.params,
                                      request_id=self.id, draft=self.req.draft).__aiter__()
        return await self.next_step()

    async def next_step(self) -> Step:
        try:
            out = await self._iter.__anext__()
        except StopAsyncIteration:
            self._end()
            raise APIError(500, "the engine ended the request without a finish reason",
                           type="server_error") from None
        except (ValueError, TypeError) as exc:   # input the engine refuses
            self._end()
            raise _bad(str(exc)) from None
        except RuntimeError as exc:                   # osd.RequestError and the like
            self._end()
            raise APIError(500, f"generation failed: {exc}", type="server_error") from None
        ids, finish = list(out.token_ids), out.finish_reason
        if finish == "abort":
            self._end()
            raise APIError(503, "the request was aborted by the engine (shutting down?)",
                           type="server_error")
        text = self._decode(ids, finish)
        hits = [i for i in (text.find(s) for s in self.req.stop) if i >= 0] \
            if finish == "stop" else []
        if hits:
            text = text[:min(hits)]
            self.counters.stop_strings += 1
        visible = text if finish is not None or not self.req.stream else \
            text[:len(text) - self._held_back(text)]
        delta = visible[len(self.text):] if visible.startswith(self.text) else ""
        if delta:
            self.text += delta
        new_ids = ids[len(self.ids):]
        new_logprobs = (out.logprobs or [])[len(self.ids):len(ids)]
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
                except RuntimeError:       # already running elsewhere: it ends by itself
                    pass

    async def cancel(self) -> None:
        """Abort the request if it is still running (the client went away). Shielded:
        this runs while the request's task is being cancelled."""
        import anyio

        if self.done:
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
        return {"content": [{**entry(e.token_id, e.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in e.top]}
                            for _, e in pairs]}
    tokens = [_token_text(tok, i) for i, _ in pairs]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e and e.logprob for _, e in pairs],
            "top_logprobs": [e and {_token_text(tok, i): lp for i, lp in e.top}
                             for _, e in pairs],
            "text_offset": offsets}


def _pairs(logprobs: list) -> list:
    return [(e.token_id, e) for e in logprobs]


def _choice(tok, req: GenRequest, text: str, ids: list[int], finish: str | None,
            stream: bool, pairs: list, offset: int = 0, index: int = 0) -> dict:
    lp = _logprobs_body(tok, req, pairs, offset)
    if req.kind == "chat":
        if stream:
            c = {"index": index, "delta": {"content": text} if text else {},
                 "logprobs": lp, "finish_reason": finish}
        else:
            c = {"index": index, "message": {"role": "assistant", "content": text},
                 "logprobs": lp, "finish_reason": finish}
    else:
        c = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
    if req.return_token_ids:
        c["token_ids"] = ids
        if not stream or finish is not None:
            c["prompt_token_ids"] = req.prompt_ids
    return c


def _envelope(kind: str, request_id: str, model_name: str, created: int, stream: bool) -> dict:
    obj = {"chat": ("chat.completion", "chat.completion.chunk"),
           "completion": ("text_completion", "text_completion")}[kind][int(stream)]
    return {"id": request_id, "object": obj, "created": created, "model": model_name}


async def _echo(async_engine, req: GenRequest) -> tuple[str, list]:
    """The echoed prompt: its text and its ``(token id, logprobs)`` pairs (scored by the
    target only when logprobs are asked for)."""
    tok = async_engine.engine.tokenizer
    text = "" if tok is None else tok.decode(req.prompt_ids)
    scores = [None] * len(req.prompt_ids) if req.logprobs is None else \
        await async_engine.score(req.prompt_ids, req.logprobs)
    return text, list(zip(req.prompt_ids, scores))


def _echo_only(slots: list, head: dict, tok, usage: dict):
    """The response to ``echo`` with ``max_tokens`` 0: each choice's prompt alone."""
    from fastapi.responses import JSONResponse, StreamingResponse

    req = slots[0][0]
    choices = [_choice(tok, r, echo[0], [], "length", req.stream, echo[1], index=k)
               for k, (r, echo, _) in enumerate(slots)]
    if not req.stream:
        return JSONResponse({**head, "choices": choices, "usage": usage})
    events = [_sse({**head, "choices": [c]}) for c in choices]
    if req.include_usage:
        events.append(_sse({**head, "choices": [], "usage": usage}))
    return StreamingResponse(iter(events + ["data: [DONE]\n\n"]),
                             media_type="text/event-stream")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _respond(request, async_engine, model_name: str, counters: Counters,
                   reqs: list[GenRequest]):
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
    echoes = [await _echo(async_engine, r) if r.echo else ("", []) for r in reqs]
    slots = [(r, echo, i) for r, echo in zip(reqs, echoes) for i in range(r.n)]
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    if not req.generate:
        return _echo_only(slots, _envelope(req.kind, request_id, model_name, created,
                                           req.stream), tok,
                          {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                           "total_tokens": prompt_tokens})
    gens = [Generation(async_engine, r, request_id if len(slots) == 1 else f"{request_id}-{k}",
                       counters, r.choice_params(i)) for k, (r, _, i) in enumerate(slots)]

    async def cancel_all() -> None:
        for g in gens:
            await g.cancel()

    firsts = []
    try:
        for g in gens:
            firsts.append(await g.start())
    except BaseException:
        await cancel_all()
        raise

    def usage() -> dict:
        c = sum(len(g.ids) for g in gens)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": c,
                "total_tokens": prompt_tokens + c}

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
        body["choices"] = [_choice(tok, r, echo[0] + g.text, g.ids, g.finish_reason, False,
                                   echo[1] + _pairs(g.logprobs), index=k)
                           for k, (g, (r, echo, _)) in enumerate(zip(gens, slots))]
        body["usage"] = usage()
        return JSONResponse(body)

    async def events():
        head = _envelope(req.kind, request_id, model_name, created, True)
        sent = [sum(len(_token_text(tok, i)) for i, _ in echo[1]) for _, echo, _ in slots]
        tasks: dict = {}

        def chunk(k: int, step: Step) -> str | None:
            r = slots[k][0]
            if not (step.text or step.finish_reason is not None or (
                    (r.return_token_ids or r.logprobs is not None) and step.token_ids)):
                return None
            c = _choice(tok, r, step.text, step.token_ids, step.finish_reason, True,
                        _pairs(step.logprobs), sent[k], index=k)
            sent[k] += sum(len(_token_text(tok, t)) for t in step.token_ids)
            return _sse({**head, "choices": [c]})

        try:
            for k, (r, echo, _) in enumerate(slots):
                if req.kind == "chat":   # a chat choice's first chunk names the role
                    yield _sse({**head, "choices": [{"index": k, "delta": {
                        "role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}]})
                if req.echo:             # the prompt first, as its own chunk
                    yield _sse({**head, "choices": [_choice(tok, r, echo[0], [], None, True,
                                                            echo[1], index=k)]})
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
                        counters.api_errors[(exc.status, exc.type)] = \
                            counters.api_errors.get((exc.status, exc.type), 0) + 1
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
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(cancel_all))


# ---- The app ----

def build_app(async_engine, model_name: str):
    """The FastAPI app serving ``async_engine`` (an :class:`osd.AsyncEngine`) under the
    model id ``model_name``."""
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    engine = async_engine.engine
    counters = Counters()
    created = int(time.time())
    app = FastAPI(title="osd", description="OpenAI-compatible speculative decoding server")
    app.state.async_engine = async_engine
    app.state.counters = counters

    def error(exc: APIError) -> JSONResponse:
        counters.api_errors[(exc.status, exc.type)] = \
            counters.api_errors.get((exc.status, exc.type), 0) + 1
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(APIError(exc.status_code, f"{request.method} {request.url.path}: "
                              f"{exc.detail}", type=kind))

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        return error(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                              type="server_error"))

    async def body_of(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad(f"the request body is not valid JSON: {exc}") from None

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "osd",
                "max_model_len": engine.max_seq_len}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{model_name!r}", "model", "model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        reqs = parse_completion(await body_of(request), engine, model_name)
        return await _respond(request, async_engine, model_name, counters, reqs)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_chat(await body_of(request), engine, model_name)
        return await _respond(request, async_engine, model_name, counters, [req])

    @app.get("/metrics")
    async def metrics():
        # AsyncEngine.stats waits for the engine's current step to end: in a thread, so
        # the event loop (which alone touches the counters) never stalls.
        snapshot = await anyio.to_thread.run_sync(engine_snapshot, async_engine)
        return PlainTextResponse(metrics_text(snapshot, counters),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def serve(args) -> int:
    """``osd serve``: load the pair, then run uvicorn until interrupted.

    The port is bound before the (slow) model load, so a busy port fails at once with one
    error line."""
    import os
    import socket

    import torch
    import uvicorn

    from osd import zoo

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    target, draft, name = args.target, args.draft, args.model_name
    if target is None:
        # The chat pair when its target is already cached (never download at start-up),
        # else the built-in pair shipped with the package.
        if zoo.chat.cached_target() is not None:
            target, chat_draft = zoo.chat_pair()
            name = name or "SmolLM2-135M-Instruct"
        else:
            target, chat_draft = zoo.default_pair()
            name = name or "osd-zoo"
        draft = None if args.no_draft else (draft or chat_draft)
    # Otherwise the target's file or directory name, without ".gguf".
    name = name or os.path.basename(os.path.normpath(str(target))).removesuffix(".gguf")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    # No speculation flag with a draft: spec=None lets from_pretrained take the draft's
    # recommended settings (its serving.json; the chat drafts carry one) or a chain of 4.
    flags = [getattr(args, f, None) for f in ("k", "lookup_tokens", "lookup_tree_below")]
    spec = None
    if args.prompt_lookup or (draft is not None and (any(f is not None for f in flags)
                                                    or getattr(args, "auto_k", False)
                                                    or getattr(args, "lookup_history", 0))):
        k = 4 if args.k is None else args.k
        lookup_tokens = getattr(args, "lookup_tokens", None) or 0
        # Without a draft model the n-gram drafter is the lookup: its chains are lookup's.
        spec = osd.SpecConfig(num_draft_tokens=k if draft is not None else lookup_tokens or k,
                              drafter="model" if draft is not None else "ngram",
                              prompt_lookup=args.prompt_lookup and draft is not None,
                              lookup_tokens=lookup_tokens if draft is not None else 0,
                              lookup_history=getattr(args, "lookup_history", 0)
                              if args.prompt_lookup else 0,
                              lookup_tree_below=getattr(args, "lookup_tree_below", None) or 0
                              if args.prompt_lookup and draft is not None else 0,
                              auto_k=getattr(args, "auto_k", False))
    if args.online and draft is None:
        raise ValueError("--online needs a draft model to learn (--draft)")
    online = osd.OnlineConfig() if args.online else None
    if args.threads:
        torch.set_num_threads(args.threads)
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only when
    # the listening socket's protocol is TCP; without it a stream's first event waits for
    # the client's delayed ACK on a kept-alive connection.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET,
                         socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    try:
        ae = osd.AsyncEngine.from_pretrained(
            target, draft=draft, device=args.device, dtype=dtype, spec=spec, online=online,
            max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
            quantized=args.quantized, prefix_cache=getattr(args, "prefix_cache", 0),
            quantize_draft=getattr(args, "quantize_draft", None))
    except BaseException:
        sock.close()
        raise
    try:
        app = build_app(ae, name)
        print(f"osd serve: {name} (target {target}, draft {draft or 'none'}) on "
              f"http://{args.host}:{args.port}/v1", flush=True)
        if ae.engine.spec is not None:
            drafts = ae.engine.drafts
            formats = {m.fmt for d in drafts for m in own_quant_layers(d).values()}
            kept = f"; draft in {', '.join(sorted(formats)) or 'float'}" if drafts else ""
            print(f"osd serve: speculation {describe(ae.engine.spec)}{kept}", flush=True)
        config = uvicorn.Config(app, log_level=args.log_level)
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:      # uvicorn re-raises Ctrl-C after its clean shutdown
            pass
    finally:
        ae.close()
        sock.close()
    return 0
