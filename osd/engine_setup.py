"""What ``Engine.__init__`` checks and derives before it builds anything: sizes, the
drafts it serves (validated, quantized for serving) and the speculation settings that go
with them."""

from __future__ import annotations

import dataclasses
import operator

from osd.models.eagle import EagleLM
from osd.models.llama import DecoderLM
from osd.models.quant import serving_drafts
from osd.online.config import OnlineConfig
from osd.spec import SpecConfig
from osd.tree import StaticTree


def check_sizes(max_batch_size, max_seq_len, prefix_cache) -> tuple[int, int, int]:
    """The engine's sizes as ints, or a ValueError naming the bad one."""
    max_batch_size = operator.index(max_batch_size)
    prefix_cache = operator.index(prefix_cache)
    if prefix_cache < 0:
        raise ValueError(f"prefix_cache must be >= 0 tokens, got {prefix_cache}")
    max_seq_len = operator.index(max_seq_len)
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    return max_batch_size, max_seq_len, prefix_cache


def resolve_drafts(model: DecoderLM, draft, spec, online, prefill_chunk, quantize_draft):
    """Validate the drafts against the target and the settings against the drafts.

    Returns ``(drafts, masters, spec)``: the drafts as served (quantized copies when
    ``quantize_draft``), the float drafts the learner trains behind quantized serving
    copies (None per draft otherwise), and the speculation settings (a chain of 4 when a
    draft comes without ``spec``; prompt lookup alone when lookup comes without a
    draft)."""
    drafts = [] if draft is None else list(draft) if isinstance(draft, (list, tuple)) else [draft]
    for i, d in enumerate(drafts):
        if not isinstance(d, DecoderLM):
            raise TypeError(f"draft {i} must be an osd DecoderLM, got {type(d).__name__}")
        if d.vocab_size != model.vocab_size:
            raise ValueError(
                f"draft vocabulary size {d.vocab_size} differs from the "
                f"target vocabulary size {model.vocab_size}"
            )
        if d.device != model.device:
            raise ValueError(f"draft is on {d.device} but the target is on {model.device}")
    if prefill_chunk is not None:
        prefill_chunk = operator.index(prefill_chunk)
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        for m in [model] + drafts:
            m.config = dataclasses.replace(m.config, prefill_chunk=prefill_chunk)
    if spec is not None and not isinstance(spec, SpecConfig):
        raise TypeError(f"spec must be an osd.SpecConfig, got {type(spec).__name__}")
    if online is not None and not isinstance(online, OnlineConfig):
        raise TypeError(f"online must be an osd.OnlineConfig, got {type(online).__name__}")
    if spec is None and drafts:
        spec = SpecConfig()
    if spec is not None and spec.lookup and spec.drafter == "model" and not drafts:
        spec = spec.lookup_alone()  # prompt lookup without a draft model: "ngram"
    if spec is not None and spec.drafter == "model" and not drafts:
        raise ValueError("SpecConfig(drafter='model') needs a draft model: pass draft=...")
    if spec is not None and spec.drafter != "model" and drafts:
        raise ValueError(
            f"SpecConfig(drafter={spec.drafter!r}) uses no draft model, but draft=... was given"
        )
    if online is not None and (spec is None or spec.drafter == "ngram"):
        raise ValueError(
            "online learning needs a model drafter (a draft or SpecConfig(drafter='self'))"
        )
    masters = (
        drafts if online is not None and quantize_draft is not None else [None] * len(drafts)
    )  # the float drafts of quantized serving copies
    drafts = serving_drafts(drafts, quantize_draft, model.device, online is not None)
    for i, d in enumerate(drafts):
        if isinstance(d, EagleLM) and d.embed_tokens.weight is not model.embed_tokens.weight:
            raise ValueError(
                f"EAGLE draft {i} was not built for this target (it must "
                f"share the target's embedding: "
                f"EagleLM.from_target(target) or load_eagle(path, target))"
            )
    return drafts, masters, spec


def spec_width(spec: SpecConfig) -> int:
    """Most tokens one verify forward feeds per row (root included)."""
    lk = spec.lookup if spec.drafter != "ngram" else None  # lookup in front of a model
    chain = max(spec.num_draft_tokens, lk.tokens if lk else 0) + 1
    if lk and lk.tree_below:  # lookup's branch and the model's, below one root
        return chain + spec.num_draft_tokens
    if spec.tree is None:
        return chain
    tree = spec.tree.num_nodes if isinstance(spec.tree, StaticTree) else spec.tree.max_nodes + 1
    # With prompt lookup, a step whose rows all match verifies a chain instead of the tree.
    return max(tree, chain) if lk else tree
