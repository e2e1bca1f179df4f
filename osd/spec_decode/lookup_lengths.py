"""How many of a prompt-lookup continuation to draft: each request's own record of how
its lookup drafts fared.

A continuation's first tokens are right far more often than its later ones, and a match
of one token is wrong far more often than a match of three; on text that does not repeat
(new explanations, code written afresh) most drafts are wrong. Each drafted token costs a
row of the verify forward, which on a CPU at batch 1 is compute bound past a few rows (a
step verifying 4 drafts costs about 1.5 plain steps there), so drafting all of every
continuation can make speculation slower than plain decoding.

:class:`LookupRecord` keeps, per request, per matched suffix length ``n`` and draft
position ``i``, how often position ``i`` was reached (every draft before it accepted)
and how often it was then accepted, with a prior of ``PRIOR_ACCEPTED`` in ``PRIOR_REACHED``.
A continuation is drafted up to the last position whose estimated chance of being reached
and accepted, the product of the positions' rates, is at least ``min_reach``: the share of
a step that one more verify row costs, below which the row costs more than it is expected
to give. The outcome of a step's drafts is read from the request's tokens at its next
proposal (the emitted tokens start with the accepted drafts; a rejected one-hot draft is
never resampled, so the first differing token marks the rejection), without a device
read. The record is the request's own.

In a batch the bar rises (:func:`batch_reach`): each draft then costs a row of a forward
that the whole batch waits for. The forward is ``[B, 1 + the longest chain]``, though, so
once one row drafts that far every row drafts as much of its continuation as fits there
(:meth:`~osd.spec_decode.lookup_drafter.NGramDrafter.propose`): those positions are
computed anyway. A request's drafts then depend on the size of the batch it
runs in (its output does not: greedy tokens stay the target's, sampled ones its
distribution, but a fixed seed's samples can differ between batch sizes, as with
``auto_k``). So that a record keeps learning under a bar its prior does not clear, a
request's steps now and then draft one position past the bar's length: every
``EXPLORE_EVERY``-th step alone, less often in a batch (:func:`explores`), where such a row
costs the whole batch a step's share and, past a kernel's rows a pass, a second pass over
the weights. Under a bar that no row's record clears for any match (a batch's, usually)
and in a step where no row explores, nothing would be drafted whatever the rows matched,
so the drafter skips the search of their contexts (:meth:`LookupRecord.may_draft`).
"""

from __future__ import annotations

PRIOR_ACCEPTED = 2.0
PRIOR_REACHED = 3.0
MAX_REACH = 0.9  # the bar never rises past this
EXPLORE_EVERY = 16  # alone, a request's every 16th step drafts one position past the bar


def explores(step: int, batch: int) -> bool:
    """Whether a request's ``step``-th speculative step explores, in a step of ``batch``
    rows: every ``EXPLORE_EVERY * batch``-th step."""
    return step % (EXPLORE_EVERY * max(1, batch)) == 0


def batch_reach(min_reach: float, batch: int) -> float:
    """The bar for a step of ``batch`` rows: ``min_reach`` scaled by the batch, at most
    ``MAX_REACH``. A drafted token adds a verify row to the step of every row in the
    batch; once the step's rows make its forward compute bound, a row costs about a
    ``batch``-th of the step that ``batch`` tokens share, so a draft pays only when it is
    ``batch`` times as likely to be accepted as it must be alone."""
    return min(MAX_REACH, min_reach * batch) if min_reach > 0.0 else 0.0


class LookupRecord:
    """One request's record of its lookup drafts (see the module docstring)."""

    __slots__ = ("reached", "accepted", "pending")

    def __init__(self) -> None:
        self.reached: dict[int, list[float]] = {}  # suffix length -> per draft position
        self.accepted: dict[int, list[float]] = {}
        self.pending: tuple[int, list[int], int] | None = None  # (n, drafts, tokens then)

    def _rows(self, n: int, length: int) -> tuple[list[float], list[float]]:
        reached = self.reached.setdefault(n, [])
        accepted = self.accepted.setdefault(n, [])
        while len(reached) < length:
            reached.append(PRIOR_REACHED)
            accepted.append(PRIOR_ACCEPTED)
        return reached, accepted

    def settle(self, tokens: list[int]) -> None:
        """Count the pending drafts' outcome from the request's ``tokens`` (prompt and
        output) as they are now; nothing while the step has not emitted yet."""
        if self.pending is None:
            return
        n, drafts, before = self.pending
        if len(tokens) <= before:
            return
        self.pending = None
        emitted = tokens[before : before + len(drafts)]
        accepted = 0
        while accepted < len(emitted) and emitted[accepted] == drafts[accepted]:
            accepted += 1
        reached, acc = self._rows(n, len(drafts))
        for i in range(min(accepted + 1, len(drafts))):
            reached[i] += 1.0
            if i < accepted:
                acc[i] += 1.0

    def length(self, n: int, available: int, min_reach: float) -> int:
        """How many of ``available`` continuation tokens of an ``n``-token match to draft."""
        if min_reach <= 0.0:
            return available
        reached, acc = self._rows(n, available)
        chance, length = 1.0, 0
        for i in range(available):
            chance *= acc[i] / reached[i]
            if chance < min_reach:
                break
            length = i + 1
        return length

    def may_draft(self, min_reach: float) -> bool:
        """Whether :meth:`length` can be 1 or more for some match under the bar
        ``min_reach`` (settled first): the prior's first rate clears it, or the recorded
        first rate of some matched length does."""
        if min_reach <= 0.0 or PRIOR_ACCEPTED / PRIOR_REACHED >= min_reach:
            return True
        return any(
            acc[0] / reached[0] >= min_reach
            for acc, reached in zip(self.accepted.values(), self.reached.values())
            if reached
        )

    def propose(self, n: int, drafts: list[int], tokens_now: int) -> None:
        """Note the drafts of this step (``tokens_now``: the request's tokens before it)."""
        self.pending = (n, drafts, tokens_now) if drafts else None
