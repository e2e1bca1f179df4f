"""What drafters propose and what the speculative step tells them back, and the
:class:`Drafter` protocol that is all the step (``osd.spec_decode.step``) uses of one.

The protocol:

- ``prefill(prompts, start_row, first_tokens, hidden=None)``, ``move_row(src, dst)``,
  ``reset()``: mirror the engine's cache rows;
- ``propose(active, roots, params, seed, offset, k=..., tree=..., stopper=...)``: a
  :class:`ChainProposal` (``k`` tokens per row) or a :class:`TreeProposal` (``tree``);
- ``after_verify(emitted, committed_lens, bound)``: the verdict (an :class:`Emitted`:
  ``tokens[:, :lengths]`` emitted per row) so the drafter can catch up;
  ``catch_up(emitted)`` after a step it did not draft for (a chain length of 0);
- ``model`` (the draft model, or None), ``use_graphs(graphs)`` and ``needs_hidden``:
  when True, the target's features (last layer before the final norm) are passed as
  ``hidden``: ``[n, T, H]`` of the prompts to ``prefill``, ``[B, T, H]`` of the verify
  forward in ``Emitted.hidden``.

A proposal says per row where its drafts came from in ``origin``, a ``[B]`` int8 tensor
of bits (:data:`FROM_MODEL`, :data:`FROM_LOOKUP`; both in a lookup tree that holds the
model's chain beside a lookup branch; 0 where the row drafted nothing). ``origin=None``
means every row's drafts are the draft model's. The step never branches on it: it rides
the step's one read-back to the statistics (``osd.spec_decode.statistics``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from osd.graphs import StepGraphs
from osd.sampling import BatchParams

FROM_MODEL = 1  # origin bit: drafted by the draft model
FROM_LOOKUP = 2  # origin bit: drafted by prompt lookup


def origin_rows(bits: list[int], device) -> torch.Tensor:
    """A proposal's ``origin`` from host bits, one per row."""
    return torch.tensor(bits, dtype=torch.int8).to(device)


@dataclass
class ChainProposal:
    """A chain of drafts per row."""

    tokens: torch.Tensor  # [B, k] int64, k >= 0 (past num_drafted: padding)
    probs: torch.Tensor | None  # [B, k, V] warped q the tokens were drawn from
    logits: torch.Tensor | None  # [B, k, V] raw draft logits (statistics)
    num_drafted: torch.Tensor | None  # [B] int32, None = k for every row
    max_drafted: int  # host-side max of num_drafted (k if None)
    origin: torch.Tensor | None = None  # [B] int8 origin bits; None: the model's, every row


@dataclass
class TreeProposal:
    """A token tree per row; node 0 is the root (the last committed token)."""

    tokens: torch.Tensor  # [B, T] int64
    parents: torch.Tensor  # [B, T] int32
    depths: torch.Tensor  # [B, T] int64
    mask: torch.Tensor  # [B, T] int64 ancestor bitmask
    max_depth: int
    # A lookup tree (``lookup_drafter.lookup_tree``): the draft model's chain inside it,
    # for α; the rows whose origin has FROM_MODEL hold it.
    draft_nodes: torch.Tensor | None = None  # [B, k] int64: the node of each drafted token
    draft_logits: torch.Tensor | None = None  # [B, k, V] the draft's raw logits there
    origin: torch.Tensor | None = None  # [B] int8 origin bits; None: the model's, every row


# Columns of a model drafter's pending-token buffer: one step's tokens (a tree of up to
# MAX_TREE_NODES = 64) or PENDING_LIMIT queued ones, plus slack and a scratch column. A
# drafter's cache holds this many positions past the target's, since pending tokens are
# fed before drafting.
PENDING_WIDTH = 72


@dataclass
class Emitted:
    """What one verify step emitted, for a drafter to catch up on."""

    B: int  # the step's rows, 0 .. B-1
    tokens: torch.Tensor  # [B, W] int64: row b emitted tokens[b, :lengths[b]]
    lengths: torch.Tensor  # [B] int64
    max_len: int  # host-side max of lengths
    hidden: torch.Tensor | None = None  # [B, W, H] the target's features (needs_hidden)


class Drafter(Protocol):
    """What the speculative step asks of a drafter."""

    model: object  # the draft DecoderLM, or None (prompt lookup)
    needs_hidden: bool  # wants the target's features in prefill / Emitted

    def prefill(
        self,
        prompts: list[list[int]],
        start_row: int,
        first_tokens: torch.Tensor,
        hidden: torch.Tensor | None = None,
    ) -> None: ...

    def move_row(self, src: int, dst: int) -> None: ...

    def reset(self) -> None: ...

    def use_graphs(self, graphs: StepGraphs | None) -> None: ...

    def propose(
        self,
        active: list,
        roots: torch.Tensor,
        params: BatchParams,
        seed: torch.Tensor,
        offset: torch.Tensor,
        *,
        k: int = 0,
        tree=None,
        stopper=None,
    ) -> ChainProposal | TreeProposal: ...

    def after_verify(self, emitted: Emitted, committed_lens: torch.Tensor, bound: int) -> None: ...

    def catch_up(self, emitted: Emitted) -> None: ...
