"""What ``osd serve`` lets one client take: access, admission, body size, timeouts,
connections, and how often a repeated error is logged.

- :class:`Limits` holds them (``docs/serving.md`` lists each with its flag and default);
- :class:`Guard` (ASGI middleware) checks the API key in constant time;
- :func:`read_body` reads a JSON request's body: ``application/json`` only, at most
  ``max_body_bytes`` (checked on the declared length before reading, and while reading),
  within ``body_timeout`` seconds;
- :func:`parse_json` decodes it, refusing nesting past :data:`MAX_JSON_DEPTH`;
- :func:`uvicorn_config` runs the app under an HTTP protocol that closes connections
  whose request headers are not complete within ``header_timeout`` seconds of their
  opening (or of the previous response) and refuses connections past
  ``max_connections`` at once, so idle or trickling clients cannot hold descriptors;
- :class:`RateLimitFilter` bounds how often one kind of log record is written (an
  ``accept()`` failing with "Too many open files" repeats as fast as clients connect).

Every refusal is an :class:`osd.server.requests.APIError`, answered in OpenAI's error
shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time

import anyio
import h11
import uvicorn
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from osd.server.requests import APIError, _bad

MAX_JSON_DEPTH = 64  # deepest nesting a request body may have
# Prompts are refused before tokenizing when longer than this many characters per token
# of context: no tokenizer packs more into a token, so such a prompt cannot fit anyway.
PROMPT_CHARS_PER_TOKEN = 32

log = logging.getLogger("osd.server")


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one client may take from ``osd serve`` (flags of the same names)."""

    api_key: str | None = None  # required as "Authorization: Bearer <key>" on /v1
    allowed_origins: tuple[str, ...] = ()  # CORS origins; none: no CORS headers at all
    max_body_bytes: int = 8 << 20  # request body, bytes (413 past it)
    max_prompt_chars: int | None = None  # None: PROMPT_CHARS_PER_TOKEN * max_seq_len
    max_waiting: int = 1024  # generations queued beyond the batch rows (429)
    keep_alive_timeout: float = 5.0  # idle keep-alive connection, seconds
    header_timeout: float = 10.0  # connection open to complete request headers
    body_timeout: float = 30.0  # request headers to complete body (408)
    max_connections: int = 1024  # open connections; more are closed at once
    max_header_bytes: int = 16 << 10  # request line and headers (h11's default)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_waiting", "max_connections", "max_header_bytes"):
            if getattr(self, name) < (0 if name == "max_waiting" else 1):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("keep_alive_timeout", "header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be positive, got {self.max_prompt_chars}")

    def prompt_chars(self, max_seq_len: int) -> int:
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_seq_len


def error_response(exc: APIError):
    """The JSON response of ``exc``. ASCII-escaped, so that no text a client sent (a lone
    surrogate, say) can make the error itself fail to encode."""
    return Response(
        json.dumps(exc.body(), ensure_ascii=True),
        status_code=exc.status,
        media_type="application/json",
        headers=exc.headers,
    )


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers") or ():
        if k == name:
            return v
    return None


class Guard:
    """ASGI middleware: with an API key, every ``/v1`` request must carry it (``/health``
    and ``/metrics`` stay open, for probes and scrapers)."""

    def __init__(self, app, limits: Limits, on_error) -> None:
        self.app, self.on_error = app, on_error
        self.key = None if limits.api_key is None else limits.api_key.encode()

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and self.key is not None
            and scope["path"].startswith("/v1")
            and scope["method"] != "OPTIONS"
        ):
            auth = _header(scope, b"authorization") or b""
            scheme, _, given = auth.partition(b" ")
            # compare_digest: the time taken does not depend on how much of the key matched
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key)):
                exc = APIError(
                    401,
                    "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                self.on_error(exc)
                return await error_response(exc)(scope, receive, send)
        return await self.app(scope, receive, send)


async def read_body(request, limits: Limits) -> bytes:
    """The body of a JSON request, or the APIError that refuses it: 415 unless
    ``application/json``, 413 past ``max_body_bytes`` (before reading when the declared
    length says so), 408 when it takes longer than ``body_timeout`` seconds. 413 and 408
    close the connection, so the rest of the body is never read."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise APIError(
            415,
            f"the request body must be JSON sent as 'content-type: "
            f"application/json' (got {ctype[:100]!r})",
            code="unsupported_media_type",
        )
    limit = limits.max_body_bytes
    too_big = APIError(
        413,
        f"the request body is larger than this server accepts ({limit} bytes, --max-body-bytes)",
        code="request_too_large",
        headers={"Connection": "close"},
    )
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_big
    chunks, size = [], 0
    try:
        with anyio.fail_after(limits.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {limits.body_timeout:g} s (--body-timeout)",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    except ClientDisconnect:
        raise APIError(
            400, "the client disconnected before sending the whole body", code="client_disconnected"
        ) from None
    return b"".join(chunks)


def parse_json(raw: bytes):
    """The decoded body, or a 400 (``param`` null: the body as a whole is at fault)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    _check_depth(body)
    return body


def _too_deep() -> APIError:
    return _bad(
        f"the request body nests JSON arrays and objects deeper than {MAX_JSON_DEPTH} levels"
    )


def _check_depth(body) -> None:
    """Iterative (no recursion to exhaust): containers only, so flat lists cost little."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        items = value.values() if isinstance(value, dict) else value
        stack.extend((v, depth + 1) for v in items if isinstance(v, (dict, list)))


# ---- Connections: header timeout, connection limit ----


def http_protocol(limits: Limits):
    """uvicorn's h11 protocol, with the header timeout and the connection limit."""
    refusal = json.dumps(
        APIError(
            408,
            f"the request headers did not arrive within {limits.header_timeout:g} s "
            "(--header-timeout)",
            code="request_timeout",
        ).body()
    ).encode()
    timeout_response = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(refusal) + refusal
    )

    class Protocol(H11Protocol):
        """Closes a connection whose request headers are not complete within
        ``header_timeout`` of its opening or of the previous response (idle and slow
        clients alike), and refuses connections past ``max_connections``."""

        _header_timer: asyncio.TimerHandle | None = None
        _served = False  # a response was sent on this connection
        _started = False  # bytes of the next request arrived

        def connection_made(self, transport) -> None:
            if len(self.server_state.connections) >= limits.max_connections:
                log.warning(
                    "osd serve: %d connections open (--max-connections); closing new ones",
                    limits.max_connections,
                )
                transport.abort()
                self.transport = transport
                return
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self.flow is None:  # refused in connection_made
                return
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(limits.header_timeout, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            """No complete request headers in time. A 408 tells a client that started
            one (or never sent any) why; a kept-alive connection that stayed idle just
            closes, as the keep-alive timeout would."""
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.our_state is h11.IDLE and (self._started or not self._served):
                self.transport.write(timeout_response)
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            self._started = True
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived
                self._disarm()

        def on_response_complete(self) -> None:
            self._served, self._started = True, False
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

    return Protocol


def uvicorn_config(app, limits: Limits, **kwargs):
    """A ``uvicorn.Config`` serving ``app`` within ``limits`` (``kwargs``: the rest)."""
    return uvicorn.Config(
        app,
        http=http_protocol(limits),
        timeout_keep_alive=limits.keep_alive_timeout,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        **kwargs,
    )


# ---- Logs ----


class RateLimitFilter(logging.Filter):
    """Lets through at most ``burst`` records of one kind (logger, level, message
    template) per ``window`` seconds; the first one after a suppression says how many
    were dropped."""

    def __init__(self, burst: int = 5, window: float = 10.0, clock=time.monotonic) -> None:
        super().__init__()
        self.burst, self.window, self.clock = burst, window, clock
        self._seen: dict[tuple, list] = {}  # kind -> [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg)[:200])
        now = self.clock()
        entry = self._seen.get(kind)
        if entry is None or now - entry[0] >= self.window:
            dropped = entry[2] if entry is not None else 0
            entry = self._seen[kind] = [now, 0, 0]
            if dropped:
                record.msg = (
                    f"{record.msg} ({dropped} more like this in the last "
                    f"{self.window:g} s were not logged)"
                )
            if len(self._seen) > 1024:  # forget kinds not seen for a window
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window}
                self._seen[kind] = entry
        if entry[1] >= self.burst:
            entry[2] += 1
            return False
        entry[1] += 1
        return True


LOGGERS = ("asyncio", "uvicorn.error", "osd.server", "osd.engine")


def limit_logs(burst: int = 5, window: float = 10.0) -> RateLimitFilter:
    """Install one :class:`RateLimitFilter` on the loggers a flood of connections or
    failing requests writes to (``asyncio`` logs each failed ``accept()``)."""
    f = RateLimitFilter(burst, window)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for old in [x for x in logger.filters if isinstance(x, RateLimitFilter)]:
            logger.removeFilter(old)
        logger.addFilter(f)
    return f
