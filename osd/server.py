"""An OpenAI-compatible HTTP server over :class:`osd.AsyncEngine` (FastAPI + uvicorn).

    >>> app = build_app(osd.AsyncEngine.from_pretrained(target, draft), "my-model")
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)      # or: osd serve --target ...

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` sends server-sent events ending with ``data: [DONE]``), ``GET /health``
and ``GET /metrics`` (Prometheus text, vLLM's spec-decode metric names under ``osd:``).
``docs/serving.md`` lists the request fields and metrics.

Every request is validated here before it reaches the engine, so a bad one gets a 4xx
with an OpenAI-style error body naming the field, and the engine never sees it. Stop
strings go to the engine (``SamplingParams.stop``), which ends the request at the token
that completes one, so its row frees at once; the text is cut before it. fastapi is imported lazily (only
:func:`build_app` and :func:`serve` need it), so ``import osd`` works without it.
"""
# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations
# (``request: Request``, imported lazily inside build_app) as objects, not strings.
import json
import math
import time
import uuid
from dataclasses import dataclass, replace

import osd
from osd.sampling import MAX_LOGPROBS, SamplingParams
from osd.server_metrics import Counters, engine_snapshot, metrics_text

# OpenAI's documented default for completions; chat defaults to the room left in the context.
DEFAULT_COMPLETION_TOKENS = 16
# Request fields this server does not implement, with the values that mean "off". Any
# other value is refused with a 400 rather than silently ignored.
UNSUPPORTED = {
    "echo": (None, False), "suffix": (None, ""), "tools": (None,), "functions": (None,),
    "best_of": (None, 1),
}


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = \
            status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


@dataclass
class GenRequest:
    """One validated generation request (completion or chat)."""

    kind: str                         # "completion" | "chat"
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]                   # stop strings, found in the decoded text
    stream: bool
    include_usage: bool               # stream_options.include_usage
    return_token_ids: bool            # add token_ids / prompt_token_ids to each choice
    draft: int | None = None          # the draft asked for (an index), else routed
    logprobs: int | None = None       # top log-probabilities per token, None for none


# ---- Request validation ----

def _int_field(body: dict, name: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer, got {json.dumps(value)}", name)
    return value


def _float_field(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        raise _bad(f"{name} must be a finite number, got {json.dumps(value)}", name)
    return float(value)


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop must be a string or a list of strings", "stop")
    if any(s == "" for s in stops):
        raise _bad("stop strings must not be empty", "stop")
    return stops


def _sampling(body: dict, prompt_len: int, max_seq_len: int, vocab: int,
              default_max_tokens: int | None) -> SamplingParams:
    """SamplingParams from the request's fields; every bad value is a 400 naming it."""
    max_tokens = _int_field(body, "max_completion_tokens")
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = _int_field(body, "max_tokens"), "max_tokens"
    room = max_seq_len - prompt_len
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens < 1:
        raise _bad(f"{name} must be at least 1, got {max_tokens}", name)
    elif max_tokens > room:
        raise _bad(f"this model's maximum context length is {max_seq_len} tokens; the prompt "
                   f"has {prompt_len} and {name} asks for {max_tokens} more (at most {room} "
                   "fit)", name)
    temperature = _float_field(body, "temperature", 1.0)
    if temperature < 0:
        raise _bad(f"temperature must be >= 0 (0 is greedy), got {temperature}", "temperature")
    top_p = _float_field(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise _bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _int_field(body, "top_k", 0)
    if top_k < -1:
        raise _bad(f"top_k must be >= 1, or 0 / -1 for no limit; got {top_k}", "top_k")
    seed = _int_field(body, "seed")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise _bad("stop_token_ids must be a list of integers", "stop_token_ids")
        bad = [t for t in stop_ids if not 0 <= t < vocab]
        if bad:
            raise _bad(f"stop_token_ids has token id {bad[0]} outside the vocabulary "
                       f"[0, {vocab})", "stop_token_ids")
    penalties = {}
    for name, default, low, high in (("presence_penalty", 0.0, -2, 2),
                                     ("frequency_penalty", 0.0, -2, 2),
                                     ("repetition_penalty", 1.0, 0, math.inf)):
        penalties[name] = _float_field(body, name, default)
        if not low <= penalties[name] <= high or penalties[name] == 0 == low:
            raise _bad(f"{name} must be {'> 0' if low == 0 else f'in [{low}, {high}]'}, "
                       f"got {penalties[name]}", name)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _bad("logit_bias must be an object {token id: bias}", "logit_bias")
        try:
            bias = {int(t): b for t, b in bias.items()}
        except ValueError:
            raise _bad("logit_bias keys must be token ids", "logit_bias") from None
        bad = [t for t in bias if not 0 <= t < vocab]
        if bad:
            raise _bad(f"logit_bias has token id {bad[0]} outside the vocabulary [0, {vocab})",
                       "logit_bias")
    try:
        return SamplingParams(max_tokens, temperature=temperature, top_k=max(top_k, 0),
                              top_p=top_p, seed=seed, stop_token_ids=stop_ids,
                              logit_bias=bias, **penalties)
    except (ValueError, TypeError) as exc:
        raise _bad(str(exc)) from None


def _common(body, model_name: str) -> None:
    """Checks shared by both endpoints: the body's shape, the model, n, unsupported
    fields."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{model_name!r}", "model", "model_not_found")
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad(f"n must be 1 (one choice per request), got {json.dumps(n)}", "n")
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        # Compare types too: False == 0 in Python, but logprobs=0 is not "off".
        is_off = value in ({}, []) or any(type(value) is type(v) and value == v for v in off)
        if not is_off:
            raise _bad(f"{name} is not supported by this server (got {json.dumps(value)})",
                       name)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream must be a boolean", "stream")


def _encode(engine, prompt, param: str) -> list[int]:
    """Validated token ids of one prompt (a string or token ids), through the engine's own
    ``encode`` so the server and the engine agree on ids and limits."""
    if isinstance(prompt, str):
        prompt = list(engine.tokenizer.encode(prompt))
    if len(prompt) >= engine.max_seq_len:
        raise _bad(f"the prompt has {len(prompt)} tokens; this model's maximum context length "
                   f"is {engine.max_seq_len} tokens, which must leave room for at least one "
                   "generated token", param)
    try:
        return engine.encode([prompt])[0]
    except (ValueError, TypeError) as exc:
        raise _bad(str(exc).replace("prompt 0 ", "the prompt "), param) from None


def parse_completion(body, engine, model_name: str) -> GenRequest:
    """Validate a ``/v1/completions`` body."""
    _common(body, model_name)
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("prompt is required: a string or a list of token ids", "prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise _bad(f"batched prompts are not supported: send one prompt per request "
                       f"(got {len(prompt)})", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise _bad("this model has no tokenizer: send the prompt as a list of token ids",
                       "prompt")
        if not prompt:
            raise _bad("prompt is empty", "prompt")
    elif isinstance(prompt, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise _bad("prompt must be a string or a list of integer token ids", "prompt")
    else:
        raise _bad("prompt must be a string or a list of token ids", "prompt")
    ids = _encode(engine, prompt, "prompt")
    return _finish_parse("completion", body, engine, ids, DEFAULT_COMPLETION_TOKENS)


def _content(msg: dict, i: int):
    """A message's content as a string: OpenAI's list of parts is joined when every part
    is text."""
    content = msg.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}]: only text content parts are supported",
                           "messages")
            texts.append(part["text"])
        return "".join(texts)
    return content


def parse_chat(body, engine, model_name: str) -> GenRequest:
    """Validate a ``/v1/chat/completions`` body and format its messages with the
    tokenizer's chat template."""
    from osd.chat import apply_chat_template

    _common(body, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages is required: a non-empty list of {role, content} messages",
                   "messages")
    tok = engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise _bad("this model's tokenizer has no chat template, so chat completions are "
                   "unavailable; use /v1/completions", "messages")
    conv = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _bad(f"messages[{i}] must be an object with role and content", "messages")
        role = "system" if msg.get("role") == "developer" else msg.get("role")
        conv.append({"role": role, "content": _content(msg, i)})
    try:
        text_ids = apply_chat_template(tok, [conv])[0]
    except (ValueError, TypeError) as exc:
        raise _bad(str(exc).replace("conversation 0, ", ""), "messages") from None
    except Exception as exc:           # the template itself raised (jinja error, bad role order)
        raise _bad(f"the chat template could not format these messages: {exc}",
                   "messages") from None
    ids = _encode(engine, text_ids, "messages")
    return _finish_parse("chat", body, engine, ids, None)


def _finish_parse(kind, body, engine, ids, default_max_tokens) -> GenRequest:
    params = _sampling(body, len(ids), engine.max_seq_len, engine.model.vocab_size,
                       default_max_tokens)
    stop = _stop_strings(body)
    if stop and engine.tokenizer is None:
        raise _bad("stop strings need a tokenizer; this model has none (use stop_token_ids)",
                   "stop")
    stream = bool(body.get("stream"))
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not stream):
        raise _bad("stream_options must be an object, and only with stream: true",
                   "stream_options")
    rti = body.get("return_token_ids", False)
    if not isinstance(rti, bool):
        raise _bad("return_token_ids must be a boolean", "return_token_ids")
    draft = body.get("draft")
    if draft is not None and (isinstance(draft, bool) or not isinstance(draft, int)):
        raise _bad("draft must be an integer index into the served drafts", "draft")
    logprobs = _logprobs_field(kind, body)
    params = replace(params, stop=stop or None, logprobs=logprobs)
    return GenRequest(kind, ids, params, stop, stream, bool((opts or {}).get("include_usage")),
                      rti or engine.tokenizer is None, draft, logprobs)


def _logprobs_field(kind: str, body: dict) -> int | None:
    """How many top log-probabilities each token gets (None: no logprobs). Completions:
    ``logprobs`` (an integer); chat: ``logprobs: true`` with ``top_logprobs``."""
    if kind == "completion":
        n, name = _int_field(body, "logprobs"), "logprobs"
        if body.get("top_logprobs") is not None:
            raise _bad("top_logprobs is a chat field; completions take logprobs: <int>",
                       "top_logprobs")
    else:
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise _bad(f"logprobs must be a boolean, got {json.dumps(on)}", "logprobs")
        n, name = _int_field(body, "top_logprobs"), "top_logprobs"
        if n is not None and not on:
            raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
        n = (n or 0) if on else None
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise _bad(f"{name} must be in [0, {MAX_LOGPROBS}], got {n}", name)
    return n


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
                 counters: Counters) -> None:
        self.ae, self.req, self.id, self.counters = async_engine, req, request_id, counters
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
        """How many trailing characters a stream must hold back for now."""
        n = len(text) - len(text.rstrip("\ufffd"))
        for s in self.req.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    n = max(n, k)
                    break
        return n

    async def start(self) -> Step:
        """Submit the request and wait for its first step. Bad input the engine refuses
        becomes a 400 here, before any response has started."""
        self.counters.running += 1
        self.counters.prompt_tokens += len(self.req.prompt_ids)
        self._iter = self.ae.generate(self.req.prompt_ids, self.req.params,
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

    def usage(self) -> dict:
        p, c = len(self.req.prompt_ids), len(self.ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# ---- Responses ----

def _token_text(tok, token_id: int) -> str:
    return f"token_id:{token_id}" if tok is None else tok.decode([token_id])


def _logprobs_body(gen: Generation, req: GenRequest, logprobs: list, offset: int):
    """OpenAI's ``logprobs`` object of a choice: chat's ``content`` list, or the
    completions' parallel lists (``text_offset`` from ``offset``, the characters sent
    before these tokens)."""
    if req.logprobs is None:
        return None
    tok = gen.tok
    if req.kind == "chat":
        def entry(i, lp):
            t = _token_text(tok, i)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
        return {"content": [{**entry(e.token_id, e.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in e.top]}
                            for e in logprobs]}
    tokens = [_token_text(tok, e.token_id) for e in logprobs]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in logprobs],
            "top_logprobs": [{_token_text(tok, i): lp for i, lp in e.top} for e in logprobs],
            "text_offset": offsets}


def _choice(gen: Generation, req: GenRequest, text: str, ids: list[int],
            finish: str | None, stream: bool, logprobs: list, offset: int = 0) -> dict:
    lp = _logprobs_body(gen, req, logprobs, offset)
    if req.kind == "chat":
        if stream:
            c = {"index": 0, "delta": {"content": text} if text else {},
                 "logprobs": lp, "finish_reason": finish}
        else:
            c = {"index": 0, "message": {"role": "assistant", "content": text},
                 "logprobs": lp, "finish_reason": finish}
    else:
        c = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
    if req.return_token_ids:
        c["token_ids"] = ids
        if not stream or finish is not None:
            c["prompt_token_ids"] = req.prompt_ids
    return c


def _envelope(gen: Generation, model_name: str, created: int, stream: bool) -> dict:
    obj = {"chat": ("chat.completion", "chat.completion.chunk"),
           "completion": ("text_completion", "text_completion")}[gen.req.kind][int(stream)]
    return {"id": gen.id, "object": obj, "created": created, "model": model_name}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _respond(request, async_engine, model_name: str, counters: Counters,
                   req: GenRequest):
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.background import BackgroundTask

    prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
    gen = Generation(async_engine, req, f"{prefix}-{uuid.uuid4().hex}", counters)
    created = int(time.time())
    first = await gen.start()

    if not req.stream:
        try:
            while not gen.done:
                if await request.is_disconnected():
                    await gen.cancel()
                    return JSONResponse({}, status_code=499)
                await gen.next_step()
        except BaseException:
            await gen.cancel()
            raise
        body = _envelope(gen, model_name, created, False)
        body["choices"] = [_choice(gen, req, gen.text, gen.ids, gen.finish_reason, False,
                                   gen.logprobs)]
        body["usage"] = gen.usage()
        return JSONResponse(body)

    async def events():
        try:
            head = _envelope(gen, model_name, created, True)
            if req.kind == "chat":     # the first chat chunk names the role (OpenAI's format)
                yield _sse({**head, "choices": [{"index": 0, "delta": {
                    "role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}]})
            step, sent = first, 0
            while True:
                if step.text or step.finish_reason is not None or \
                        ((req.return_token_ids or req.logprobs is not None) and step.token_ids):
                    yield _sse({**head, "choices": [_choice(
                        gen, req, step.text, step.token_ids, step.finish_reason, True,
                        step.logprobs, sent)]})
                    sent += sum(len(_token_text(gen.tok, t)) for t in step.token_ids)
                if gen.done:
                    break
                try:
                    step = await gen.next_step()
                except APIError as exc:
                    counters.api_errors[(exc.status, exc.type)] = \
                        counters.api_errors.get((exc.status, exc.type), 0) + 1
                    yield _sse(exc.body())
                    break
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"
        finally:
            await gen.cancel()

    # The generator's finally covers a cancelled stream; the background task covers a
    # generator that never resumes after the client left (it is not closed at once).
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(gen.cancel))


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
        req = parse_completion(await body_of(request), engine, model_name)
        return await _respond(request, async_engine, model_name, counters, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_chat(await body_of(request), engine, model_name)
        return await _respond(request, async_engine, model_name, counters, req)

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
    spec = None
    if draft is not None or args.prompt_lookup:
        spec = osd.SpecConfig(num_draft_tokens=args.k,
                              drafter="model" if draft is not None else "ngram",
                              prompt_lookup=args.prompt_lookup and draft is not None,
                              lookup_history=getattr(args, "lookup_history", 0)
                              if args.prompt_lookup else 0,
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
        config = uvicorn.Config(app, log_level=args.log_level)
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:      # uvicorn re-raises Ctrl-C after its clean shutdown
            pass
    finally:
        ae.close()
        sock.close()
    return 0
