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
   (or ``spec``), one **speculative step** (``osd.spec_decode.step``): the drafter proposes a
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
import threading

import torch

from osd.chat_template import apply_chat_template
from osd.spec_decode.factory import make_drafters
from osd.spec_decode.model_drafter import PENDING_WIDTH
from osd.engine_setup import check_sizes, resolve_drafts, spec_width
from osd.graphs import StepGraphs
from osd.lanes import Lane
from osd.loader import load_for_engine
from osd.spec_decode.lookup_history import LookupHistory
from osd.models.llama import DecoderLM
from osd.online.collect import TeacherCollector
from osd.online.config import OnlineConfig
from osd.online.serving import OnlineManager
from osd.prefix_cache import PrefixCache
from osd.runner import ModelRunner
from osd.scheduler import Scheduler
from osd.detok import output_text
from osd.request import RequestError, RequestState, encode_prompts, stop_prefix_length
from osd.sampling import Output, SamplingParams, TokenLogprobs, request_seed
from osd.scoring import score_tokens
from osd.spec import SpecConfig
from osd.spec_decode.step import Speculator
from osd.stats import SpecStats


class Engine(Scheduler, ModelRunner):
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

    def __init__(
        self,
        model: DecoderLM,
        *,
        draft: DecoderLM | list[DecoderLM] | None = None,
        tokenizer=None,
        max_batch_size: int = 8,
        max_seq_len: int = 2048,
        spec: SpecConfig | None = None,
        online: OnlineConfig | None = None,
        cuda_graphs: bool = True,
        prefill_chunk: int | None = None,
        prefix_cache: int = 0,
        quantize_draft: str | None = None,
        pack_weights: bool = True,
    ) -> None:
        max_batch_size, max_seq_len, prefix_cache = check_sizes(
            max_batch_size, max_seq_len, prefix_cache
        )
        drafts, masters, spec = resolve_drafts(
            model, draft, spec, online, prefill_chunk, quantize_draft
        )
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
        self._headroom = 0 if spec is None else spec_width(spec) + 2
        # Finished requests' tokens, searched by prompt lookup after each request's own
        # (shared by every lane's lookup).
        lk = None if spec is None else spec.lookup
        self.lookup_history = (
            LookupHistory(lk.history, lk.ngram_min, lk.ngram_max) if lk and lk.history else None
        )
        # One lane (target cache rows) per drafter, so requests of every draft are served
        # in the same steps; plain decoding has one lane without a speculator.
        drafters = (
            [None]
            if spec is None
            else make_drafters(
                spec,
                model,
                drafts,
                max_batch_size,
                max_seq_len + self._headroom + PENDING_WIDTH,
                max_seq_len,
                self.lookup_history,
                learning=online is not None,
            )
        )
        self.online = (
            None if online is None else OnlineManager([d.model for d in drafters], online, masters)
        )
        self.lanes = [
            Lane(
                model.new_cache(max_batch_size, max_seq_len + self._headroom, context=max_seq_len),
                torch.zeros(max_batch_size, dtype=torch.int64, device=self.device),
                model.new_cache(1, max_seq_len + self._headroom, context=max_seq_len),
            )
            for _ in drafters
        ]
        self.prefix_cache = PrefixCache(prefix_cache) if prefix_cache else None
        for lane in self.lanes:
            lane.prefix_cache = self.prefix_cache
        for i, (lane, drafter) in enumerate(zip(self.lanes, drafters)):
            if drafter is None:
                continue
            listeners = []
            if online is not None:
                listeners.append(
                    TeacherCollector(
                        online.topk,
                        online.positions,
                        online.prompt_positions,
                        swap=lambda i=i: self.online.swap(i),
                        training=lambda: self.online.training(),
                    )
                )
            lane.speculator = Speculator(
                self, spec, drafter, lane.cache, lane.next_tokens, listeners
            )
        self.speculators: list[Speculator] = [
            lane.speculator for lane in self.lanes if lane.speculator is not None
        ]
        self.cache = self.lanes[0].cache
        self.graphs: StepGraphs | None = None
        # A mixture of experts picks its experts on the host: no graphs for such a target.
        if (
            cuda_graphs
            and (spec is None or spec.cuda_graphs)
            and self.device.type == "cuda"
            and not self.model.config.num_experts
        ):
            self.use_graphs(StepGraphs(self.device))
        self._wall, self._generated, self._requests_served = 0.0, 0, 0
        self.plain_stats = SpecStats()  # plain lanes: target forwards, time by phase
        self.errors: collections.Counter = collections.Counter()  # failures by kind
        self._aborted = 0
        self.last_error: str | None = None
        # One caller steps the lanes at a time (generate, stream, AsyncEngine's loop).
        self._call_lock = threading.Lock()
        self._call_owner: int | None = None
        self.eos_token_ids = frozenset(model.config.eos_token_ids)
        self._ones = torch.ones(max_batch_size, dtype=torch.int32, device=self.device)

    @classmethod
    def from_pretrained(
        cls,
        target,
        draft=None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 8,
        max_seq_len: int = 2048,
        spec: SpecConfig | None = None,
        online: OnlineConfig | None = None,
        attention_backend: str = "auto",
        tokenizer=None,
        cuda_graphs: bool = True,
        prefill_chunk: int | None = None,
        quantized: bool | str | None = None,
        quantize_draft: str | None = "auto",
        prefix_cache: int = 0,
        pack_weights: bool = True,
        kv_dtype: torch.dtype | str | None = None,
    ) -> "Engine":
        """Load ``target`` (and drafts): each a checkpoint directory, a GGUF file or a
        transformers model.

        Args:
            target: checkpoint directory (config.json + safetensors/.bin), a ``.gguf`` file
                (or a directory holding one; weights dequantized to ``dtype``), or a
                transformers ``*ForCausalLM``.
            draft: the same for a draft model, or a list of them (routed per request), or
                None (plain decoding, or a draft-free ``spec``: self-speculation, n-gram).
                An EAGLE draft's directory (``osd.models.eagle``) loads on the target.
            spec: :class:`~osd.SpecConfig`; None: the draft's recommended settings when a
                single draft directory on the CPU carries them (``serving.json``,
                :func:`osd.spec.draft_serving_defaults`; the shipped chat drafts do), else
                a chain of 4 when a draft is given.
            online: :class:`~osd.OnlineConfig` to let the draft(s) learn while serving.

        The tokenizer is loaded from the target directory when it has one (local files
        only); pass ``tokenizer`` to override. ``attention_backend``: see
        ``osd.models.attention``; ``cuda_graphs``, ``prefill_chunk``, ``prefix_cache``:
        :class:`Engine`.

        ``quantized``: a GGUF target keeps its block-quantized weights quantized in
        memory and the CPU kernels compute with them (``osd.models.quant``): decode and
        verify logits equal the dequantized target's bit for bit, prefill to float
        rounding, with fewer bytes read per token (drafts load as usual). CPU, float32
        and a GGUF target only (ValueError otherwise). ``"int8"``: the same weights times
        int8 activations where the CPU has AVX-512 VNNI (``osd_kernels.quant_x16``, as
        llama.cpp computes): not the dequantized target's float32 logits (greedy tokens
        can part from it at near ties), but a plain step about 1.2x and a verify forward
        of 5 tokens about 1.7x faster; speculative output still equals plain decoding's.
        None (the default) is ``"int8"`` for a GGUF target on the CPU in float32 and
        dequantizes it elsewhere; False dequantizes it to ``dtype`` everywhere.
        ``kv_dtype``: the target's K/V cache dtype (None: float16 where it computes with
        int8 activations, so attention reads half the bytes a key; else its dtype).

        ``quantize_draft``, ``pack_weights``: see :class:`Engine`. The default ``"auto"``
        takes the block format a single draft's ``serving.json`` recommends when it runs
        in float32 on the CPU (where quantized drafts run), else None (float drafts).
        """
        model, draft_models, tokenizer, spec, quantize_draft, online = load_for_engine(
            target,
            draft,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            quantized=quantized,
            kv_dtype=kv_dtype,
            tokenizer=tokenizer,
            spec=spec,
            quantize_draft=quantize_draft,
            online=online,
        )
        return cls(
            model,
            draft=draft_models or None,
            tokenizer=tokenizer,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            spec=spec,
            online=online,
            cuda_graphs=cuda_graphs,
            prefill_chunk=prefill_chunk,
            prefix_cache=prefix_cache,
            quantize_draft=quantize_draft,
            pack_weights=pack_weights,
        )

    def encode(self, prompts) -> list[list[int]]:
        """Validate ``prompts`` (token-id lists or strings) and return token-id lists
        (:func:`osd.request.encode_prompts`)."""
        return encode_prompts(
            prompts,
            self.tokenizer,
            self.model.vocab_size,
            self.max_seq_len,
            self.model.config.max_position_embeddings,
        )

    def requests(
        self,
        prompts,
        params: SamplingParams | list[SamplingParams],
        base_index: int = 0,
        draft: int | None = None,
    ) -> list[RequestState]:
        """Validated :class:`RequestState` objects for ``prompts``, each with its own
        sampling parameters (``params``: one for all, or one per prompt) and Philox seed,
        served by draft ``draft`` (an index into the engine's drafts) or, when None, by
        the router's choice. Bad input raises ValueError / TypeError naming the problem
        (counted in ``stats["errors"]["bad_request"]``)."""
        try:
            if draft is not None:
                n = len(self.speculators)
                if isinstance(draft, bool) or not isinstance(draft, int):
                    raise TypeError(
                        f"draft must be an int index into the engine's drafts, "
                        f"got {type(draft).__name__}"
                    )
                if not 0 <= draft < max(n, 1) or (n == 0 and draft != 0):
                    raise ValueError(
                        f"unknown draft {draft}: this engine has "
                        f"{'no drafts' if n == 0 else f'{n} (0..{n - 1})'}"
                    )
            per = list(params) if isinstance(params, (list, tuple)) else None
            for p in per if per is not None else [params]:
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"params must be an osd.SamplingParams, got {type(p).__name__}")
                if p.stop and self.tokenizer is None:
                    raise ValueError(
                        "stop strings need a tokenizer; this engine has none (use stop_token_ids)"
                    )
                bad = [t for t in p.logit_bias or () if not 0 <= t < self.model.vocab_size]
                if bad:
                    raise ValueError(
                        f"logit_bias has token id {bad[0]} outside the vocabulary "
                        f"[0, {self.model.vocab_size})"
                    )
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
            stop_ids = (frozenset() if p.ignore_eos else self.eos_token_ids) | frozenset(
                p.stop_token_ids or ()
            )
            # A shared seed is spread over the prompts; a prompt's own seed is its alone.
            out.append(
                RequestState(
                    base_index + i,
                    ids,
                    p.max_new_tokens,
                    stop_ids,
                    request_seed(base_seed, 0 if per else base_index + i),
                    p,
                    pinned_draft=draft,
                    logprobs=None if p.logprobs is None else [],
                )
            )
        return out

    _requests = requests

    def generate(
        self, prompts, params: SamplingParams | list[SamplingParams], draft: int | None = None
    ) -> list[Output]:
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
        if self.tokenizer is None:
            raise ValueError(
                "chat needs a tokenizer with a chat template; this engine has "
                "none (load a checkpoint that ships one, or pass tokenizer=...)"
            )
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
            raise RuntimeError(
                "this thread is already inside a generate/stream call of this "
                "engine (an unfinished stream?): exhaust or close() it first"
            )
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
            loaded = [sp.k_control_loaded for sp in self.speculators]
            if any(loaded):  # the arms measured while a learner trained beside serving
                out["auto_k_learning"] = [c.summary() if c else {} for c in loaded]
        if len(self.speculators) > 1:
            out["per_draft"] = [sp.stats.as_dict() for sp in self.speculators]
        if self.online is not None:
            out["online"] = self.online.history()
        if self.graphs is not None:
            out["cuda_graphs"] = {
                "graphs": len(self.graphs.entries),
                "replays": self.graphs.replays,
            }
        errors = dict(self.errors)
        if self.online is not None and hasattr(self.online, "faults"):
            errors.update({f"online_{k}": v for k, v in self.online.faults().items() if v})
        out["errors"] = errors
        if self.prefix_cache is not None:
            out["prefix_cache"] = self.prefix_cache.stats()
        out["last_error"] = self.last_error
        out["aborted"] = self._aborted
        out["running"] = sum(len(lane.active) + (lane.staging is not None) for lane in self.lanes)
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
            for m in [self.model] + [getattr(sp.drafter, "model", None) for sp in self.speculators]:
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
            text = output_text(self.tokenizer, r)
            if r.finish_reason is None and r.params is not None and r.params.stop:
                # a snapshot's text is always a prefix of the final one
                text = text[: len(text) - stop_prefix_length(text, r.params.stop)]
        stats = r.spec_stats.as_dict() if r.spec_stats is not None else None
        if stats is not None:
            stats["draft_index"] = r.draft_index
        return Output(
            token_ids=list(r.generated),
            text=text,
            finish_reason=r.finish_reason,
            stats=stats,
            prompt_token_ids=list(r.prompt),
            error=r.error,
            logprobs=None if r.logprobs is None else list(r.logprobs),
        )
