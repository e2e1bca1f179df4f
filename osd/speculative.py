"""The speculative step: draft, verify in one target forward, sample, roll back.

One step over the active rows ``0 .. B-1`` (all state on the device):

1. **draft**: the drafter proposes a chain of up to k tokens per row, or a token tree;
2. **verify**: one target forward over ``[root, drafts...]`` (``T = k + 1`` tokens per
   row; a tree passes its ancestor bitmask and node depths), writing K/V at
   ``lens[b] + i``;
3. **sample**: ``osd_kernels.rejection_sample`` (chain) or
   ``osd_kernels.tree_rejection_sample`` (tree) decides, keyed on per-request
   ``(seed, step)`` Philox streams;
4. **roll back**: chain: ``lens += accepted + 1``; tree: ``kv_rollback`` compacts the
   accepted path in place. The draft cache drops its drafts and queues the accepted
   tokens plus the emitted one as the next step's first draft input.

The one deliberate host sync per step is reading one small tensor back (the accepted
counts, the non-finite flags, the drafted counts of an adaptive chain, the rows' exact α
and the tokens), which the stop check, the output lists and the statistics need. Host values
go to the device with non-blocking copies from pinned memory.
"""

from __future__ import annotations

import dataclasses
import time

import torch

import osd_kernels
from osd.drafters import ChainProposal, Emitted, TreeProposal
from osd.fused_step import fused_chain_step, fusable
from osd.graphs import StepGraphs, graphed_forward
from osd.penalties import Penalties, tree_ancestors, wants_penalties
from osd.sampling import BatchParams, fail_rows, nonfinite_rows, record_logprobs
from osd.spec import SpecConfig
from osd.stats import SpecStats
from osd_kernels.warp import warp_probs


def to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device`` without blocking the host: on CUDA through
    pinned memory and a non-blocking copy (ordered on the current stream)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class AdaptiveStopper:
    """Adaptive draft length: a row stops drafting when the next token is unlikely to be
    accepted together with every draft before it.

    Confidence is the draft's probability of the token it proposes. Acceptance is
    calibrated per confidence bin from the verdicts seen so far (a position counts as
    tested when every earlier draft of its step was accepted), with a prior that trusts
    confidences above ``init_threshold``. Each drafted token multiplies a running product
    by its bin's calibrated P(accept | confidence) plus an exploration bonus
    ``EXPLORE / sqrt(tested + prior weight)`` (capped at 1), which shrinks as the bin is
    tested; a row keeps drafting while the product, its estimated chance of getting this
    far, is at least ``floor``. Without the bonus a bin whose prior is below the floor would
    never be drafted, hence never tested: a draft that is accepted more often than its
    confidence suggests would be stopped for good.
    """

    BINS = 10
    PRIOR_WEIGHT = 4.0
    EXPLORE = 0.7

    def __init__(self, floor: float, init_threshold: float):
        self.floor = floor
        centers = (torch.arange(self.BINS, dtype=torch.float64) + 0.5) / self.BINS
        self.prior = (centers >= init_threshold).double()
        self.tested = torch.zeros(self.BINS, dtype=torch.float64)
        self.accepted = torch.zeros(self.BINS, dtype=torch.float64)
        self._conf: list[torch.Tensor] = []
        self._reach = torch.ones(0, dtype=torch.float64)  # [B] running product of scores

    def _bin(self, conf: torch.Tensor) -> torch.Tensor:
        # Deliberate host sync (adaptive mode only): the calibration table is on the host.
        return (conf.double() * self.BINS).long().clamp(0, self.BINS - 1).cpu()

    def rates(self) -> torch.Tensor:
        """Calibrated P(accept) per confidence bin."""
        w = self.PRIOR_WEIGHT
        return (self.accepted + w * self.prior) / (self.tested + w)

    def scores(self) -> torch.Tensor:
        """:meth:`rates` plus the exploration bonus: what ``floor`` is compared with."""
        return self.rates() + self.EXPLORE / (self.tested + self.PRIOR_WEIGHT).sqrt()

    def keep_going(self, logits, tokens, q, active):
        probs = q if q is not None else torch.softmax(logits.float(), -1)
        conf = probs.gather(1, tokens[:, None])[:, 0]
        if active is None:
            self._conf = []
            self._reach = torch.ones(conf.shape[0], dtype=torch.float64)
        self._conf.append(conf)
        self._reach = self._reach * self.scores().clamp(max=1.0)[self._bin(conf)]
        go = (self._reach >= self.floor).to(conf.device)
        return go if active is None else active & go

    def observe(self, num_drafted: list[int], num_accepted: list[int]) -> None:
        """Learn from one step's verdicts (host lists, already synced)."""
        if not self._conf:
            return
        conf = torch.stack(self._conf, 1).cpu()  # [B, steps drafted]
        for b, (d, a) in enumerate(zip(num_drafted, num_accepted)):
            for i in range(min(d, a + 1)):  # positions 0..a were tested
                j = int(self._bin(conf[b, i]))
                self.tested[j] += 1
                self.accepted[j] += float(i < a)
        self._conf = []


class DraftLengthController:
    """Chooses each step's chain length from measured goodput, per batch-size bucket.

    The arms are a few chain lengths from 0 (plain decoding through the verify path) to
    ``k_max``. An arm's goodput is the tokens a step emitted per second of its wall time
    (which includes the step's host sync, so it is device time on a GPU), as an
    exponential moving average per batch bucket (1, 2, 4, ...). A step takes the best arm,
    except an exploring step, which re-measures the best arm's neighbour (the next shorter
    or longer chain) measured longest ago, so that a change in acceptance or in cost is
    noticed; goodput is unimodal in the chain length, so the best arm moves one neighbour
    at a time, and a neighbour costs less to try than the longest chain. Exploring steps
    come ``explore_every`` steps apart; each one that leaves the best arm as it was doubles
    the spacing, up to ``explore_max`` (default ``8 * explore_every``), and one that
    changes it resets the spacing: where one arm clearly wins (plain decoding against a
    useless draft) the slower arms cost little. The first measurement of an arm in a bucket
    is dropped: it pays one-time costs (CUDA graph capture, allocator growth).
    """

    def __init__(
        self,
        k_max: int,
        explore_every: int = 16,
        decay: float = 0.7,
        explore_max: int | None = None,
    ):
        self.arms = sorted({k for k in (k_max, 0, 1, 2, k_max // 2) if 0 <= k <= k_max})
        self.explore_every = explore_every
        self.explore_max = explore_max or 8 * explore_every
        self.decay = decay
        self.goodput: dict[int, dict[int, float]] = {}  # bucket -> arm -> tokens/s
        self._seen: dict[int, dict[int, int]] = {}  # bucket -> arm -> measurements
        self._when: dict[int, dict[int, int]] = {}  # bucket -> arm -> last step
        self._steps: dict[int, int] = {}
        self._spacing: dict[int, int] = {}  # bucket -> steps between explorations
        self._explored: dict[int, int] = {}  # bucket -> step of the last one
        self._probe: dict[int, tuple[int, int]] = {}  # bucket -> (arm explored, best then)
        self.chosen: dict[int, dict[int, int]] = {}  # bucket -> arm -> steps

    @staticmethod
    def bucket(B: int) -> int:
        return 1 << (B - 1).bit_length()

    def choose(self, B: int) -> int:
        b = self.bucket(B)
        good = self.goodput.setdefault(b, {})
        step = self._steps[b] = self._steps.get(b, 0) + 1
        untried = [k for k in reversed(self.arms) if k not in good]
        if untried:
            k = untried[0]
            self._explored[b] = step
        elif step - self._explored[b] >= self._spacing.setdefault(b, self.explore_every):
            when, best = self._when[b], max(good, key=good.get)
            i = self.arms.index(best)
            k = min(
                self.arms[max(0, i - 1) : i] + self.arms[i + 1 : i + 2],
                key=lambda a: when.get(a, -1),
            )
            self._explored[b] = step
            self._probe[b] = (k, best)
        else:
            k = max(good, key=good.get)
        counts = self.chosen.setdefault(b, {})
        counts[k] = counts.get(k, 0) + 1
        return k

    def observe(self, B: int, k: int, tokens: int, seconds: float) -> None:
        b = self.bucket(B)
        seen = self._seen.setdefault(b, {})
        seen[k] = seen.get(k, 0) + 1
        self._when.setdefault(b, {})[k] = self._steps.get(b, 0)
        good = self.goodput.setdefault(b, {})
        if seen[k] > 1 and seconds > 0:
            rate = tokens / seconds
            good[k] = rate if k not in good else self.decay * good[k] + (1 - self.decay) * rate
        probe = self._probe.pop(b, None)
        if probe is not None and probe[0] == k:
            same = max(good, key=good.get) == probe[1]
            self._spacing[b] = (
                min(2 * self._spacing[b], self.explore_max) if same else self.explore_every
            )

    def summary(self) -> dict:
        """Per batch bucket: goodput (tokens/s) per arm and how often each arm ran."""
        return {
            b: {
                "goodput": {k: round(v, 2) for k, v in sorted(self.goodput[b].items())},
                "steps": dict(sorted(self.chosen.get(b, {}).items())),
            }
            for b in sorted(self.goodput)
        }


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


class Speculator:
    """Runs speculative steps over one lane of an :class:`~osd.Engine`.

    A step is: propose (the drafter), verify (one target forward), sample (the rejection
    sampler), commit (cache lengths, the drafter catches up), then hand the
    :class:`Verdict` to the statistics and to every listener.

    Args:
        engine: the owning engine (``model``, ``device``, ``max_seq_len``).
        spec: :class:`~osd.SpecConfig`.
        drafter: any drafter of ``osd.drafters`` (one protocol).
        cache: the target's KV cache of the rows this speculator serves.
        next_tokens: ``[max_batch_size]`` int64, row ``b``'s last sampled token (the root
            of its next step).
        listeners: objects with ``before_step()``, ``on_prefill(requests, prompt_logits,
            prompt_hidden)``
            and ``on_verdict(verdict)`` (the online learner's ``TeacherCollector``); the
            largest ``prompt_positions`` among them is how many prompt logits the engine's
            prefill keeps.
    """

    def __init__(
        self, engine, spec: SpecConfig, drafter, cache, next_tokens: torch.Tensor, listeners=()
    ):
        self.engine = engine
        self.cache = cache
        self.next_tokens = next_tokens
        self.spec = spec
        self.drafter = drafter
        self.listeners = list(listeners)
        self.prompt_positions = max(
            (getattr(x, "prompt_positions", 0) for x in self.listeners), default=0
        )
        self.stats = SpecStats()
        self.stopper = (
            AdaptiveStopper(spec.adaptive_floor, spec.adaptive_init_threshold)
            if spec.adaptive and not spec.is_tree
            else None
        )
        self.k_control = DraftLengthController(spec.num_draft_tokens) if spec.auto_k else None
        self.graphs: StepGraphs | None = None  # CUDA graphs of the forwards (use_graphs)

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
        self.stats.requests += len(requests)
        for r in requests:
            r.spec_steps = 0
            r.spec_stats = SpecStats(requests=1)
        for listener in self.listeners:
            listener.on_prefill(requests, prompt_logits, prompt_hidden)
        self.drafter.prefill([r.prompt for r in requests], start_row, first_tokens, prompt_hidden)

    def move_row(self, src: int, dst: int) -> None:
        self.drafter.move_row(src, dst)

    def reset(self) -> None:
        self.drafter.reset()

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
        k = self.spec.num_draft_tokens if self.k_control is None else self.k_control.choose(B)
        fused = (
            fused_chain_step(self, B, params, sampling, k)
            if fusable(self, active, params, k)
            else None
        )
        if fused is not None:  # draft, verify, sample, commit: one replay
            prop, logits, packed = fused
            path = hidden = None
            t1 = time.perf_counter()
            clock += [clock[0], t1, t1]  # the replay counts as "verify"
            host = packed.tolist()  # the step's one read-back
            self.drafter._pending_max = int(max(h[0] for h in host)) + 1
            alpha_col = 2 if self.spec.exact_alpha else None
            extra = 3 if self.spec.exact_alpha else 2
        else:
            prop, logits, hidden, path, host, extra, alpha_col = self._step_parts(
                active, params, sampling, k, clock
            )
        clock.append(time.perf_counter())
        n_host = [int(h[0]) for h in host]
        fail_rows(active, [h[1] for h in host])
        out_host = [[int(t) for t in h[extra:]] for h in host]
        if isinstance(prop, TreeProposal):
            drafted = [prop.max_depth] * B  # a tree offers up to max_depth per row
        elif prop.num_drafted is None:
            drafted = [prop.tokens.shape[1]] * B
        else:
            drafted = [int(h[2]) for h in host]
        emitted = []
        for b, r in enumerate(active):
            before = len(r.generated)
            for t in out_host[b][: n_host[b] + 1] if r.finish_reason is None else ():
                if r.finish_reason is not None:
                    break
                r.append(t, self.engine.max_seq_len)
            emitted.append(len(r.generated) - before)
        if any(r.logprobs is not None for r in active):
            self._logprobs(active, logits, out_host, emitted, path)
        verdict = Verdict(active, logits, prop, n_host, drafted, emitted, path, params, hidden)
        self._observe(verdict, None if alpha_col is None else [h[alpha_col] for h in host])
        for listener in self.listeners:
            listener.on_verdict(verdict)
        clock.append(time.perf_counter())
        if self.k_control is not None:
            self.k_control.observe(B, k, sum(emitted), clock[-1] - clock[0])
        for phase, t0, t1 in zip(
            ("draft", "verify", "sample", "rollback", "other"), clock, clock[1:]
        ):
            self.stats.add_time(phase, t1 - t0)

    def _step_parts(self, active, params: BatchParams, sampling: dict, k: int, clock: list):
        """The step as separate parts (each forward replayed from its own graph when
        graphs are on): propose, verify, sample, commit, read back, and the drafter's
        catch-up. Returns ``(proposal, logits, hidden, path, host rows, index of the
        first token column, index of the α column or None)``."""
        B = len(active)
        cache = self.cache
        if k == 0:  # plain decoding through the verify path; the drafter catches up
            prop = ChainProposal(
                torch.empty(B, 0, dtype=torch.int64, device=cache.lens.device),
                None,
                None,
                None,
                0,
                source="none",
            )
        else:
            prop = self.drafter.propose(
                active,
                self.next_tokens[:B],
                params,
                sampling["seed"],
                sampling["offset"],
                k=k,
                tree=self.spec.tree,
                stopper=self.stopper,
            )
        clock.append(time.perf_counter())
        plain = isinstance(prop, ChainProposal) and prop.source == "none"
        lens_before = None if plain else cache.lens[:B].clone()
        logits, hidden = self._verify(prop)  # [B, T, V], [B, T, H] / None
        clock.append(time.perf_counter())
        scored = self._penalized(active, logits, prop) if wants_penalties(active) else logits
        out, n, path = self._sample(scored, prop, sampling)
        if path is not None and hidden is not None:  # the features along the accepted path
            hidden = hidden.gather(1, path.clamp(min=0)[..., None].expand(-1, -1, hidden.shape[-1]))
        clock.append(time.perf_counter())
        keep = (n + 1).to(torch.int32)
        if path is not None:
            cache.commit_tree(path, keep, prop.max_depth + 1)
        else:
            cache.commit(keep, logits.shape[1])
        # The one deliberate host sync of the step: the accepted counts and tokens decide
        # the stop checks and fill the outputs; rows with non-finite logits fail; the
        # statistics' per-row values ride along. float64 holds every token id exactly.
        alpha = self._alpha_rows(prop, logits, params)  # [B] or None
        cols = [n[:, None], nonfinite_rows(logits)[:, None]]
        num_drafted = getattr(prop, "num_drafted", None)
        if num_drafted is not None:
            cols.append(num_drafted[:, None])
        alpha_col = None
        if alpha is not None:
            alpha_col = len(cols)
            cols.append(alpha[:, None])
        host = torch.cat([c.double() for c in cols] + [out.double()], 1).tolist()
        self.next_tokens[:B] = out.gather(1, n[:, None].long())[:, 0]
        emitted = Emitted(B, out, keep.long(), int(max(h[0] for h in host)) + 1, hidden)
        if plain:
            self.drafter.catch_up(emitted)
        else:
            # the draft keeps everything up to the old root; its cache may reach one past
            # the target's (the root it has not fed yet)
            self.drafter.after_verify(
                emitted, committed_lens=lens_before + 1, bound=cache.bound + 1
            )
        return prop, logits, hidden, path, host, len(cols), alpha_col

    def use_graphs(self, graphs: StepGraphs | None) -> None:
        """Replay the verify forward (and a model drafter's chain loop) from ``graphs``."""
        self.graphs = graphs
        self.drafter.use_graphs(graphs)

    def _verify(self, prop: ChainProposal | TreeProposal):
        """The target's forward over the roots and the drafts (a tree: its ancestor mask
        and depths) -> ``([B, T, V] logits, [B, T, H] features or None)``, from a CUDA
        graph of the batch bucket when enabled. The features (the last
        layer's output before the final norm) are kept only for a drafter that
        ``needs_hidden``; that forward runs eagerly."""
        if isinstance(prop, TreeProposal):
            inputs, mask, depths = prop.tokens, prop.mask, prop.depths
        else:
            B = prop.tokens.shape[0]
            inputs = torch.cat([self.next_tokens[:B, None], prop.tokens], 1)
            mask = depths = None
        model = self.engine.model
        if self.drafter.needs_hidden:
            return model(inputs, self.cache, tree_mask=mask, depths=depths, return_hidden=True)
        if self.graphs is None:
            return model(inputs, self.cache, tree_mask=mask, depths=depths), None
        return graphed_forward(self.graphs, model, self.cache, inputs, mask, depths), None

    def _penalized(self, active, logits: torch.Tensor, prop) -> torch.Tensor:
        """``logits`` with the rows' penalties, each position counting the drafts on its
        own path (``osd.penalties``); the raw logits stay the statistics' and teachers'."""
        penalties = Penalties(active, logits.shape[-1], logits.device)
        if isinstance(prop, TreeProposal):
            return penalties.verify(logits, prop.tokens, tree_ancestors(prop.mask), prop.depths)
        B = logits.shape[0]
        return penalties.verify(logits, torch.cat([self.next_tokens[:B, None], prop.tokens], 1))

    def _sample(self, logits: torch.Tensor, prop, sampling: dict):
        """The rejection sampler: ``(tokens [B, D + 1], accepted [B], path or None)``."""
        if "temperature" not in sampling and prop.tokens.shape[1] == 0:
            # greedy without drafts (auto_k's plain steps): the argmax is the whole sampler
            return logits.argmax(-1), logits.new_zeros(logits.shape[0], dtype=torch.int32), None
        if isinstance(prop, TreeProposal):
            path, out, n = osd_kernels.tree_rejection_sample(
                logits, prop.tokens, prop.parents, None, **sampling, max_depth=prop.max_depth
            )
            return out, n, path
        out, n = osd_kernels.rejection_sample(
            logits, prop.tokens, prop.probs, num_draft_tokens=prop.num_drafted, **sampling
        )
        return out, n, None

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
        dev = self.engine.device
        seed, offset = to_device(
            [[r.seed for r in active], [r.spec_steps for r in active]], torch.int64, dev
        )
        if params.greedy:
            return {"seed": seed, "offset": offset}
        return {**params.per_row(len(active), dev), "seed": seed, "offset": offset}

    def _observe(self, v: Verdict, alpha: list[float] | None = None) -> None:
        """Statistics of a verdict: per request and per speculator, the adaptive
        stopper's calibration, and the rows' exact α (``alpha``, from
        :meth:`_alpha_rows`) where the draft model drafted."""
        source = getattr(v.proposal, "source", "model")
        lookup = source == "lookup"
        rows = v.proposal.lookup_rows if source == "mixed" else None
        if self.stopper is not None:
            self.stopper.observe(v.drafted, v.accepted)
        if alpha is not None:
            self._add_alpha(v, alpha, self._alpha_counts(v))
        for b, r in enumerate(v.active):
            r.spec_steps += 1
            r.spec_stats.add_step([v.drafted[b]], [min(v.accepted[b], v.emitted[b])], v.emitted[b])
            r.spec_stats.lookup_steps += lookup or (rows is not None and rows[b])
        self.stats.add_step(v.drafted, v.accepted, sum(v.emitted))
        self.stats.lookup_steps += lookup

    def _alpha_rows(self, prop, logits: torch.Tensor, params: BatchParams):
        """Exact 1 - TV(p, q) summed per row over the positions the draft model drafted
        (statistics only), as a ``[B]`` device tensor, or None where nothing is measured:
        a chain of the draft model (rows of a mixed step that verified lookup drafts count
        0 positions), or the draft model's chain inside a lookup tree (the target's
        distribution at each drafted token's parent node against the draft's)."""
        if not self.spec.exact_alpha:
            return None
        source = getattr(prop, "source", "model")
        V = logits.shape[-1]
        if isinstance(prop, ChainProposal):
            if source in ("lookup", "none") or prop.logits is None:
                return None
            B, K = prop.tokens.shape
            p_logits = logits[:, :K].reshape(-1, V)
            q = None if params.greedy else prop.probs.reshape(p_logits.shape).float()
            counts = (
                prop.num_drafted
                if prop.num_drafted is not None
                else torch.full((B,), K, device=logits.device)
            )
            if prop.lookup_rows is not None:
                counts = counts * to_device(
                    [not x for x in prop.lookup_rows], counts.dtype, logits.device
                )
            return self._alpha_sums(p_logits, prop.logits, q, K, counts, params)
        if getattr(prop, "draft_logits", None) is None:
            return None
        B, K = prop.draft_nodes.shape
        parents = torch.cat([prop.draft_nodes.new_zeros(B, 1), prop.draft_nodes[:, :-1]], 1)
        p_logits = logits.gather(1, parents[..., None].expand(B, K, V)).reshape(B * K, V)
        q = (
            None
            if params.greedy
            else warp_probs(prop.draft_logits.reshape(B * K, V), *params.repeat(K))
        )
        counts = to_device([K if m else 0 for m in prop.model_rows], torch.int64, logits.device)
        return self._alpha_sums(p_logits, prop.draft_logits, q, K, counts, params)

    @staticmethod
    def _alpha_counts(v: Verdict) -> list[int]:
        """Host-side twin of the counts :meth:`_alpha_rows` sums over."""
        prop = v.proposal
        if isinstance(prop, ChainProposal):
            skip = prop.lookup_rows or [False] * len(v.active)
            return [0 if s else d for d, s in zip(v.drafted, skip)]
        K = prop.draft_nodes.shape[1]
        return [K if m else 0 for m in prop.model_rows]

    def _alpha_sums(
        self,
        p_logits: torch.Tensor,
        q_logits: torch.Tensor,
        q: torch.Tensor | None,
        K: int,
        counts: torch.Tensor,
        params: BatchParams,
    ) -> torch.Tensor:
        """Each row's summed 1 - TV(p, q) over its first ``counts[b]`` of ``K`` positions
        -> ``[B]``. ``p_logits [B * K, V]`` (raw target), ``q_logits [B, K, V]`` (raw
        draft); ``q [B * K, V]`` the warped draft distribution (None: greedy, where both
        sides are the plain softmax)."""
        # A draft with a reduced head puts no mass outside its columns, so min(p, q) is 0
        # there: the sum runs over those columns alone (a sixth of the chat draft's vocab).
        head = self.drafter.model.head_ids
        if params.greedy:
            p_logits = p_logits.float()
            q_logits = q_logits.reshape(p_logits.shape).float()
            if head is None:
                p = torch.softmax(p_logits, -1)
                q = torch.softmax(q_logits, -1)
            else:
                p = (
                    p_logits.index_select(1, head) - torch.logsumexp(p_logits, 1, keepdim=True)
                ).exp()
                q = torch.softmax(q_logits.index_select(1, head), -1)
        else:
            p = warp_probs(p_logits, *params.repeat(K))
            if head is not None:
                p, q = p.index_select(1, head), q.index_select(1, head)
        a = torch.minimum(p, q).sum(-1).view(counts.shape[0], K)
        return torch.where(torch.arange(K, device=a.device) < counts[:, None], a, 0.0).sum(1)

    def _add_alpha(self, v: Verdict, totals: list[float], drafted: list[int]) -> None:
        for b, r in enumerate(v.active):
            if drafted[b] and r.finish_reason != "error":
                r.spec_stats.add_alpha(totals[b], drafted[b])
                self.stats.add_alpha(totals[b], drafted[b])
