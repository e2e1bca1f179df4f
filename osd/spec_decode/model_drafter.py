"""The draft-model drafter: a draft model (or the target with layers skipped) and its own
KV cache, drafting chains and trees (the protocol: ``osd.spec_decode.proposals``).

With ``skip_layers`` and the target's own weights it is *self-speculation* (the target
with some layers skipped, as in Draft & Verify / LayerSkip). The other drafters:
``lookup_drafter`` (prompt lookup alone, or in front of this one) and ``eagle_drafter``
(an EAGLE draft, which drafts from the target's features).

Draft-cache invariant: the cache holds the K/V of the committed tokens ``seq[:lens[b]]``;
the tokens after that (the accepted drafts and the newly emitted token of the last step)
are *pending* and are fed by the first forward of the next step, which also yields the
distribution at the root (the last committed token). Chain and tree drafts are written
past that point and simply dropped afterwards (``reset_to``), so the draft cache needs no
compaction.
"""

from __future__ import annotations

import torch

from osd.graphs import StepGraphs, batch_bucket
from osd.models.llama import DecoderLM
from osd.sampling import BatchParams, SamplingParams, greedy_tokens
from osd.spec import DynamicTree
from osd.spec_decode.proposals import (
    PENDING_WIDTH,
    ChainProposal,
    Drafter,
    Emitted,
    TreeProposal,
)
from osd.tree import StaticTree, depths_from_parents, mask_from_parents
from osd_kernels._ops import native_available
from osd_kernels.philox import philox_uniform_rows
from osd_kernels.warp import warp_probs

# The draft's sampling noise uses its own Philox key (seed ^ DRAFT_KEY), so it is
# independent of the verifier's accept/resample noise drawn with the same seed and offset.
DRAFT_KEY = 0x5DEECE66D


def sample_draft(
    q: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, position: int
) -> torch.Tensor:
    """Draw one token per row from ``q [B, V]`` by an exponential race with counter-based
    noise keyed on ``(seed[b], offset[b], position)``: ``argmax_x q(x) / E_x`` with
    ``E_x = -log u_x`` is distributed as ``q``. No generator state, no host sync."""
    if q.device.type == "cpu" and native_available():
        # the same words from the C++ generator, far cheaper per row than the PyTorch one
        u = torch.ops.osd.philox_uniform(seed ^ DRAFT_KEY, offset, position, q.shape[-1])
    else:
        u = philox_uniform_rows(seed ^ DRAFT_KEY, offset, position, q.shape[-1])
    return (q / -torch.log(u)).argmax(-1)


class ModelDrafter:
    """A draft model (or the target with skipped layers) and its own KV cache.

    Args:
        model: the draft :class:`~osd.models.DecoderLM`.
        max_batch_size, capacity: of its cache.
        skip_layers: layers of ``model`` to bypass (self-speculation).
    """

    has_model = True
    needs_hidden = False
    # Most pending tokens (steps drafted by prompt lookup) before they are fed. The pending
    # buffer's PENDING_WIDTH columns hold them or one step's tokens (at most
    # MAX_TREE_NODES = 64); its last column is the queue's scratch column.
    PENDING_LIMIT = 24

    def __init__(
        self,
        model: DecoderLM,
        max_batch_size: int,
        capacity: int,
        skip_layers: frozenset[int] = frozenset(),
        context: int | None = None,
        defer: bool = False,
    ):
        self.model = model
        # defer: not fed while it does not draft (auto_k's chain length 0); rows it sat
        # out are fed what they missed when it next drafts (resync)
        self.defer = defer and not self.needs_hidden
        self._stale: set[int] = set()  # rows not fed up to their root
        self.skip_layers = frozenset(skip_layers)
        # context: the engine's, so that a LongRoPE draft rotates as the target does
        self.cache = model.new_cache(max_batch_size, capacity, context=context)
        self.device = model.device
        dev = self.device
        self._pending = torch.zeros(max_batch_size, PENDING_WIDTH, dtype=torch.int64, device=dev)
        self._pending_len = torch.zeros(max_batch_size, dtype=torch.int64, device=dev)
        self._pending_max = 0
        self._one = torch.ones(max_batch_size, dtype=torch.int32, device=dev)
        self.graphs: StepGraphs | None = None  # CUDA graphs of the chain loop (osd.graphs)

    def _forward(self, ids, **kw):
        return self.model(ids, self.cache, skip_layers=self.skip_layers, **kw)

    def use_graphs(self, graphs: StepGraphs | None) -> None:
        self.graphs = graphs

    def propose(
        self,
        active,
        roots: torch.Tensor,
        params: BatchParams,
        seed: torch.Tensor,
        offset: torch.Tensor,
        *,
        k: int = 0,
        tree=None,
        stopper=None,
    ):
        """A chain of ``k`` drafts per row (:meth:`propose_chain`), or a ``tree``
        (:meth:`propose_tree`) below ``roots [B]``."""
        B = len(active)
        self.sync(active)
        if tree is not None:
            return self.propose_tree(B, tree, roots)
        return self.propose_chain(B, k, params, seed, offset, stopper)

    def after_verify(self, emitted: Emitted, committed_lens: torch.Tensor, bound: int) -> None:
        """The step's verdict: :meth:`set_pending`."""
        e = emitted
        self.set_pending(e.B, e.tokens, e.lengths, e.max_len, committed_lens, bound)

    def catch_up(self, emitted: Emitted) -> None:
        """The verdict of a step this drafter did not draft for: :meth:`queue`, or with
        ``defer`` the rows left stale."""
        e = emitted
        if self.defer:
            self._stale.update(range(e.B))
            return
        self.queue(e.B, e.tokens, e.lengths, e.max_len)

    def sync(self, active) -> None:
        """Feed the stale rows among ``active``'s what they missed (:meth:`resync`)."""
        if self._stale:
            rows = [b for b in range(len(active)) if b in self._stale]
            if rows:
                self.resync(rows, [active[b].prompt + active[b].generated for b in rows])
                self._stale.difference_update(rows)

    # -- bookkeeping ---------------------------------------------------------------
    def reset(self) -> None:
        self.cache.reset()
        self._stale.clear()
        self._pending_len.zero_()
        self._pending_max = 0

    def prefill(
        self, prompts: list[list[int]], start_row: int, first_tokens: torch.Tensor, hidden=None
    ) -> None:
        """Run ``prompts`` into rows ``start_row ..``; ``first_tokens [n]`` become pending
        (with ``defer``: the rows are emptied and left stale)."""
        if self.defer:
            self.cache.rows(start_row, len(prompts)).reset()
            self._stale.update(range(start_row, start_row + len(prompts)))
            return
        n, longest = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(n, longest, dtype=torch.int64)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=self.device)
        rows = self.cache.rows(start_row, n)
        rows.reset()
        self.model.prefill(
            ids.to(self.device),
            rows,
            lens,
            skip_layers=self.skip_layers,
            logits_index=(lens.long() - 1)[:, None],
        )
        self.cache.set_bound(max(self.cache.bound, longest))
        self._pending[start_row : start_row + n, 0] = first_tokens
        self._pending_len[start_row : start_row + n] = 1
        self._pending_max = max(self._pending_max, 1)

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)
        self._pending[dst] = self._pending[src]
        self._pending_len[dst] = self._pending_len[src]
        if src in self._stale:
            self._stale.add(dst)
        else:
            self._stale.discard(dst)

    def set_pending(
        self,
        B: int,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        max_len: int,
        committed_lens: torch.Tensor,
        bound: int,
        hidden=None,
    ) -> None:
        """After a verify step: rows ``< B`` keep ``committed_lens`` cached tokens (the
        target's pre-step length + 1: everything up to the old root) and queue
        ``tokens[:, :lengths]`` (the accepted drafts and the emitted token); drafts written
        past that are dropped. Invariant: ``lens + pending = target lens + 1``."""
        self.cache.lens[:B] = committed_lens.to(torch.int32)
        self.cache.set_bound(min(bound, self.cache.capacity))
        width = tokens.shape[1]
        self._pending[:B, :width] = tokens.clamp(min=0)
        if hidden is not None:  # an EAGLE draft's features, token by token
            self._pending_feat[:B, :width] = hidden[:, :width]
        self._pending_len[:B] = lengths
        self._pending_max = max_len

    def queue(
        self, B: int, tokens: torch.Tensor, lengths: torch.Tensor, max_len: int, hidden=None
    ) -> None:
        """After a verify step the draft did not draft for (prompt lookup): append
        ``tokens[:, :lengths]`` to the rows' pending tokens; the cache is unchanged. When
        the pending tokens would pass :attr:`PENDING_LIMIT`, they are fed first."""
        if self._pending_max + max_len > self.PENDING_LIMIT:
            self._root(B)  # feed the pending tokens now
            self._pending_len[:B] = 0
            self._pending_max = 0
        width = tokens.shape[1]
        j = torch.arange(width, device=self.device)
        # Entries past a row's length go to the last column, which pending tokens never
        # reach (they are fed at PENDING_LIMIT): a scatter without a host sync.
        scratch = self._pending.shape[1] - 1
        cols = torch.where(j < lengths[:, None], self._pending_len[:B, None] + j, scratch)
        rows = torch.arange(B, device=self.device)[:, None].expand(B, width)
        self._pending[rows, cols] = tokens.clamp(min=0)
        if hidden is not None:
            self._pending_feat[rows, cols] = hidden[:, :width]
        self._pending_len[:B] += lengths
        self._pending_max += max_len  # an upper bound of the rows' pending lengths

    def resync(self, rows: list[int], histories: list[list[int]]) -> None:
        """Bring up to date rows that sat out steps without being fed (``defer``): row
        ``rows[i]`` keeps its cached tokens, a prefix of ``histories[i]`` (the request's
        prompt and output, the root last). A row that missed at most
        :attr:`PENDING_LIMIT` tokens, the root included (a few steps of prompt lookup),
        gets them as its pending tokens, fed by the draft's next forward with its root,
        as if they had been queued step by step; a row that missed more (its prompt, a
        long stretch) is fed all but the root now, and the root is its one pending token.
        Each run of neighbouring rows is fed by one ragged prefill that continues the rows
        (one host read of the rows' lengths in all)."""
        lens = self.cache.lens.tolist()
        missed = {b: hist[lens[b] :] for b, hist in zip(rows, histories)}
        queued = [b for b in rows if len(missed[b]) <= self.PENDING_LIMIT]
        for b in queued:
            self._pending[b, : len(missed[b])] = torch.tensor(missed[b], dtype=torch.int64)
            self._pending_len[b] = len(missed[b])
            self._pending_max = max(self._pending_max, len(missed[b]))
        rest = [(b, hist) for b, hist in zip(rows, histories) if b not in queued]
        todo = {b: hist[lens[b] : -1] for b, hist in rest}
        fed = sorted(b for b, t in todo.items() if t)
        runs: list[list[int]] = []
        for b in fed:
            if runs and runs[-1][-1] == b - 1:
                runs[-1].append(b)
            else:
                runs.append([b])
        for run in runs:
            longest = max(len(todo[b]) for b in run)
            have = max(lens[b] for b in run)
            if have + longest > self.cache.capacity:  # padding would pass the capacity
                for b in run:
                    self._feed([b], {b: todo[b]}, lens[b], len(todo[b]))
            else:
                self._feed(run, todo, have, longest)
            self.cache.set_bound(max(self.cache.bound, max(lens[b] + len(todo[b]) for b in run)))
        for b, hist in rest:
            self._pending[b, 0] = hist[-1]
            self._pending_len[b] = 1
        self._pending_max = max(self._pending_max, 1)

    def _feed(self, run: list[int], todo: dict, have: int, longest: int) -> None:
        """Prefill ``todo[b]`` into the neighbouring rows ``run``, continuing each row;
        ``have``: their longest cached length, ``longest``: the longest ``todo``."""
        ids = torch.zeros(len(run), longest, dtype=torch.int64)
        for i, b in enumerate(run):
            ids[i, : len(todo[b])] = torch.tensor(todo[b], dtype=torch.int64)
        n = torch.tensor([len(todo[b]) for b in run], dtype=torch.int32, device=self.device)
        view = self.cache.rows(run[0], len(run))
        view.bound = have  # these rows' longest, not the whole cache's
        self.model.prefill(
            ids.to(self.device),
            view,
            n,
            skip_layers=self.skip_layers,
            logits_index=(n.long() - 1)[:, None],
        )

    def _root(self, B: int) -> torch.Tensor:
        """Feed the pending tokens; return the logits at the root ``[B, V]``. The pending
        state itself is left as it is (a CUDA graph of the draft loop replays this)."""
        P = self._pending_max
        last = (self._pending_len[:B] - 1)[:, None]
        logits = self._forward(self._pending[:B, :P], logits_index=last)
        self.cache.commit(self._pending_len[:B].to(torch.int32), P)
        return logits[:, 0]

    # -- proposals -----------------------------------------------------------------
    def propose_chain(
        self,
        B: int,
        k: int,
        params: SamplingParams | BatchParams,
        seed: torch.Tensor,
        offset: torch.Tensor,
        stopper=None,
    ) -> ChainProposal:
        """Draft ``k`` tokens per row autoregressively.

        Greedy params draft the argmax (one-hot q, ``probs`` None); otherwise each token is
        drawn from the warped draft distribution (``sample_draft`` with the rows' ``seed``
        and ``offset``), which is returned as ``probs``. A ``stopper`` (adaptive draft
        length) may end rows early; without one, the loop replays a CUDA graph when
        :attr:`graphs` is set.
        """
        # Graphs are keyed on the warp scalars: rows with mixed parameters run eagerly.
        if self.graphs is not None and stopper is None and getattr(params, "uniform", params):
            tokens, probs, raw = self._chain_graphed(B, k, params, seed, offset)
            return ChainProposal(
                tokens=tokens, probs=probs, logits=raw, num_drafted=None, max_drafted=k
            )
        toks, probs, raw, num = self._chain(B, k, params, seed, offset, stopper)
        n = len(toks)
        tokens = torch.stack(toks, 1)
        max_drafted = n
        if num is not None:
            max_drafted = int(num.max())  # host sync (adaptive mode only)
            # When no row drafts, the verify forward is a plain decode step (T = 1).
            tokens = tokens[:, :max_drafted]
            num = num.clamp(max=tokens.shape[1])
        return ChainProposal(
            tokens=tokens,
            probs=torch.stack(probs, 1)[:, : tokens.shape[1]] if probs else None,
            logits=torch.stack(raw, 1)[:, : tokens.shape[1]],
            num_drafted=num,
            max_drafted=max_drafted,
        )

    def _chain(
        self,
        B: int,
        k: int,
        params: SamplingParams | BatchParams,
        seed: torch.Tensor,
        offset: torch.Tensor,
        stopper=None,
    ):
        """The draft loop: lists of ``[B]`` tokens, ``[B, V]`` warped q (sampling only) and
        ``[B, V]`` raw logits per position, and the stopper's ``[B]`` counts (or None)."""
        logits = self._root(B)
        toks, probs, raw = [], [], []
        active = None
        num = None
        for i in range(k):
            raw.append(logits)
            if params.greedy:
                x = greedy_tokens(logits)
                q = None
            else:
                q = self._warp(logits, params)
                x = sample_draft(q, seed, offset, i)
                probs.append(q)
            toks.append(x)
            if stopper is not None:
                active = stopper.keep_going(logits, x, q, active)
                num = active.to(torch.int32) if num is None else num + active.to(torch.int32)
                # Deliberate host sync (adaptive mode only): stop when every row stopped.
                if not bool(active.any()):
                    break
            if i + 1 < k:
                logits = self._advance(x, B)
        return toks, probs, raw, num

    def _warp(self, logits: torch.Tensor, params: SamplingParams | BatchParams) -> torch.Tensor:
        """The warped draft distribution ``[B, V]`` of ``logits [B, V]``. A draft with a
        restricted head has ``-inf`` logits outside its kept columns, whose probability
        is 0 under any warp: on the CPU its columns alone are warped (8,192 of the chat
        draft's 49,152), the same distribution for a sixth of the work."""
        head = self.model.head_ids
        if head is None or logits.device.type != "cpu":
            return warp_probs(logits, params.temperature, params.top_k, params.top_p)
        q = warp_probs(logits.index_select(1, head), params.temperature, params.top_k, params.top_p)
        return logits.new_zeros(logits.shape, dtype=torch.float32).index_copy_(1, head, q)

    def _advance(self, x: torch.Tensor, B: int) -> torch.Tensor:
        """Feed the drafted tokens ``x [B]``; the draft's logits after them ``[B, V]``."""
        logits = self._forward(x[:, None])[:, 0]
        self.cache.commit(self._one[:B], 1)
        return logits

    def _chain_graphed(
        self,
        B: int,
        k: int,
        params: SamplingParams | BatchParams,
        seed: torch.Tensor,
        offset: torch.Tensor,
    ):
        """:meth:`_chain` replayed from a CUDA graph of the batch bucket (``osd.graphs``):
        ``tokens [B, k]``, ``probs [B, k, V]`` or None, ``logits [B, k, V]``."""
        cache = self.cache
        P = self._pending_max
        width = P + k - 1  # tokens the loop commits to the draft cache
        bound = cache.bound
        if bound + width > cache.capacity:  # the eager path raises the capacity error
            toks, probs, raw, _ = self._chain(B, k, params, seed, offset)
            return (
                torch.stack(toks, 1),
                torch.stack(probs, 1) if probs else None,
                torch.stack(raw, 1),
            )
        Bb = batch_bucket(B, cache.max_batch_size)
        warp = None if params.greedy else (params.temperature, params.top_k, params.top_p)

        def build():
            static = {
                "seed": torch.zeros(Bb, dtype=torch.int64, device=self.device),
                "offset": torch.zeros(Bb, dtype=torch.int64, device=self.device),
            }

            def body(s):
                toks, probs, raw, _ = self._chain(Bb, k, params, s["seed"], s["offset"])
                return (
                    torch.stack(toks, 1),
                    torch.stack(probs, 1) if probs else None,
                    torch.stack(raw, 1),
                )

            return static, body

        def fill(s):
            s["seed"][:B].copy_(seed)
            s["offset"][:B].copy_(offset)
            cache.lens[B:Bb].zero_()  # padding rows are free rows
            self._pending_len[B:Bb] = 1

        def host_state():
            saved = cache.bound
            cache.bound = cache.capacity - width  # capture with the widest key range
            return lambda: setattr(cache, "bound", saved)

        # The step reads these after the verify graph replays: they live outside the pool.
        tokens, probs, raw = self.graphs.run(
            ("chain", id(self), Bb, P, k, warp),
            build,
            fill,
            state=(cache.lens,),
            host_state=host_state,
            own_outputs=True,
        )
        cache.bound = min(bound + width, cache.capacity)  # what the eager commits add
        return tokens[:B], None if probs is None else probs[:B], raw[:B]

    def propose_tree(self, B: int, tree, root_tokens: torch.Tensor) -> TreeProposal:
        """Expand a token tree from the draft's top-ranked children (deterministic)."""
        logits = self._root(B)
        if isinstance(tree, StaticTree):
            return self._static_tree(B, tree, root_tokens, logits)
        return self._dynamic_tree(B, tree, root_tokens, logits)

    def _forward_nodes(self, tokens, parents, depths, upto: int, at: torch.Tensor):
        """Logits of nodes ``at [B, m]`` after a forward over nodes ``1..upto-1`` (root in
        the cache, not re-fed)."""
        mask = mask_with_roots(parents[:, 1:upto] - 1)  # the root's children become roots
        logits = self._forward(
            tokens[:, 1:upto], tree_mask=mask, depths=depths[:, 1:upto] - 1, logits_index=at - 1
        )
        return logits

    def _tree_consts(self, tree: StaticTree):
        """The tree's parents, depths and, per level, the nodes whose children follow, as
        device tensors made once (no host-to-device copy per step)."""
        consts = self.__dict__.setdefault("_static_tree_consts", {})
        if id(tree) not in consts:
            dev, levels = self.device, tree.levels()
            at = {}
            for d in range(1, len(levels) - 1):
                parents_next = {tree.parents[n] for n in levels[d + 1]}
                need = sorted(n for n in levels[d] if n in parents_next)
                at[d] = (need, torch.tensor(need, dtype=torch.int64, device=dev))
            consts[id(tree)] = (
                tree,
                torch.tensor(tree.parents, dtype=torch.int32, device=dev),
                torch.tensor(tree.depths, dtype=torch.int64, device=dev),
                at,
            )
        return consts[id(tree)][1:]

    def _static_tree(self, B, tree: StaticTree, root_tokens, root_logits) -> TreeProposal:
        T = tree.num_nodes
        dev = self.device
        parents, depths, level_at = self._tree_consts(tree)
        parents, depths = parents.expand(B, T), depths.expand(B, T)
        tokens = torch.zeros(B, T, dtype=torch.int64, device=dev)
        tokens[:, 0] = root_tokens
        dist = {0: root_logits}  # node -> logits over its children
        levels = tree.levels()
        for d in range(1, len(levels)):
            for node in levels[d]:
                par = tree.parents[node]
                rank = tree.ranks[node]
                top = torch.topk(dist[par], rank + 1, dim=-1).indices
                tokens[:, node] = top[:, rank]
            if d + 1 < len(levels):
                need, at = level_at[d]
                upto = max(levels[d]) + 1
                at = at.expand(B, len(need))
                logits = self._forward_nodes(tokens, parents, depths, upto, at)
                for j, n in enumerate(need):
                    dist[n] = logits[:, j]
        return TreeProposal(
            tokens,
            parents.contiguous(),
            depths.contiguous(),
            mask_from_parents(parents),
            tree.max_depth,
        )

    def _dynamic_tree(self, B, tree: DynamicTree, root_tokens, root_logits) -> TreeProposal:
        dev = self.device
        k = tree.topk
        # Expansion buffers (root + k nodes per level), filled level by level.
        n_exp = 1 + k * tree.depth
        tokens = torch.zeros(B, n_exp, dtype=torch.int64, device=dev)
        parents = torch.full((B, n_exp), -1, dtype=torch.int64, device=dev)
        depths = torch.zeros(B, n_exp, dtype=torch.int64, device=dev)
        score = torch.full((B, n_exp), float("-inf"), device=dev)
        tokens[:, 0] = root_tokens
        score[:, 0] = 0.0
        logp = torch.log_softmax(root_logits.float(), -1)
        cand = torch.topk(logp, k, dim=-1)
        tokens[:, 1 : 1 + k] = cand.indices
        parents[:, 1 : 1 + k] = 0
        depths[:, 1 : 1 + k] = 1
        score[:, 1 : 1 + k] = cand.values
        for d in range(1, tree.depth):
            lo, hi = 1 + k * (d - 1), 1 + k * d  # the level-d frontier
            at = torch.arange(lo, hi, device=dev).expand(B, k)
            logits = self._forward_nodes(tokens, parents.to(torch.int32), depths, hi, at)
            logp = torch.log_softmax(logits.float(), -1) + score[:, lo:hi, None]  # [B, k, V]
            best = torch.topk(logp.reshape(B, -1), k, dim=-1)
            V = logp.shape[-1]
            tokens[:, hi : hi + k] = best.indices % V
            parents[:, hi : hi + k] = lo + best.indices // V
            depths[:, hi : hi + k] = d + 1
            score[:, hi : hi + k] = best.values
        # Keep the best max_nodes by path log-probability; a parent scores at least as
        # high as its children and ties favour the shallower node, so the kept set is
        # closed under ancestors. Keep expansion order (parents before children).
        keep_n = min(tree.max_nodes, n_exp - 1)
        rank_key = score[:, 1:] - 1e-6 * depths[:, 1:].float()
        kept = torch.topk(rank_key, keep_n, dim=-1).indices.sort(-1).values + 1  # [B, keep]
        kept = torch.cat([torch.zeros(B, 1, dtype=torch.int64, device=dev), kept], 1)
        remap = torch.full((B, n_exp), -1, dtype=torch.int64, device=dev)
        remap.scatter_(1, kept, torch.arange(keep_n + 1, device=dev).expand(B, -1))
        new_tokens = tokens.gather(1, kept)
        old_par = parents.gather(1, kept)
        new_par = torch.where(old_par >= 0, remap.gather(1, old_par.clamp(min=0)), old_par)
        new_par = new_par.to(torch.int32)
        return TreeProposal(
            new_tokens,
            new_par,
            depths_from_parents(new_par),
            mask_from_parents(new_par),
            tree.depth,
        )


def mask_with_roots(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor bitmask for a forest: nodes with parent -1 are roots of their own."""
    T = parents.shape[-1]
    mask = torch.zeros(parents.shape, dtype=torch.int64, device=parents.device)
    par = parents.to(torch.int64)
    one = torch.ones((), dtype=torch.int64, device=parents.device)
    for i in range(T):
        own = torch.bitwise_left_shift(one, i)
        up = mask.gather(-1, par[..., i : i + 1].clamp(min=0))[..., 0]
        mask[..., i] = torch.where(par[..., i] >= 0, up | own, own)
    return mask


__all__ = [
    "DRAFT_KEY",
    "ChainProposal",
    "Drafter",
    "Emitted",
    "ModelDrafter",
    "PENDING_WIDTH",
    "TreeProposal",
    "mask_with_roots",
    "sample_draft",
]
