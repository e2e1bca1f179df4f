"""Kept for old imports: the HTTP limits of ``osd serve`` live in :mod:`osd.server.limits`."""

from osd.server.limits import (
    LOGGERS,
    MAX_JSON_DEPTH,
    PROMPT_CHARS_PER_TOKEN,
    Guard,
    Limits,
    RateLimitFilter,
    error_response,
    http_protocol,
    limit_logs,
    parse_json,
    read_body,
    uvicorn_config,
)

__all__ = [
    "LOGGERS",
    "MAX_JSON_DEPTH",
    "PROMPT_CHARS_PER_TOKEN",
    "Guard",
    "Limits",
    "RateLimitFilter",
    "error_response",
    "http_protocol",
    "limit_logs",
    "parse_json",
    "read_body",
    "uvicorn_config",
]
