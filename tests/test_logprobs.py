"""``SamplingParams.logprobs``: each generated token's log-probability under the target
(before warping) and the most likely tokens', equal to transformers' on the same sequence
whether the token came from plain decoding, a chain or a tree verify, or sampling."""

import pytest
import torch

import osd
from osd import zoo
from osd.online.buffer import Example
from osd.online.distill import heldout_alpha
from osd.scoring import draft_alphas
from tests.test_eagle import _eagle
from tests.test_models import tiny_hf_model
from tests.test_speculative import TREE, perturbed, prompts_of

N_TOP = 5


@pytest.fixture(scope="module")
def target():
    return tiny_hf_model("llama", seed=31)


def _reference(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' log-probabilities ``[len(generated), V]`` of each generated position."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def _check(hf, prompt, out, n_top=N_TOP):
    ref = _reference(hf, prompt, out.token_ids)
    assert [e.token_id for e in out.logprobs] == out.token_ids
    for j, e in enumerate(out.logprobs):
        assert e.logprob == pytest.approx(ref[j, e.token_id].item(), abs=1e-4)
        assert len(e.top) == n_top
        top = ref[j].topk(n_top)
        assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert {i for i, _ in e.top} == set(top.indices.tolist())


@pytest.mark.parametrize(
    "spec",
    [
        None,
        dict(num_draft_tokens=4),
        dict(tree=TREE),
        dict(tree=osd.DynamicTree(topk=3, depth=3, max_nodes=8)),
    ],
    ids=["plain", "chain", "tree", "dynamic"],
)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_equal_transformers(target, spec, temperature):
    draft = perturbed(target, 0.3, seed=32) if spec is not None else None
    eng = osd.Engine.from_pretrained(
        target,
        draft=draft,
        max_batch_size=3,
        max_seq_len=96,
        spec=osd.SpecConfig(**spec) if spec else None,
    )
    prompts = prompts_of([5, 11, 3], seed=33)
    params = osd.SamplingParams(20, temperature=temperature, top_k=20, seed=4, logprobs=N_TOP)
    outs = eng.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        _check(target, prompt, out)
        if temperature == 0:  # greedy: the chosen token is the most likely one
            assert all(e.top[0][0] == e.token_id for e in out.logprobs)
    # Without logprobs, none are kept; with 0, only the chosen token's.
    assert eng.generate(prompts[:1], osd.SamplingParams(4))[0].logprobs is None
    [out] = eng.generate(prompts[:1], osd.SamplingParams(6, logprobs=0))
    _check(target, prompts[0], out, n_top=0)


def test_logprobs_follow_stop_strings_and_bad_values_raise():
    target, draft = zoo.default_pair()
    eng = osd.Engine.from_pretrained(
        target,
        draft=draft,
        max_batch_size=1,
        max_seq_len=128,
        spec=osd.SpecConfig(num_draft_tokens=4),
    )
    [free] = eng.generate(["def add(a, b):"], osd.SamplingParams(32, logprobs=2))
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    [cut] = eng.generate(["def add(a, b):"], osd.SamplingParams(32, logprobs=2, stop=stop))
    assert len(cut.logprobs) == len(cut.token_ids) < len(free.token_ids)
    assert cut.logprobs == free.logprobs[: len(cut.token_ids)]
    for bad, err in [(-1, ValueError), (21, ValueError), (2.5, TypeError), ("3", TypeError)]:
        with pytest.raises(err, match="logprobs"):
            osd.SamplingParams(4, logprobs=bad)


def test_score_equals_transformers(target):
    """``Engine.score``: each prompt token's log-probability given the ones before it, in
    pieces of ``prefill_chunk`` tokens (here 4), equal to transformers' on the whole
    prompt; the serving engine's outputs are unchanged around it."""
    eng = osd.Engine.from_pretrained(
        target,
        draft=perturbed(target, 0.3, seed=34),
        max_batch_size=2,
        max_seq_len=96,
        prefill_chunk=4,
        spec=osd.SpecConfig(num_draft_tokens=3),
    )
    prompts = prompts_of([11, 2, 9], seed=35)
    before = eng.generate(prompts[:1], osd.SamplingParams(10))[0].token_ids
    scored = eng.score(prompts, logprobs=3)
    for prompt, entries in zip(prompts, scored):
        assert len(entries) == len(prompt) and entries[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(target(torch.tensor([prompt])).logits[0].float(), -1)
        for j, e in enumerate(entries[1:], start=1):
            assert e.token_id == prompt[j]
            assert e.logprob == pytest.approx(ref[j - 1, prompt[j]].item(), abs=1e-4)
            assert [v for _, v in e.top] == pytest.approx(
                ref[j - 1].topk(3).values.tolist(), abs=1e-4
            )
    assert eng.generate(prompts[:1], osd.SamplingParams(10))[0].token_ids == before
    with pytest.raises(ValueError, match="logprobs must be in"):
        eng.score(prompts, logprobs=50)


def test_draft_alphas_equal_transformers_teacher_forced(target):
    """``draft_alphas``: each draft's mean ``sum_x min(p, q)`` over the answer positions,
    p and q transformers' softmax on the whole sequence; a reduced head puts no mass
    outside its rows; the target as its own draft scores 1; an EAGLE draft scores what the
    online learner's held-out scoring gives the same answer."""
    hf_draft = perturbed(target, 0.4, seed=36)
    eng = osd.Engine.from_pretrained(
        target,
        draft=hf_draft,
        max_batch_size=1,
        max_seq_len=96,
        spec=osd.SpecConfig(num_draft_tokens=3),
    )
    prompt = prompts_of([13], seed=37)[0]
    ids = prompt + eng.generate([prompt], osd.SamplingParams(17))[0].token_ids
    reduced = osd.Engine.from_pretrained(hf_draft, max_batch_size=1, max_seq_len=96).model
    head = torch.randperm(reduced.vocab_size, generator=torch.Generator().manual_seed(38))[:50]
    reduced.restrict_head(head)
    eagle = _eagle(eng.model, seed=39)
    got = draft_alphas(eng.model, [eng.draft, reduced, eng.model, eagle], ids, len(prompt))
    with torch.no_grad():
        x = torch.tensor([ids])
        p = torch.softmax(target(x).logits[0, len(prompt) - 1 : -1].float(), -1)
        q = torch.softmax(hf_draft(x).logits[0, len(prompt) - 1 : -1].float(), -1)
    assert got[0] == pytest.approx(torch.minimum(p, q).sum(-1).mean().item(), abs=1e-5)
    q_head = torch.zeros_like(q)
    q_head[:, head] = torch.softmax(torch.log(q[:, head]), -1)
    assert got[1] == pytest.approx(torch.minimum(p, q_head).sum(-1).mean().item(), abs=1e-5)
    assert got[2] == pytest.approx(1.0, abs=1e-5)
    # the EAGLE draft against the learner's held-out scoring of the same answer (its own
    # alignment of tokens, features and targets), with the target's full logits
    with torch.no_grad():
        full, feats = eng.model.forward_train(torch.tensor([ids]), return_hidden=True)
    tokens = torch.tensor(ids)
    positions = torch.arange(len(prompt), len(ids))
    ex = Example(
        tokens,
        positions,
        None,
        None,
        full[0, positions - 1],
        features=feats[0, :-1].to(torch.float16),
    )
    assert got[3] == pytest.approx(heldout_alpha(eagle, [ex], 512, "cpu"), abs=2e-3)
    with pytest.raises(ValueError, match="1 <= start < len"):
        draft_alphas(eng.model, [eng.draft], ids, len(ids))
