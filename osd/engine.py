"""``Engine``: batched generation, plain or speculative, on our runtime.

Scheduling is continuous batching over **lanes**: one lane per drafter (one for plain
decoding), each with ``max_batch_size`` rows of the target's KV cache, its running
requests always in rows ``0 .. B-1``. Requests are submitted to the lane of their draft
(the router picks it when several drafts learn online) and every :meth:`Engine.step`
advances every lane:

1. waiting requests **prefill** into the free rows ``B ..`` (a ragged batch padded to its
   longest prompt, through a row view of the cache, so the running rows are untouched),
   and sample their first token. A step admits prompts of up to ``4 * prefill_chunk``
   tokens in all (always at least one request). A prompt that needs more than one
   ``prefill_chunk`` piece is *staged* instead: the lane's one-row staging cache takes
   one piece per step (the running rows keep decoding in between), and its last piece
   is prefilled into a lane row reserved for it, where its K/V were copied;
2. every running row advances by one **decode step** (one token each) or, with a draft
   (or ``spec``), one **speculative step** (``osd.speculative``): the drafter proposes a
   chain or a tree, the target verifies it in one forward, the rejection sampler decides,
   and both caches roll back in place;
3. finished (or aborted) requests **retire**: the last running row moves into the hole
   (one cache row copy), so the hot path never gathers rows.

Each request carries its own :class:`~osd.SamplingParams` and Philox seed, and each of its
draws is keyed on its own token position, so its tokens do not depend on which requests
share its batch. With ``online``, the drafts learn from the target's verdicts while
serving (``osd.online``). :meth:`Engine.generate` and :meth:`Engine.stream` submit and step
until their requests finish; ``osd.AsyncEngine`` steps the lanes from a background thread
while requests come and go.

The context limit is ``max_seq_len`` tokens per sequence, prompt included: a prompt must
leave room for one generated token, and generation stops with ``finish_reason="length"``
when the sequence reaches ``max_seq_len``. A row whose target logits turn non-finite
fails alone (``finish_reason="error"``); a step that raises fails only the request that
makes it raise, found by running each of the lane's requests alone, and the others resume
where they were (``osd.isolation``).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import operator
import os
import threading
import time

import torch

from osd.drafter_factory import make_drafters
from osd.drafters import PENDING_WIDTH
from osd.isolation import mark_lane, recover, resumed_prompts
from osd.graphs import StepGraphs, graphed_forward
from osd.lanes import Lane
from osd.lookup_history import LookupHistory
from osd.models.eagle import EagleLM, is_eagle_checkpoint, load_eagle
from osd.models.llama import DecoderLM
from osd.models.loading import (is_gguf_source, is_transformers_model, load_model,
                                 load_tokenizer, resolve_device)
from osd.models.quant import serving_drafts
from osd.online.collect import TeacherCollector
from osd.online.config import OnlineConfig, draft_online_recipe, with_recipe
from osd.online.serving import OnlineManager
from osd.penalties import Penalties, wants_penalties
from osd.prefix_cache import PrefixCache
from osd.request import RequestError, RequestState, encode_prompts, stop_prefix_length
from osd.sampling import (BatchParams, Output, SamplingParams, TokenLogprobs, fail_rows,
                          nonfinite_rows, record_logprobs, request_seed, sample_tokens)
from osd.scoring import score_tokens
from osd.spec import SpecConfig, serving_settings
from osd.speculative import Speculator
from osd.stats import SpecStats
from osd.tree import StaticTree


class Engine:
    """Batched generation with a target model, and speculative decoding with drafts.

    Args:
        model: the target :class:`~osd.models.DecoderLM`.
        draft: an optional draft model with the same vocabulary (ValueError otherwise), or
            a list of them (routed per request).
        tokenizer: a transformers tokenizer for string prompts and ``Output.text``, or None.
        max_batch_size: cache rows; larger requests lists are served by continuous refill.
        max_seq_len: the maximum context per sequence, prompt included.
        spec: :class:`~osd.SpecConfig` for speculative decoding, or None.
        online: :class:`~osd.OnlineConfig` to let the drafts learn while serving.
        cuda_graphs: on CUDA, replay the decode forward (and, unless
            ``spec.cuda_graphs`` is False, the draft loop and verify forward) from CUDA
            graphs per batch-size bucket (``osd.graphs``). CPU always runs eagerly, and so does
            a mixture-of-experts target.
        prefill_chunk: feed prompts in pieces of at most this many tokens (bounds the
            prefill's peak memory); None keeps the models' ``config.prefill_chunk``.
        prefix_cache: keep the target's K/V of up to this many prompt tokens across
            requests (``osd.prefix_cache``, blocks of 16, least recently used out first):
            a prompt that starts with a kept prefix (a shared system prompt, a chat's
            earlier turns) prefills only the rest. 0 (default) keeps none. With an EAGLE
            draft the target's features at those positions are kept too.
        quantize_draft: ``"Q8_0"``, ``"Q4_1"`` or ``"Q4_0"``: serve copies of the drafts
            whose decoder layers and output heads are block-quantized
            (``osd.models.quantize_linears``), so a draft step reads about a quarter (Q8_0)
            of its float32 bytes. Outputs stay the target's; only the proposals change,
            by the rounding. With ``online`` the learner trains the float drafts and each
            update it publishes is quantized in its thread. CPU, float32 drafts only.
        pack_weights: on the CPU, keep the float32 target's linear weights also packed for
            the decode kernel (``DecoderLM.pack_weights``): faster decode and verify
            forwards for a second copy of those weights in memory. False keeps one copy.
    """

    def __init__(self, model: DecoderLM, *, draft: DecoderLM | list[DecoderLM] | None = None,
                 tokenizer=None, max_batch_size: int = 8, max_seq_len: int = 2048,
                 spec: SpecConfig | None = None, online: OnlineConfig | None = None,
                 cuda_graphs: bool = True, prefill_chunk: int | None = None,
                 prefix_cache: int = 0, quantize_draft: str | None = None,
                 pack_weights: bool = True) -> None:
        max_batch_size = operator.index(max_batch_size)
        prefix_cache = operator.index(prefix_cache)
        if prefix_cache < 0:
            raise ValueError(f"prefix_cache must be >= 0 tokens, got {prefix_cache}")
        max_seq_len = operator.index(max_seq_len)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        drafts = [] if draft is None else list(draft) if isinstance(draft, (list, tuple)) \
            else [draft]
        for i, d in enumerate(drafts):
            if not isinstance(d, DecoderLM):
                raise TypeError(f"draft {i} must be an osd DecoderLM, got {type(d).__name__}")
            if d.vocab_size != model.vocab_size:
                raise ValueError(f"draft vocabulary size {d.vocab_size} differs from the "
                                 f"target vocabulary size {model.vocab_size}")
            if d.device != model.device:
                raise ValueError(f"draft is on {d.device} but the target is on {model.device}")
        if prefill_chunk is not None:
            prefill_chunk = operator.index(prefill_chunk)
            if prefill_chunk < 1:
                raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
            for m in [model] + drafts:
                m.config = dataclasses.replace(m.config, prefill_chunk=prefill_chunk)
        if spec is not None and not isinstance(spec, SpecConfig):
            raise TypeError(f"spec must be an osd.SpecConfig, got {type(spec).__name__}")
        if online is not None and not isinstance(online, OnlineConfig):
            raise TypeError(f"online must be an osd.OnlineConfig, got {type(online).__name__}")
        if spec is None and drafts:
            spec = SpecConfig()
        if spec is not None and spec.prompt_lookup and spec.drafter == "model" and not drafts:
            spec = spec.lookup_alone()      # prompt lookup without a draft model: "ngram"
        if spec is not None and spec.drafter == "model" and not drafts:
            raise ValueError("SpecConfig(drafter='model') needs a draft model: pass draft=...")
        if spec is not None and spec.drafter != "model" and drafts:
            raise ValueError(f"SpecConfig(drafter={spec.drafter!r}) uses no draft model, but "
                             f"draft=... was given")
        if online is not None and (spec is None or spec.drafter == "ngram"):
            raise ValueError("online learning needs a model drafter (a draft or "
                             "SpecConfig(drafter='self'))")
        masters = drafts if online is not None and quantize_draft is not None \
            else [None] * len(drafts)      # the float drafts of quantized serving copies
        drafts = serving_drafts(drafts, quantize_draft, model.device, online is not None)
        for i, d in enumerate(drafts):
            if isinstance(d, EagleLM) and d.embed_tokens.weight is not model.embed_tokens.weight:
                raise ValueError(f"EAGLE draft {i} was not built for this target (it must "
                                 f"share the target's embedding: "
                                 f"EagleLM.from_target(target) or load_eagle(path, target))")
        if pack_weights:
            model.pack_weights()
        self.model = model
        self.drafts = drafts
        self.draft = drafts[0] if drafts else None
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.device = model.device
        self.spec = spec
        # Speculative steps write up to a whole tree past a row's length: room for it.
        self._headroom = 0 if spec is None else _spec_width(spec) + 2
        # Finished requests' tokens, searched by prompt lookup after each request's own
        # (shared by every lane's lookup).
        self.lookup_history = LookupHistory(spec.lookup_history, spec.ngram_min,
                                            spec.ngram_max) \
            if spec is not None and spec.lookup_history else None
        # One lane (target cache rows) per drafter, so requests of every draft are served
        # in the same steps; plain decoding has one lane without a speculator.
        drafters = [None] if spec is None else make_drafters(
            spec, model, drafts, max_batch_size, max_seq_len + self._headroom + PENDING_WIDTH,
            max_seq_len,
            self.lookup_history, learning=online is not None)
        self.online = None if online is None else \
            OnlineManager([d.model for d in drafters], online, masters)
        self.lanes = [Lane(model.new_cache(max_batch_size, max_seq_len + self._headroom,
                                           context=max_seq_len),
                           torch.zeros(max_batch_size, dtype=torch.int64, device=self.device),
                           model.new_cache(1, max_seq_len + self._headroom,
                                           context=max_seq_len))
                      for _ in drafters]
        self.prefix_cache = PrefixCache(prefix_cache) if prefix_cache else None
        for lane in self.lanes:
            lane.prefix_cache = self.prefix_cache
        for i, (lane, drafter) in enumerate(zip(self.lanes, drafters)):
            if drafter is None:
                continue
            listeners = []
            if online is not None:
                listeners.append(TeacherCollector(online.topk, online.positions,
                                                  online.prompt_positions,
                                                  swap=lambda i=i: self.online.swap(i)))
            lane.speculator = Speculator(self, spec, drafter, lane.cache, lane.next_tokens,
                                         listeners)
        self.speculators: list[Speculator] = [lane.speculator for lane in self.lanes
                                              if lane.speculator is not None]
        self.cache = self.lanes[0].cache
        self.graphs: StepGraphs | None = None
        # A mixture of experts picks its experts on the host: no graphs for such a target.
        if cuda_graphs and (spec is None or spec.cuda_graphs) and self.device.type == "cuda" \
                and not self.model.config.num_experts:
            self.use_graphs(StepGraphs(self.device))
        self._wall, self._generated, self._requests_served = 0.0, 0, 0
        self.plain_stats = SpecStats()       # plain lanes: target forwards, time by phase
        self.errors: collections.Counter = collections.Counter()   # failures by kind
        self._aborted = 0
        self.last_error: str | None = None
        # One caller steps the lanes at a time (generate, stream, AsyncEngine's loop).
        self._call_lock = threading.Lock()
        self._call_owner: int | None = None
        self.eos_token_ids = frozenset(model.config.eos_token_ids)
        self._ones = torch.ones(max_batch_size, dtype=torch.int32, device=self.device)

    @classmethod
    def from_pretrained(cls, target, draft=None, *, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32, max_batch_size: int = 8,
                        max_seq_len: int = 2048, spec: SpecConfig | None = None,
                        online: OnlineConfig | None = None, attention_backend: str = "auto",
                        tokenizer=None, cuda_graphs: bool = True,
                        prefill_chunk: int | None = None, quantized: bool | None = None,
                        quantize_draft: str | None = "auto",
                        prefix_cache: int = 0, pack_weights: bool = True) -> "Engine":
        """Load ``target`` (and drafts): each a checkpoint directory, a GGUF file or a
        transformers model.

        Args:
            target: checkpoint directory (config.json + safetensors/.bin), a ``.gguf`` file
                (or a directory holding one; weights dequantized to ``dtype``), or a
                transformers ``*ForCausalLM``.
            draft: the same for a draft model, or a list of them (routed per request), or
                None (plain decoding, or a draft-free ``spec``: self-speculation, n-gram).
                An EAGLE draft's directory (``osd.models.eagle``) loads on top of the
                target.
            spec: :class:`~osd.SpecConfig`; None: the draft's recommended settings when a
                single draft directory on the CPU carries them (``serving.json``,
                :func:`osd.spec.draft_serving_defaults`; the shipped chat drafts do), else
                a chain of 4 when a draft is given.
            online: :class:`~osd.OnlineConfig` to let the draft(s) learn while serving.

        The tokenizer is loaded from the target directory when it has one (local files
        only); pass ``tokenizer`` to override. ``attention_backend``: see
        ``osd.models.attention``. ``cuda_graphs``, ``prefill_chunk``, ``prefix_cache``: see
        :class:`Engine`.

        ``quantized``: a GGUF target keeps its Q4_0 / Q4_1 / Q8_0 weights quantized in
        memory and the CPU kernels compute with them (``osd.models.quant``): decode and
        verify logits equal the dequantized target's bit for bit, prefill to float
        rounding, with fewer bytes read per token (drafts load as usual). CPU, float32
        and a GGUF target only (ValueError otherwise). None (the default) keeps a GGUF
        target quantized on the CPU in float32 and dequantizes it elsewhere; False
        dequantizes it to ``dtype`` everywhere.

        ``quantize_draft``, ``pack_weights``: see :class:`Engine`. The default ``"auto"``
        takes the block format a single draft's ``serving.json`` recommends when it runs
        in float32 on the CPU (where quantized drafts run), else None (float drafts).
        """
        drafts = [] if draft is None else list(draft) if isinstance(draft, (list, tuple)) \
            else [draft]
        for name, source in [("target", target)] + [("draft", d) for d in drafts]:
            if source is not None and not (isinstance(source, (str, os.PathLike))
                                           or is_transformers_model(source)):
                raise TypeError(f"{name} must be a checkpoint directory path or a transformers "
                                f"model, got {type(source).__name__}")
        if quantized is None:
            quantized = (is_gguf_source(target) and resolve_device(device).type == "cpu"
                         and dtype == torch.float32)
        model = load_model(target, device=device, dtype=dtype, attention_backend=attention_backend,
                           quantized=quantized)
        draft_models = [load_eagle(d, model) if is_eagle_checkpoint(d) else
                        load_model(d, device=device, dtype=dtype,
                                   attention_backend=attention_backend) for d in drafts]
        if tokenizer is None:
            tokenizer = load_tokenizer(target)
        spec, quantize_draft = serving_settings(drafts, draft_models, spec, quantize_draft)
        if online is not None and len(drafts) == 1:
            online = with_recipe(online, draft_online_recipe(drafts[0]))
        return cls(model, draft=draft_models or None, tokenizer=tokenizer,
                   max_batch_size=max_batch_size, max_seq_len=max_seq_len, spec=spec,
                   online=online, cuda_graphs=cuda_graphs, prefill_chunk=prefill_chunk,
                   prefix_cache=prefix_cache, quantize_draft=quantize_draft,
                   pack_weights=pack_weights)

    def encode(self, prompts) -> list[list[int]]:
        """Validate ``prompts`` (token-id lists or strings) and return token-id lists
        (:func:`osd.request.encode_prompts`)."""
        return encode_prompts(prompts, self.tokenizer, self.model.vocab_size, self.max_seq_len,
                              self.model.config.max_position_embeddings)

    def requests(self, prompts, params: SamplingParams | list[SamplingParams],
                 base_index: int = 0, draft: int | None = None) -> list[RequestState]:
        """Validated :class:`RequestState` objects for ``prompts``, each with its own
        sampling parameters (``params``: one for all, or one per prompt) and Philox seed,
        served by draft ``draft`` (an index into the engine's drafts) or, when None, by
        the router's choice. Bad input raises ValueError / TypeError naming the problem
        (counted in ``stats["errors"]["bad_request"]``)."""
        try:
            if draft is not None:
                n = len(self.speculators)
                if isinstance(draft, bool) or not isinstance(draft, int):
                    raise TypeError(f"draft must be an int index into the engine's drafts, "
                                    f"got {type(draft).__name__}")
                if not 0 <= draft < max(n, 1) or (n == 0 and draft != 0):
                    raise ValueError(f"unknown draft {draft}: this engine has "
                                     f"{'no drafts' if n == 0 else f'{n} (0..{n - 1})'}")
            per = list(params) if isinstance(params, (list, tuple)) else None
            for p in per if per is not None else [params]:
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"params must be an osd.SamplingParams, got "
                                    f"{type(p).__name__}")
                if p.stop and self.tokenizer is None:
                    raise ValueError("stop strings need a tokenizer; this engine has none "
                                     "(use stop_token_ids)")
                bad = [t for t in p.logit_bias or () if not 0 <= t < self.model.vocab_size]
                if bad:
                    raise ValueError(f"logit_bias has token id {bad[0]} outside the vocabulary "
                                     f"[0, {self.model.vocab_size})")
            token_lists = self.encode(prompts)
            if per is not None and len(per) != len(token_lists):
                raise ValueError(f"got {len(per)} SamplingParams for {len(token_lists)} prompts")
        except (TypeError, ValueError) as e:
            self._count_error("bad_request", e)
            raise
        out = []
        for i, ids in enumerate(token_lists):
            p = per[i] if per is not None else params
            base_seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,)))
            stop_ids = (frozenset() if p.ignore_eos else self.eos_token_ids) \
                | frozenset(p.stop_token_ids or ())
            # A shared seed is spread over the prompts; a prompt's own seed is its alone.
            out.append(RequestState(base_index + i, ids, p.max_new_tokens, stop_ids,
                                    request_seed(base_seed, 0 if per else base_index + i), p,
                                    pinned_draft=draft,
                                    logprobs=None if p.logprobs is None else []))
        return out

    _requests = requests

    def generate(self, prompts, params: SamplingParams | list[SamplingParams],
                 draft: int | None = None) -> list[Output]:
        """Generate a continuation of every prompt.

        Args:
            prompts: a list of prompts, each a list of token ids or (with a tokenizer) a
                string.
            params: :class:`~osd.SamplingParams` shared by all prompts (prompt ``i``
                samples with ``request_seed(seed, i)``), or a list with one per prompt (each
                sampled as it would be alone; rows with different parameters share the
                batch).
            draft: serve every prompt with this draft (an index into the engine's drafts)
                instead of the router's choice.

        Returns:
            One :class:`~osd.Output` per prompt, in order. A request whose target logits
            turn non-finite ends with ``finish_reason="error"`` and ``error`` set; the
            others are unaffected.
        """
        requests = self.requests(prompts, params, draft=draft)
        with self._exclusive():
            for _ in self.run(requests):
                pass
        return [self.output(r) for r in requests]

    def score(self, prompts, logprobs: int = 0) -> list[list[TokenLogprobs | None]]:
        """Each prompt token's log-probability under the target given the tokens before it,
        with the ``logprobs`` (0 to 20) most likely tokens' (an evaluation harness's
        loglikelihood; the server's ``echo``).

        Args:
            prompts: token-id lists or (with a tokenizer) strings, as for :meth:`generate`.
            logprobs: how many most likely tokens each entry lists.

        Returns:
            Per prompt, one entry per token: None for the first, then
            :class:`~osd.TokenLogprobs`. Each prompt runs through the target alone, in
            pieces of ``prefill_chunk`` tokens, in a cache of its own (the serving rows are
            untouched), between the engine's steps.
        """
        n = SamplingParams(1, logprobs=logprobs).logprobs
        token_lists = self.encode(prompts)
        with self._exclusive(), torch.inference_mode():
            return [score_tokens(self.model, ids, n, self.max_seq_len) for ids in token_lists]

    def chat(self, conversations, params: SamplingParams) -> list[Output]:
        """Answer each conversation: its messages formatted with the tokenizer's chat
        template, the assistant's generation prompt added, then :meth:`generate`.

        Args:
            conversations: a list of conversations, each a list of ``{"role": ...,
                "content": ...}`` messages (roles ``system``, ``user``, ``assistant``,
                ``tool``).
            params: :class:`~osd.SamplingParams`, shared by all conversations.

        Returns:
            One :class:`~osd.Output` per conversation (the assistant's reply).
        """
        from osd.chat import apply_chat_template

        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this engine has "
                             "none (load a checkpoint that ships one, or pass tokenizer=...)")
        return self.generate(apply_chat_template(self.tokenizer, conversations), params)

    def stream(self, prompt, params: SamplingParams):
        """Generate one prompt, yielding each step's new token ids (a list) as soon as the
        target has accepted them: one token per step for plain decoding, up to k + 1 with
        speculation."""
        requests = self.requests([prompt], params)
        r = requests[0]
        seen = 0
        with self._exclusive(), contextlib.closing(self.run(requests)) as steps:
            for _ in steps:
                if len(r.generated) > seen:
                    yield list(r.generated[seen:])
                    seen = len(r.generated)
        if r.finish_reason == "error":
            raise RequestError(r.error)

    @contextlib.contextmanager
    def _exclusive(self):
        """Serialize callers that step the lanes (:meth:`generate`, :meth:`stream`,
        ``AsyncEngine``) across threads: a call waits until the running one (a stream: until
        it is exhausted or closed) is done. A thread that is already inside a call
        (iterating a stream) gets a RuntimeError instead of a deadlock."""
        me = threading.get_ident()
        if self._call_owner == me:
            raise RuntimeError("this thread is already inside a generate/stream call of this "
                               "engine (an unfinished stream?): exhaust or close() it first")
        with self._call_lock:
            self._call_owner = me
            try:
                yield
            finally:
                self._call_owner = None

    def run(self, requests: list[RequestState]):
        """Submit ``requests`` and step until all of them are finished, yielding after
        every step. Closing the generator early, or an exception, aborts the ones still
        running (their rows are freed); the caller must hold :meth:`_exclusive`."""
        self.submit(requests)
        try:
            while any(r.finish_reason is None for r in requests):
                self.step()
                yield
        finally:
            self.abort([r for r in requests if r.finish_reason is None])

    def submit(self, requests: list[RequestState]) -> None:
        """Queue ``requests``; each joins its draft's lane at the next :meth:`step`."""
        for r in requests:
            if r.pinned_draft is not None:
                r.draft_index = r.pinned_draft
            else:
                r.draft_index = self.online.choose(r.prompt) if self.online is not None else 0
            self.lanes[r.draft_index].waiting.append(r)

    def abort(self, requests: list[RequestState]) -> None:
        """End ``requests`` with ``finish_reason="abort"`` now: waiting ones are dropped,
        running ones leave their rows (cache rows freed at once)."""
        doomed = {id(r) for r in requests}
        for r in requests:
            if r.finish_reason is None:
                r.finish_reason = "abort"
        for lane in self.lanes:
            lane.waiting = collections.deque(r for r in lane.waiting if id(r) not in doomed)
            if lane.staging is not None and id(lane.staging) in doomed:
                lane.unstage()
            if any(id(r) in doomed for r in lane.active):
                self.retire(lane.active, lane=lane)

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return any(lane.active or lane.waiting or lane.staging for lane in self.lanes)

    def step(self) -> None:
        """One scheduling step over every lane: waiting requests fill the free rows
        (prefill, first token sampled), then every running row advances by one decode or
        speculative step, and finished rows leave. Each row samples with its own
        parameters, seed and offset, so its tokens do not depend on what shares the batch.

        A lane whose step raises does not fail as a whole: the requests that make it
        raise fail (``finish_reason="error"``, error kind ``step_error``) and the others
        resume from where they stood before the step (``osd.isolation.recover``); the
        other lanes keep their state. The exception is logged, not raised.
        """
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                for lane in self.lanes:
                    marks = mark_lane(lane)
                    try:
                        self._step_lane(lane)
                    except Exception as e:
                        recover(self, lane, e, marks)
        finally:
            self._wall += time.perf_counter() - t0

    def _empty_lane(self, lane: Lane) -> None:
        lane.cache.reset()
        if lane.speculator is not None:
            lane.speculator.reset()

    def _step_lane(self, lane: Lane) -> None:
        spec = lane.speculator
        m = spec.prompt_positions if spec is not None else 0
        staged = lane.advance_staging(self.model, m, self._empty_lane)
        new = lane.admit(self.max_batch_size, self.model.config.prefill_chunk, m,
                         reserved=int(staged is not None))
        if staged is not None or new:
            if not lane.active and staged is None:
                self._empty_lane(lane)
            start = len(lane.active)
            reused = [lane.load_prefix(r, m, lane.cache, start + b + (staged is not None))
                      for b, r in enumerate(new)]
            ready, done, early = new, [n for n, _ in reused], [h for _, h in reused]
            if staged is not None:
                ready, done, early = [staged[0]] + new, [staged[1]] + done, [staged[2]] + early
            lane.active += ready
            prompt_logits = self.prefill(ready, start_row=start, lane=lane,
                                         prompt_positions=m, done=done,
                                         early_hidden=early if lane.needs_hidden else None)
            prompt_hidden = None
            if lane.needs_hidden:
                prompt_logits, prompt_hidden = prompt_logits
            lane.store_prefix(ready, start, prompt_hidden)
            if spec is not None:
                with resumed_prompts(ready, spec):
                    spec.prefill(ready, start, lane.next_tokens[start:start + len(ready)],
                                 prompt_logits, prompt_hidden)
            for r in ready:
                r.context = None              # a resumed request's row holds its tokens
            self.retire(lane.active, lane=lane)
        if not lane.active:
            return
        params = BatchParams([r.params for r in lane.active], self.device)
        if spec is not None:
            spec.step(lane.active, params)
        else:
            self.decode_step(lane.active, params, lane=lane)
        self.retire(lane.active, lane=lane)

    def _count_error(self, kind: str, error) -> None:
        self.errors[kind] += 1
        self.last_error = f"{kind}: {error}"

    def prefill(self, new: list[RequestState], start_row: int, prompt_positions: int = 0,
                lane: Lane | None = None, done: list[int] | None = None,
                early_hidden: list | None = None):
        """Run the prompts of ``new`` into cache rows ``start_row ..`` of ``lane`` (default
        the first) and sample each one's first token with its own parameters (a request
        that resumes, ``RequestState.context``, has its context fed instead and samples
        nothing: its last generated token is its next input). ``done[b]``
        tokens of prompt ``b`` are already in its row (a staged prompt); the rest are fed.
        ``prompt_positions = m > 0``: return the logits at each prompt's last ``m``
        positions ``[n, m, V]`` (oldest first; a shorter prompt's row starts with copies of
        its position 0), which online learning keeps; otherwise None.

        ``early_hidden`` (one entry per request: the ``[done[b], H]`` features of its staged
        pieces, or None) asks for the target's features at every prompt position too: the
        return value is then ``(logits or None, features [n, longest prompt, H])``."""
        lane = lane or self.lanes[0]
        t0 = time.perf_counter()
        done = done or [0] * len(new)
        rest = [r.prefill_ids[d:] for r, d in zip(new, done)]
        n, longest = len(new), max(len(x) for x in rest)
        ids = torch.zeros(n, longest, dtype=torch.int64)
        for b, x in enumerate(rest):
            ids[b, :len(x)] = torch.tensor(x)
        prompt_lens = torch.tensor([len(x) for x in rest], device=self.device)
        rows = lane.cache.rows(start_row, n)
        rows.reset()                     # the view's bound: its own rows' longest
        if any(done):
            rows.lens.copy_(torch.tensor(done, dtype=torch.int32))
            rows.set_bound(max(done))
        m = min(prompt_positions, longest)
        width = max(m, 1)
        index = (prompt_lens[:, None] - width
                 + torch.arange(width, device=self.device)).clamp(min=0)
        # In pieces of model.config.prefill_chunk tokens; commits rows.lens += prompt_lens.
        logits = self.model.prefill(ids.to(self.device), rows, prompt_lens,
                                    logits_index=index,                   # [n, m or 1, V]
                                    return_hidden=early_hidden is not None)
        if early_hidden is not None:
            logits, rest_hidden = logits
            hidden = rest_hidden.new_zeros(n, max(len(r.prefill_ids) for r in new),
                                           rest_hidden.shape[-1])
            for b, (r, d) in enumerate(zip(new, done)):
                if d:
                    hidden[b, :d] = early_hidden[b]
                hidden[b, d:len(r.prefill_ids)] = rest_hidden[b, :len(r.prefill_ids) - d]
        lane.cache.set_bound(max(lane.cache.bound, max(len(r.prefill_ids) for r in new)))
        bad = nonfinite_rows(logits)
        last = logits[:, -1]
        if wants_penalties(new):
            last = Penalties(new, last.shape[-1], self.device).apply(last[:, None])[:, 0]
        tokens = sample_tokens(last, BatchParams([r.params for r in new], self.device),
                               *self._sampling_keys(new))
        resumed = [b for b, r in enumerate(new) if r.context is not None]
        if resumed:
            tokens[resumed] = torch.tensor([new[b].generated[-1] for b in resumed],
                                           dtype=tokens.dtype, device=tokens.device)
        lane.next_tokens[start_row:start_row + n] = tokens
        self._record(new, tokens, bad, logits[:, -1], skip=frozenset(resumed))
        stats = self.plain_stats if lane.speculator is None else lane.speculator.stats
        stats.add_time("prefill", time.perf_counter() - t0)
        if early_hidden is not None:
            return (logits if m > 0 else None), hidden
        return logits if m > 0 else None

    def decode_step(self, active: list[RequestState], params: BatchParams,
                    lane: Lane | None = None) -> None:
        """One token for every active row of ``lane`` (default the first)."""
        lane = lane or self.lanes[0]
        B = len(active)
        t0 = time.perf_counter()
        ids = lane.next_tokens[:B, None]
        logits = (self.model(ids, lane.cache) if self.graphs is None
                  else graphed_forward(self.graphs, self.model, lane.cache, ids))
        lane.cache.commit(self._ones[:B], 1)
        t1 = time.perf_counter()
        bad = nonfinite_rows(logits)
        step = Penalties(active, logits.shape[-1], self.device).apply(logits) \
            if wants_penalties(active) else logits
        tokens = sample_tokens(step[:, 0], params, *self._sampling_keys(active))
        lane.next_tokens[:B] = tokens
        self._record(active, tokens, bad, logits[:, 0])
        # The forward counts as "verify" (a one-token verify): the target's forward time.
        st = self.plain_stats
        st.target_forwards += 1
        st.sequence_steps += B
        st.generated_tokens += B
        st.add_time("verify", t1 - t0)
        st.add_time("sample", time.perf_counter() - t1)

    def _sampling_keys(self, requests: list[RequestState]) -> tuple[torch.Tensor, torch.Tensor]:
        """Philox ``(seeds, offsets)`` ``[B]`` of the plain sampler for ``requests``: the
        offset of a draw is the number of tokens the request generated before it."""
        keys = torch.tensor([[r.seed for r in requests], [len(r.generated) for r in requests]],
                            dtype=torch.int64).to(self.device, non_blocking=True)
        return keys[0], keys[1]

    def _record(self, requests: list[RequestState], tokens: torch.Tensor, bad: torch.Tensor,
                logits: torch.Tensor, skip: frozenset = frozenset()) -> None:
        """Fail the rows whose logits were not finite (``bad [B]``, :func:`nonfinite_rows`)
        and append every other row's sampled token (``tokens [B]``, drawn from ``logits
        [B, V]``), except the rows in ``skip`` (resumed: nothing was drawn for them)."""
        # The one host sync per step, after every kernel of the step is queued: the stop
        # check (EOS, stop ids, lengths) needs the sampled ids on the host, and
        # Output.token_ids collects them there anyway.
        ids, flags = torch.stack([tokens, bad.to(tokens.dtype)]).tolist()
        fail_rows(requests, flags)
        rows = []
        for b, (r, t) in enumerate(zip(requests, ids)):
            if r.finish_reason is None and b not in skip:
                r.append(t, self.max_seq_len)
                if r.logprobs is not None:
                    rows.append((b, b, t))
        record_logprobs(requests, logits, rows)

    def retire(self, active: list[RequestState], speculator: Speculator | None = None,
               lane: Lane | None = None) -> None:
        """Drop finished sequences from ``lane`` (default the first; ``active`` is its
        list), moving the last active row into each hole (in the draft's cache too), hand
        requests that finished normally to online learning, and tighten the cache's
        host-side length bound to the exact longest cached sequence."""
        lane = lane or self.lanes[0]
        speculator = speculator or lane.speculator
        for r in active:
            r.check_stop_strings(self.tokenizer)
        for b in reversed(range(len(active))):
            r = active[b]
            if r.finish_reason is None:
                continue
            self._finished(r)
            last = len(active) - 1
            if b != last:
                lane.cache.move_row(last, b)
                if speculator is not None:
                    speculator.move_row(last, b)
                lane.next_tokens[b] = lane.next_tokens[last]
                active[b] = active[last]
            active.pop()
        lane.cache.set_bound(max((r.cached_length for r in active), default=0))

    def _finished(self, r: RequestState) -> None:
        """Account for a request that just finished (out of its row, or never in one):
        online learning, error and abort counts, the lookup history."""
        if self.online is not None and r.finish_reason != "error":
            st = r.spec_stats
            alpha = None if st is None else \
                st.alpha if st.alpha is not None else st.acceptance_rate
            self.online.finish(r, r.draft_index, alpha)
        if r.finish_reason == "error":
            self.errors[r.error_kind] += 1
            self.last_error = f"{r.error_kind}: {r.error}"
        elif r.finish_reason == "abort":
            self._aborted += 1
        if self.lookup_history is not None and r.finish_reason != "error":
            self.lookup_history.add(r.prompt, r.generated)
        r.teacher = []                # the learner has its copy; free it now
        self._generated += len(r.generated)
        self._requests_served += 1

    @property
    def stats(self) -> dict:
        """Engine statistics (``osd.stats.SpecStats`` fields, see there), plus
        ``per_draft`` when several drafts are routed and ``online`` (the learning history:
        updates applied and rejected, losses, α per window of requests) when learning."""
        total = SpecStats()
        total.merge(self.plain_stats)
        for sp in self.speculators:
            total.merge(sp.stats)
        out = total.as_dict()
        out["requests"] = self._requests_served
        out["generated_tokens"] = self._generated
        out["wall_s"] = self._wall
        out["tokens_per_s"] = self._generated / self._wall if self._wall > 0 else None
        if any(sp.k_control is not None for sp in self.speculators):
            out["auto_k"] = [sp.k_control.summary() for sp in self.speculators]
        if len(self.speculators) > 1:
            out["per_draft"] = [sp.stats.as_dict() for sp in self.speculators]
        if self.online is not None:
            out["online"] = self.online.history()
        if self.graphs is not None:
            out["cuda_graphs"] = {"graphs": len(self.graphs.entries),
                                  "replays": self.graphs.replays}
        errors = dict(self.errors)
        if self.online is not None and hasattr(self.online, "faults"):
            errors.update({f"online_{k}": v for k, v in self.online.faults().items() if v})
        out["errors"] = errors
        if self.prefix_cache is not None:
            out["prefix_cache"] = self.prefix_cache.stats()
        out["last_error"] = self.last_error
        out["aborted"] = self._aborted
        out["running"] = sum(len(lane.active) + (lane.staging is not None)
                             for lane in self.lanes)
        out["waiting"] = sum(len(lane.waiting) for lane in self.lanes)
        return out

    def use_graphs(self, graphs: StepGraphs | None) -> None:
        """Replay the decode forward and the speculative step's forwards from ``graphs``
        (None: eager).

        On CUDA the engine does this itself (``cuda_graphs``, ``SpecConfig.cuda_graphs``);
        ``StepGraphs(device, emulate=True)`` runs the same static-buffer path eagerly.
        """
        self.graphs = graphs
        if graphs is not None:
            # Captures read the models' constant buffers (sized by new_cache for every cache
            # the engine made): pinned, they are never replaced under a graph.
            for m in [self.model] + [getattr(sp.drafter, "model", None)
                                     for sp in self.speculators]:
                if m is not None:
                    m.pin_buffers()
        for sp in self.speculators:
            sp.use_graphs(graphs)

    def reset_stats(self) -> None:
        """Zero the statistics (learned weights and learning history are kept)."""
        for sp in self.speculators:
            sp.stats = SpecStats()
        self.plain_stats = SpecStats()
        self._wall, self._generated, self._requests_served = 0.0, 0, 0
        self.errors.clear()
        self._aborted, self.last_error = 0, None

    @contextlib.contextmanager
    def learning_paused(self):
        """Context manager: the background learners hold at their next step boundary
        until the block ends (``OnlineLearner.pause``), leaving their CPU and memory
        bandwidth to other work. Serving goes on (updates queue). No-op without online."""
        if self.online is None:
            yield self
            return
        self.online.pause()
        try:
            yield self
        finally:
            self.online.resume()

    def close(self) -> None:
        """Finish pending online updates and stop the learner threads."""
        if self.online is not None:
            self.online.close()

    def output(self, r: RequestState) -> Output:
        """The :class:`~osd.Output` of ``r`` as it stands (a snapshot while it runs)."""
        text = r.stop_text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(r.generated, skip_special_tokens=True)
            if r.finish_reason is None and r.params is not None and r.params.stop:
                # a snapshot's text is always a prefix of the final one
                text = text[:len(text) - stop_prefix_length(text, r.params.stop)]
        stats = r.spec_stats.as_dict() if r.spec_stats is not None else None
        if stats is not None:
            stats["draft_index"] = r.draft_index
        return Output(token_ids=list(r.generated), text=text, finish_reason=r.finish_reason,
                      stats=stats, prompt_token_ids=list(r.prompt), error=r.error,
                      logprobs=None if r.logprobs is None else list(r.logprobs))


def _spec_width(spec: SpecConfig) -> int:
    """Most tokens one verify forward feeds per row (root included)."""
    chain = max(spec.num_draft_tokens, spec.lookup_tokens) + 1
    if spec.lookup_tree_below:          # lookup's branch and the model's, below one root
        return chain + spec.num_draft_tokens
    if spec.tree is None:
        return chain
    tree = spec.tree.num_nodes if isinstance(spec.tree, StaticTree) else spec.tree.max_nodes + 1
    # With prompt lookup, a step whose rows all match verifies a chain instead of the tree.
    return max(tree, chain) if spec.prompt_lookup else tree
