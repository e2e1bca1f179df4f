"""Prompts longer than a tree mask (64 tokens), up to 2,000: greedy output equals
transformers' for every family, speculative greedy equals plain greedy for every drafter,
ragged batches mix short and long prompts, and a chunked prefill equals one forward.

The kernel-level checks of causal blocks with ``T > 64`` (reference, C++ and Triton) are
in tests/test_tree_attention.py.
"""

import dataclasses

import pytest
import torch

import osd
from osd.models import load_model
from osd.spec import DynamicTree
from tests.test_generate import _hf_greedy
from tests.test_models import VOCAB, tiny_hf_model
from tests.test_speculative import perturbed

LENGTHS = (65, 100, 500, 2000)
NEW = 10  # generated tokens per prompt
MAX_SEQ = 2048


def long_model(family: str, seed: int) -> torch.nn.Module:
    """tests.test_models' tiny random model, declared with a context that fits 2,000 tokens."""
    hf = tiny_hf_model(family, seed=seed)
    hf.config.max_position_embeddings = 4096
    return hf


def prompts_of(lengths, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def with_chunk(model, chunk: int):
    """``model`` with prefill pieces of ``chunk`` tokens."""
    model.config = dataclasses.replace(model.config, prefill_chunk=chunk)
    return model


@pytest.fixture(scope="module")
def llama():
    """Target, its greedy outputs on LENGTHS (from transformers), and a perturbed draft."""
    hf = long_model("llama", seed=3)
    prompts = prompts_of(LENGTHS, seed=4)
    prompts[1] = (prompts[1][:20] * 5)[:100]  # repetition: prompt lookup finds matches
    ref = [_hf_greedy(hf, p, NEW) for p in prompts]
    return hf, perturbed(hf, 0.35, seed=5), prompts, ref


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "granite",
        "olmo2",
        "phi3",
        "smollm3",
        "mistral_window",
        "gemma2",
        "gemma3",
        "mixtral",
    ],
)
def test_greedy_equals_transformers(family):
    """Each prompt alone (one cache row, continuous refill); 2,000 tokens is four pieces of
    the default 512-token chunk."""
    hf = long_model(family, seed=7)
    prompts = prompts_of(LENGTHS, seed=8)
    eng = osd.Engine(load_model(hf), max_batch_size=1, max_seq_len=MAX_SEQ)
    outs = eng.generate(prompts, osd.SamplingParams(NEW))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _hf_greedy(hf, prompt, NEW), len(prompt)


def test_longrope_long_factors_past_the_original_context():
    """Phi-3 LongRoPE (Phi-4-mini's layout) past its original context, 256 positions in the
    tiny model: an engine whose context exceeds it rotates with the long factors, as
    transformers does for sequences longer than that, so greedy from prompts of 300 and
    480 tokens equals transformers', plain and speculative (self-speculation included).
    (The model keeps its declared 512 positions: transformers derives the attention
    factor from them when it builds the model.)"""
    hf = tiny_hf_model("phi3_longrope", seed=9)
    prompts = prompts_of((300, 480), seed=10)
    model = load_model(hf)
    plain = osd.Engine(model, max_batch_size=1, max_seq_len=500)
    outs = plain.generate(prompts, osd.SamplingParams(NEW))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _hf_greedy(hf, prompt, NEW), len(prompt)
    spec = osd.Engine(
        model,
        max_batch_size=1,
        max_seq_len=500,
        spec=osd.SpecConfig(drafter="self", num_draft_tokens=3),
    )
    assert [o.token_ids for o in spec.generate(prompts, osd.SamplingParams(NEW))] == [
        o.token_ids for o in outs
    ]


SPECS = {
    "chain": dict(num_draft_tokens=4),
    "dynamic_tree": dict(tree=DynamicTree(topk=3, depth=3, max_nodes=12)),
    "self": dict(drafter="self", skip_layers=(1,), num_draft_tokens=4),
    "ngram": dict(drafter="ngram", num_draft_tokens=4),
    "prompt_lookup": dict(num_draft_tokens=4, prompt_lookup=True),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_speculative_greedy_equals_plain(llama, name):
    """Two rows of mixed lengths, prefill in 192-token pieces (target and draft)."""
    hf, draft, prompts, ref = llama
    spec = SPECS[name]
    uses_draft = spec.get("drafter", "model") == "model"
    eng = osd.Engine(
        with_chunk(load_model(hf), 192),
        draft=with_chunk(load_model(draft), 192) if uses_draft else None,
        spec=osd.SpecConfig(**spec),
        max_batch_size=2,
        max_seq_len=MAX_SEQ,
    )
    outs = eng.generate(prompts, osd.SamplingParams(NEW))
    assert [o.token_ids for o in outs] == ref
    assert eng.stats["drafted"] > 0


def test_ragged_batch_mixes_short_and_long(llama):
    """Short and long prompts share a padded prefill (its piece boundaries cut the long
    rows, the short rows end in the first piece) and then decode together."""
    hf, _, prompts, ref = llama
    short = prompts_of([3, 17, 64], seed=9)
    mixed = [short[0], prompts[3], short[1], prompts[0], prompts[2], short[2], prompts[1]]
    eng = osd.Engine(with_chunk(load_model(hf), 300), max_batch_size=4, max_seq_len=MAX_SEQ)
    outs = eng.generate(mixed, osd.SamplingParams(NEW))
    want = [_hf_greedy(hf, p, NEW) for p in short]
    expect = [want[0], ref[3], want[1], ref[0], ref[2], want[2], ref[1]]
    assert [o.token_ids for o in outs] == expect


def test_chunked_prefill_equals_one_forward():
    """DecoderLM.prefill in pieces (one token, odd sizes, and all at once) on a ragged
    batch: the same logits, committed lengths and cached K/V."""
    model = load_model(long_model("qwen2", seed=10))
    lengths = [150, 70, 3, 129]
    T = max(lengths)
    ids = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(11))
    lens = torch.tensor(lengths, dtype=torch.int32)
    index = torch.tensor([[149, 0, 64, 65], [69, 36, 37, 0], [2, 1, 0, 0], [128, 127, 63, 64]])
    results = {}
    with torch.no_grad():
        for chunk in (T, 1, 37, 64):
            cache = model.new_cache(5, T + 8)
            full = model.prefill(ids, cache, lens, chunk=chunk)
            assert cache.lens.tolist() == lengths + [0] and cache.bound == T
            picked = model.prefill(
                ids, model.new_cache(4, T), lens, chunk=chunk, logits_index=index
            )
            results[chunk] = full, picked, cache
    full, _, cache = results[T]
    for chunk in (1, 37, 64):
        got, picked, got_cache = results[chunk]
        for b, n in enumerate(lengths):
            torch.testing.assert_close(got[b, :n], full[b, :n], rtol=0, atol=1e-4)
            torch.testing.assert_close(
                got_cache.kv[:, :, b, :, :n], cache.kv[:, :, b, :, :n], rtol=0, atol=1e-4
            )
        torch.testing.assert_close(
            picked, full.gather(1, index[..., None].expand(-1, -1, VOCAB)), rtol=0, atol=1e-4
        )


def test_engine_prefill_positions_across_pieces():
    """The engine's last-``m`` prompt logits (online learning) straddle piece boundaries:
    the same with 16-token pieces as with one forward, and generation agrees."""
    hf = long_model("mistral", seed=12)
    prompts = prompts_of([100, 5, 66], seed=13)
    params = osd.SamplingParams(NEW)
    got = {}
    for chunk in (16, 512):
        eng = osd.Engine(with_chunk(load_model(hf), chunk), max_batch_size=3, max_seq_len=256)
        requests = eng._requests(prompts, params)
        with torch.no_grad():
            got[chunk] = eng.prefill(requests, start_row=0, prompt_positions=24)
        assert eng.cache.lens[:3].tolist() == [100, 5, 66]
        got[chunk, "gen"] = [o.token_ids for o in eng.generate(prompts, params)]
    assert got[16].shape == (3, 24, VOCAB)
    torch.testing.assert_close(got[16], got[512], rtol=0, atol=1e-4)
    assert got[16, "gen"] == got[512, "gen"]
    assert got[16, "gen"][0] == _hf_greedy(hf, prompts[0], NEW)


def test_tree_mask_limit_names_the_problem():
    """Causal forwards take any length; a tree mask still covers at most 64 tokens."""
    model = load_model(long_model("llama", seed=14))
    cache = model.new_cache(1, 200)
    ids = torch.zeros(1, 65, dtype=torch.int64)
    with torch.no_grad():
        assert model(ids, cache).shape == (1, 65, VOCAB)
        with pytest.raises(ValueError, match="at most 64"):
            model(ids, cache, tree_mask=torch.zeros(1, 65, dtype=torch.int64))
        with pytest.raises(ValueError, match="chunk"):
            model.prefill(ids, cache, torch.tensor([65], dtype=torch.int32), chunk=0)


def test_engine_prefill_chunk_option(llama):
    hf, draft, prompts, ref = llama
    eng = osd.Engine.from_pretrained(
        hf, draft=draft, max_batch_size=2, max_seq_len=MAX_SEQ, prefill_chunk=48
    )
    assert eng.model.config.prefill_chunk == 48 == eng.draft.config.prefill_chunk
    outs = eng.generate(prompts[:2], osd.SamplingParams(NEW))
    assert [o.token_ids for o in outs] == ref[:2]
    with pytest.raises(ValueError, match="prefill_chunk"):
        osd.Engine.from_pretrained(hf, max_seq_len=MAX_SEQ, prefill_chunk=0)


@pytest.mark.parametrize("spec", [None, osd.SpecConfig(num_draft_tokens=3)], ids=["plain", "spec"])
def test_staged_prompts_back_to_back_in_a_full_lane(spec):
    """Two staged prompts in a row while the lane is full: the one joining the lane keeps
    its row reserved, so the next staged prompt waits instead of overflowing the rows."""
    hf = tiny_hf_model("llama", seed=41)
    prompts = prompts_of([7, 3, 12, 5, 9, 20, 2], seed=42)
    ref = osd.Engine.from_pretrained(hf, max_batch_size=8).generate(prompts, osd.SamplingParams(12))
    draft = [perturbed(hf, 0.3, seed=43)] if spec else None
    eng = osd.Engine.from_pretrained(
        hf, draft=draft, spec=spec, max_batch_size=2, max_seq_len=160, prefill_chunk=8
    )
    outs = eng.generate(prompts, osd.SamplingParams(12))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
