"""``Engine``: plain (non-speculative) batched generation on our runtime.

Scheduling is continuous refill. The cache has ``max_batch_size`` rows and the active
sequences always occupy rows ``0 .. B-1``. Each loop iteration either

1. **prefills** waiting requests into the free rows ``B ..`` (a ragged batch padded to its
   longest prompt, through a row view of the cache, so the running rows are untouched),
   or, when no row is free or nothing waits,
2. runs one **decode step** over the ``B`` active rows (one token each);

then **retires** finished sequences: the last active row moves into the hole (one cache
row copy), so the hot path never gathers rows. Every request samples with its own seeded
``torch.Generator``, so its output does not depend on which requests share its batch.

The context limit is ``max_seq_len`` tokens per sequence, prompt included: a prompt must
leave room for one generated token, and generation stops with ``finish_reason="length"``
when the sequence reaches ``max_seq_len``.
"""
from __future__ import annotations

import collections
import dataclasses
import operator
import os

import torch

from osd.models.llama import DecoderLM
from osd.models.loading import is_transformers_model, load_model, load_tokenizer
from osd.sampling import Output, SamplingParams, make_generator, sample_tokens


@dataclasses.dataclass
class RequestState:
    """Host-side state of one sequence being generated."""

    index: int                        # position in the prompts of the generate() call
    prompt: list[int]                 # prompt token ids
    max_new_tokens: int
    stop_ids: frozenset[int]          # EOS ids and the request's stop ids
    generator: torch.Generator        # this request's sampling generator
    generated: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

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


class Engine:
    """Batched generation with a target model (and, later, a draft for speculation).

    Args:
        model: the target :class:`~osd.models.DecoderLM`.
        draft: an optional draft model with the same vocabulary (ValueError otherwise).
        tokenizer: a transformers tokenizer for string prompts and ``Output.text``, or None.
        max_batch_size: cache rows; larger requests lists are served by continuous refill.
        max_seq_len: the maximum context per sequence, prompt included.
    """

    def __init__(self, model: DecoderLM, *, draft: DecoderLM | None = None, tokenizer=None,
                 max_batch_size: int = 8, max_seq_len: int = 2048) -> None:
        max_batch_size = operator.index(max_batch_size)
        max_seq_len = operator.index(max_seq_len)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        window = model.config.sliding_window
        if window is not None and max_seq_len > window:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's sliding window "
                             f"({window}); sliding-window attention is not implemented, so "
                             f"contexts must fit inside the window")
        if draft is not None and draft.vocab_size != model.vocab_size:
            raise ValueError(f"draft vocabulary size {draft.vocab_size} differs from the "
                             f"target vocabulary size {model.vocab_size}")
        self.model = model
        self.draft = draft
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.device = model.device
        self.cache = model.new_cache(max_batch_size, max_seq_len)
        self.eos_token_ids = frozenset(model.config.eos_token_ids)
        self._ones = torch.ones(max_batch_size, dtype=torch.int32, device=self.device)
        # next_tokens[b]: the last sampled token of row b, the input of its next decode.
        self._next_tokens = torch.zeros(max_batch_size, dtype=torch.int64, device=self.device)

    @classmethod
    def from_pretrained(cls, target, draft=None, *, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32, max_batch_size: int = 8,
                        max_seq_len: int = 2048, attention_backend: str = "auto",
                        tokenizer=None) -> "Engine":
        """Load ``target`` (and ``draft``): each a checkpoint directory or a transformers model.

        The tokenizer is loaded from the target directory when it has one (local files
        only); pass ``tokenizer`` to override. ``attention_backend``: see
        ``osd.models.attention``.
        """
        for name, source in (("target", target), ("draft", draft)):
            if source is not None and not (isinstance(source, (str, os.PathLike))
                                           or is_transformers_model(source)):
                raise TypeError(f"{name} must be a checkpoint directory path or a transformers "
                                f"model, got {type(source).__name__}")
        model = load_model(target, device=device, dtype=dtype, attention_backend=attention_backend)
        draft_model = None if draft is None else load_model(
            draft, device=device, dtype=dtype, attention_backend=attention_backend)
        if tokenizer is None:
            tokenizer = load_tokenizer(target)
        return cls(model, draft=draft_model, tokenizer=tokenizer,
                   max_batch_size=max_batch_size, max_seq_len=max_seq_len)

    def encode(self, prompts) -> list[list[int]]:
        """Validate ``prompts`` (token-id lists or strings) and return token-id lists."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of prompts (token-id lists or strings), "
                            f"got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        vocab = self.model.vocab_size
        out = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise TypeError(f"prompt {i} is a string but this engine has no tokenizer; "
                                    "pass token ids")
                ids = list(self.tokenizer.encode(prompt)) if prompt else []
            elif isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
                ids = prompt.tolist()
            elif isinstance(prompt, (list, tuple)):
                ids = list(prompt)
            else:
                raise TypeError(f"prompt {i} must be a list of token ids or a string, got "
                                f"{type(prompt).__name__}")
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            for t in ids:
                if isinstance(t, bool) or not hasattr(t, "__index__"):
                    raise TypeError(f"prompt {i} has a non-integer token {t!r}")
            ids = [operator.index(t) for t in ids]
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary "
                                 f"[0, {vocab})")
            if len(ids) >= self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(ids)} tokens, longer than the maximum "
                                 f"context allows (max_seq_len={self.max_seq_len}, which must "
                                 f"leave room for one generated token)")
            out.append(ids)
        return out

    @torch.inference_mode()
    def generate(self, prompts, params: SamplingParams) -> list[Output]:
        """Generate a continuation of every prompt.

        Args:
            prompts: a list of prompts, each a list of token ids or (with a tokenizer) a
                string.
            params: :class:`~osd.SamplingParams`, shared by all prompts.

        Returns:
            One :class:`~osd.Output` per prompt, in order.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be an osd.SamplingParams, got {type(params).__name__}")
        token_lists = self.encode(prompts)
        base_seed = params.seed if params.seed is not None else \
            int(torch.randint(0, 2**62, (1,)))
        stop_ids = self.eos_token_ids | frozenset(params.stop_token_ids or ())
        requests = [RequestState(i, ids, params.max_new_tokens, stop_ids,
                                 make_generator(base_seed + i, self.device))
                    for i, ids in enumerate(token_lists)]
        waiting = collections.deque(requests)
        active: list[RequestState] = []          # active[b] occupies cache row b
        self.cache.reset()
        while waiting or active:
            free = self.max_batch_size - len(active)
            if waiting and free > 0:
                new = [waiting.popleft() for _ in range(min(free, len(waiting)))]
                self.prefill(new, start_row=len(active), params=params)
                active += new
            else:
                self.decode_step(active, params)
            self.retire(active)
        return [self._output(r) for r in requests]

    def prefill(self, new: list[RequestState], start_row: int, params: SamplingParams) -> None:
        """Run the prompts of ``new`` into cache rows ``start_row ..`` and sample each one's
        first token."""
        n, longest = len(new), max(len(r.prompt) for r in new)
        ids = torch.zeros(n, longest, dtype=torch.int64)
        for b, r in enumerate(new):
            ids[b, :len(r.prompt)] = torch.tensor(r.prompt)
        prompt_lens = torch.tensor([len(r.prompt) for r in new], device=self.device)
        rows = self.cache.rows(start_row, n)
        rows.reset()
        logits = self.model(ids.to(self.device), rows, logits_index=(prompt_lens - 1)[:, None])
        rows.commit(prompt_lens.to(torch.int32), longest)
        self.cache.set_bound(max(self.cache.bound, longest))
        tokens = sample_tokens(logits[:, 0], params, [r.generator for r in new])
        self._next_tokens[start_row:start_row + n] = tokens
        self._record(new, tokens)

    def decode_step(self, active: list[RequestState], params: SamplingParams) -> None:
        """One token for every active row."""
        B = len(active)
        logits = self.model(self._next_tokens[:B, None], self.cache)
        self.cache.commit(self._ones[:B], 1)
        tokens = sample_tokens(logits[:, 0], params, [r.generator for r in active])
        self._next_tokens[:B] = tokens
        self._record(active, tokens)

    def _record(self, requests: list[RequestState], tokens: torch.Tensor) -> None:
        # The one host sync per step: the stop check (EOS, stop ids, lengths) needs the
        # sampled ids on the host, and Output.token_ids collects them there anyway.
        for r, t in zip(requests, tokens.tolist()):
            r.append(t, self.max_seq_len)

    def retire(self, active: list[RequestState]) -> None:
        """Drop finished sequences, moving the last active row into each hole, and tighten
        the cache's host-side length bound to the exact longest cached sequence."""
        for b in reversed(range(len(active))):
            if active[b].finish_reason is None:
                continue
            last = len(active) - 1
            if b != last:
                self.cache.move_row(last, b)
                self._next_tokens[b] = self._next_tokens[last]
                active[b] = active[last]
            active.pop()
        self.cache.set_bound(max((r.cached_length for r in active), default=0))

    def _output(self, r: RequestState) -> Output:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.generated, skip_special_tokens=True)
        return Output(token_ids=list(r.generated), text=text, finish_reason=r.finish_reason)
