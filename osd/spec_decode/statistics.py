"""The speculative step's statistics, computed by a step listener.

:class:`StepStatistics` is the first listener of every ``Speculator``. Before the step's
one read-back it adds its device columns (each row's exact α: ``1 - TV(p, q)`` summed over
the positions the draft model drafted), so they ride the same host sync as the accepted
counts; from the :class:`~osd.spec_decode.step.Verdict` it then updates each request's
``spec_stats`` and the speculator's :class:`~osd.stats.SpecStats`. Where a row's drafts
came from is the proposal's ``origin`` bits (``osd.spec_decode.proposals``), read back as
the verdict's ``"origin"`` column.
"""

from __future__ import annotations

import torch

from osd.sampling import BatchParams
from osd.stats import SpecStats
from osd.spec_decode.proposals import FROM_LOOKUP, FROM_MODEL, ChainProposal
from osd_kernels.warp import warp_probs


class StepStatistics:
    """Per-request and per-speculator statistics of each verdict (a step listener).

    Args:
        stats: the speculator's totals, updated in place.
        drafter: the speculator's drafter (its draft model's reduced head, if any, bounds
            the α sums).
        exact_alpha: measure α (``SpecConfig.exact_alpha``).
    """

    prompt_positions = 0

    def __init__(self, stats: SpecStats, drafter, exact_alpha: bool):
        self.stats = stats
        self.drafter = drafter
        self.exact_alpha = exact_alpha

    def before_step(self) -> None:
        pass

    def on_prefill(self, requests, prompt_logits, prompt_hidden) -> None:
        self.stats.requests += len(requests)
        for r in requests:
            r.spec_stats = SpecStats(requests=1)

    def device_columns(self, prop, logits: torch.Tensor, params: BatchParams) -> dict:
        """``{"alpha": [B]}`` where the draft model drafted, else ``{}``."""
        alpha = self._alpha_rows(prop, logits, params) if self.exact_alpha else None
        return {} if alpha is None else {"alpha": alpha}

    def on_verdict(self, v) -> None:
        B = len(v.active)
        origin = v.columns.get("origin")
        bits = [FROM_MODEL] * B if origin is None else [int(o) for o in origin]
        alpha = v.columns.get("alpha")
        if alpha is not None:
            for b, r in enumerate(v.active):
                n = self._alpha_count(v, b, bits[b])
                if n and r.finish_reason != "error":
                    r.spec_stats.add_alpha(alpha[b], n)
                    self.stats.add_alpha(alpha[b], n)
        for b, r in enumerate(v.active):
            r.spec_stats.add_step([v.drafted[b]], [min(v.accepted[b], v.emitted[b])], v.emitted[b])
            r.spec_stats.lookup_steps += bool(bits[b] & FROM_LOOKUP)
        self.stats.add_step(v.drafted, v.accepted, sum(v.emitted))
        # a step counts as prompt lookup's when no row's drafts are the draft model's
        self.stats.lookup_steps += bool(B) and all(
            o & FROM_LOOKUP and not o & FROM_MODEL for o in bits
        )

    @staticmethod
    def _alpha_count(v, b: int, bits: int) -> int:
        """The positions row ``b``'s α sums over (the host twin of :meth:`_alpha_rows`)."""
        if not bits & FROM_MODEL:
            return 0
        if isinstance(v.proposal, ChainProposal):
            return 0 if bits & FROM_LOOKUP else v.drafted[b]
        return v.proposal.draft_nodes.shape[1]

    def _alpha_rows(self, prop, logits: torch.Tensor, params: BatchParams):
        """Exact 1 - TV(p, q) summed per row over the positions the draft model drafted,
        as a ``[B]`` device tensor, or None where nothing is measured: a chain of the draft
        model (rows whose drafts are lookup's count 0 positions), or the draft model's chain
        inside a lookup tree (the target's distribution at each drafted token's parent node
        against the draft's)."""
        V = logits.shape[-1]
        if isinstance(prop, ChainProposal):
            if prop.logits is None:  # prompt lookup's or a plain step
                return None
            model_rows = None if prop.origin is None else (prop.origin == FROM_MODEL)
            B, K = prop.tokens.shape
            p_logits = logits[:, :K].reshape(-1, V)
            q = None if params.greedy else prop.probs.reshape(p_logits.shape).float()
            counts = (
                prop.num_drafted
                if prop.num_drafted is not None
                else torch.full((B,), K, device=logits.device)
            )
            if model_rows is not None:
                counts = counts * model_rows
            return self._alpha_sums(p_logits, prop.logits, q, K, counts, params)
        if prop.draft_logits is None:
            return None
        B, K = prop.draft_nodes.shape
        parents = torch.cat([prop.draft_nodes.new_zeros(B, 1), prop.draft_nodes[:, :-1]], 1)
        p_logits = logits.gather(1, parents[..., None].expand(B, K, V)).reshape(B * K, V)
        q = (
            None
            if params.greedy
            else warp_probs(prop.draft_logits.reshape(B * K, V), *params.repeat(K))
        )
        counts = torch.full((B,), K, device=logits.device)
        if prop.origin is not None:
            counts = counts * (prop.origin & FROM_MODEL).bool()
        return self._alpha_sums(p_logits, prop.draft_logits, q, K, counts, params)

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
