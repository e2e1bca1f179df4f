"""Our Llama-family runtime against transformers, on tiny random models built in the test.

Every family is compared in fp32 with max abs diff <= 1e-4: prefill logits, step-by-step
decode logits, the training forward, and checkpoint directories written by
``save_pretrained`` (safetensors, sharded safetensors, .bin and sharded .bin). The
families: Llama, Llama with Llama-3 RoPE scaling, Llama with biases, Mistral, Qwen2 with
q/k/v bias, Qwen3 with per-head q/k norms and a head width of its own, Granite with its
embedding, residual, attention and logit multipliers, OLMo-2 with norms on each block's
output and on whole query and key projections, Phi-3 with fused projections, Phi-3 with
Phi-4-mini's partial rotary embedding and LongRoPE, SmolLM3 with a layer without RoPE,
Mistral and Qwen2 with sliding windows shorter than the test sequences, Gemma 2 with
soft-capped attention scores and logits, Gemma 3 with a sliding and a global layer, and
the mixtures of experts: Mixtral, Qwen2-MoE with its shared expert and a dense layer,
Qwen3-MoE with renormalized routing weights, OLMoE (q/k norms over whole projections) and
Granite-MoE (Granite's multipliers).
"""

import copy
import json

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

from osd.cache import KVCache
from osd.models import DecoderLM, ModelConfig, load_model
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


def tiny_hf_model(family: str, *, seed: int = 0, eos_token_id=None) -> torch.nn.Module:
    """A random 2-layer transformers model: hidden 64, 4 heads, 2 KV heads, vocab 131.

    Weights are drawn wide (std 0.3, norms around 1) so that logits are well separated
    and greedy decoding has no near-ties.
    """
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=88,
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
    import warnings

    from osd.models.llama import RMSNorm

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
    assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["safetensors", "sharded", "bin", "legacy_bin", "sharded_bin"])
def test_checkpoint_directory_loads_same_logits(layout, tmp_path):
    hf = tiny_hf_model("qwen2", seed=8)
    if layout in ("safetensors", "sharded"):
        hf.save_pretrained(tmp_path, max_shard_size="40KB" if layout == "sharded" else "50GB")
    else:
        hf.config.save_pretrained(tmp_path)
        state = {k: v.clone() for k, v in hf.state_dict().items()}
        if layout in ("bin", "legacy_bin"):
            torch.save(
                state,
                tmp_path / "pytorch_model.bin",
                _use_new_zipfile_serialization=layout == "bin",
            )
        else:
            keys = sorted(state)
            shards = {
                "pytorch_model-00001-of-00002.bin": keys[::2],
                "pytorch_model-00002-of-00002.bin": keys[1::2],
            }
            weight_map = {}
            for file, names in shards.items():
                torch.save({k: state[k] for k in names}, tmp_path / file)
                weight_map.update({k: file for k in names})
            (tmp_path / "pytorch_model.bin.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map})
            )
    files = sorted(p.name for p in tmp_path.iterdir())
    if layout == "sharded":
        assert "model.safetensors.index.json" in files and len(files) > 3
    model = load_model(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        got = model(ids, model.new_cache(2, 16))
    assert (got - _hf_logits(hf, ids)).abs().max() <= ATOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_runs(dtype, tmp_path):
    hf = tiny_hf_model("llama3", seed=10)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(11))
    cache = model.new_cache(2, 16)
    assert cache.kv.dtype == dtype
    with torch.no_grad():
        got = model(ids, cache)
    ref = _hf_logits(hf, ids)
    hf_half = _hf_logits(copy.deepcopy(hf).to(dtype), ids)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # our half-precision error is at most twice transformers' in the same precision
    assert (got - ref).abs().max() <= 2 * (hf_half - ref).abs().max()


def test_config_parsing_old_and_new_styles():
    old = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "rope_theta": 500000.0,
        "eos_token_id": [5, 7],
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }
    cfg = ModelConfig.from_hf(old)
    assert (cfg.rope_type, cfg.rope_theta, cfg.rope_original_max_positions) == ("llama3", 5e5, 64)
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16 and cfg.eos_token_ids == (5, 7)
    qwen = ModelConfig.from_hf(
        Qwen2Config(
            vocab_size=100,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
        )
    )
    assert qwen.architecture == "Qwen2ForCausalLM" and qwen.qkv_bias and not qwen.o_bias
    assert qwen.sliding_window is None
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        ModelConfig.from_hf({**old, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf({**old, "hidden_act": "gelu"})
    # Gemma 3 1B's config.json as written before per-layer-type RoPE parameters
    gemma = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 262144,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "rope_theta": 1000000,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "max_position_embeddings": 32768,
    }
    g = ModelConfig.from_hf(gemma)
    assert (g.rope_theta, g.rope_local_theta, g.sliding_window) == (1e6, 1e4, 512)
    assert g.window_layers == tuple(i for i in range(26) if (i + 1) % 6)
    assert g.embedding_multiplier == 1152**0.5 and g.attention_multiplier == 1 / 16
    assert (g.qk_norm, g.pre_norm, g.post_norm, g.hidden_act) == (
        "head",
        True,
        True,
        "gelu_pytorch_tanh",
    )


def test_param_count_and_init_weights():
    hf = tiny_hf_model("llama_bias")
    model = load_model(hf)
    assert model.config.num_parameters == sum(p.numel() for p in hf.parameters())
    fresh = DecoderLM(model.config)
    fresh.init_weights(generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, VOCAB, (1, 4))
    with torch.no_grad():
        assert torch.isfinite(fresh(ids, fresh.new_cache(1, 8))).all()


def test_kv_cache_rows_and_move():
    cache = KVCache(2, 4, 2, 16, 8)
    cache.kv.normal_()
    cache.lens.copy_(torch.tensor([3, 5, 7, 2], dtype=torch.int32))
    cache.set_bound(7)
    view = cache.rows(2, 2)
    assert view.kv.data_ptr() == cache.kv[:, :, 2].data_ptr() and view.bound == 7
    view.reset()
    assert cache.lens.tolist() == [3, 5, 0, 0]
    cache.lens[2] = 6
    before = cache.kv[:, :, 2, :, :7].clone()
    cache.move_row(2, 0)
    assert torch.equal(cache.kv[:, :, 0, :, :7], before) and cache.lens[0] == 6
    cache.commit(torch.tensor([1, 2], dtype=torch.int32), 2)
    assert cache.lens.tolist() == [7, 7, 6, 0] and cache.bound == 9
    with pytest.raises(ValueError, match="rows"):
        cache.rows(3, 2)
    with pytest.raises(ValueError, match="bound"):
        cache.set_bound(17)


@pytest.mark.parametrize("backend", ["native", "triton"])
def test_attention_backends_match_reference(backend):
    """The same model through each tree-attention backend: prefill, tree verify, decode."""
    hf = tiny_hf_model("qwen2", seed=12)
    ref_model, model = load_model(hf), load_model(hf, attention_backend=backend)
    parents = [-1, 0, 0, 1]
    masks, depths = _tree(parents)
    gen = torch.Generator().manual_seed(13)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=gen)
    nodes = torch.randint(0, VOCAB, (2, 4), generator=gen)
    outs = []
    for m in (ref_model, model):
        cache = m.new_cache(3, 16)
        with torch.no_grad():
            a = m(prompt, cache)
            cache.commit(torch.tensor([5, 5], dtype=torch.int32), 5)
            b = m(
                nodes, cache, tree_mask=torch.tensor([masks] * 2), depths=torch.tensor([depths] * 2)
            )
            cache.commit(torch.tensor([1, 1], dtype=torch.int32), 1)
            c = m(nodes[:, 1:2], cache)
        outs.append(torch.cat([a, b, c], dim=1))
    assert (outs[0] - outs[1]).abs().max() <= ATOL


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from osd.models.llama import rope_inv_freq

    hf_cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        num_attention_heads=4,
        rope_theta=500000.0,
        rope_scaling=rope,
    )
    ours = rope_inv_freq(ModelConfig.from_hf(hf_cfg))
    if rope is None:
        ref = 1.0 / (500000.0 ** (torch.arange(0, 32, 2).float() / 32))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg)
    assert torch.equal(ours, ref)


def test_packed_weights_match_and_go_stale_safely():
    """pack_weights keeps panel copies the decode kernel reads: decode logits still match
    transformers; a weight changed in place or replaced after packing is read directly."""
    hf = tiny_hf_model("llama_bias", seed=13)
    model = load_model(hf)
    added = model.pack_weights()
    # every linear but the 131-row head (not a multiple of 16) is packed
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert added == sum(m.weight.numel() * 4 for m in linears if m.weight.shape[0] % 16 == 0)
    assert model.pack_weights() == 0  # already packed: nothing to do
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    ref = _hf_logits(hf, ids)

    def decode_logits():
        cache = model.new_cache(2, 16)
        out = []
        with torch.no_grad():
            for t in range(ids.shape[1]):
                out.append(model(ids[:, t : t + 1], cache)[:, 0])
                cache.commit(torch.ones(2, dtype=torch.int32), 1)
        return torch.stack(out, 1)

    assert (decode_logits() - ref).abs().max() <= ATOL
    layer = model.layers[0].w_down
    with torch.no_grad():
        layer.weight.mul_(0.5)  # in place: the copy is stale
        hf.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    ref = _hf_logits(hf, ids)
    assert (decode_logits() - ref).abs().max() <= ATOL
    assert model.pack_weights() == layer.weight.numel() * 4  # only the stale one re-packs
    assert (decode_logits() - ref).abs().max() <= ATOL


def test_layer_skipping_copy_keeps_the_nope_layers():
    """SmolLM3 without its second layer: the standalone copy (self-speculation's draft)
    keeps RoPE off in the layer that had it off, now at a new index, and computes what the
    full model computes with that layer skipped."""
    from osd.models.llama import without_layers

    hf = SmolLM3ForCausalLM(
        SmolLM3Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=88,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            no_rope_layers=[1, 1, 0, 1],
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        )
    )
    model = load_model(hf.eval())
    assert model.config.nope_layers == (2,)
    sub = without_layers(model, frozenset({1}))
    assert sub.config.nope_layers == (1,) and [layer.rope for layer in sub.layers] == [
        True,
        False,
        True,
    ]
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model.forward_train(ids, skip_layers=frozenset({1}))
        assert (sub.forward_train(ids) - want).abs().max() <= ATOL


def test_multimodal_gemma3_checkpoint_loads_its_language_model(tmp_path):
    """Gemma 3 4B and larger ship as Gemma3ForConditionalGeneration: the language model
    (text_config, language_model.* tensors) loads on its own, in memory and from a saved
    directory, and gives the multimodal model's text logits."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = gemma3_config(
        {
            **dict(
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=88,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
            )
        }
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    hf = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=text.to_dict(),
            vision_config=vision.to_dict(),
            mm_tokens_per_image=4,
            image_token_index=VOCAB - 1,
            boi_token_index=VOCAB - 3,
            eoi_token_index=VOCAB - 2,
        )
    )
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((0.1 if "norm" in name else 0.3) * torch.randn(p.shape, generator=gen))
    hf.eval().save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB - 3, (1, 11), generator=gen)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits.float()
        for model in (load_model(hf), load_model(tmp_path)):
            assert model.config.architecture == "Gemma3ForCausalLM"
            assert (model(ids, model.new_cache(1, 16)) - ref).abs().max() <= ATOL


@pytest.mark.parametrize("window,softcap", [(5, None), (3, 2.0), (None, 1.5), (40, None)])
def test_windowed_attention_matches_a_per_query_loop(window, softcap):
    """``windowed_attention`` against a loop over every query of every row: ragged cached
    lengths, a causal block and a tree (keys placed by depth), 6 query heads over 2 KV
    heads, odd sizes; the window counts positions, the cap bends the scaled scores."""
    from osd.models.attention import windowed_attention
    from osd_kernels.tree_attention import tree_mask_from_parents

    gen = torch.Generator().manual_seed(11)
    B, Hq, Hkv, D, S = 3, 6, 2, 7, 37
    lens = torch.tensor([9, 0, 17, 4], dtype=torch.int32)  # B_max = 4
    k = torch.randn(4, Hkv, S, D, generator=gen)
    v = torch.randn(4, Hkv, S, D, generator=gen)
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2], [-1, 0, 1, 2, 3, 4], [-1, -1, 1, 0, 2, 2]])
    trees = {
        "causal": (None, None),
        "tree": (
            tree_mask_from_parents(parents),
            torch.tensor([[0, 1, 1, 2, 3, 2], [0, 1, 2, 3, 4, 5], [0, 0, 1, 1, 2, 2]]),
        ),
    }
    T = parents.shape[1]
    q = torch.randn(B, T, Hq, D, generator=gen)
    scale = D**-0.5
    for mask, depths in trees.values():
        got = windowed_attention(
            q,
            k,
            v,
            lens,
            mask,
            depths,
            scale=scale,
            max_kv_len=int(lens[:B].max()) + T,
            window=window,
            softcap=softcap,
        )
        for b in range(B):
            n = int(lens[b])
            d = list(range(T)) if depths is None else depths[b].tolist()
            for i in range(T):
                keys = list(range(n)) + [
                    n + j
                    for j in range(T)
                    if (j <= i if mask is None else (int(mask[b, i]) >> j) & 1)
                ]
                pos = [s if s < n else n + d[s - n] for s in keys]
                keys = [s for s, p in zip(keys, pos) if window is None or p > n + d[i] - window]
                for h in range(Hq):
                    kh = k[b, h // (Hq // Hkv), keys]
                    s_ = (kh @ q[b, i, h]) * scale
                    if softcap is not None:
                        s_ = torch.tanh(s_ / softcap) * softcap
                    want = torch.softmax(s_, 0) @ v[b, h // (Hq // Hkv), keys]
                    torch.testing.assert_close(got[b, i, h], want, rtol=1e-5, atol=1e-5)
