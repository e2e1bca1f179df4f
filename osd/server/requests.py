"""Validation of the OpenAI-compatible server's requests (:mod:`osd.server.app`): a request
body becomes a :class:`GenRequest` (token ids, :class:`~osd.SamplingParams`, stream and
response options) or an :class:`APIError` naming the bad field, before the engine sees it.
"""

import json
import math
from dataclasses import dataclass, replace

from osd.chat_template import apply_chat_template
from osd.sampling import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MIN_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SamplingParams,
)

MAX_CHOICES = 16  # most choices (n) one request may ask for
MAX_PROMPTS = 64  # most prompts in one batched completions request
# OpenAI's documented default for completions; chat defaults to the room left in the context.
DEFAULT_COMPLETION_TOKENS = 16
# Request fields this server does not implement, with the values that mean "off". Any
# other value is refused with a 400 naming the field rather than silently ignored.
UNSUPPORTED = {
    "suffix": (None, ""),
    "tools": (None,),
    "functions": (None,),
    "best_of": (None, 1),
    "response_format": (None, {"type": "text"}),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` and an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )
        self.headers = headers  # extra response headers (Retry-After, ...)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


@dataclass
class GenRequest:
    """One validated generation request (completion or chat)."""

    kind: str  # "completion" | "chat"
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]  # stop strings, found in the decoded text
    stream: bool
    include_usage: bool  # stream_options.include_usage
    return_token_ids: bool  # add token_ids / prompt_token_ids to each choice
    draft: int | None = None  # the draft asked for (an index), else routed
    logprobs: int | None = None  # top log-probabilities per token, None for none
    echo: bool = False  # completions: the prompt leads the text (and logprobs)
    generate: bool = True  # False: echo with max_tokens 0, nothing generated
    n: int = 1  # choices, each its own engine request

    def choice_params(self, i: int) -> SamplingParams:
        """Choice ``i``'s parameters: a given seed moves by ``i`` so the choices differ
        (wrapping within int64)."""
        p = self.params
        if p.seed is None or i == 0:
            return p
        return replace(p, seed=(p.seed + i - INT64_MIN) % 2**64 + INT64_MIN)


# ---- Request validation ----


def _int_field(body: dict, name: str, default=None, low: int = INT64_MIN, high: int = INT64_MAX):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer, got {_show(value)}", name)
    if not low <= value <= high:
        raise _bad(f"{name} must be an integer in [{low}, {high}], got {_show(value)}", name)
    return value


def _show(value) -> str:
    """A short JSON rendering of a client's value, for error messages."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def _text(value: str, param: str) -> str:
    """``value`` when it is valid Unicode text (JSON allows lone surrogates, which no
    tokenizer or UTF-8 encoder takes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(
            f"{param} is not valid Unicode text: a lone surrogate "
            f"(\\u{ord(value[exc.start]):04x}) at character {exc.start}",
            param,
        ) from None
    return value


def _float_field(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"{name} must be a finite number, got {_show(value)}", name)
    try:
        return float(value)
    except OverflowError:
        raise _bad(f"{name} must be a finite number, got {_show(value)}", name) from None


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop must be a string or a list of strings", "stop")
    if any(s == "" for s in stops):
        raise _bad("stop strings must not be empty", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad(
            f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of "
            f"{max(map(len, stops))}",
            "stop",
        )
    return [_text(s, "stop") for s in stops]


def _sampling(
    body: dict, prompt_len: int, max_seq_len: int, vocab: int, default_max_tokens: int | None
) -> SamplingParams:
    """SamplingParams from the request's fields; every bad value is a 400 naming it. With
    ``echo``, ``max_tokens`` may be 0 (the caller generates nothing; the params say 1)."""
    max_tokens = _int_field(body, "max_completion_tokens")
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = _int_field(body, "max_tokens"), "max_tokens"
    room = max_seq_len - prompt_len
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens == 0 and body.get("echo") is True:
        max_tokens = 1
    elif max_tokens < 1:
        raise _bad(f"{name} must be at least 1 (0 only with echo), got {max_tokens}", name)
    elif max_tokens > room:
        raise _bad(
            f"this model's maximum context length is {max_seq_len} tokens; the prompt "
            f"has {prompt_len} and {name} asks for {max_tokens} more (at most {room} "
            "fit)",
            name,
        )
    temperature = _float_field(body, "temperature", 1.0)
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise _bad(
            f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
            f"{MAX_TEMPERATURE:g}], got {temperature}",
            "temperature",
        )
    top_p = _float_field(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise _bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if top_p < MIN_TOP_P:
        raise _bad(
            f"top_p must be at least {MIN_TOP_P:.3g} (float32's smallest normal "
            f"number), got {top_p}",
            "top_p",
        )
    top_k = _int_field(body, "top_k", 0)
    if not -1 <= top_k <= INT32_MAX:
        raise _bad(
            f"top_k must be >= 1 (at most {INT32_MAX}), or 0 / -1 for no limit; got {_show(top_k)}",
            "top_k",
        )
    seed = _int_field(body, "seed")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
        ):
            raise _bad("stop_token_ids must be a list of integers", "stop_token_ids")
        bad = [t for t in stop_ids if not 0 <= t < vocab]
        if bad:
            raise _bad(
                f"stop_token_ids has token id {bad[0]} outside the vocabulary [0, {vocab})",
                "stop_token_ids",
            )
    penalties = {}
    for name, default, low, high in (
        ("presence_penalty", 0.0, -2, 2),
        ("frequency_penalty", 0.0, -2, 2),
        ("repetition_penalty", 1.0, MIN_PENALTY, MAX_PENALTY),
    ):
        penalties[name] = _float_field(body, name, default)
        if not low <= penalties[name] <= high:
            rule = (
                f"> 0, in [{low:g}, {high:g}]"
                if name == "repetition_penalty"
                else f"in [{low}, {high}]"
            )
            raise _bad(f"{name} must be {rule}, got {penalties[name]}", name)
    bias = _logit_bias(body, vocab)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos must be a boolean", "ignore_eos")
    min_tokens = _int_field(body, "min_tokens", 0)
    if not 0 <= min_tokens <= max_tokens:
        raise _bad(
            f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}", "min_tokens"
        )
    try:
        return SamplingParams(
            max_tokens,
            temperature=temperature,
            top_k=max(top_k, 0),
            top_p=top_p,
            seed=seed,
            stop_token_ids=stop_ids,
            logit_bias=bias,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            **penalties,
        )
    except (ValueError, TypeError) as exc:  # every field is checked above; a backstop
        message = str(exc)
        field = message.split(" ")[0].split("[")[0]
        raise _bad(message, field if field in body else None) from None


def _logit_bias(body: dict, vocab: int) -> dict | None:
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise _bad("logit_bias must be an object {token id: bias}", "logit_bias")
    out = {}
    for t, b in bias.items():
        try:
            token = int(t)
        except ValueError:
            raise _bad("logit_bias keys must be token ids", "logit_bias") from None
        if not 0 <= token < vocab:
            raise _bad(
                f"logit_bias has token id {token} outside the vocabulary [0, {vocab})", "logit_bias"
            )
        if (
            isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100
        ):  # also false for NaN
            raise _bad(
                f"logit_bias[{token}] must be in [-100, 100] (a number), got {_show(b)}",
                "logit_bias",
            )
        out[token] = float(b)
    return out


def _common(body, model_name: str) -> None:
    """Checks shared by both endpoints: the body's shape, the model, n, unsupported
    fields."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(
            404,
            f"the model {_show(model)} does not exist; this server serves {model_name!r}",
            "model",
            "model_not_found",
        )
    n = body.get("n")
    if n is not None and (
        isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES
    ):
        raise _bad(f"n must be an integer in [1, {MAX_CHOICES}], got {_show(n)}", "n")
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        # Compare types too: False == 0 in Python, but logprobs=0 is not "off".
        is_off = value in ({}, []) or any(type(value) is type(v) and value == v for v in off)
        if not is_off:
            raise _bad(f"{name} is not supported by this server (got {_show(value)})", name)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream must be a boolean", "stream")


def _encode(engine, prompt, param: str, max_chars: int | None = None) -> list[int]:
    """Validated token ids of one prompt (a string or token ids), through the engine's own
    ``encode`` so the server and the engine agree on ids and limits. A string longer than
    ``max_chars`` is refused before it is tokenized (it cannot fit the context)."""
    if isinstance(prompt, str):
        _text(prompt, param)
        if max_chars is not None and len(prompt) > max_chars:
            raise _bad(
                f"the prompt has {len(prompt)} characters; this server takes at most "
                f"{max_chars} (this model's context is {engine.max_seq_len} tokens)",
                param,
            )
        prompt = list(engine.tokenizer.encode(prompt))
    if len(prompt) >= engine.max_seq_len:
        raise _bad(
            f"the prompt has {len(prompt)} tokens; this model's maximum context length "
            f"is {engine.max_seq_len} tokens, which must leave room for at least one "
            "generated token",
            param,
        )
    try:
        return engine.encode([prompt])[0]
    except (ValueError, TypeError) as exc:
        raise _bad(str(exc).replace("prompt 0 ", "the prompt "), param) from None


def parse_completion(
    body, engine, model_name: str, max_chars: int | None = None
) -> list[GenRequest]:
    """Validate a ``/v1/completions`` body: one :class:`GenRequest` per prompt (a batch is
    a list of strings or of token-id lists, up to :data:`MAX_PROMPTS`). A string prompt
    longer than ``max_chars`` characters is refused before tokenizing."""
    _common(body, model_name)
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("prompt is required: a string or a list of token ids", "prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > MAX_PROMPTS:
            raise _bad(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}", "prompt")
        return [_completion(body, engine, p, max_chars) for p in prompt]
    return [_completion(body, engine, prompt, max_chars)]


def _completion(body, engine, prompt, max_chars: int | None = None) -> GenRequest:
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise _bad(
                "this model has no tokenizer: send the prompt as a list of token ids", "prompt"
            )
        if not prompt:
            raise _bad("prompt is empty", "prompt")
    elif isinstance(prompt, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise _bad("prompt must be a string or a list of integer token ids", "prompt")
    else:
        raise _bad("prompt must be a string or a list of token ids", "prompt")
    ids = _encode(engine, prompt, "prompt", max_chars)
    return _finish_parse("completion", body, engine, ids, DEFAULT_COMPLETION_TOKENS)


def _content(msg: dict, i: int):
    """A message's content as a string: OpenAI's list of parts is joined when every part
    is text."""
    content = msg.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise _bad(f"messages[{i}]: only text content parts are supported", "messages")
            texts.append(_text(part["text"], "messages"))
        return "".join(texts)
    return _text(content, "messages") if isinstance(content, str) else content


def parse_chat(body, engine, model_name: str, max_chars: int | None = None) -> GenRequest:
    """Validate a ``/v1/chat/completions`` body and format its messages with the
    tokenizer's chat template. Messages longer than ``max_chars`` characters in all are
    refused before formatting."""
    _common(body, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages is required: a non-empty list of {role, content} messages", "messages")
    tok = engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise _bad(
            "this model's tokenizer has no chat template, so chat completions are "
            "unavailable; use /v1/completions",
            "messages",
        )
    conv = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _bad(f"messages[{i}] must be an object with role and content", "messages")
        role = "system" if msg.get("role") == "developer" else msg.get("role")
        if isinstance(role, str):
            _text(role, "messages")
        conv.append({"role": role, "content": _content(msg, i)})
    chars = sum(len(m["content"]) for m in conv if isinstance(m["content"], str))
    if max_chars is not None and chars > max_chars:
        raise _bad(
            f"the messages have {chars} characters; this server takes at most "
            f"{max_chars} (this model's context is {engine.max_seq_len} tokens)",
            "messages",
        )
    try:
        text_ids = apply_chat_template(tok, [conv])[0]
    except (ValueError, TypeError) as exc:
        raise _bad(str(exc).replace("conversation 0, ", ""), "messages") from None
    except Exception as exc:  # the template itself raised (jinja error, bad role order)
        raise _bad(
            f"the chat template could not format these messages: {exc}", "messages"
        ) from None
    ids = _encode(engine, text_ids, "messages")
    return _finish_parse("chat", body, engine, ids, None)


def _finish_parse(kind, body, engine, ids, default_max_tokens) -> GenRequest:
    params = _sampling(
        body, len(ids), engine.max_seq_len, engine.model.vocab_size, default_max_tokens
    )
    stop = _stop_strings(body)
    if stop and engine.tokenizer is None:
        raise _bad(
            "stop strings need a tokenizer; this model has none (use stop_token_ids)", "stop"
        )
    stream = bool(body.get("stream"))
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not stream):
        raise _bad("stream_options must be an object, and only with stream: true", "stream_options")
    rti = body.get("return_token_ids", False)
    if not isinstance(rti, bool):
        raise _bad("return_token_ids must be a boolean", "return_token_ids")
    draft = body.get("draft")
    if draft is not None and (isinstance(draft, bool) or not isinstance(draft, int)):
        raise _bad("draft must be an integer index into the served drafts", "draft")
    logprobs = _logprobs_field(kind, body)
    params = replace(params, stop=stop or None, logprobs=logprobs)
    echo = body.get("echo")
    if echo is not None and (not isinstance(echo, bool) or (echo and kind == "chat")):
        raise _bad("echo must be a boolean, and only for completions", "echo")
    generate = not (echo and body.get("max_tokens") == 0)
    return GenRequest(
        kind,
        ids,
        params,
        stop,
        stream,
        bool((opts or {}).get("include_usage")),
        rti or engine.tokenizer is None,
        draft,
        logprobs,
        bool(echo),
        generate,
        body.get("n") or 1,
    )


def _logprobs_field(kind: str, body: dict) -> int | None:
    """How many top log-probabilities each token gets (None: no logprobs). Completions:
    ``logprobs`` (an integer); chat: ``logprobs: true`` with ``top_logprobs``."""
    if kind == "completion":
        n, name = _int_field(body, "logprobs"), "logprobs"
        if body.get("top_logprobs") is not None:
            raise _bad(
                "top_logprobs is a chat field; completions take logprobs: <int>", "top_logprobs"
            )
    else:
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise _bad(f"logprobs must be a boolean, got {_show(on)}", "logprobs")
        n, name = _int_field(body, "top_logprobs"), "top_logprobs"
        if n is not None and not on:
            raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
        n = (n or 0) if on else None
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise _bad(f"{name} must be in [0, {MAX_LOGPROBS}], got {n}", name)
    return n
