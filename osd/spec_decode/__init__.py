"""Speculative decoding: who drafts, the step that verifies, and its policies.

- ``proposals``: :class:`ChainProposal`, :class:`TreeProposal`, :class:`Emitted` and the
  :class:`Drafter` protocol (what the step asks of a drafter);
- one module per drafter: ``model_drafter`` (a draft model, or the target with layers
  skipped), ``lookup_drafter`` (prompt lookup alone, or in front of a model drafter),
  ``eagle_drafter`` (an EAGLE draft on the target's features); ``factory`` builds the
  drafters a :class:`~osd.SpecConfig` asks for; ``lookup_history`` is prompt lookup's
  index of finished requests;
- ``step``: :class:`Speculator`, the step's four stages (propose, verify, sample, commit)
  and the :class:`Verdict` it hands to its listeners; ``readback`` its one host sync;
  ``fused_step`` the whole chain step as one CUDA graph;
- ``policies``: the adaptive chain length per row and per step;
- ``statistics``: the listener that turns verdicts into statistics.
"""

from osd.spec_decode.model_drafter import ModelDrafter
from osd.spec_decode.proposals import (
    FROM_LOOKUP,
    FROM_MODEL,
    ChainProposal,
    Drafter,
    Emitted,
    TreeProposal,
)
from osd.spec_decode.step import Speculator, Verdict

__all__ = [
    "FROM_LOOKUP",
    "FROM_MODEL",
    "ChainProposal",
    "Drafter",
    "Emitted",
    "ModelDrafter",
    "Speculator",
    "TreeProposal",
    "Verdict",
]
