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

With a draft (or ``spec``), step 2 is a **speculative step** instead (``osd.speculative``):
the drafter proposes a chain or a tree, the target verifies it in one forward, the
rejection sampler decides, and both caches roll back in place. With ``online``, the draft
learns from the target's verdicts while serving (``osd.online``); with several drafts a
router picks one per request and requests are served in groups by draft.

The context limit is ``max_seq_len`` tokens per sequence, prompt included: a prompt must
leave room for one generated token, and generation stops with ``finish_reason="length"``
when the sequence reaches ``max_seq_len``.
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

from osd.drafters import ModelDrafter, NGramDrafter
from osd.graphs import StepGraphs, graphed_forward
from osd.models.llama import DecoderLM
from osd.models.loading import is_transformers_model, load_model, load_tokenizer
from osd.online.config import OnlineConfig
from osd.online.serving import OnlineManager
from osd.sampling import Output, SamplingParams, request_seed, sample_tokens
from osd.spec import SpecConfig
from osd.speculative import Speculator
from osd.stats import SpecStats
from osd.tree import StaticTree


@dataclasses.dataclass
class RequestState:
    """Host-side state of one sequence being generated."""

    index: int                        # position in the prompts of the generate() call
    prompt: list[int]                 # prompt token ids
    max_new_tokens: int
    stop_ids: frozenset[int]          # EOS ids and the request's stop ids
    seed: int                         # Philox seed of all its sampling (request_seed)
    generated: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    draft_index: int = 0              # which draft serves it (routing)
    spec_steps: int = 0               # speculative steps so far (the Philox offset)
    spec_stats: SpecStats | None = None
    teacher: list = dataclasses.field(default_factory=list)  # collected target distributions

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
            graphs per batch-size bucket (``osd.graphs``). CPU always runs eagerly.
        prefill_chunk: feed prompts in pieces of at most this many tokens (bounds the
            prefill's peak memory); None keeps the models' ``config.prefill_chunk``.
    """

    def __init__(self, model: DecoderLM, *, draft: DecoderLM | list[DecoderLM] | None = None,
                 tokenizer=None, max_batch_size: int = 8, max_seq_len: int = 2048,
                 spec: SpecConfig | None = None, online: OnlineConfig | None = None,
                 cuda_graphs: bool = True, prefill_chunk: int | None = None) -> None:
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
        if spec is not None and spec.drafter == "model" and not drafts:
            raise ValueError("SpecConfig(drafter='model') needs a draft model: pass draft=...")
        if spec is not None and spec.drafter != "model" and drafts:
            raise ValueError(f"SpecConfig(drafter={spec.drafter!r}) uses no draft model, but "
                             f"draft=... was given")
        if online is not None and (spec is None or spec.drafter == "ngram"):
            raise ValueError("online learning needs a model drafter (a draft or "
                             "SpecConfig(drafter='self'))")
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
        self.cache = model.new_cache(max_batch_size, max_seq_len + self._headroom)
        self.speculators: list[Speculator] = []
        if spec is not None:
            self.speculators = [Speculator(self, spec, d)
                                for d in self._make_drafters(spec, drafts, online is not None)]
        self.graphs: StepGraphs | None = None
        if cuda_graphs and (spec is None or spec.cuda_graphs) and self.device.type == "cuda":
            self.use_graphs(StepGraphs(self.device))
        self.online = None
        if online is not None:
            self.online = OnlineManager([sp.drafter.model for sp in self.speculators], online)
            for i, sp in enumerate(self.speculators):
                sp.collect_topk = online.topk
                sp.collect_full = online.topk is None
                sp.collect_policy = online.positions
                sp.collect_prompt = online.prompt_positions
                sp.on_swap = (lambda i=i: self.online.swap(i))
        self._wall, self._generated, self._requests_served = 0.0, 0, 0
        # One generate/stream call at a time: they share the caches and the rows.
        self._call_lock = threading.Lock()
        self._call_owner: int | None = None
        self.eos_token_ids = frozenset(model.config.eos_token_ids)
        self._ones = torch.ones(max_batch_size, dtype=torch.int32, device=self.device)
        # next_tokens[b]: the last sampled token of row b, the input of its next decode.
        self._next_tokens = torch.zeros(max_batch_size, dtype=torch.int64, device=self.device)

    def _make_drafters(self, spec: SpecConfig, drafts: list[DecoderLM], learning: bool) -> list:
        """The drafters of ``spec``. Self-speculation drafts with the target's own layers,
        except when the draft learns online (``learning``): then it drafts with a copy of
        the layers it uses, so training never writes the target's weights."""
        capacity = self.max_seq_len + self._headroom + 72
        if spec.drafter == "ngram":
            return [NGramDrafter(spec.ngram_min, spec.ngram_max)]
        if spec.drafter == "self":
            n = self.model.config.num_layers
            skip = frozenset(spec.skip_layers) if spec.skip_layers is not None else \
                frozenset(range(1, n, 2))
            bad = [i for i in skip if not 0 <= i < n]
            if bad or len(skip) >= n:
                raise ValueError(f"skip_layers must name some (not all) of the target's "
                                 f"{n} layers, got {sorted(skip)}")
            if learning:
                return [ModelDrafter(_layer_subset(self.model, skip), self.max_batch_size,
                                     capacity)]
            return [ModelDrafter(self.model, self.max_batch_size, capacity, skip)]
        return [ModelDrafter(d, self.max_batch_size, capacity) for d in drafts]

    @classmethod
    def from_pretrained(cls, target, draft=None, *, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32, max_batch_size: int = 8,
                        max_seq_len: int = 2048, spec: SpecConfig | None = None,
                        online: OnlineConfig | None = None, attention_backend: str = "auto",
                        tokenizer=None, cuda_graphs: bool = True,
                        prefill_chunk: int | None = None) -> "Engine":
        """Load ``target`` (and drafts): each a checkpoint directory, a GGUF file or a
        transformers model.

        Args:
            target: checkpoint directory (config.json + safetensors/.bin), a ``.gguf`` file
                (or a directory holding one; weights dequantized to ``dtype``), or a
                transformers ``*ForCausalLM``.
            draft: the same for a draft model, or a list of them (routed per request), or
                None (plain decoding, or a draft-free ``spec``: self-speculation, n-gram).
            spec: :class:`~osd.SpecConfig`; defaults to a chain of 4 when a draft is given.
            online: :class:`~osd.OnlineConfig` to let the draft(s) learn while serving.

        The tokenizer is loaded from the target directory when it has one (local files
        only); pass ``tokenizer`` to override. ``attention_backend``: see
        ``osd.models.attention``. ``cuda_graphs``, ``prefill_chunk``: see :class:`Engine`.
        """
        drafts = [] if draft is None else list(draft) if isinstance(draft, (list, tuple)) \
            else [draft]
        for name, source in [("target", target)] + [("draft", d) for d in drafts]:
            if source is not None and not (isinstance(source, (str, os.PathLike))
                                           or is_transformers_model(source)):
                raise TypeError(f"{name} must be a checkpoint directory path or a transformers "
                                f"model, got {type(source).__name__}")
        model = load_model(target, device=device, dtype=dtype, attention_backend=attention_backend)
        draft_models = [load_model(d, device=device, dtype=dtype,
                                   attention_backend=attention_backend) for d in drafts]
        if tokenizer is None:
            tokenizer = load_tokenizer(target)
        return cls(model, draft=draft_models or None, tokenizer=tokenizer,
                   max_batch_size=max_batch_size, max_seq_len=max_seq_len, spec=spec,
                   online=online, cuda_graphs=cuda_graphs, prefill_chunk=prefill_chunk)

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

    def _requests(self, prompts, params: SamplingParams) -> list[RequestState]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be an osd.SamplingParams, got {type(params).__name__}")
        token_lists = self.encode(prompts)
        base_seed = params.seed if params.seed is not None else \
            int(torch.randint(0, 2**62, (1,)))
        stop_ids = self.eos_token_ids | frozenset(params.stop_token_ids or ())
        return [RequestState(i, ids, params.max_new_tokens, stop_ids,
                             request_seed(base_seed, i))
                for i, ids in enumerate(token_lists)]

    def generate(self, prompts, params: SamplingParams) -> list[Output]:
        """Generate a continuation of every prompt.

        Args:
            prompts: a list of prompts, each a list of token ids or (with a tokenizer) a
                string.
            params: :class:`~osd.SamplingParams`, shared by all prompts.

        Returns:
            One :class:`~osd.Output` per prompt, in order.
        """
        requests = self._requests(prompts, params)
        with self._exclusive(), contextlib.closing(self._serve(requests, params)) as steps:
            while True:
                with torch.inference_mode():
                    if next(steps, None) is None:
                        break
        return [self._output(r) for r in requests]

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
        requests = self._requests([prompt], params)
        r = requests[0]
        seen = 0
        with self._exclusive(), contextlib.closing(self._serve(requests, params)) as steps:
            while True:
                with torch.inference_mode():
                    done = next(steps, None) is None
                if len(r.generated) > seen:
                    yield list(r.generated[seen:])
                    seen = len(r.generated)
                if done:
                    return

    @contextlib.contextmanager
    def _exclusive(self):
        """Serialize :meth:`generate` and :meth:`stream` calls across threads: a call
        waits until the running one (a stream: until it is exhausted or closed) is done.
        Each call then serves exactly what it would serve alone. A thread that is already
        inside a call (iterating a stream) gets a RuntimeError instead of a deadlock."""
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

    def _serve(self, requests: list[RequestState], params: SamplingParams):
        """The serving loop as a generator: yields after every prefill or decode step."""
        t0 = time.perf_counter()
        groups: dict[int, list[RequestState]] = collections.defaultdict(list)
        for r in requests:
            r.draft_index = self.online.choose(r.prompt) if self.online is not None else 0
            groups[r.draft_index].append(r)
        for d in sorted(groups):
            spec = self.speculators[d] if self.speculators else None
            waiting = collections.deque(groups[d])
            active: list[RequestState] = []          # active[b] occupies cache row b
            self.cache.reset()
            if spec is not None:
                spec.reset()
            while waiting or active:
                free = self.max_batch_size - len(active)
                if waiting and free > 0:
                    new = [waiting.popleft() for _ in range(min(free, len(waiting)))]
                    start = len(active)
                    prompt_logits = self.prefill(new, start_row=start, params=params,
                                                 prompt_positions=spec.collect_prompt
                                                 if spec is not None else 0)
                    if spec is not None:
                        spec.prefill(new, start, self._next_tokens[start:start + len(new)],
                                     prompt_logits)
                    active += new
                elif spec is not None:
                    spec.step(active, params)
                else:
                    self.decode_step(active, params)
                self.retire(active, spec)
                yield True
        self._wall += time.perf_counter() - t0
        self._generated += sum(len(r.generated) for r in requests)
        self._requests_served += len(requests)

    def prefill(self, new: list[RequestState], start_row: int, params: SamplingParams,
                prompt_positions: int = 0) -> torch.Tensor | None:
        """Run the prompts of ``new`` into cache rows ``start_row ..`` and sample each one's
        first token. ``prompt_positions = m > 0``: return the logits at each prompt's last
        ``m`` positions ``[n, m, V]`` (oldest first; a shorter prompt's row starts with
        copies of its position 0), which online learning keeps; otherwise None."""
        n, longest = len(new), max(len(r.prompt) for r in new)
        ids = torch.zeros(n, longest, dtype=torch.int64)
        for b, r in enumerate(new):
            ids[b, :len(r.prompt)] = torch.tensor(r.prompt)
        prompt_lens = torch.tensor([len(r.prompt) for r in new], device=self.device)
        rows = self.cache.rows(start_row, n)
        rows.reset()
        m = min(prompt_positions, longest)
        width = max(m, 1)
        index = (prompt_lens[:, None] - width
                 + torch.arange(width, device=self.device)).clamp(min=0)
        # In pieces of model.config.prefill_chunk tokens; commits rows.lens = prompt_lens.
        logits = self.model.prefill(ids.to(self.device), rows, prompt_lens,
                                    logits_index=index)                   # [n, m or 1, V]
        self.cache.set_bound(max(self.cache.bound, longest))
        tokens = sample_tokens(logits[:, -1], params, *self._sampling_keys(new))
        self._next_tokens[start_row:start_row + n] = tokens
        self._record(new, tokens)
        return logits if m > 0 else None

    def decode_step(self, active: list[RequestState], params: SamplingParams) -> None:
        """One token for every active row."""
        B = len(active)
        ids = self._next_tokens[:B, None]
        logits = (self.model(ids, self.cache) if self.graphs is None
                  else graphed_forward(self.graphs, self.model, self.cache, ids))
        self.cache.commit(self._ones[:B], 1)
        tokens = sample_tokens(logits[:, 0], params, *self._sampling_keys(active))
        self._next_tokens[:B] = tokens
        self._record(active, tokens)

    def _sampling_keys(self, requests: list[RequestState]) -> tuple[torch.Tensor, torch.Tensor]:
        """Philox ``(seeds, offsets)`` ``[B]`` of the plain sampler for ``requests``: the
        offset of a draw is the number of tokens the request generated before it."""
        keys = torch.tensor([[r.seed for r in requests], [len(r.generated) for r in requests]],
                            dtype=torch.int64).to(self.device, non_blocking=True)
        return keys[0], keys[1]

    def _record(self, requests: list[RequestState], tokens: torch.Tensor) -> None:
        # The one host sync per step: the stop check (EOS, stop ids, lengths) needs the
        # sampled ids on the host, and Output.token_ids collects them there anyway.
        for r, t in zip(requests, tokens.tolist()):
            r.append(t, self.max_seq_len)

    def retire(self, active: list[RequestState], speculator: Speculator | None = None) -> None:
        """Drop finished sequences, moving the last active row into each hole (in the
        draft's cache too), hand finished requests to online learning, and tighten the
        cache's host-side length bound to the exact longest cached sequence."""
        for b in reversed(range(len(active))):
            if active[b].finish_reason is None:
                continue
            if self.online is not None:
                st = active[b].spec_stats
                alpha = st.alpha if st.alpha is not None else st.acceptance_rate
                self.online.finish(active[b], active[b].draft_index, alpha)
            last = len(active) - 1
            if b != last:
                self.cache.move_row(last, b)
                if speculator is not None:
                    speculator.move_row(last, b)
                self._next_tokens[b] = self._next_tokens[last]
                active[b] = active[last]
            active.pop()
        self.cache.set_bound(max((r.cached_length for r in active), default=0))

    @property
    def stats(self) -> dict:
        """Engine statistics (``osd.stats.SpecStats`` fields, see there), plus
        ``per_draft`` when several drafts are routed and ``online`` (the learning history:
        updates applied and rejected, losses, α per window of requests) when learning."""
        total = SpecStats()
        for sp in self.speculators:
            total.merge(sp.stats)
        out = total.as_dict()
        out["requests"] = self._requests_served
        out["generated_tokens"] = self._generated
        out["wall_s"] = self._wall
        out["tokens_per_s"] = self._generated / self._wall if self._wall > 0 else None
        if len(self.speculators) > 1:
            out["per_draft"] = [sp.stats.as_dict() for sp in self.speculators]
        if self.online is not None:
            out["online"] = self.online.history()
        if self.graphs is not None:
            out["cuda_graphs"] = {"graphs": len(self.graphs.entries),
                                  "replays": self.graphs.replays}
        return out

    def use_graphs(self, graphs: StepGraphs | None) -> None:
        """Replay the decode forward and the speculative step's forwards from ``graphs``
        (None: eager).

        On CUDA the engine does this itself (``cuda_graphs``, ``SpecConfig.cuda_graphs``);
        ``StepGraphs(device, emulate=True)`` runs the same static-buffer path eagerly.
        """
        self.graphs = graphs
        for sp in self.speculators:
            sp.use_graphs(graphs)

    def reset_stats(self) -> None:
        """Zero the statistics (learned weights and learning history are kept)."""
        for sp in self.speculators:
            sp.stats = SpecStats()
        self._wall, self._generated, self._requests_served = 0.0, 0, 0

    def close(self) -> None:
        """Finish pending online updates and stop the learner threads."""
        if self.online is not None:
            self.online.close()

    def _output(self, r: RequestState) -> Output:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.generated, skip_special_tokens=True)
        stats = r.spec_stats.as_dict() if r.spec_stats is not None else None
        if stats is not None:
            stats["draft_index"] = r.draft_index
        return Output(token_ids=list(r.generated), text=text, finish_reason=r.finish_reason,
                      stats=stats)


def _layer_subset(model: DecoderLM, skip: frozenset[int]) -> DecoderLM:
    """A standalone copy of ``model`` without the layers in ``skip``: the self-speculative
    draft as a model of its own (its embeddings, kept layers, norm and head copied)."""
    keep = [i for i in range(model.config.num_layers) if i not in skip]
    config = dataclasses.replace(model.config, num_layers=len(keep))
    sub = DecoderLM(config, device=model.device, dtype=model.dtype)
    state = {}
    for name, value in model.state_dict().items():
        if name.startswith("layers."):
            index, rest = name.split(".", 2)[1:]
            if int(index) not in keep:
                continue
            name = f"layers.{keep.index(int(index))}.{rest}"
        state[name] = value
    sub.load_state_dict(state)
    return sub.requires_grad_(False)


def _spec_width(spec: SpecConfig) -> int:
    """Most tokens one verify forward feeds per row (root included)."""
    if spec.tree is None:
        return spec.num_draft_tokens + 1
    if isinstance(spec.tree, StaticTree):
        return spec.tree.num_nodes
    return spec.tree.max_nodes + 1
