"""The shape of a draft for any target, chosen from the target's config
(``osd draft build --target``).

The draft is a ``LlamaForCausalLM`` (the plainest architecture, which every loader reads)
with the target's tokenizer and vocabulary, and with the target family's conventions where
they carry over: its head width, its ratio of query to key/value heads, its MLP's ratio
to the model width, its RoPE base, norm epsilon and context length. It is shallower and
narrower: the chat pair's recipe (``osd.draft_build.recipe.DRAFT``: 4 layers of width 256
under SmolLM2-135M's 30 layers of 576) is what these rules give for that target.

Plain functions of the config's fields (no torch), so they are cheap to test.
"""

from __future__ import annotations

import math

from osd.draft_build.recipe import DraftShape

MAX_LAYERS = 4  # decoder layers of the deepest draft
MAX_WIDTH = 1024  # the widest draft (bounds the cost of training it on a CPU)
FULL_HEAD_MAX = 16384  # vocabularies up to this size keep their whole output head
HEAD_VOCAB_MIN = 8192  # rows of a reduced head, at least ...
HEAD_VOCAB_MAX = 32768  # ... and at most
HEAD_VOCAB_SHARE = 6  # ... about one sixth of the vocabulary in between
MAX_PREFILL_LOGITS = 5e8  # bytes of float32 prompt logits one teacher prefill may hold


def draft_layers(target_layers: int) -> int:
    """1 under a target of at most 6 layers, else about a sixth of its layers, 2 to
    :data:`MAX_LAYERS`."""
    if target_layers <= 6:
        return 1
    return min(MAX_LAYERS, max(2, target_layers // 6))


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= max(1, limit))


def choose_shape(config) -> DraftShape:
    """The draft's shape for a target of ``config`` (an ``osd.models.config.ModelConfig``,
    or anything with its fields): about half the target's width in whole heads of the
    target's head width (at least 2 heads, at most :data:`MAX_WIDTH`; a target narrower
    than 2 heads keeps its own), the target's query/key-value head ratio (rounded up to
    a divisor of the query heads), its MLP ratio (2 to 4 times the width, a multiple of 64),
    its RoPE base, context length and norm epsilon, :func:`draft_layers` layers."""
    head_dim = int(config.head_dim)
    width = int(config.hidden_size)
    heads = max(2, (width // 2) // head_dim)
    heads = min(heads, max(1, MAX_WIDTH // head_dim))
    if heads * head_dim > width:
        heads = max(1, width // head_dim)
    group = max(1, round(config.num_heads / max(1, config.num_kv_heads)))
    kv_heads = _largest_divisor_at_most(heads, math.ceil(heads / group))
    hidden = heads * head_dim
    mlp = config.intermediate_size or (
        config.moe_intermediate_size * max(1, config.num_experts_per_tok)
    )
    ratio = min(4.0, max(2.0, mlp / width))
    intermediate = max(64, round(hidden * ratio / 64) * 64)
    return DraftShape(
        hidden_size=hidden,
        num_layers=draft_layers(int(config.num_layers)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=intermediate,
        rope_theta=float(config.rope_theta),
        max_position_embeddings=int(config.max_position_embeddings),
    )


def choose_head_vocab(vocab_size: int) -> int:
    """Rows the draft's output head keeps: 0 (all of them) up to :data:`FULL_HEAD_MAX`
    tokens, else about a sixth of the vocabulary, a multiple of 1024 between
    :data:`HEAD_VOCAB_MIN` and :data:`HEAD_VOCAB_MAX`. (SmolLM2's 49,152 tokens give the
    chat recipe's 8,192.)"""
    if vocab_size <= FULL_HEAD_MAX:
        return 0
    size = round(vocab_size / HEAD_VOCAB_SHARE / 1024) * 1024
    return min(vocab_size, max(HEAD_VOCAB_MIN, min(HEAD_VOCAB_MAX, size)))


def teacher_batch(config, max_prompt_tokens: int) -> tuple[int, int]:
    """``(rows decoded together, prompts prefilled at once)`` while the target answers:
    32 rows (16 over a billion parameters, 8 over four), and as many prompts per prefill
    (at most 8) as keep its float32 logits, prompts x tokens x vocabulary, under
    :data:`MAX_PREFILL_LOGITS` bytes."""
    params = config.num_layers * 12 * config.hidden_size**2 + config.vocab_size * config.hidden_size
    rows = 32 if params < 1e9 else 16 if params < 4e9 else 8
    group = int(MAX_PREFILL_LOGITS // (4 * max_prompt_tokens * config.vocab_size))
    return rows, max(1, min(8, group))
