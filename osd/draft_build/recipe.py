"""The chat draft's recipe: its shape, how it is trained, and how its teacher data is made.

Plain dataclasses (no torch): ``osd draft build --help`` reads its defaults from here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class DraftShape:
    """Shape of the draft (a ``LlamaForCausalLM`` with the target's vocabulary)."""

    hidden_size: int = 256  # width; the 49,152 x hidden LM head dominates latency
    num_layers: int = 4  # decoder layers (each adds ~0.15 ms per decode step here)
    num_heads: int = 4  # query heads, head_dim 64 like the target
    num_kv_heads: int = 2  # key/value heads
    intermediate_size: int = 704  # SwiGLU width
    rope_theta: float = 100000.0  # the target's
    max_position_embeddings: int = 8192


@dataclass(frozen=True)
class TrainRecipe:
    """How the draft is trained."""

    epochs: float = 16.0  # upper bound; the time budget usually allows fewer
    tokens_per_batch: int = 3072  # padded tokens per optimizer step
    lr: float = 2e-3  # peak AdamW learning rate
    warmup: int = 20  # linear warm-up steps (their time plans the rest)
    weight_decay: float = 0.01  # on matrices (not norms)
    bf16_autocast: bool = True  # bf16 matmuls, fp32 weights, where the CPU has fast bf16
    #                                 (osd.online.config.cpu_has_fast_bf16; fp32 otherwise)
    final_norm_init: float = 0.3  # final RMSNorm weight at init (1.0 starts at loss ~25)
    prompt_positions: bool = True  # also distill the target at prompt positions
    heldout_fraction: float = 0.03  # examples kept out of training for the alpha report
    seed: int = 0


@dataclass(frozen=True)
class DataRecipe:
    """How the teacher data is made."""

    prompts: int = 1100  # chat requests (the generation stage may stop earlier)
    max_new_tokens: int = 128  # response length cap
    max_prompt_tokens: int = 320  # longer prompts are skipped
    batch_size: int = 32  # target rows decoded together (> 16: GEMM, not decode_linear)
    prefill_group: int = 8  # most prompts prefilled at once (their logits: 8 x T x V)
    teacher_dtype: str = "bfloat16"  # the target's dtype while answering (1.6-1.8x faster here)
    topk: int = 32  # target probabilities kept per position
    sampled_fraction: float = 0.25  # share of prompts answered at temperature 0.7
    temperature: float = 0.7
    seed: int = 0
    features: bool = True  # keep the target's features too (the EAGLE draft's data)
    kinds: tuple[str, ...] = ("explain", "write", "summarize", "test", "improve", "comment")
    #                                 requests about stdlib functions, in turn (the keys of
    #                                 osd.draft_build.prompts.CODE_TEMPLATES)


# Rows the draft's output head keeps (the build's head-vocabulary stage).
HEAD_VOCAB = 8192

DRAFT = DraftShape()
TRAIN = TrainRecipe()

DATA = DataRecipe()
# The second and third teacher sets (``--data-sets``; the EAGLE draft trains on all three):
# other stdlib functions (seeds 1 and 2), half and two thirds of the code requests asking
# for a function's body from its signature and docstring.
EXTRA_DATA = replace(
    DATA, seed=1, kinds=("complete", "write", "complete", "explain", "complete", "test")
)
MORE_DATA = replace(
    DATA, seed=2, kinds=("complete", "write", "complete", "test", "complete", "explain")
)
TEACHER_SETS = (DATA, EXTRA_DATA, MORE_DATA)
