"""``osd serve``: an OpenAI-compatible HTTP server over :class:`osd.AsyncEngine`
(FastAPI + uvicorn; the ``serve`` extra).

    >>> from osd.server import build_app
    >>> app = build_app(osd.AsyncEngine.from_pretrained(target, draft), "my-model")
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)      # or: osd serve --target ...

The modules:

- :mod:`osd.server.app`: :func:`build_app`, the FastAPI app and its routes;
- :mod:`osd.server.requests`: request bodies validated into :class:`GenRequest`, or an
  :class:`APIError` naming the bad field;
- :mod:`osd.server.generation`: one choice running on the engine (:class:`Generation`);
- :mod:`osd.server.responses`: the OpenAI response bodies and server-sent events;
- :mod:`osd.server.limits`: what one client may take (:class:`Limits`) and the uvicorn
  configuration that enforces the connection-level limits;
- :mod:`osd.server.metrics`: ``/metrics`` in the Prometheus text format;
- :mod:`osd.server.run`: the ``osd serve`` command (loads the pair, runs uvicorn).

``import osd`` does not import this package; importing it needs fastapi and uvicorn.
"""

from osd.server.app import build_app
from osd.server.generation import Generation, Step
from osd.server.limits import (
    Guard,
    Limits,
    RateLimitFilter,
    error_response,
    limit_logs,
    parse_json,
    read_body,
    uvicorn_config,
)
from osd.server.metrics import Counters, engine_snapshot, metrics_text
from osd.server.requests import APIError, GenRequest, parse_chat, parse_completion

__all__ = [
    "APIError",
    "Counters",
    "GenRequest",
    "Generation",
    "Guard",
    "Limits",
    "RateLimitFilter",
    "Step",
    "build_app",
    "engine_snapshot",
    "error_response",
    "limit_logs",
    "metrics_text",
    "parse_chat",
    "parse_completion",
    "parse_json",
    "read_body",
    "uvicorn_config",
]
