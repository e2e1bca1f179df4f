"""The prefix cache: prompt K/V kept across requests (``osd.prefix_cache``).

Blocks match exactly and only whole; eviction keeps the capacity and drops a block with
the blocks below it; an engine with the cache gives the same greedy tokens as one
without, plain and speculative, through ragged batches, staged long prompts and online
learning that keeps prompt logits; blocks keep the target's features for an EAGLE draft
(its engine-level check is in tests/test_eagle.py); bad sizes raise.
"""

import dataclasses

import pytest
import torch

import osd
from osd.models import load_model
from osd.prefix_cache import PrefixCache
from tests.test_models import VOCAB, tiny_hf_model
from tests.test_speculative import perturbed

L, H, D, S = 2, 2, 4, 128


def _row(tokens: list[int]) -> torch.Tensor:
    """A fake cache row ``[L, 2, H, S, D]`` whose slot t holds a value of tokens[:t + 1]."""
    row = torch.zeros(L, 2, H, S, D)
    acc = 0
    for t, tok in enumerate(tokens):
        acc = (acc * 31 + tok + 1) % 1000003
        row[:, :, :, t] = float(acc)
    return row


def test_load_returns_whole_blocks_of_the_exact_prefix():
    pc = PrefixCache(capacity_tokens=256, block=8)
    a = list(range(30))
    pc.store(a, _row(a))
    assert len(pc) == 3  # 24 of 30 tokens: whole blocks
    b = a[:20] + [99] * 10  # shares 20 tokens: 2 blocks
    dst = torch.full((L, 2, H, S, D), -1.0)
    assert pc.load(b, len(b) - 1, dst) == (16, None)
    assert torch.equal(dst[:, :, :, :16], _row(a)[:, :, :, :16])
    assert (dst[:, :, :, 16:] == -1).all()
    assert pc.load(a, 23, dst)[0] == 16  # the limit cuts the third block
    assert pc.load(a, 24, dst)[0] == 24
    assert pc.load([5] + a, 30, dst)[0] == 0  # a shifted prompt matches nothing
    st = pc.stats()
    assert st["tokens_reused"] == 56 and st["blocks"] == 3


def test_eviction_keeps_capacity_and_drops_subtrees():
    pc = PrefixCache(capacity_tokens=32, block=8)  # 4 blocks
    a, b = [1] * 32, [2] * 16
    pc.store(a, _row(a))
    assert len(pc) == 4
    pc.store(b, _row(b))  # evicts a's oldest: its first block
    assert len(pc) <= 4
    dst = torch.zeros(L, 2, H, S, D)
    assert pc.load(b, 16, dst)[0] == 16
    assert pc.load(a, 32, dst)[0] == 0  # a's root block went with its subtree
    c = [3] * 80  # longer than the capacity
    pc.store(c, _row(c))
    assert len(pc) == 4
    assert pc.load(c, 80, dst)[0] == 32


def test_features_kept_with_the_blocks():
    """A lookup that needs the target's features follows only blocks that have them; a
    later store with features adds them to the blocks kept without."""
    pc = PrefixCache(capacity_tokens=256, block=8)
    a = list(range(20))
    pc.store(a, _row(a))
    dst = torch.zeros(L, 2, H, S, D)
    assert pc.load(a, 19, dst, need_hidden=True) == (0, None)
    feats = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    pc.store(a, _row(a), feats)
    n, got = pc.load(a, 19, dst, need_hidden=True)
    assert n == 16 and torch.equal(got, feats[:16])
    b = a[:8] + [77] * 12  # a new branch, kept with features
    fb = -torch.ones(20, 3)
    pc.store(b, _row(b), fb)
    n, got = pc.load(b, 20, dst, need_hidden=True)
    assert n == 16 and torch.equal(got, torch.cat([feats[:8], fb[8:16]]))


@pytest.mark.parametrize("capacity,block", [(8, 16), (0, 16), (64, 0)])
def test_bad_sizes_raise(capacity, block):
    with pytest.raises(ValueError, match="PrefixCache"):
        PrefixCache(capacity, block)


@pytest.fixture(scope="module")
def pair():
    hf = tiny_hf_model("llama", seed=21)
    hf.config.max_position_embeddings = 1024
    return load_model(hf), load_model(perturbed(hf, 0.3, seed=22)), hf


def _prompts(seed: int) -> list[list[int]]:
    """Prompts sharing a 37-token system prefix, repeats, a prompt that is a prefix of
    another, lengths on and off the 16-token blocks, and two long ones sharing 300 tokens."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    system, long = rand(37), rand(300)
    first = system + rand(20)
    return [
        first,
        system + rand(11),
        first,
        system + rand(27),
        first[:48],
        system,
        long + rand(40),
        long + rand(13),
        first + rand(5),
    ]


@pytest.mark.parametrize("drafted", [False, True])
@pytest.mark.parametrize("chunk", [512, 64])
@pytest.mark.parametrize("kv_dtype", [None, torch.float16], ids=["float32-kv", "float16-kv"])
def test_greedy_equals_without_the_cache(pair, drafted, chunk, kv_dtype):
    """Served in batches of 3 and one by one; chunk 64 stages the long prompts; over a
    float32 cache and over a float16 one (the prefix cache keeps the cache's own dtype)."""
    target, draft, _ = pair
    target.kv_dtype = kv_dtype
    target.config = dataclasses.replace(target.config, prefill_chunk=chunk)
    prompts = _prompts(seed=23)
    kw = dict(
        max_seq_len=512,
        draft=draft if drafted else None,
        spec=osd.SpecConfig(num_draft_tokens=3, prompt_lookup=True) if drafted else None,
    )
    params = osd.SamplingParams(12)
    try:
        ref = [
            o.token_ids
            for o in osd.Engine(target, max_batch_size=3, **kw).generate(prompts, params)
        ]
        for batch in (3, 1):
            eng = osd.Engine(target, max_batch_size=batch, prefix_cache=4096, **kw)
            assert eng.cache.kv.dtype == (kv_dtype or torch.float32)
            assert [o.token_ids for o in eng.generate(prompts, params)] == ref
            st = eng.stats["prefix_cache"]
            # One by one each prompt reuses every earlier one's whole blocks (the last
            # token always fed): 32 + 48 + 32 + 32 + 32 + 0 + 288 + 48. A batch's prompts
            # are kept after their prefill, so they reuse only earlier batches.
            assert st["tokens_reused"] == 512 if batch == 1 else st["tokens_reused"] > 0, st
            again = eng.generate(prompts[:2], params)  # kept across generate calls
            assert [o.token_ids for o in again] == ref[:2]
    finally:
        target.config = dataclasses.replace(target.config, prefill_chunk=512)
        target.kv_dtype = None


def test_online_prompt_logits_stay_fed(pair):
    """Online learning that keeps the last 8 prompt positions' logits: the cache never
    covers them, outputs stay the target's, and the learner receives every request."""
    target, _, hf = pair
    prompts = _prompts(seed=24)
    params = osd.SamplingParams(10)
    ref = [o.token_ids for o in osd.Engine(target, max_seq_len=512).generate(prompts, params)]
    online = osd.OnlineConfig(
        prompt_positions=8, update_every_requests=4, steps_per_update=1, background=False
    )
    eng = osd.Engine(
        target,
        draft=load_model(perturbed(hf, 0.3, seed=22)),
        max_seq_len=512,
        online=online,
        prefix_cache=4096,
    )
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert eng.stats["prefix_cache"]["tokens_reused"] > 0
    assert eng.stats["online"]["requests"] == len(prompts)


@pytest.mark.parametrize("bad", [-1, 8])
def test_engine_rejects_bad_prefix_cache(pair, bad):
    with pytest.raises(ValueError, match="prefix_cache|PrefixCache"):
        osd.Engine(pair[0], prefix_cache=bad)
