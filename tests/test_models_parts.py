"""Parts of our decoder on their own: parameter count and fresh weights, KV cache rows,
the attention backends and windowed attention against references, RoPE frequencies
against transformers, packed decode weights, and the layer-skipping copy."""

import pytest
import torch
from transformers import (
    LlamaConfig,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from osd.cache import KVCache
from osd.models import DecoderLM, ModelConfig, load_model
from osd.models.attention import attention, windowed_attention
from osd.models.llama import without_layers
from osd.models.rope import rope_inv_freq
from osd_kernels import native_available
from osd_kernels.tree_attention import tree_mask_from_parents
from tests.test_models import ATOL, VOCAB, _hf_logits, _tree, tiny_hf_model


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


@pytest.mark.skipif(not native_available(), reason="the C++ extension is not built")
@pytest.mark.parametrize("window", [5, 16])
def test_windowed_rows_do_not_depend_on_the_queries_beside_them(window):
    """Past the window on the CPU, a causal call's query computes over its window's slice
    alone: each query of a verify block equals, bit for bit, the same query decoded alone
    (one row, lens advanced to its position), and all of them match the SDPA reference."""
    gen = torch.Generator().manual_seed(12)
    B, T, Hq, Hkv, D, S = 3, 7, 4, 2, 16, 64
    lens = torch.tensor([30, 3, 41, 0], dtype=torch.int32)
    k = torch.randn(4, Hkv, S, D, generator=gen)
    v = torch.randn(4, Hkv, S, D, generator=gen)
    q = torch.randn(B, T, Hq, D, generator=gen)
    kw = dict(scale=D**-0.5, max_kv_len=int(lens[:B].max()) + T, backend="auto", window=window)
    block = attention(q, k, v, lens, None, **kw)
    want = windowed_attention(
        q, k, v, lens, None, None, scale=kw["scale"], max_kv_len=kw["max_kv_len"], window=window
    )
    torch.testing.assert_close(block, want, rtol=1e-5, atol=1e-5)
    for b in range(B):
        for i in range(T):
            one = attention(
                q[b : b + 1, i : i + 1],
                k[b : b + 1],
                v[b : b + 1],
                lens[b : b + 1] + i,
                None,
                **dict(kw, max_kv_len=int(lens[b]) + i + 1),
            )
            if int(lens[b]) + i + 1 > window:  # past the window: the per-query path
                assert torch.equal(one[0, 0], block[b, i]), (b, i)


@pytest.mark.parametrize("window,softcap", [(5, None), (3, 2.0), (None, 1.5), (40, None)])
def test_windowed_attention_matches_a_per_query_loop(window, softcap):
    """``windowed_attention`` against a loop over every query of every row: ragged cached
    lengths, a causal block and a tree (keys placed by depth), 6 query heads over 2 KV
    heads, odd sizes; the window counts positions, the cap bends the scaled scores."""
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
