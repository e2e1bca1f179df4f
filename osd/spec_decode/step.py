"""The speculative step: draft, verify in one target forward, sample, roll back.

One step over the active rows ``0 .. B-1`` (all state on the device), one short method
each:

1. **propose** (:meth:`Speculator.propose`): the drafter proposes a chain of up to k
   tokens per row, or a token tree;
2. **verify** (:meth:`Speculator.verify`): one target forward over ``[root, drafts...]``
   (``T = k + 1`` tokens per row; a tree passes its ancestor bitmask and node depths),
   writing K/V at ``lens[b] + i``;
3. **sample** (:meth:`Speculator.sample`): ``osd_kernels.rejection_sample`` (chain) or
   ``osd_kernels.tree_rejection_sample`` (tree) decides, keyed on per-request
   ``(seed, step)`` Philox streams;
4. **commit** (:meth:`Speculator.commit`): chain: ``lens += accepted + 1``; tree:
   ``kv_rollback`` compacts the accepted path in place. The drafter drops its drafts and
   queues the accepted tokens plus the emitted one as its next step's first input.

The one deliberate host sync per step is reading one small tensor back
(``osd.spec_decode.readback``: the accepted counts, the non-finite flags, named per-row columns
such as the drafted counts of an adaptive chain, the proposal's origin and the
listeners' statistics, then the tokens). Host values go to the device with non-blocking
copies from pinned memory. A plain model-drafter chain step replays all four stages from
one CUDA graph (``osd.spec_decode.fused_step``).
"""

from __future__ import annotations

import dataclasses
import time

import torch

import osd_kernels
from osd.graphs import StepGraphs, graphed_forward
from osd.penalties import Penalties, tree_ancestors, wants_penalties
from osd.sampling import (
    BatchParams,
    fail_rows,
    greedy_tokens,
    native_rows,
    nonfinite_rows,
    record_logprobs,
)
from osd.spec import SpecConfig
from osd.spec_decode.fused_step import fusable, fused_chain_step
from osd.spec_decode.policies import AdaptiveStopper, DraftLengthController
from osd.spec_decode.proposals import ChainProposal, Emitted, TreeProposal
from osd.spec_decode.readback import Readback, pack_readback
from osd.spec_decode.statistics import StepStatistics
from osd.stats import SpecStats


def greedy_chain(logits: torch.Tensor, prop: ChainProposal):
    """The chain rejection sampler's greedy rows from one ``argmax_finite`` pass: ``(out
    [B, K + 1], accepted [B] int32, non-finite flags [B])``, equal to
    ``osd_kernels.rejection_sample``'s tokens and counts (drafts accepted while they are
    the argmax, within each row's ``num_drafted``; then the argmax; -1 past it). On the
    CPU that kernel and the read-back's logits check were two more passes over the
    ``[B, K + 1, V]`` logits."""
    ids, bad = osd_kernels.argmax_finite(logits)  # [B, K + 1] each
    K = prop.tokens.shape[1]
    if K == 0:  # a plain step through the verify path
        return ids, ids.new_zeros(ids.shape[0], dtype=torch.int32), bad[:, 0]
    ok = prop.tokens == ids[:, :K]
    if prop.num_drafted is not None:
        ok &= torch.arange(K, device=ok.device) < prop.num_drafted[:, None]
    n = ok.int().cumprod(1).sum(1, dtype=torch.int32)
    pos = torch.arange(K + 1, device=ids.device)
    return torch.where(pos <= n[:, None], ids, -1), n, bad.any(1)


def to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device`` without blocking the host: on CUDA through
    pinned memory and a non-blocking copy (ordered on the current stream)."""
    t = torch.tensor(values, dtype=dtype)
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cpu":
        return t
    if kind == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# (batch, temperature, top_k, top_p) -> the [B] tensors of BatchParams.per_row, on the
# CPU: a batch keeps its setting step after step and the samplers only read them.
_UNIFORM_ROWS: dict = {}


def _per_row(params: BatchParams, batch: int, device: torch.device) -> dict:
    if params.uniform is None or device.type != "cpu":
        return params.per_row(batch, device)
    key = (batch, params.temperature, params.top_k, params.top_p)
    rows = _UNIFORM_ROWS.get(key)
    if rows is None:
        if len(_UNIFORM_ROWS) >= 64:
            _UNIFORM_ROWS.clear()
        rows = _UNIFORM_ROWS[key] = params.per_row(batch, device)
    return rows


@dataclasses.dataclass
class Verdict:
    """What one speculative step decided, handed to the step's listeners.

    Row ``b`` is ``active[b]``; its tokens were appended to it already (``emitted[b]`` of
    them, fewer than ``accepted[b] + 1`` when it stopped inside the step).
    """

    active: list  # the requests of the step
    logits: torch.Tensor  # [B, T, V] the target's verify logits
    proposal: ChainProposal | TreeProposal
    accepted: list[int]  # drafts accepted per row
    drafted: list[int]  # drafts offered per row (a tree: its depth)
    emitted: list[int]  # tokens appended per row
    path: torch.Tensor | None  # tree: [B, D + 1] accepted node per depth
    params: BatchParams
    hidden: torch.Tensor | None = None  # [B, T, H] the target's verify features (a drafter
    #                                     that needs_hidden; a tree: [B, D + 1, H] along the
    #                                     accepted path), else None
    columns: dict = dataclasses.field(default_factory=dict)  # name -> [B] host values read
    #     back with the step ("origin": the proposal's origin bits; "alpha": the α sums)


class Speculator:
    """Runs speculative steps over one lane of an :class:`~osd.Engine`.

    A step is: propose (the drafter), verify (one target forward), sample (the rejection
    sampler), commit (cache lengths, the drafter catches up), then hand the
    :class:`Verdict` to every listener, the statistics first.

    Args:
        engine: the owning engine (``model``, ``device``, ``max_seq_len``).
        spec: :class:`~osd.SpecConfig`.
        drafter: any :class:`~osd.spec_decode.proposals.Drafter`.
        cache: the target's KV cache of the rows this speculator serves.
        next_tokens: ``[max_batch_size]`` int64, row ``b``'s last sampled token (the root
            of its next step).
        listeners: objects with ``before_step()``, ``on_prefill(requests, prompt_logits,
            prompt_hidden)`` and ``on_verdict(verdict)`` (the online learner's
            ``TeacherCollector``), and optionally ``device_columns(proposal, logits,
            params) -> {name: [B] tensor}``, read back with the step into
            ``verdict.columns``; the largest ``prompt_positions`` among them is how many
            prompt logits the engine's prefill keeps.
    """

    def __init__(
        self, engine, spec: SpecConfig, drafter, cache, next_tokens: torch.Tensor, listeners=()
    ):
        self.engine = engine
        self.cache = cache
        self.next_tokens = next_tokens
        self.spec = spec
        self.drafter = drafter
        self.statistics = StepStatistics(SpecStats(), drafter, spec.exact_alpha)
        self.listeners = [self.statistics, *listeners]
        self.prompt_positions = max(
            (getattr(x, "prompt_positions", 0) for x in self.listeners), default=0
        )
        self.stopper = (
            AdaptiveStopper(spec.adaptive_floor, spec.adaptive_init_threshold)
            if spec.adaptive and not spec.is_tree
            else None
        )
        # arm 0 behind prompt lookup is lookup alone, another drafter than the chains
        apart = hasattr(drafter, "propose_lookup")
        self.k_control = (
            DraftLengthController(spec.num_draft_tokens, zero_apart=apart) if spec.auto_k else None
        )
        # A listener with ``loaded()`` (the online collector: a learner training beside
        # serving) slows every step while it says so; the arms' goodput measured then is
        # kept by a controller of its own, so that an arm is never judged against another
        # measured under a different load.
        self._load = [x.loaded for x in self.listeners if hasattr(x, "loaded")]
        self.k_control_loaded = (
            DraftLengthController(spec.num_draft_tokens, zero_apart=apart)
            if spec.auto_k and self._load
            else None
        )
        self.graphs: StepGraphs | None = None  # CUDA graphs of the forwards (use_graphs)
        self._fused_columns: dict = {}  # fused graph key -> its read-back column names
        self._empty: dict = {}  # batch size -> the proposal of a step without drafts

    @property
    def stats(self) -> SpecStats:
        """This speculator's totals (kept by its statistics listener; assignable, as
        ``Engine.reset_stats`` does)."""
        return self.statistics.stats

    @stats.setter
    def stats(self, value: SpecStats) -> None:
        self.statistics.stats = value

    # -- row bookkeeping (mirrors the engine's cache rows) ---------------------------
    def prefill(
        self,
        requests,
        start_row: int,
        first_tokens: torch.Tensor,
        prompt_logits: torch.Tensor | None = None,
        prompt_hidden: torch.Tensor | None = None,
    ) -> None:
        """New rows ``start_row ..``; ``prompt_logits [n, m, V]`` (the target's logits at
        each prompt's last ``m`` positions) go to the listeners, ``prompt_hidden [n, T, H]``
        (the target's features at every prompt position) to a drafter that
        ``needs_hidden``."""
        for r in requests:
            r.spec_steps = 0  # the step counter keying the row's Philox streams
        for listener in self.listeners:
            listener.on_prefill(requests, prompt_logits, prompt_hidden)
        self.drafter.prefill([r.prompt for r in requests], start_row, first_tokens, prompt_hidden)

    def move_row(self, src: int, dst: int) -> None:
        self.drafter.move_row(src, dst)

    def reset(self) -> None:
        self.drafter.reset()

    def use_graphs(self, graphs: StepGraphs | None) -> None:
        """Replay the verify forward (and a model drafter's chain loop) from ``graphs``."""
        self.graphs = graphs
        self.drafter.use_graphs(graphs)

    # -- one step ----------------------------------------------------------------------
    def step(self, active, params: BatchParams) -> None:
        """One speculative step over ``active`` (row ``b`` is ``active[b]``) sampled with
        the rows' ``params``. A row whose target logits are not finite fails
        (``finish_reason = "error"``); it emits nothing and teaches nothing."""
        for listener in self.listeners:
            listener.before_step()  # between steps, never within one
        B = len(active)
        clock = [time.perf_counter()]
        sampling = self._sampling_tensors(active, params)
        loaded = any(f() for f in self._load)
        control = self.k_control_loaded if loaded else self.k_control
        k = self.spec.num_draft_tokens if control is None else control.choose(B)
        fused = (
            fused_chain_step(self, B, params, sampling, k)
            if fusable(self, active, params, k)
            else None
        )
        if fused is not None:  # propose, verify, sample, commit: one replay
            prop, logits, packed, names = fused
            path = hidden = None
            t1 = time.perf_counter()
            clock += [clock[0], t1, t1]  # the replay counts as "verify"
            back = Readback.fetch(packed, names)
            self.drafter._pending_max = max(back.accepted) + 1
        elif self._idle(active, k):
            prop, logits, back = self._plain_step(active, params, sampling, clock)
            path = hidden = None
        else:
            prop, logits, hidden, path, back = self._step_parts(active, params, sampling, k, clock)
        clock.append(time.perf_counter())
        fail_rows(active, back.nonfinite)
        if isinstance(prop, TreeProposal):
            drafted = [prop.max_depth] * B  # a tree offers up to max_depth per row
        elif prop.num_drafted is None:
            drafted = [prop.tokens.shape[1]] * B
        else:
            drafted = [int(d) for d in back.columns["drafted"]]
        emitted = self._append(active, back)
        if any(r.logprobs is not None for r in active):
            self._logprobs(active, logits, back.tokens, emitted, path)
        verdict = Verdict(
            active, logits, prop, back.accepted, drafted, emitted, path, params, hidden,
            back.columns,
        )  # fmt: skip
        if self.stopper is not None:
            self.stopper.observe(drafted, back.accepted)
        for r in active:
            r.spec_steps += 1
        for listener in self.listeners:
            listener.on_verdict(verdict)
        clock.append(time.perf_counter())
        if (
            control is not None
            and not getattr(self.drafter, "lookup_decided", False)
            and any(f() for f in self._load) == loaded
        ):
            # (a step every row of which had a long lookup match was lookup's whatever k;
            # one during which the load changed measures neither controller's arms)
            control.observe(B, k, sum(emitted), clock[-1] - clock[0])
        for phase, t0, t1 in zip(
            ("draft", "verify", "sample", "rollback", "other"), clock, clock[1:]
        ):
            self.stats.add_time(phase, t1 - t0)

    def _append(self, active, back: Readback) -> list[int]:
        """Append each row's accepted tokens and its emitted one, up to its stop; returns
        how many each row took."""
        emitted = []
        for b, r in enumerate(active):
            before = len(r.generated)
            for t in back.tokens[b][: back.accepted[b] + 1] if r.finish_reason is None else ():
                if r.finish_reason is not None:
                    break
                r.append(t, self.engine.max_seq_len)
            emitted.append(len(r.generated) - before)
        return emitted

    def _idle(self, active, k: int) -> bool:
        """Whether the drafter drafts nothing for any row this step and keeps no state of
        its own to catch up (prompt lookup alone, whose rows can clear no bar): the step is
        then a plain decode step (:meth:`_plain_step`)."""
        idle = getattr(self.drafter, "idle", None)
        return idle is not None and idle(active, k)

    def _plain_step(self, active, params: BatchParams, sampling: dict, clock: list):
        """One token per row, no drafts: the target's forward over the roots, the sampler
        (the same kernels and Philox keys as a step through the verify path with nothing
        drafted, so a row samples the same token either way) and the chain commit of one
        token, without the proposal tensors, columns and drafter bookkeeping of
        :meth:`_step_parts`. Returns ``(proposal, logits, read-back)``."""
        clock.append(time.perf_counter())
        return self._plain_tail(active, params, sampling, clock)

    def _plain_tail(self, active, params: BatchParams, sampling: dict, clock: list):
        """:meth:`_plain_step` after its (empty) proposal."""
        B = len(active)
        prop = self._empty_proposal(B)
        logits, _ = self.verify(prop)  # [B, 1, V]
        clock.append(time.perf_counter())
        scored = self._penalized(active, logits, prop) if wants_penalties(active) else logits
        out, n, _, bad = self.sample(scored, prop, sampling)
        if bad is None or scored is not logits:
            bad = nonfinite_rows(logits)
        clock.append(time.perf_counter())
        columns = self.device_columns(prop, logits, params)
        back = self.commit(B, prop, logits, out, n, None, None, columns, plain=True, bad=bad)
        return prop, logits, back

    def _nothing_drafted(self, prop) -> bool:
        """Whether ``prop`` drafts nothing for any row and came from prompt lookup alone
        (finding no match worth drafting), in front of a model or not: the step's verify,
        sampling and commit are then a plain step's (:meth:`_plain_tail`, whose commit
        lets a model behind lookup catch up as after any lookup step)."""
        if not isinstance(prop, ChainProposal) or prop.tokens.shape[1] != 0:
            return False
        d = self.drafter
        if not getattr(d, "has_model", True):
            return True
        # (an EAGLE draft behind lookup is fed the target's features, which only the
        # verify path returns)
        return getattr(d, "lookup_only", False) and not d.needs_hidden

    def _empty_proposal(self, B: int) -> ChainProposal:
        """The proposal of a step without drafts: ``tokens [B, 0]``."""
        empty = self._empty.get(B)
        if empty is None:
            tokens = torch.empty(B, 0, dtype=torch.int64, device=self.cache.lens.device)
            empty = self._empty[B] = ChainProposal(tokens, None, None, None, 0)
        return empty

    def _step_parts(self, active, params: BatchParams, sampling: dict, k: int, clock: list):
        """The step as separate stages (each forward replayed from its own graph when
        graphs are on). Returns ``(proposal, logits, hidden, path, read-back)``."""
        B = len(active)
        prop = self.propose(active, params, sampling, k)
        clock.append(time.perf_counter())
        if self._nothing_drafted(prop):  # no row matched: a plain step from here
            prop, logits, back = self._plain_tail(active, params, sampling, clock)
            return prop, logits, None, None, back
        logits, hidden = self.verify(prop)  # [B, T, V], [B, T, H] / None
        clock.append(time.perf_counter())
        scored = self._penalized(active, logits, prop) if wants_penalties(active) else logits
        out, n, path, bad = self.sample(scored, prop, sampling)
        if scored is not logits:
            bad = None  # the flags are the raw logits'; the sampler saw penalized ones
        if path is not None and hidden is not None:  # the features along the accepted path
            hidden = hidden.gather(1, path.clamp(min=0)[..., None].expand(-1, -1, hidden.shape[-1]))
        clock.append(time.perf_counter())
        columns = {}
        if getattr(prop, "num_drafted", None) is not None:
            columns["drafted"] = prop.num_drafted
        if prop.origin is not None:
            columns["origin"] = prop.origin
        columns.update(self.device_columns(prop, logits, params))
        plain = isinstance(prop, ChainProposal) and prop.tokens.shape[1] == 0
        back = self.commit(B, prop, logits, out, n, path, hidden, columns, plain=plain, bad=bad)
        return prop, logits, hidden, path, back

    def propose(self, active, params: BatchParams, sampling: dict, k: int):
        """Stage 1: the drafter's chain of ``k`` (or its tree); ``k = 0`` drafts without
        the draft model: prompt lookup alone in front of one (``propose_lookup``), else a
        plain step through the verify path (no drafts)."""
        B = len(active)
        if k == 0:
            lookup = getattr(self.drafter, "propose_lookup", None)
            if lookup is not None:
                return lookup(
                    active,
                    self.next_tokens[:B],
                    params,
                    sampling["seed"],
                    sampling["offset"],
                    k=self.spec.num_draft_tokens,
                )
            empty = torch.empty(B, 0, dtype=torch.int64, device=self.cache.lens.device)
            return ChainProposal(empty, None, None, None, 0)
        return self.drafter.propose(
            active,
            self.next_tokens[:B],
            params,
            sampling["seed"],
            sampling["offset"],
            k=k,
            tree=self.spec.tree,
            stopper=self.stopper,
        )

    def verify(self, prop: ChainProposal | TreeProposal):
        """Stage 2: the target's forward over the roots and the drafts (a tree: its
        ancestor mask and depths) -> ``([B, T, V] logits, [B, T, H] features or None)``,
        from a CUDA graph of the batch bucket when enabled. The features (the last layer's
        output before the final norm) are kept only for a drafter that ``needs_hidden``;
        that forward runs eagerly."""
        if isinstance(prop, TreeProposal):
            inputs, mask, depths = prop.tokens, prop.mask, prop.depths
        else:
            B = prop.tokens.shape[0]
            inputs = self.next_tokens[:B, None]
            if prop.tokens.shape[1]:
                inputs = torch.cat([inputs, prop.tokens], 1)
            mask = depths = None
        model = self.engine.model
        if self.drafter.needs_hidden:
            return model(inputs, self.cache, tree_mask=mask, depths=depths, return_hidden=True)
        if self.graphs is None:
            return model(inputs, self.cache, tree_mask=mask, depths=depths), None
        return graphed_forward(self.graphs, model, self.cache, inputs, mask, depths), None

    def sample(self, logits: torch.Tensor, prop, sampling: dict):
        """Stage 3, the rejection sampler: ``(tokens [B, D + 1], accepted [B], path or
        None, the rows' non-finite flags [B] or None)`` (None: the read-back computes
        them)."""
        greedy = "temperature" not in sampling
        if greedy and isinstance(prop, ChainProposal) and native_rows(logits):
            out, n, bad = greedy_chain(logits, prop)
            return out, n, None, bad
        if greedy and prop.tokens.shape[1] == 0:
            # greedy without drafts (auto_k's plain steps): the argmax is the whole sampler
            out = greedy_tokens(logits)
            return out, logits.new_zeros(logits.shape[0], dtype=torch.int32), None, None
        if isinstance(prop, TreeProposal):
            path, out, n = osd_kernels.tree_rejection_sample(
                logits, prop.tokens, prop.parents, None, **sampling, max_depth=prop.max_depth
            )
            return out, n, path, None
        out, n = osd_kernels.rejection_sample(
            logits, prop.tokens, prop.probs, num_draft_tokens=prop.num_drafted, **sampling
        )
        return out, n, None, None

    def commit(self, B, prop, logits, out, n, path, hidden, columns: dict, plain: bool, bad=None):
        """Stage 4: the target cache keeps the accepted tokens, the next roots are set,
        the step's one read-back happens, and the drafter catches up (``bad [B]``: the
        rows' non-finite flags when the sampler found them). Returns the
        :class:`Readback`."""
        cache = self.cache
        lens_before = None if plain else cache.lens[:B].clone()
        # a plain step keeps one token a row: its sampled one (n is 0)
        keep = self.engine._ones[:B] if plain else (n + 1).to(torch.int32)
        if path is not None:
            cache.commit_tree(path, keep, prop.max_depth + 1)
        else:
            cache.commit(keep, logits.shape[1])
        if logits.device.type == "cpu":
            back = Readback.direct(n, nonfinite_rows(logits) if bad is None else bad, columns, out)
        else:
            back = Readback.fetch(*pack_readback(n, logits, columns, out, bad))
        self.next_tokens[:B] = out[:, 0] if plain else out.gather(1, n[:, None].long())[:, 0]
        if plain and not getattr(self.drafter, "has_model", True):
            return back  # prompt lookup alone keeps nothing to catch up
        emitted = Emitted(B, out, keep.long(), max(back.accepted) + 1, hidden)
        if plain:
            self.drafter.catch_up(emitted)
        else:
            # the draft keeps everything up to the old root; its cache may reach one past
            # the target's (the root it has not fed yet)
            self.drafter.after_verify(
                emitted, committed_lens=lens_before + 1, bound=cache.bound + 1
            )
        return back

    def device_columns(self, prop, logits: torch.Tensor, params: BatchParams) -> dict:
        """The listeners' per-row device columns for the step's read-back."""
        columns = {}
        for listener in self.listeners:
            get = getattr(listener, "device_columns", None)
            if get is not None:
                columns.update(get(prop, logits, params))
        return columns

    def _penalized(self, active, logits: torch.Tensor, prop) -> torch.Tensor:
        """``logits`` with the rows' penalties, each position counting the drafts on its
        own path (``osd.penalties``); the raw logits stay the statistics' and teachers'."""
        penalties = Penalties(active, logits.shape[-1], logits.device)
        if isinstance(prop, TreeProposal):
            return penalties.verify(logits, prop.tokens, tree_ancestors(prop.mask), prop.depths)
        B = logits.shape[0]
        return penalties.verify(logits, torch.cat([self.next_tokens[:B, None], prop.tokens], 1))

    @staticmethod
    def _logprobs(active, logits: torch.Tensor, out_host, emitted, path) -> None:
        """Record the emitted tokens' log-probabilities: token ``j`` of row ``b`` was
        sampled from verify position ``j`` (a tree: the accepted node at depth ``j``)."""
        nodes = path.tolist() if path is not None else None
        T = logits.shape[1]
        rows = [
            (b, b * T + (nodes[b][j] if nodes is not None else j), out_host[b][j])
            for b, r in enumerate(active)
            if r.logprobs is not None
            for j in range(emitted[b])
        ]
        record_logprobs(active, logits.reshape(-1, logits.shape[-1]), rows)

    def _sampling_tensors(self, active, params: BatchParams) -> dict:
        """``seed`` and ``offset`` ``[B]`` (the rows' Philox keys and step counters) and,
        unless every row is greedy, their ``temperature``, ``top_k``, ``top_p``."""
        dev = self.engine.device
        seed, offset = to_device(
            [[r.seed for r in active], [r.spec_steps for r in active]], torch.int64, dev
        ).unbind(0)
        if params.greedy:
            return {"seed": seed, "offset": offset}
        return {**_per_row(params, len(active), dev), "seed": seed, "offset": offset}
