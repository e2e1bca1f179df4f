"""Our Llama-family runtime against transformers, on tiny random models built in the test.

Every family is compared in fp32 with max abs diff <= 1e-4: prefill logits, step-by-step
decode logits, the training forward, skipped layers and tree verification. Checkpoint
directories and config parsing are tested in ``tests/test_models_loading.py``, the model's
parts on their own in ``tests/test_models_parts.py``; both use the tiny models built here.
The families: Llama, Llama with Llama-3 RoPE scaling, Llama with biases, Mistral, Qwen2 with
q/k/v bias, Qwen3 with per-head q/k norms and a head width of its own, Granite with its
embedding, residual, attention and logit multipliers, OLMo-2 with norms on each block's
output and on whole query and key projections, Phi-3 with fused projections, Phi-3 with
Phi-4-mini's partial rotary embedding and LongRoPE, SmolLM3 with a layer without RoPE,
Mistral and Qwen2 with sliding windows shorter than the test sequences, Gemma 2 with
soft-capped attention scores and logits, Gemma 3 with a sliding and a global layer, and the
mixtures of experts: Mixtral, Qwen2-MoE with its shared expert and a dense layer, Qwen3-MoE
with renormalized routing weights, OLMoE (q/k norms over whole projections) and Granite-MoE
(Granite's multipliers).
"""

import warnings

import pytest
import torch
from transformers import (
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
)

from osd.models import load_model
from osd.models.layers import RMSNorm
from osd_kernels.tree_attention import causal_tree_mask

FAMILIES = (
    "llama",
    "llama3",
    "llama_bias",
    "mistral",
    "qwen2",
    "qwen3",
    "granite",
    "olmo2",
    "phi3",
    "phi3_longrope",
    "smollm3",
    "mistral_window",
    "qwen2_window",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "granite_moe",
)


def phi3_config(family: str, common: dict, original: int = 256) -> Phi3Config:
    """Phi-3 (fused q/k/v and gate/up weights); ``phi3_longrope`` as Phi-4-mini: RoPE on
    the leading 3/4 of each head, LongRoPE short factors up to ``original`` positions and
    its attention factor (from the context ratio, here 512 / 256)."""
    if family == "phi3":
        return Phi3Config(**common)
    half = int(0.75 * common["hidden_size"] // common["num_attention_heads"]) // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.3 * i for i in range(half)],
        "long_factor": [4.0] * half,
        "original_max_position_embeddings": original,
    }
    return Phi3Config(
        rope_parameters=rope,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=original,
        **common,
    )


def gemma3_config(common: dict) -> Gemma3TextConfig:
    """Gemma 3 (GeGLU, four norms of ``1 + weight`` per layer, per-head q/k norms, scaled
    embeddings, query scale 1/sqrt(24)) with a 5-token sliding window in its first layer
    (RoPE base 10,000) and a global second layer (base 10^6, linear scaling by 8)."""
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    }
    common = {**common, "pad_token_id": None}
    return Gemma3TextConfig(
        head_dim=16,
        sliding_window=5,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=rope,
        **common,
    )


# Granite-3's multipliers (its 2B and 8B configs use these values)
GRANITE = dict(
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    attention_multiplier=0.015625,
    logits_scaling=8.0,
)
VOCAB = 131
ATOL = 1e-4


def tiny_hf_model(
    family: str, *, seed: int = 0, eos_token_id=None, intermediate_size: int = 88
) -> torch.nn.Module:
    """A random 2-layer transformers model: hidden 64, 4 heads, 2 KV heads, vocab 131
    (MLP width 88 unless given: not a whole number of 32-weight blocks).

    Weights are drawn wide (std 0.3, norms around 1) so that logits are well separated
    and greedy decoding has no near-ties.
    """
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    elif family == "llama3":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        model = LlamaForCausalLM(LlamaConfig(rope_scaling=rope, rope_theta=500000.0, **common))
    elif family == "llama_bias":
        model = LlamaForCausalLM(LlamaConfig(attention_bias=True, mlp_bias=True, **common))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif family == "qwen3":  # head_dim 24, not hidden / heads = 16
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=24, **common))
    elif family == "granite":
        model = GraniteForCausalLM(GraniteConfig(**GRANITE, **common))
    elif family == "olmo2":
        model = Olmo2ForCausalLM(Olmo2Config(**common))
    elif family.startswith("phi3"):
        model = Phi3ForCausalLM(phi3_config(family, common))
    elif family == "mistral_window":  # an 8-token sliding window in every layer
        model = MistralForCausalLM(MistralConfig(sliding_window=8, **common))
    elif family == "qwen2_window":  # the second layer's window only
        model = Qwen2ForCausalLM(
            Qwen2Config(use_sliding_window=True, sliding_window=5, max_window_layers=1, **common)
        )
    elif family == "gemma2":  # soft caps low enough to bend the scores and logits
        model = Gemma2ForCausalLM(
            Gemma2Config(
                **{**common, "pad_token_id": None},
                head_dim=16,
                query_pre_attn_scalar=16,
                sliding_window=5,
                attn_logit_softcapping=5.0,
                final_logit_softcapping=3.0,
            )
        )
    elif family == "gemma3":
        model = Gemma3ForCausalLM(gemma3_config(common))
    elif family == "smollm3":  # the second layer without RoPE
        model = SmolLM3ForCausalLM(SmolLM3Config(no_rope_layers=[1, 0], **common))
    elif family == "mixtral":  # 4 experts, 2 per token
        model = MixtralForCausalLM(
            MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        )
    elif family == "qwen2_moe":  # a shared expert; the second layer a dense MLP
        model = Qwen2MoeForCausalLM(
            Qwen2MoeConfig(
                num_experts=5,
                num_experts_per_tok=2,
                moe_intermediate_size=40,
                shared_expert_intermediate_size=56,
                norm_topk_prob=False,
                mlp_only_layers=[1],
                **common,
            )
        )
    elif family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                num_experts=6,
                num_experts_per_tok=3,
                moe_intermediate_size=40,
                norm_topk_prob=True,
                head_dim=24,
                **common,
            )
        )
    elif family == "olmoe":
        model = OlmoeForCausalLM(OlmoeConfig(num_experts=5, num_experts_per_tok=2, **common))
    elif family == "granite_moe":
        model = GraniteMoeForCausalLM(
            GraniteMoeConfig(num_local_experts=4, num_experts_per_tok=2, **GRANITE, **common)
        )
    else:
        raise ValueError(family)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    hf = tiny_hf_model(request.param)
    return request.param, hf, load_model(hf)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits.float()


def test_prefill_and_decode_match_transformers(pair):
    _, hf, model = pair
    ids = torch.randint(0, VOCAB, (3, 13), generator=torch.Generator().manual_seed(1))
    ref = _hf_logits(hf, ids)
    cache = model.new_cache(4, 32)
    prefix = 8
    with torch.no_grad():
        got = model(ids[:, :prefix], cache)
        assert got.dtype == torch.float32 and got.shape == (3, prefix, VOCAB)
        assert (got - ref[:, :prefix]).abs().max() <= ATOL
        assert cache.lens.tolist() == [0, 0, 0, 0]  # the forward does not commit
        cache.commit(torch.full((3,), prefix, dtype=torch.int32), prefix)
        for t in range(prefix, ids.shape[1]):
            step = model(ids[:, t : t + 1], cache)
            cache.commit(torch.ones(3, dtype=torch.int32), 1)
            assert (step[:, 0] - ref[:, t]).abs().max() <= ATOL, f"decode step {t}"


def test_ragged_prefill_and_logits_index(pair):
    """Rows of different lengths padded into one forward; logits_index picks each row's last."""
    _, hf, model = pair
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (5, 9, 2)]
    ids = torch.zeros(3, 9, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    last = torch.tensor([[len(p) - 1] for p in prompts])
    with torch.no_grad():
        got = model(ids, model.new_cache(3, 16), logits_index=last)
    for b, p in enumerate(prompts):
        ref = _hf_logits(hf, p[None])[0, -1]
        assert (got[b, 0] - ref).abs().max() <= ATOL


def test_rms_norm_of_a_half_input_is_fp32_without_warning():
    """Under autocast a bf16 activation meets an fp32 norm weight: the norm computes in
    fp32 through the fused kernel (no mixed-dtype fallback warning) and gradients reach
    the weight."""
    norm = RMSNorm(24, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 24).bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = norm(x)
    assert y.dtype == torch.float32
    ref = torch.nn.functional.rms_norm(x.float(), (24,), norm.weight.detach(), 1e-6)
    torch.testing.assert_close(y.detach(), ref)
    y.sum().backward()
    assert norm.weight.grad is not None


def test_forward_train_matches_and_backprops(pair):
    _, hf, model = pair
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    ref = _hf_logits(hf, ids)
    with torch.no_grad():
        assert (model.forward_train(ids) - ref).abs().max() <= ATOL
    # left padding: positions count real tokens only, so row 1 equals running it alone
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.int64), ids[1:, :8]], dim=1)
    mask = torch.tensor([[0, 0, 0] + [1] * 8])
    with torch.no_grad():
        got = model.forward_train(padded, attention_mask=mask)
    assert (got[0, 3:] - _hf_logits(hf, ids[1:, :8])[0]).abs().max() <= ATOL
    rows = torch.tensor([20, 0, 13, 5])  # the head on chosen flattened positions only
    with torch.no_grad():
        full = model.forward_train(ids).reshape(-1, VOCAB)
        assert (model.forward_train(ids, rows=rows) - full[rows]).abs().max() <= ATOL
    loss = model.forward_train(ids).logsumexp(-1).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    model.zero_grad(set_to_none=True)


def test_skip_layers_consistent_between_forwards(pair):
    _, _, model = pair
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cached = model(ids, model.new_cache(2, 8), skip_layers=frozenset({1}))
        train = model.forward_train(ids, skip_layers=frozenset({1}))
        full = model.forward_train(ids)
        no_layers = model.forward_train(ids, skip_layers=frozenset({0, 1}))
        c = model.config  # Granite's multipliers are 1 in the other families
        x = model.embed_tokens(ids) * c.embedding_multiplier
        direct = model.lm_head(model.norm(x)).float() / c.logits_scaling
        if c.final_logit_softcapping is not None:  # Gemma 2
            direct = torch.tanh(direct / c.final_logit_softcapping) * c.final_logit_softcapping
    assert (cached - train).abs().max() <= ATOL
    assert (train - full).abs().max() > 1e-2
    assert (no_layers - direct).abs().max() <= ATOL


def _tree(parents):
    """Bitmask ``[T]`` (ancestors and self) and depths ``[T]`` of a tree given parents."""
    masks, depths = [], []
    for i, p in enumerate(parents):
        masks.append((1 << i) | (masks[p] if p >= 0 else 0))
        depths.append(depths[p] + 1 if p >= 0 else 0)
    return masks, depths


def test_tree_verify_matches_each_path_as_a_chain(pair):
    _, _, model = pair
    parents = [-1, 0, 0, 1, 1, 2, 3, 5]
    masks, depths = _tree(parents)
    leaves = [i for i in range(len(parents)) if i not in parents]
    gen = torch.Generator().manual_seed(5)
    prefixes = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (6, 3)]
    nodes = torch.randint(0, VOCAB, (2, len(parents)), generator=gen)

    def prefilled(rows_prefix):
        cache = model.new_cache(2, 32)
        for b, p in enumerate(rows_prefix):
            view = cache.rows(b, 1)
            model(p[None], view)
            view.commit(torch.tensor([len(p)], dtype=torch.int32), len(p))
        cache.set_bound(max(len(p) for p in rows_prefix))
        return cache

    with torch.no_grad():
        cache = prefilled(prefixes)
        tree_logits = model(
            nodes,
            cache,
            tree_mask=torch.tensor([masks, masks]),
            depths=torch.tensor([depths, depths]),
        )
        for b in range(2):
            for leaf in leaves:
                path = [leaf]
                while parents[path[-1]] >= 0:
                    path.append(parents[path[-1]])
                path = path[::-1]
                chain_cache = prefilled([prefixes[b]])
                chain = model(nodes[b, path][None], chain_cache)
                assert (chain[0] - tree_logits[b, path]).abs().max() <= ATOL, (b, path)


def test_tree_commit_then_decode_matches_chain(pair):
    """After tree verify, compacting the accepted path makes the cache equal to a chain."""
    _, _, model = pair
    parents = [-1, 0, 0, 1, 2, 4]
    masks, depths = _tree(parents)
    accepted = [0, 2, 4]
    gen = torch.Generator().manual_seed(6)
    prefix = torch.randint(0, VOCAB, (1, 5), generator=gen)
    nodes = torch.randint(0, VOCAB, (1, len(parents)), generator=gen)
    nxt = torch.randint(0, VOCAB, (1, 1), generator=gen)
    with torch.no_grad():
        cache = model.new_cache(1, 32)
        model(prefix, cache)
        cache.commit(torch.tensor([5], dtype=torch.int32), 5)
        model(nodes, cache, tree_mask=torch.tensor([masks]), depths=torch.tensor([depths]))
        cache.commit_tree(torch.tensor([accepted]), torch.tensor([3], dtype=torch.int32), 3)
        assert cache.lens.tolist() == [8]
        got = model(nxt, cache)[0, -1]
        chain = torch.cat([prefix, nodes[:, accepted], nxt], dim=1)
        ref = model(chain, model.new_cache(1, 32))[0, -1]
    assert (got - ref).abs().max() <= ATOL


def test_causal_tree_mask_equals_default(pair):
    _, _, model = pair
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        a = model(ids, model.new_cache(2, 8))
        b = model(ids, model.new_cache(2, 8), tree_mask=causal_tree_mask(2, 7))
    if any(layer.window is not None and layer.window < 7 for layer in model.layers):
        # past a window, a causal block runs the C++ kernel once per query and a tree the
        # masked SDPA: the same attention, summed in another order
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(a, b)
