"""Repetition, presence and frequency penalties: plain and speculative decoding (chain,
static and dynamic trees, prompt lookup) sample from the penalized target, each verified
position counting the drafts on its own path. Greedy output equals a step-by-step loop
over transformers' logits with the penalties written out; sampled output follows the
penalized target's exact joint."""

import pytest
import torch

import osd
from osd_kernels.warp import warp_probs
from tests.test_models import tiny_hf_model
from tests.test_speculative import (
    TREE,
    V_SMALL,
    _small_pair,
    assert_joint_follows_target,
    perturbed,
    prompts_of,
)

PENALTIES = dict(repetition_penalty=1.6, presence_penalty=0.7, frequency_penalty=0.4)


def _penalized(logits: torch.Tensor, prompt, output, p) -> torch.Tensor:
    """vLLM's penalties on one position's ``logits [V]``, written out token by token."""
    x = logits.clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def _reference(hf, prompt, n, p):
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        out.append(int(_penalized(logits, prompt, out, p).argmax()))
    return out


@pytest.mark.parametrize(
    "spec",
    [
        None,
        dict(num_draft_tokens=4),
        dict(tree=TREE),
        dict(tree=osd.DynamicTree(topk=3, depth=3, max_nodes=8)),
        dict(num_draft_tokens=3, prompt_lookup=True, ngram_min=1),
    ],
    ids=["plain", "chain", "tree", "dynamic", "lookup"],
)
def test_greedy_with_penalties_equals_the_written_out_loop(spec):
    target = tiny_hf_model("llama", seed=41)
    draft = perturbed(target, 0.3, seed=42) if spec else None
    eng = osd.Engine.from_pretrained(
        target,
        draft=draft,
        max_batch_size=3,
        max_seq_len=96,
        spec=osd.SpecConfig(**spec) if spec else None,
    )
    prompts = prompts_of([6, 3, 9], seed=43)
    prompts[2] = prompts[2] * 3  # repeats: lookup matches, penalties bite
    p = osd.SamplingParams(24, **PENALTIES)
    outs = eng.generate(prompts, p)
    free = eng.generate(prompts, osd.SamplingParams(24))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _reference(target, prompt, 24, p)
    assert [o.token_ids for o in outs] != [o.token_ids for o in free]  # penalties changed it
    if spec:
        assert eng.stats["accepted"] > 0


def _exact_joint(target, prompt, params, n=3):
    """P(first n tokens) of the penalized, warped target alone, by enumeration."""
    joint, ctxs = torch.ones(1), [[]]
    for _ in range(n):
        with torch.no_grad():
            logits = target(torch.tensor([prompt + c for c in ctxs])).logits[:, -1].float()
        logits = torch.stack([_penalized(x, prompt, c, params) for x, c in zip(logits, ctxs)])
        B = logits.shape[0]
        probs = warp_probs(
            logits,
            torch.full((B,), params.temperature),
            torch.full((B,), params.top_k),
            torch.full((B,), params.top_p),
        )
        joint = (joint[:, None] * probs).reshape(-1)
        ctxs = [c + [t] for c in ctxs for t in range(V_SMALL)]
    return joint


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec", [dict(num_draft_tokens=2), dict(tree=[(0,), (1,), (0, 0)])], ids=["chain", "tree"]
)
def test_sampled_with_penalties_follows_the_penalized_target(spec):
    target, draft = _small_pair()
    prompt, n = [3, 1, 4, 1], 40_000
    sp = osd.SamplingParams(3, seed=99, temperature=0.9, top_k=10, **PENALTIES)
    eng = osd.Engine.from_pretrained(
        target, draft=draft, spec=osd.SpecConfig(**spec), max_batch_size=4096, max_seq_len=16
    )
    assert_joint_follows_target(eng, target, prompt, sp, n, exact_joint=_exact_joint)


@pytest.mark.parametrize(
    "field,value,err",
    [
        ("repetition_penalty", 0.0, ValueError),
        ("repetition_penalty", float("inf"), ValueError),
        ("presence_penalty", 2.5, ValueError),
        ("frequency_penalty", -3, ValueError),
        ("presence_penalty", "1", TypeError),
        ("repetition_penalty", True, TypeError),
    ],
)
def test_bad_penalties_raise(field, value, err):
    with pytest.raises(err, match=field):
        osd.SamplingParams(4, **{field: value})


@pytest.mark.gpu
def test_cuda_moe_target_with_penalties_and_logprobs_equals_cpu():
    """On CUDA (eager: a mixture of experts runs without graphs): a Qwen3-MoE target with a
    dense draft, penalties and logprobs gives the CPU engine's greedy tokens."""
    target = tiny_hf_model("qwen3_moe", seed=51)
    draft = tiny_hf_model("qwen3", seed=52)
    prompts = prompts_of([7, 4], seed=53)
    p = osd.SamplingParams(20, logprobs=2, **PENALTIES)
    outs = {}
    for device in ("cpu", "cuda"):
        eng = osd.Engine.from_pretrained(
            target,
            draft=draft,
            device=device,
            max_batch_size=2,
            max_seq_len=64,
            spec=osd.SpecConfig(num_draft_tokens=3),
        )
        outs[device] = eng.generate(prompts, p)
    for a, b in zip(outs["cpu"], outs["cuda"]):
        assert a.token_ids == b.token_ids
        assert [e.logprob for e in a.logprobs] == pytest.approx(
            [e.logprob for e in b.logprobs], abs=1e-3
        )


def test_mixed_batch_rows_equal_each_alone():
    """Rows with penalties, logprobs and stop ids share a speculative batch with plain rows;
    each gets what it gets alone."""
    target = tiny_hf_model("llama", seed=61)
    eng = osd.Engine.from_pretrained(
        target,
        draft=perturbed(target, 0.3, seed=62),
        max_batch_size=4,
        max_seq_len=96,
        spec=osd.SpecConfig(num_draft_tokens=3),
    )
    prompts = prompts_of([5, 8, 3, 6], seed=63)
    free = eng.generate(prompts[3:], osd.SamplingParams(20))[0]
    params = [
        osd.SamplingParams(20, **PENALTIES),
        osd.SamplingParams(20),
        osd.SamplingParams(20, logprobs=1, repetition_penalty=1.2),
        osd.SamplingParams(
            20, stop_token_ids=[free.token_ids[6]], temperature=0.8, seed=5, frequency_penalty=0.5
        ),
    ]
    together = eng.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together):
        [alone] = eng.generate([prompt], p)
        assert out.token_ids == alone.token_ids
        assert (out.logprobs is None) == (p.logprobs is None)


@pytest.mark.parametrize(
    "spec", [None, dict(num_draft_tokens=4), dict(tree=TREE)], ids=["plain", "chain", "tree"]
)
def test_logit_bias(spec):
    """A bias of +100 forces its token; -100 bans the free greedy choice at every step;
    speculative output equals plain."""
    target = tiny_hf_model("llama", seed=71)
    kw = dict(max_batch_size=2, max_seq_len=64)
    plain = osd.Engine.from_pretrained(target, **kw)
    eng = osd.Engine.from_pretrained(
        target,
        draft=perturbed(target, 0.3, seed=72) if spec else None,
        spec=osd.SpecConfig(**spec) if spec else None,
        **kw,
    )
    prompts = prompts_of([5, 7], seed=73)
    [forced] = eng.generate(prompts[:1], osd.SamplingParams(8, logit_bias={17: 100}))
    assert forced.token_ids == [17] * 8
    free = plain.generate(prompts, osd.SamplingParams(12))
    ban = {free[0].token_ids[0]: -100, free[1].token_ids[3]: -100}
    p = osd.SamplingParams(12, logit_bias=ban, repetition_penalty=1.3)
    want, got = plain.generate(prompts, p), eng.generate(prompts, p)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(t not in ban for o in got for t in o.token_ids)
    with pytest.raises(ValueError, match="logit_bias has token id 999"):
        eng.generate(prompts, osd.SamplingParams(4, logit_bias={999: 1.0}))
    with pytest.raises(ValueError, match=r"logit_bias\[3\] must be in \[-100, 100\]"):
        osd.SamplingParams(4, logit_bias={3: 101})
    with pytest.raises(TypeError, match="logit_bias must be a mapping"):
        osd.SamplingParams(4, logit_bias=[3])


@pytest.mark.parametrize(
    "spec", [None, dict(num_draft_tokens=4), dict(tree=TREE)], ids=["plain", "chain", "tree"]
)
def test_min_tokens_and_ignore_eos(spec):
    """``min_tokens``: the stop ids are banned until that many tokens (the output equals a
    written-out loop that bans them); ``ignore_eos``: EOS no longer ends the output."""
    target = tiny_hf_model("llama", seed=81)
    prompts = prompts_of([4, 6, 5, 7], seed=82)
    free = osd.Engine.from_pretrained(target, max_batch_size=4, max_seq_len=64).generate(
        prompts, osd.SamplingParams(16)
    )
    eos = free[0].token_ids[2]  # an id every row may meet early
    target.config.eos_token_id = eos
    kw = dict(max_batch_size=4, max_seq_len=64)
    eng = osd.Engine.from_pretrained(
        target,
        draft=perturbed(target, 0.3, seed=83) if spec else None,
        spec=osd.SpecConfig(**spec) if spec else None,
        **kw,
    )
    stopped = eng.generate(prompts, osd.SamplingParams(16))
    assert stopped[0].token_ids == free[0].token_ids[:3] and stopped[0].finish_reason == "stop"
    got = eng.generate(prompts, osd.SamplingParams(16, min_tokens=8))
    for prompt, out in zip(prompts, got):
        ref = []
        for _ in range(16):
            with torch.no_grad():
                logits = target(torch.tensor([prompt + ref])).logits[0, -1].float()
            if len(ref) < 8:
                logits[eos] = float("-inf")
            ref.append(int(logits.argmax()))
            if ref[-1] == eos:
                break
        assert out.token_ids == ref
        assert eos not in out.token_ids[:8]
    ignored = eng.generate(prompts, osd.SamplingParams(16, ignore_eos=True))
    assert [o.token_ids for o in ignored] == [o.token_ids for o in free]
    assert all(o.finish_reason == "length" for o in ignored)
    with pytest.raises(ValueError, match="min_tokens must be in"):
        osd.SamplingParams(4, min_tokens=5)
