"""Loading our decoder: Hugging Face checkpoint directories in every weight layout,
half precision, ``config.json`` parsing (old and new styles) and the language model of a
multimodal Gemma 3 checkpoint, each against transformers on tiny random models
(``tests.test_models``)."""

import copy
import json

import pytest
import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    SiglipVisionConfig,
    Qwen2Config,
)

from osd.models import ModelConfig, load_model
from tests.test_models import ATOL, VOCAB, _hf_logits, gemma3_config, tiny_hf_model


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


def test_multimodal_gemma3_checkpoint_loads_its_language_model(tmp_path):
    """Gemma 3 4B and larger ship as Gemma3ForConditionalGeneration: the language model
    (text_config, language_model.* tensors) loads on its own, in memory and from a saved
    directory, and gives the multimodal model's text logits."""
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
