"""Kept for old imports: the request models and their validation live in
:mod:`osd.server.requests`."""

from osd.server.requests import (
    DEFAULT_COMPLETION_TOKENS,
    MAX_CHOICES,
    MAX_PROMPTS,
    UNSUPPORTED,
    APIError,
    GenRequest,
    parse_chat,
    parse_completion,
)

__all__ = [
    "DEFAULT_COMPLETION_TOKENS",
    "MAX_CHOICES",
    "MAX_PROMPTS",
    "UNSUPPORTED",
    "APIError",
    "GenRequest",
    "parse_chat",
    "parse_completion",
]
