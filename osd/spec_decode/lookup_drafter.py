"""Prompt lookup as a drafter (``osd.spec_decode.proposals`` has the protocol):
:class:`NGramDrafter` alone, :class:`LookupDrafter` in front of a model drafter, and the
proposals they build from a row's matches (:func:`lookup_tree`, :func:`overlay_lookup`)."""

from __future__ import annotations

import torch

from osd.graphs import StepGraphs
from osd.models.llama import DecoderLM
from osd.sampling import SamplingParams
from osd.spec_decode.lookup_history import LookupHistory
from osd.spec_decode.lookup_lengths import LookupRecord, batch_reach, explores
from osd.spec_decode.model_drafter import ModelDrafter
from osd.spec_decode.ngram_index import NGramIndex
from osd.spec_decode.proposals import (
    FROM_LOOKUP,
    FROM_MODEL,
    ChainProposal,
    Emitted,
    TreeProposal,
    origin_rows,
)

# A lookup tree's model branch is drafted greedily (point masses) whatever the sampling.
GREEDY = SamplingParams(1)


class NGramDrafter:
    """Prompt lookup: propose what followed the latest earlier match of the context's
    suffix (longest suffix first, ``ngram_max`` down to ``ngram_min`` tokens), in the
    row's own text and then, at each length, in the engine's ``history`` of finished
    requests (:class:`~osd.spec_decode.lookup_history.LookupHistory`) when it has one. With
    ``min_reach > 0`` a row drafts only as much of its continuation as its request's record
    of earlier lookup drafts says is likely to be accepted
    (:mod:`osd.spec_decode.lookup_lengths`); that record lives on the request, so the
    drafter keeps no per-row state: the row bookkeeping of the protocol does nothing."""

    has_model = False
    needs_hidden = False
    model = None

    def __init__(
        self,
        ngram_min: int,
        ngram_max: int,
        history: LookupHistory | None = None,
        min_reach: float = 0.0,
    ):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.history = history
        self.min_reach = min_reach
        self._vetted = None  # the rows idle() found may draft, until the next propose

    def prefill(self, prompts, start_row: int, first_tokens: torch.Tensor, hidden=None) -> None:
        pass

    def move_row(self, src: int, dst: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def use_graphs(self, graphs) -> None:
        pass

    def after_verify(self, emitted: Emitted, committed_lens: torch.Tensor, bound: int) -> None:
        pass

    def catch_up(self, emitted: Emitted) -> None:
        pass

    def propose(
        self,
        active,
        roots,
        params,
        seed,
        offset,
        *,
        k: int = 0,
        tree=None,
        stopper=None,
        found: list[tuple[int, list[int]]] | None = None,
    ) -> ChainProposal:
        """Up to ``k`` drafts per row from each request's prompt and output (``found``:
        the rows' :meth:`matches`, when the caller has them)."""
        if tree is not None:
            raise ValueError("prompt lookup drafts chains, not trees")
        batched = batch_reach(self.min_reach, len(active))
        vetted, self._vetted = self._vetted is active, None
        if (
            found is None
            and self.min_reach > 0.0
            and not vetted
            and not self._may_draft(active, batched)
        ):
            # no row's record clears the bar whatever it matches (a batch's bar is high):
            # the step drafts nothing, so the search of every row's context is skipped
            return self.chain([[] for _ in active], k, roots.device)
        histories = [r.prompt + r.generated for r in active]
        if found is None:
            found = self.matches(histories, k, active)
        return self.chain(self.worth_drafting(active, histories, found), k, roots.device)

    def worth_drafting(
        self, active, histories: list[list[int]], found: list[tuple[int, list[int]]]
    ) -> list[list[int]]:
        """Each row's drafts from its match ``found`` (:meth:`matches`): as much of the
        continuation as its request's record makes worth a verify row under the batch's
        bar (all of it without ``min_reach``), noted on the record as this step's drafts."""
        if self.min_reach <= 0.0:
            return [cont for _, cont in found]
        batched = batch_reach(self.min_reach, len(active))
        lengths = []
        for r, hist, (n, cont) in zip(active, histories, found):
            record = r.lookup_record
            if record is None:
                record = r.lookup_record = LookupRecord()
            record.settle(hist)
            length = record.length(n, len(cont), batched)
            if explores(r.spec_steps, len(active)):  # one position past the bar's length
                length = min(length + 1, len(cont))
            lengths.append(length)
        # The verify forward is [B, 1 + the longest chain]: a row's positions up to that
        # length are computed whether it drafts them or not, so every row drafts as much of
        # its continuation as fits there, at no cost to the step.
        top = max(lengths, default=0)
        conts = []
        for r, hist, (n, cont), length in zip(active, histories, found, lengths):
            cont = cont[: max(length, min(top, len(cont)))]
            r.lookup_record.propose(n, cont, len(hist))
            conts.append(cont)
        return conts

    def idle(self, active, k: int) -> bool:
        """Whether :meth:`propose` with chains of ``k`` would draft nothing for any row
        whatever the rows match (``k = 0``, or no row's record clears the batch's bar and
        none explores), leaving the records as that call would. The speculator then runs
        a plain step; this drafter keeps no rows to catch up."""
        if k == 0:
            return True
        if self.min_reach <= 0.0:
            return False
        if self._may_draft(active, batch_reach(self.min_reach, len(active))):
            self._vetted = active  # the step's propose need not ask again
            return False
        return True

    @staticmethod
    def _may_draft(active, batched: float) -> bool:
        """Whether any row could draft under the bar ``batched``: it explores this step,
        or its record (its pending drafts settled first) clears the bar for some match.
        False means :meth:`propose` would draft nothing whatever the rows matched (and
        leave every record as this leaves it: pending drafts settled, none new)."""
        for r in active:
            if explores(r.spec_steps, len(active)):
                return True
            record = r.lookup_record
            if record is None:
                record = r.lookup_record = LookupRecord()
            if record.pending is not None:
                record.settle(r.prompt + r.generated)
            if record.may_draft(batched):
                return True
        return False

    def propose_chain(self, histories: list[list[int]], k: int, device) -> ChainProposal:
        """Up to ``k`` drafts per row from ``histories`` (each row's prompt + output)."""
        return self.chain(self.continuations(histories, k), k, device)

    def continuations(self, histories: list[list[int]], k: int) -> list[list[int]]:
        """Each row's lookup continuation (up to ``k`` tokens; [] without a match)."""
        return [self.lookup(hist, k) for hist in histories]

    def matches(
        self, histories: list[list[int]], k: int, requests=None
    ) -> list[tuple[int, list[int]]]:
        """Each row's ``(suffix length matched, continuation)``; ``(0, [])`` without one.
        ``requests``: the rows' requests, whose n-gram indexes (kept on each request as its
        text grows) replace the search of every row's context."""
        if requests is None:
            return [self.lookup_match(hist, k) for hist in histories]
        return [
            self.lookup_match(hist, k, self.index_of(r)) for r, hist in zip(requests, histories)
        ]

    def index_of(self, request) -> NGramIndex:
        """``request``'s n-gram index for this drafter's lengths (made on first use)."""
        index = request.ngram_index
        if index is None or (index.ngram_min, index.ngram_max) != (self.ngram_min, self.ngram_max):
            index = request.ngram_index = NGramIndex(self.ngram_min, self.ngram_max)
        return index

    @staticmethod
    def chain(conts: list[list[int]], k: int, device) -> ChainProposal:
        """The lookup chain of continuations ``conts`` (one list per row)."""
        B = len(conts)
        conts = [c[:k] for c in conts]
        max_drafted = max(map(len, conts), default=0)
        # one tensor from host lists (a per-row copy costs a few op calls a row)
        padded = [c + [0] * (max_drafted - len(c)) for c in conts]
        tokens = torch.tensor(padded, dtype=torch.int64).reshape(B, max_drafted)
        num = torch.tensor([len(c) for c in conts], dtype=torch.int32)
        return ChainProposal(
            tokens.to(device),
            None,
            None,
            num.to(device),
            max_drafted,
            origin=origin_rows([FROM_LOOKUP if c else 0 for c in conts], device),
        )

    def lookup(self, hist: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of a suffix: the
        longest suffix with a match, in ``hist`` itself before the history."""
        return self.lookup_match(hist, k)[1]

    def lookup_match(
        self, hist: list[int], k: int, index: NGramIndex | None = None
    ) -> tuple[int, list[int]]:
        """:meth:`lookup` with the length of the suffix it matched: ``(n, continuation)``,
        ``(0, [])`` when no suffix of ``ngram_min`` or more tokens has a continuation.
        ``index``: the n-grams of ``hist``'s earlier steps (a request's
        :class:`~osd.spec_decode.ngram_index.NGramIndex`, same lengths), which turns the
        search of the context into dict probes; the answer is the same."""
        L = len(hist)
        seq = None if index is not None else torch.tensor(hist, dtype=torch.int64)
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if L < n:
                continue
            if L > n:
                if index is not None:
                    found = index.start(hist, n)
                    if found is not None:
                        return n, hist[found + n : found + n + k]
                else:
                    windows = seq[: L - 1].unfold(0, n, 1)  # starts 0 .. L-1-n
                    hits = (windows == seq[L - n :]).all(1).nonzero()
                    if hits.numel():
                        start = int(hits[-1]) + n
                        return n, seq[start : start + k].tolist()
            if self.history is not None:
                cont = self.history.lookup(hist[L - n :], k)
                if cont:
                    return n, cont
        return 0, []


class LookupDrafter:
    """Prompt lookup in front of a :class:`ModelDrafter`: when every row's context has a
    match worth drafting, its continuation (up to ``max(k, lookup_tokens)`` tokens, cut by
    the request's record when the lookup has ``min_reach``) is the chain (no draft
    forward); otherwise the model drafts, and in a chain step the rows that have lookup
    drafts still verify those in place of the model's drafts (a one-hot q when
    sampling). The model's cache catches up on the tokens accepted meanwhile
    (:meth:`ModelDrafter.queue`); after a model step every row's cache keeps its pre-step
    tokens and queues what was accepted (:meth:`ModelDrafter.set_pending`), whichever
    drafts a row verified.

    With ``tree_below = m`` (``SpecConfig.lookup_tree_below``) a match of at least ``m``
    tokens drafts alone; when every row has one the step is lookup's, as above.
    Otherwise the draft model drafts a greedy chain of ``k`` and every step is a tree
    (:func:`lookup_tree`): a row with a long match verifies its lookup chain, any other
    row its lookup continuation (as long as it would draft alone, or none) and the
    model's chain as two branches. A short match is often wrong where the model is right,
    and the other way round, and one verify forward tries both; where the match is right,
    its branch runs as far as a lookup step's would.

    Under ``SpecConfig.auto_k`` (arm 0: lookup alone) the model drafter defers
    (``ModelDrafter(defer=True)``): it is not fed while it does not draft, and each row
    that sat out steps is fed what it missed, from the request's text, when the model
    next drafts for it (:meth:`ModelDrafter.resync`). While lookup alone serves, the model
    costs nothing; a request that ends before the model drafts is never fed at all. (An
    EAGLE drafter, which reads the target's features, is always fed.)
    """

    has_model = True

    def __init__(
        self,
        inner: ModelDrafter,
        lookup: NGramDrafter,
        lookup_tokens: int = 0,
        tree_below: int = 0,
    ):
        self.inner = inner
        self.lookup = lookup
        self.lookup_tokens = lookup_tokens  # most drafts of an all-lookup step (0: k)
        self.tree_below = tree_below  # shorter matches verify beside the model's chain
        self._looked_up = False  # the last proposal came from lookup
        # every row of the last step had a match long enough to draft alone: lookup
        # drafted it whatever the chain length asked (auto_k learns nothing from it)
        self.lookup_decided = False

    @property
    def model(self) -> DecoderLM:
        return self.inner.model

    @property
    def needs_hidden(self) -> bool:
        return self.inner.needs_hidden

    def prefill(self, prompts, start_row: int, first_tokens: torch.Tensor, hidden=None) -> None:
        self.inner.prefill(prompts, start_row, first_tokens, hidden)

    def move_row(self, src: int, dst: int) -> None:
        self.inner.move_row(src, dst)

    def reset(self) -> None:
        self.inner.reset()

    def use_graphs(self, graphs: StepGraphs | None) -> None:
        self.inner.use_graphs(graphs)

    def propose(self, active, roots, params, seed, offset, *, k: int = 0, tree=None, stopper=None):
        width = max(k, self.lookup_tokens)
        histories = [r.prompt + r.generated for r in active]
        found = self.lookup.matches(histories, width, active)
        if self._gated(tree, stopper):
            return self._propose_gated(
                active,
                roots,
                params,
                seed,
                offset,
                k,
                self.lookup.worth_drafting(active, histories, found),
            )
        conts = [cont for _, cont in found]
        self._looked_up = all(n >= max(self.tree_below, 1) for n, _ in found)
        self.lookup_decided = self._looked_up
        if self._looked_up:
            return self.lookup.chain(conts, width, roots.device)
        self.inner.sync(active)
        if self.tree_below and tree is None and stopper is None:
            # Per row, whatever its neighbours: a long match drafts alone (the lookup
            # chain), any other row gets both branches, so a request's drafts (and its
            # seeded samples) do not depend on the batch it runs in.
            alone = [n >= self.tree_below for n, _ in found]
            chain = self.inner.propose(active, roots, GREEDY, seed, offset, k=k)
            return lookup_tree(roots, chain, conts, [not a for a in alone])
        prop = self.inner.propose(
            active, roots, params, seed, offset, k=k, tree=tree, stopper=stopper
        )
        # A stopper calibrates on the model's own drafts: its steps stay the model's.
        if tree is None and stopper is None and any(conts):
            prop = overlay_lookup(prop, conts)
        return prop

    def _gated(self, tree, stopper) -> bool:
        """Whether a chain step drafts the model only where lookup, as far as the rows'
        records make it worth (``min_reach > 0``), drafts nothing: a chain without a
        lookup tree, a static tree or a stopper."""
        return (
            self.lookup.min_reach > 0.0 and not self.tree_below and tree is None and stopper is None
        )

    def _propose_gated(self, active, roots, params, seed, offset, k, conts) -> ChainProposal:
        """A chain step whose rows' lookup drafts ``conts`` (already cut by their records):
        lookup's alone when every row has some, as :meth:`propose_lookup` drafts them;
        otherwise the model's chain of ``k``, the rows with lookup drafts verifying those
        instead (cut to ``k``). Where lookup drafts, the step is what prompt lookup alone
        would make it, so ``auto_k`` measures its chain lengths on the other steps only
        (``lookup_decided``): the model against a plain step, where it has no lookup
        draft to compete with."""
        self._looked_up = self.lookup_decided = all(conts)
        if self._looked_up:
            return self.lookup.chain(conts, max(k, self.lookup_tokens), roots.device)
        self.inner.sync(active)
        prop = self.inner.propose(active, roots, params, seed, offset, k=k)
        return overlay_lookup(prop, conts) if any(conts) else prop

    def propose_lookup(self, active, roots, params, seed, offset, *, k: int) -> ChainProposal:
        """Prompt lookup alone, the draft model idle (``SpecConfig.auto_k``'s arm 0): each
        row's continuation, up to ``max(k, lookup_tokens)`` drafts, as far as its
        request's record makes worth it (the n-gram drafter's ``min_reach``); a row
        without a match drafts nothing. The model catches up on what was accepted."""
        self._looked_up = True
        width = max(k, self.lookup_tokens)
        histories = [r.prompt + r.generated for r in active]
        found = self.lookup.matches(histories, width, active)
        conts = self.lookup.worth_drafting(active, histories, found)
        self.lookup_decided = (
            all(conts)  # a gated chain step would have drafted these alone
            if self._gated(None, None)
            else all(n >= max(self.tree_below, 1) for n, _ in found)
        )
        return self.lookup.chain(conts, width, roots.device)

    @property
    def lookup_only(self) -> bool:
        """The last proposal was prompt lookup's alone: the model neither drafted nor was
        fed, and catches up on the step's tokens (:meth:`catch_up`)."""
        return self._looked_up

    def after_verify(self, emitted: Emitted, committed_lens: torch.Tensor, bound: int) -> None:
        if self._looked_up:
            self.catch_up(emitted)
        else:
            self.inner.after_verify(emitted, committed_lens, bound)

    def catch_up(self, emitted: Emitted) -> None:
        self.inner.catch_up(emitted)


def lookup_tree(
    roots: torch.Tensor, chain: ChainProposal, conts: list[list[int]], model_rows: list[bool]
) -> TreeProposal:
    """One tree per row below its root ``roots[b]``: the lookup continuation ``conts[b]``
    (a chain, possibly empty) and, on the rows of ``model_rows``, the draft model's greedy
    ``chain`` (``tokens [B, k]``), sharing their common prefix. Every draft is a point
    mass, so the tree verifier's deterministic-children rule keeps sampling lossless.

    Rows with fewer nodes than the widest are padded with children of the root that
    repeat node 1's token: the verifier never follows them (an earlier sibling carries
    the same token, tried first, and a repeated token counts once)."""
    B, k = chain.tokens.shape
    drafted = chain.tokens.tolist()
    all_tokens, all_parents, all_nodes = [], [], []
    for b in range(B):
        cont = conts[b]
        tokens = [0] + list(cont)  # node 0: the root
        parents = list(range(-1, len(cont)))  # the lookup branch is a chain
        nodes = [0] * k  # no model branch: α skips the row
        if model_rows[b]:
            prev, shared = 0, True
            for j, t in enumerate(drafted[b]):
                shared = shared and j < len(cont) and cont[j] == t
                if not shared:
                    tokens.append(t)
                    parents.append(prev)
                prev = nodes[j] = j + 1 if shared else len(tokens) - 1
        all_tokens.append(tokens)
        all_parents.append(parents)
        all_nodes.append(nodes)
    T = max(len(t) for t in all_tokens)
    depths, masks = [], []
    for tokens, parents in zip(all_tokens, all_parents):
        pad = T - len(tokens)
        tokens += [tokens[1]] * pad
        parents += [0] * pad
        # depths and ancestor bitmasks from the host lists (parents precede children)
        depth, mask = [0], [1]
        for i in range(1, T):
            depth.append(depth[parents[i]] + 1)
            mask.append(mask[parents[i]] | 1 << i)
        depths.append(depth)
        masks.append([m - (1 << 64) if m >> 63 else m for m in mask])  # as int64
    dev = roots.device
    tokens = torch.tensor(all_tokens, dtype=torch.int64).to(dev)
    tokens[:, 0] = roots
    return TreeProposal(
        tokens,
        torch.tensor(all_parents, dtype=torch.int32).to(dev),
        torch.tensor(depths, dtype=torch.int64).to(dev),
        torch.tensor(masks, dtype=torch.int64).to(dev),
        max(k, max(len(c) for c in conts)),
        draft_nodes=torch.tensor(all_nodes, dtype=torch.int64).to(dev),
        draft_logits=chain.logits,
        origin=origin_rows(
            [FROM_LOOKUP * bool(c) | FROM_MODEL * bool(m) for c, m in zip(conts, model_rows)], dev
        ),
    )


def overlay_lookup(prop: ChainProposal, conts: list[list[int]]) -> ChainProposal:
    """The model's chain ``prop`` with each row that has a lookup continuation in
    ``conts`` drafting that instead (cut to the chain's width). Sampling proposals get a
    one-hot q on those rows, which the verifier treats as it treats lookup drafts."""
    B, width = prop.tokens.shape
    if width == 0:
        return prop
    device = prop.tokens.device
    tokens = prop.tokens.clone()
    num = (
        torch.full((B,), width, dtype=torch.int32, device=device)
        if prop.num_drafted is None
        else prop.num_drafted.clone()
    )
    probs = None if prop.probs is None else prop.probs.clone()
    rows = [bool(c) for c in conts]
    for b, cont in enumerate(conts):
        if not cont:
            continue
        cont = torch.tensor(cont[:width], dtype=torch.int64, device=device)
        n = cont.numel()
        tokens[b, :n] = cont
        num[b] = n
        if probs is not None:
            probs[b, :n] = 0
            probs[b, torch.arange(n, device=device), cont] = 1
    origin = origin_rows([FROM_LOOKUP if r else FROM_MODEL for r in rows], device)
    return ChainProposal(tokens, probs, prop.logits, num, width, origin=origin)
