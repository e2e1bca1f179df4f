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

The one deliberate host sync per step is reading the accepted counts and tokens back,
which the stop check and the output lists need.
"""
from __future__ import annotations

import time

import torch

import osd_kernels
from osd.drafters import ModelDrafter, NGramDrafter
from osd.graphs import StepGraphs, graphed_forward
from osd.online.buffer import compress_target
from osd.sampling import BatchParams, fail_nonfinite
from osd.spec import SpecConfig
from osd.stats import SpecStats
from osd_kernels.warp import warp_probs


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
        self._reach = torch.ones(0, dtype=torch.float64)   # [B] running product of scores

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
        conf = torch.stack(self._conf, 1).cpu()        # [B, steps drafted]
        for b, (d, a) in enumerate(zip(num_drafted, num_accepted)):
            for i in range(min(d, a + 1)):             # positions 0..a were tested
                j = int(self._bin(conf[b, i]))
                self.tested[j] += 1
                self.accepted[j] += float(i < a)
        self._conf = []


class Speculator:
    """Runs speculative steps for an :class:`~osd.Engine` (its target, cache and roots).

    Args:
        engine: the owning engine (``model``, ``device``, ``max_seq_len``).
        spec: :class:`~osd.SpecConfig`.
        drafter: a :class:`ModelDrafter` or :class:`NGramDrafter`.
        cache: the target's KV cache of the rows this speculator serves.
        next_tokens: ``[max_batch_size]`` int64, row ``b``'s last sampled token (the root
            of its next step).
    """

    def __init__(self, engine, spec: SpecConfig, drafter, cache, next_tokens: torch.Tensor):
        self.engine = engine
        self.cache = cache
        self.next_tokens = next_tokens
        self.spec = spec
        self.drafter = drafter
        self.stats = SpecStats()
        self.lookup = (NGramDrafter(spec.ngram_min, spec.ngram_max)
                       if spec.prompt_lookup and isinstance(drafter, ModelDrafter) else None)
        self.stopper = (AdaptiveStopper(spec.adaptive_floor, spec.adaptive_init_threshold)
                        if spec.adaptive and not spec.is_tree else None)
        self.collect_topk: int | None = None       # set by the online learner
        self.collect_full: bool = False
        self.collect_policy: str = "all"
        self.collect_prompt: int = 0                # keep the prefill's logits at this many
        #                                             last prompt positions (online learning)
        self.on_swap = None                         # callable run between steps (weights)
        self.graphs: StepGraphs | None = None       # CUDA graphs of the forwards (use_graphs)

    # -- row bookkeeping (mirrors the engine's cache rows) ---------------------------
    def prefill(self, requests, start_row: int, first_tokens: torch.Tensor,
                prompt_logits: torch.Tensor | None = None) -> None:
        """New rows ``start_row ..``; ``prompt_logits [n, m, V]`` (the target's logits at
        each prompt's last ``m`` positions, when :attr:`collect_prompt` is ``m``) become the
        requests' first teacher positions ``len(prompt) - m + 1 .. len(prompt)``."""
        self.stats.requests += len(requests)
        for r in requests:
            r.spec_steps = 0
            r.spec_stats = SpecStats(requests=1)
            r.teacher = []     # (positions [m], topk ids, topk probs | logits)
        if prompt_logits is not None:
            m = prompt_logits.shape[1]
            keep = [min(m, len(r.prompt)) for r in requests]   # rows without the copies
            self._keep_teacher(
                [(r, torch.arange(len(r.prompt) - j + 1, len(r.prompt) + 1))
                 for r, j in zip(requests, keep)],
                [prompt_logits[b, m - j:] for b, j in enumerate(keep)])
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.prefill([r.prompt for r in requests], start_row, first_tokens)

    def move_row(self, src: int, dst: int) -> None:
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.move_row(src, dst)

    def reset(self) -> None:
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.reset()

    # -- one step ----------------------------------------------------------------------
    def step(self, active, params: BatchParams) -> None:
        """One speculative step over ``active`` (row ``b`` is ``active[b]``) sampled with
        the rows' ``params``. A row whose target logits are not finite fails
        (``finish_reason = "error"``); it emits nothing and teaches nothing."""
        if self.on_swap is not None:
            self.on_swap()                           # between steps, never within one
        eng = self.engine
        B = len(active)
        dev = eng.device
        cache = self.cache
        roots = self.next_tokens[:B]
        t0 = time.perf_counter()
        sampling = self._sampling_tensors(active, params, dev)
        tree = self.spec.tree
        looked_up = False      # drafts from prompt lookup (the draft model did not run)
        if tree is not None:
            prop = self.drafter.propose_tree(B, tree, roots)
            inputs, mask, depths = prop.tokens, prop.mask, prop.depths
            drafted = None
        else:
            k = self.spec.num_draft_tokens
            if isinstance(self.drafter, NGramDrafter):
                prop = self.drafter.propose_chain([r.prompt + r.generated for r in active], k, dev)
            else:
                prop = None
                if self.lookup is not None:
                    prop = self.lookup.propose_chain([r.prompt + r.generated for r in active],
                                                     k, dev, every_row=True)
                looked_up = prop is not None
                if prop is None:
                    prop = self.drafter.propose_chain(B, k, params, sampling["seed"],
                                                      sampling["offset"], self.stopper)
            inputs = torch.cat([roots[:, None], prop.tokens], 1)
            mask = depths = None
            drafted = prop.num_drafted
        t1 = time.perf_counter()
        lens_before = cache.lens[:B].clone()
        logits = self._verify(inputs, mask, depths)                            # [B, T, V]
        t2 = time.perf_counter()
        if tree is not None:
            path, out, n = osd_kernels.tree_rejection_sample(
                logits, prop.tokens, prop.parents, None, **sampling, max_depth=prop.max_depth)
        else:
            out, n = osd_kernels.rejection_sample(
                logits, prop.tokens, prop.probs, num_draft_tokens=drafted, **sampling)
        t3 = time.perf_counter()
        keep = (n + 1).to(torch.int32)
        if tree is not None:
            cache.commit_tree(path, keep, prop.max_depth + 1)
        else:
            cache.commit(keep, inputs.shape[1])
        t4 = time.perf_counter()
        # The one deliberate host sync of the step: the accepted counts and tokens decide
        # the stop checks and fill the outputs.
        n_host = n.tolist()
        out_host = out.tolist()
        fail_nonfinite(active, logits)
        self.next_tokens[:B] = out.gather(1, n[:, None].long())[:, 0]
        if looked_up:
            self.drafter.queue(B, out, keep.long(), max(n_host) + 1)
        elif isinstance(self.drafter, ModelDrafter):
            self.drafter.set_pending(B, out, keep.long(), max(n_host) + 1, lens_before + 1,
                                     cache.bound + 1)
        if tree is not None:
            drafted_host = [prop.max_depth] * B   # a tree offers up to max_depth per row
        elif drafted is None:
            drafted_host = [prop.tokens.shape[1]] * B
        else:
            drafted_host = drafted.tolist()
        if self.stopper is not None:
            self.stopper.observe(drafted_host, n_host)
        self._collect(active, logits, n_host, drafted_host, path if tree is not None else None)
        if (self.spec.exact_alpha and tree is None and isinstance(self.drafter, ModelDrafter)
                and not looked_up):
            self._alpha(active, logits, prop, params, drafted_host)
        emitted_total = 0
        for b, r in enumerate(active):
            before = len(r.generated)
            for t in out_host[b][:n_host[b] + 1] if r.finish_reason is None else ():
                if r.finish_reason is not None:
                    break
                r.append(t, eng.max_seq_len)
            emitted = len(r.generated) - before
            emitted_total += emitted
            r.spec_steps += 1
            r.spec_stats.add_step([drafted_host[b]], [min(n_host[b], emitted)], emitted)
            r.spec_stats.lookup_steps += looked_up
        self.stats.add_step(drafted_host, n_host, emitted_total)
        self.stats.lookup_steps += looked_up
        t5 = time.perf_counter()
        for phase, dt in (("draft", t1 - t0), ("verify", t2 - t1), ("sample", t3 - t2),
                          ("rollback", t4 - t3), ("other", t5 - t4)):
            self.stats.add_time(phase, dt)

    def use_graphs(self, graphs: StepGraphs | None) -> None:
        """Replay the verify forward (and a model drafter's chain loop) from ``graphs``."""
        self.graphs = graphs
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.graphs = graphs

    def _verify(self, inputs: torch.Tensor, mask: torch.Tensor | None,
                depths: torch.Tensor | None) -> torch.Tensor:
        """The target's forward over ``inputs [B, T]`` (tree: ``mask``, ``depths [B, T]``)
        -> ``[B, T, V]`` logits, from a CUDA graph of the batch bucket when enabled."""
        model = self.engine.model
        if self.graphs is None:
            return model(inputs, self.cache, tree_mask=mask, depths=depths)
        return graphed_forward(self.graphs, model, self.cache, inputs, mask, depths)

    def _sampling_tensors(self, active, params: BatchParams, dev) -> dict:
        seed = torch.tensor([r.seed for r in active], dtype=torch.int64, device=dev)
        offset = torch.tensor([r.spec_steps for r in active], dtype=torch.int64, device=dev)
        if params.greedy:
            return {"seed": seed, "offset": offset}
        return {**params.per_row(len(active), dev), "seed": seed, "offset": offset}

    def _alpha(self, active, logits, prop, params, drafted) -> None:
        """Exact 1 - TV(p, q) at every drafted position (statistics only)."""
        K = prop.tokens.shape[1]
        p_logits = logits[:, :K].reshape(-1, logits.shape[-1])
        if params.greedy:
            p = torch.softmax(p_logits.float(), -1)
            q = torch.softmax(prop.logits.reshape(-1, p.shape[-1]).float(), -1)
        else:
            p = warp_probs(p_logits, *params.repeat(K))
            q = prop.probs.reshape(-1, p.shape[-1]).float()
        a = torch.minimum(p, q).sum(-1).view(len(active), K).cpu()
        for b, r in enumerate(active):
            d = drafted[b]
            if d and r.finish_reason is None:
                total = float(a[b, :d].sum())
                r.spec_stats.add_alpha(total, d)
                self.stats.add_alpha(total, d)

    def _collect(self, active, logits, n_host, drafted_host, path) -> None:
        """Keep the target's distributions that decided this step's tokens (online
        learning); nothing is recomputed later."""
        if self.collect_topk is None and not self.collect_full:
            return
        rows, where = [], []
        path_host = path.tolist() if path is not None else None
        for b, r in enumerate(active):
            if r.finish_reason is not None:
                continue
            base = len(r.prompt) + len(r.generated)       # position of the first new token
            n = n_host[b]
            if self.collect_policy == "corrected":
                idx = [n] if n < drafted_host[b] else []
            else:
                idx = list(range(n + 1))
            if not idx:
                continue
            node = [path_host[b][j] for j in idx] if path is not None else idx
            rows.append(logits[b, node])
            where.append((r, torch.tensor([base + j for j in idx], dtype=torch.int64)))
        self._keep_teacher(where, rows)

    def _keep_teacher(self, where, rows) -> None:
        """Append the target's distributions ``rows`` (``[m_i, V]`` logits each) to the
        teacher lists of the requests in ``where`` (``(request, positions [m_i])``)."""
        if not rows:
            return
        ids, probs, full = compress_target(torch.cat(rows), None if self.collect_full
                                           else self.collect_topk)
        start = 0
        for r, pos in where:
            m = pos.numel()
            sl = slice(start, start + m)
            r.teacher.append((pos, None if ids is None else ids[sl],
                              None if probs is None else probs[sl],
                              None if full is None else full[sl]))
            start += m
