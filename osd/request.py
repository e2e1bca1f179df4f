"""Host-side state of one request as the engine serves it, the error a request that
fails while it runs raises (``osd.RequestError``), and the validation of prompts before
they become requests (:func:`encode_prompts`)."""

from __future__ import annotations

import dataclasses
import functools
import operator

import torch

from osd.sampling import SamplingParams
from osd.stats import SpecStats


class RequestError(RuntimeError):
    """A request failed while it ran (non-finite target logits, a failed step); the
    engine and the other requests go on."""


@dataclasses.dataclass
class RequestState:
    """Host-side state of one sequence being generated."""

    index: int  # position in the prompts of the generate() call
    prompt: list[int]  # prompt token ids
    max_new_tokens: int
    stop_ids: frozenset[int]  # EOS ids and the request's stop ids
    seed: int  # Philox seed of all its sampling (request_seed)
    params: SamplingParams | None = None  # its own sampling parameters
    generated: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # why it failed (finish_reason "error")
    error_kind: str | None = None  # its kind, counted in Engine.stats["errors"]
    draft_index: int = 0  # which draft serves it (routing)
    pinned_draft: int | None = None  # the draft the caller asked for (no routing)
    spec_steps: int = 0  # speculative steps so far (the Philox offset)
    spec_stats: SpecStats | None = None
    teacher: list = dataclasses.field(default_factory=list)  # collected target distributions
    stop_checked: int = 0  # generated tokens already searched for stop strings
    stop_text: str | None = None  # the text cut before the stop string that ended it
    text_done: tuple[int, str] = (0, "")  # (n, the text of generated[:n]): osd.detok
    logprobs: list | None = None  # TokenLogprobs per generated token (params.logprobs)
    lookup_record: object = None  # its prompt-lookup drafts' record (spec_decode.lookup_lengths)
    ngram_index: object = None  # its text's n-grams for prompt lookup (spec_decode.ngram_index)
    # Set while the request waits to resume after a failed step (``osd.isolation``): the
    # tokens whose K/V its row must hold again (the prompt and all generated tokens but
    # the last, which is its next input). Prefilled instead of the prompt, sampling
    # nothing; cleared once its row holds them.
    context: list[int] | None = None

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens a prefill of this request feeds: its prompt, or its ``context``
        when it resumes."""
        return self.prompt if self.context is None else self.context

    @property
    def length(self) -> int:
        """Tokens in the sequence (prompt and generated)."""
        return len(self.prompt) + len(self.generated)

    @property
    def cached_length(self) -> int:
        """Tokens whose K/V are in the cache: all but the last sampled one."""
        return self.length - 1 if self.generated else len(self.prompt)

    def append(self, token: int, max_seq_len: int) -> None:
        """Record a sampled token and decide whether the sequence is finished."""
        self.generated.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.generated) >= self.max_new_tokens or self.length >= max_seq_len:
            self.finish_reason = "length"

    def check_stop_strings(self, tokenizer) -> None:
        """End the request at the first of its stop strings that its newly generated
        tokens completed: ``generated`` is cut after the token that completed it and
        ``stop_text`` holds the text before the string. Searched once per step, in a
        window of tail tokens wide enough for the longest stop string."""
        stops = self.params.stop if self.params is not None else None
        new = len(self.generated)
        if not stops or new == self.stop_checked or self.finish_reason in ("error", "abort"):
            return
        hit = find_stop_string(tokenizer, self.generated, self.stop_checked, stops)
        self.stop_checked = new
        if hit is not None:
            m, self.stop_text = hit
            del self.generated[m:]
            if self.logprobs is not None:
                del self.logprobs[m:]
            self.finish_reason = "stop"

    def fail(self, message: str, kind: str = "nonfinite_logits") -> None:
        """End the request with ``finish_reason = "error"``; it teaches no draft."""
        self.finish_reason, self.error, self.error_kind = "error", message, kind


def find_stop_string(tokenizer, ids: list[int], start: int, stops) -> tuple[int, str] | None:
    """``(m, text)`` for the first of ``stops`` that ``ids[start:]`` completes: ``m`` the
    fewest tokens whose decoded text holds a stop string (so the cut does not depend on how
    many tokens a step accepted) and ``text`` the decoded ``ids[:m]`` cut before the
    earliest one; None when there is none.

    The search decodes a tail window only: every token but a special or partial-byte one
    decodes to at least one character, so a string of L characters that ends in the new
    tokens starts within the L tokens before them (a margin of 8 covers the rest)."""
    lo = max(0, start - max(map(len, stops)) - 8)
    tail = tokenizer.decode(ids[lo:], skip_special_tokens=True)
    if not any(s in tail for s in stops):
        return None
    for m in range(start + 1, len(ids) + 1):
        text = tokenizer.decode(ids[:m], skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return m, text[: min(hits)]
    return None


def stop_prefix_length(text: str, stops) -> int:
    """The longest tail of ``text`` that is the start of one of ``stops`` (what a stream
    holds back: it may still become a stop string, whose text is cut), shorter than the
    string itself. Linear: ``O(len(s))`` per stop string ``s``, whatever ``len(text)``
    (a Knuth-Morris-Pratt scan of the last ``len(s) - 1`` characters)."""
    n = 0
    for s in stops or ():
        if len(s) > 1:
            n = max(n, _border(s, text[-(len(s) - 1) :]))
    return n


@functools.lru_cache(maxsize=256)
def _failure(s: str) -> tuple[int, ...]:
    """KMP failure function of ``s``: ``f[i]``, the longest proper border of ``s[:i + 1]``."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return tuple(f)


def _border(s: str, tail: str) -> int:
    """The longest suffix of ``tail`` that is a proper prefix of ``s`` (``len(tail) <
    len(s)``, so ``s`` itself never fits)."""
    f = _failure(s)
    k = 0
    for c in tail:
        while k and c != s[k]:
            k = f[k - 1]
        if c == s[k]:
            k += 1
    return k


def encode_prompts(
    prompts, tokenizer, vocab_size: int, max_seq_len: int, trained_context: int
) -> list[list[int]]:
    """Validate ``prompts`` (token-id lists, 1-D tensors or strings, encoded with
    ``tokenizer``) and return token-id lists. TypeError or ValueError naming the prompt
    and the problem: not a list, empty, a string without a tokenizer, a non-integer
    token, an id outside ``[0, vocab_size)``, or no room for one generated token within
    ``max_seq_len`` (the message names the model's ``trained_context`` too)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a list of prompts (token-id lists or strings), "
            f"got {type(prompts).__name__}"
        )
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise TypeError(
                    f"prompt {i} is a string but this engine has no tokenizer; pass token ids"
                )
            ids = list(tokenizer.encode(prompt)) if prompt else []
        elif isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
            ids = prompt.tolist()
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise TypeError(
                f"prompt {i} must be a list of token ids or a string, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        for t in ids:
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise TypeError(f"prompt {i} has a non-integer token {t!r}")
        ids = [operator.index(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size})"
            )
        if len(ids) >= max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens, longer than the maximum "
                f"context allows (max_seq_len={max_seq_len}, which must leave "
                f"room for one generated token; the model's trained context: "
                f"{trained_context})"
            )
        out.append(ids)
    return out
