"""The drafters a :class:`~osd.SpecConfig` asks for, composed: prompt lookup in front of a
model drafter is a :class:`~osd.spec_decode.lookup_drafter.LookupDrafter` around it."""

from __future__ import annotations

from osd.models.eagle import EagleLM
from osd.models.llama import DecoderLM, without_layers
from osd.spec import MIN_REACH
from osd.spec_decode.eagle_drafter import EagleDrafter
from osd.spec_decode.lookup_drafter import LookupDrafter, NGramDrafter
from osd.spec_decode.lookup_history import LookupHistory
from osd.spec_decode.model_drafter import ModelDrafter


def make_drafters(
    spec,
    target: DecoderLM,
    drafts: list[DecoderLM],
    max_batch_size: int,
    capacity: int,
    context: int,
    history: LookupHistory | None,
    learning: bool = False,
) -> list:
    """The drafters of ``spec`` (``osd.SpecConfig``) for ``target``: one per draft model
    (an EAGLE draft gets an :class:`EagleDrafter`), or the n-gram drafter, or the target's
    own layers (self-speculation), each behind prompt lookup when ``spec.lookup`` is set;
    caches of ``capacity`` slots for sequences of up to ``context`` tokens. Self-speculation
    drafts with the target's own layers, except when the draft learns online
    (``learning``): then with a copy of the layers it uses, so training never writes the
    target's weights."""
    lk = spec.lookup
    # auto_k's chain length 0 leaves the draft model out: it is fed only when it drafts
    defer = spec.auto_k
    reach = None if lk is None else lk.min_reach
    if reach is None:  # a lookup drafting alone (the ngram drafter, auto_k's arm 0)
        reach = MIN_REACH.get(next(target.parameters()).device.type, MIN_REACH["cuda"])
    if spec.drafter == "ngram":
        return [NGramDrafter(lk.ngram_min, lk.ngram_max, history, reach)]
    if spec.drafter == "self":
        n = target.config.num_layers
        skip = (
            frozenset(spec.skip_layers)
            if spec.skip_layers is not None
            else frozenset(range(1, n, 2))
        )
        bad = [i for i in skip if not 0 <= i < n]
        if bad or len(skip) >= n:
            raise ValueError(
                f"skip_layers must name some (not all) of the target's "
                f"{n} layers, got {sorted(skip)}"
            )
        drafters = [
            ModelDrafter(
                without_layers(target, skip), max_batch_size, capacity, context=context, defer=defer
            )
            if learning
            else ModelDrafter(target, max_batch_size, capacity, skip, context=context, defer=defer)
        ]
    else:
        drafters = [
            EagleDrafter(d, max_batch_size, capacity, context=context)
            if isinstance(d, EagleLM)
            else ModelDrafter(d, max_batch_size, capacity, context=context, defer=defer)
            for d in drafts
        ]
    if lk is not None:  # prompt lookup in front of each model drafter
        drafters = [
            LookupDrafter(
                d,
                NGramDrafter(lk.ngram_min, lk.ngram_max, history, reach),
                lk.tokens,
                lk.tree_below,
            )
            for d in drafters
        ]
    return drafters
