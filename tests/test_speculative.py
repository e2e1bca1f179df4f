"""Speculative decoding is lossless: greedy output equals the target alone token for token
(fp32), and sampled output follows the target's warped distribution exactly. Prompt lookup
beside a draft model is tested in ``tests/test_prompt_lookup.py``, with the helpers here."""

import copy
import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

import osd
from osd.spec import DynamicTree
from osd.spec_decode.policies import AdaptiveStopper
from osd_kernels.warp import warp_probs
from tests.conftest import slow_case
from tests.test_models import VOCAB, tiny_hf_model

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]


def perturbed(hf, scale: float, seed: int):
    """A draft: the target's weights plus noise (agrees often, not always)."""
    draft = copy.deepcopy(hf)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return draft


def prompts_of(lengths, vocab=VOCAB, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def serve_in_batches(eng, prompts, params, size: int = 4) -> list:
    """``eng.generate`` over ``prompts`` as a stream of batches of ``size`` (so that online
    learners see requests finish between calls); the outputs in prompt order."""
    return [
        o for i in range(0, len(prompts), size) for o in eng.generate(prompts[i : i + size], params)
    ]


def record_verdicts(eng) -> list:
    """The verdicts of ``eng``'s speculative steps from now on, appended as they come."""
    verdicts = []

    class Spy:
        def before_step(self):
            pass

        def on_prefill(self, *args):
            pass

        def on_verdict(self, v):
            verdicts.append(v)

    eng.speculators[0].listeners.append(Spy())
    return verdicts


@pytest.fixture(scope="module")
def llama_pair():
    target = tiny_hf_model("llama", seed=11)
    return target, perturbed(target, 0.35, seed=12)


@pytest.fixture(scope="module")
def plain(llama_pair):
    return osd.Engine.from_pretrained(llama_pair[0], max_batch_size=8, max_seq_len=96)


def _spec_engine(target, draft, **spec):
    return osd.Engine.from_pretrained(
        target, draft=draft, spec=osd.SpecConfig(**spec), max_batch_size=8, max_seq_len=96
    )


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "llama3",
        "mistral",
        "qwen2",
        "qwen3",
        "granite",
        "olmo2",
        "phi3_longrope",
        "smollm3",
        "mistral_window",
        "qwen2_window",
        "gemma2",
        "gemma3",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
    ],
)
def test_greedy_chain_equals_target_and_transformers(family):
    target = tiny_hf_model(family, seed=21)
    draft = perturbed(target, 0.3, seed=22)
    prompts = prompts_of([5, 9, 2], seed=23)
    ref = osd.Engine.from_pretrained(target, max_batch_size=4, max_seq_len=64).generate(
        prompts, osd.SamplingParams(24)
    )
    eng = osd.Engine.from_pretrained(
        target,
        draft=draft,
        spec=osd.SpecConfig(num_draft_tokens=3),
        max_batch_size=4,
        max_seq_len=64,
    )
    outs = eng.generate(prompts, osd.SamplingParams(24))
    for prompt, o, r in zip(prompts, outs, ref):
        assert o.token_ids == r.token_ids
        with torch.no_grad():
            ids = torch.tensor([prompt])
            hf = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=24,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert o.token_ids == hf
    st = eng.stats
    assert st["drafted"] > 0 and 0 < st["accepted"] <= st["drafted"]


@pytest.mark.parametrize("k,batch", [(1, 3), (3, 3), (5, 3), (8, 3), (3, 1), (4, 8)])
def test_greedy_chain_k_and_batch(llama_pair, plain, k, batch):
    target, draft = llama_pair
    prompts = prompts_of([3 + 4 * i for i in range(batch)], seed=k * 10 + batch)
    ref = plain.generate(prompts, osd.SamplingParams(20))
    outs = _spec_engine(target, draft, num_draft_tokens=k).generate(prompts, osd.SamplingParams(20))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


@pytest.mark.parametrize(
    "tree", [TREE, DynamicTree(topk=3, depth=3, max_nodes=10)], ids=["static", "dynamic"]
)
def test_greedy_tree_equals_target(llama_pair, plain, tree):
    target, draft = llama_pair
    prompts = prompts_of([4, 11, 7], seed=31)
    ref = plain.generate(prompts, osd.SamplingParams(22))
    eng = _spec_engine(target, draft, tree=tree)
    outs = eng.generate(prompts, osd.SamplingParams(22))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert eng.stats["accepted"] > 0


@pytest.mark.parametrize(
    "spec",
    [
        dict(drafter="self", skip_layers=(1,), num_draft_tokens=4),
        dict(drafter="ngram", num_draft_tokens=4),
        dict(num_draft_tokens=6, adaptive=True),
        dict(num_draft_tokens=4, prompt_lookup=True),
    ],
    ids=["self", "ngram", "adaptive", "lookup"],
)
def test_greedy_other_drafters_equal_target(llama_pair, plain, spec):
    target, draft = llama_pair
    prompts = prompts_of([6, 3, 12, 5], seed=41)
    prompts[1] = prompts[1] * 4  # repetition gives the n-gram drafter matches
    ref = plain.generate(prompts, osd.SamplingParams(25))
    eng = osd.Engine.from_pretrained(
        target,
        draft=draft if spec.get("drafter") is None else None,
        spec=osd.SpecConfig(**spec),
        max_batch_size=3,
        max_seq_len=96,
    )
    outs = eng.generate(prompts, osd.SamplingParams(25))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_stop_tokens_and_refill(llama_pair, plain):
    target, draft = llama_pair
    prompts = prompts_of([5, 8, 3, 10, 6, 4, 9, 7, 2, 12], seed=51)
    free = plain.generate(prompts, osd.SamplingParams(18))
    stops = [free[0].token_ids[4], free[5].token_ids[9]]
    params = osd.SamplingParams(18, stop_token_ids=stops)
    ref = plain.generate(prompts, params)
    outs = _spec_engine(target, draft, num_draft_tokens=4).generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert [o.finish_reason for o in outs] == [r.finish_reason for r in ref]


def test_stream_yields_the_generated_tokens(llama_pair, plain):
    target, _ = llama_pair
    prompt = prompts_of([7], seed=61)[0]
    ref = plain.generate([prompt], osd.SamplingParams(15))[0].token_ids
    eng = _spec_engine(target, target, num_draft_tokens=4)  # a perfect draft
    chunks = list(eng.stream(prompt, osd.SamplingParams(15)))
    assert [t for c in chunks for t in c] == ref
    assert len(chunks) < len(ref)  # several tokens per step when drafts are accepted


# -- sampling: the joint of the first three tokens equals the target's, exactly --------
V_SMALL = 16


def _small_pair():
    cfg = LlamaConfig(
        vocab_size=V_SMALL,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(71)
    target = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(72)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if "norm" not in name:
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))
    return target, perturbed(target, 0.5, seed=73)


def _exact_joint(target, prompt, params, n=3):
    """P(first n tokens) of the target alone, by enumeration, with the same warping."""

    def warped(ctxs):
        with torch.no_grad():
            logits = target(torch.tensor(ctxs)).logits[:, -1].float()
        if params.temperature == 0:
            raise ValueError("sampling only")
        B = logits.shape[0]
        return warp_probs(
            logits,
            torch.full((B,), params.temperature),
            torch.full((B,), params.top_k),
            torch.full((B,), params.top_p),
        )

    joint = torch.ones(1)
    ctxs = [list(prompt)]
    for _ in range(n):
        p = warped(ctxs)  # [len(ctxs), V]
        joint = (joint[:, None] * p).reshape(-1)
        ctxs = [c + [t] for c in ctxs for t in range(V_SMALL)]
    return joint  # [V^n], lexicographic


def assert_joint_follows_target(
    eng, hf_target, prompt, sp, n: int = 50_000, exact_joint=None
) -> None:
    """``eng``'s first three tokens of ``n`` requests for ``prompt`` follow the warped
    target's exact joint (``exact_joint(hf_target, prompt, sp)``, default
    :func:`_exact_joint`; chi-square p > 1e-3, nothing outside its support), and its draft
    was accepted sometimes, not always."""
    outs = eng.generate([prompt] * n, sp)
    codes = torch.tensor(
        [o.token_ids[0] * V_SMALL**2 + o.token_ids[1] * V_SMALL + o.token_ids[2] for o in outs]
    )
    counts = torch.bincount(codes, minlength=V_SMALL**3).double()
    expected = (exact_joint or _exact_joint)(hf_target, prompt, sp).double()
    assert counts[expected == 0].sum() == 0
    assert _chi2(counts, expected).pvalue > 1e-3
    assert 0 < eng.stats["accepted"] < eng.stats["drafted"]


def _chi2(counts, expected_p):
    """Chi-square goodness of fit, pooling the cells expected to hold fewer than 5."""
    exp = expected_p * counts.sum()
    small = exp < 5
    obs = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    ex = torch.cat([exp[~small], exp[small].sum(0, keepdim=True)])
    if ex[-1] == 0:
        obs, ex = obs[:-1], ex[:-1]
    return chisquare(obs.numpy(), ex.numpy() * (obs.sum() / ex.sum()).item())


def _engine_modes():
    """(device, cuda_graphs): CPU eager, and on CUDA both eager and graphed."""
    modes = [("cpu", False)]
    if torch.cuda.is_available():
        modes += [pytest.param(("cuda", graphs), marks=pytest.mark.gpu) for graphs in (False, True)]
    return modes


@pytest.mark.parametrize("mode", _engine_modes(), ids=lambda m: f"{m[0]}-graphs{int(m[1])}")
@pytest.mark.parametrize(
    "spec,params",
    [
        (dict(num_draft_tokens=2), dict(temperature=0.7, top_k=6, top_p=0.9)),
        slow_case(dict(num_draft_tokens=3), dict(temperature=0.9, top_k=0, top_p=1.0)),
        slow_case(
            dict(tree=[(0,), (1,), (2,), (0, 0)]), dict(temperature=0.8, top_k=8, top_p=0.85)
        ),
        slow_case(
            dict(tree=DynamicTree(topk=3, depth=2, max_nodes=5)), dict(temperature=0.9, top_k=5)
        ),
        slow_case(
            dict(num_draft_tokens=2, prompt_lookup=True), dict(temperature=0.9, top_k=0, top_p=1.0)
        ),
        slow_case(dict(num_draft_tokens=3, auto_k=True), dict(temperature=0.8, top_k=6, top_p=1.0)),
        # what a draft learning online beside a quantized target serves: lookup alone as
        # chain length 0, the model deferred, its chains where lookup drafts nothing
        slow_case(
            dict(num_draft_tokens=3, prompt_lookup=True, lookup_tokens=6, auto_k=True),
            dict(temperature=0.8, top_k=6, top_p=0.9),
        ),
        slow_case(
            dict(num_draft_tokens=1, prompt_lookup=True, lookup_tokens=3),
            dict(temperature=0.8, top_k=6, top_p=0.9),
        ),
        slow_case(
            dict(num_draft_tokens=2, prompt_lookup=True, lookup_tree_below=4),
            dict(temperature=0.8, top_k=6, top_p=0.9),
        ),
        # a lookup branch (3 drafts) deeper than the model's (1) in the same tree
        slow_case(
            dict(num_draft_tokens=1, prompt_lookup=True, lookup_tokens=3, lookup_tree_below=4),
            dict(temperature=0.9, top_k=0, top_p=0.95),
        ),
    ],
    ids=[
        "chain",
        "chain-t",
        "tree",
        "dyntree",
        "lookup",
        "auto-k",
        "auto-k-lookup",
        "lookup-long",
        "lookup-tree",
        "lookup-tree-long",
    ],
)
def test_sampled_joint_follows_target(spec, params, mode):
    """The joint of the first three tokens over 50,000 requests in batches of 4096 (the
    first drawn by the plain sampler at prefill, the others by speculative steps);
    chi-square p > 1e-3 (cells with expectation < 5 are pooled)."""
    device, graphs = mode
    target, draft = _small_pair()
    prompt = [3, 1, 4, 1]
    N = 50_000
    sp = osd.SamplingParams(3, seed=1234, **params)
    eng = osd.Engine.from_pretrained(
        target,
        draft=draft,
        spec=osd.SpecConfig(**spec),
        max_batch_size=4096,
        max_seq_len=16,
        device=device,
        cuda_graphs=graphs,
    )
    outs = eng.generate([prompt] * N, sp)
    codes = torch.tensor(
        [o.token_ids[0] * V_SMALL**2 + o.token_ids[1] * V_SMALL + o.token_ids[2] for o in outs]
    )
    counts = torch.bincount(codes, minlength=V_SMALL**3).double()
    expected = _exact_joint(target, prompt, sp).double()
    assert counts[expected == 0].sum() == 0, "emitted a sequence the warped target excludes"
    stat = _chi2(counts, expected)
    assert stat.pvalue > 1e-3, stat
    st = eng.stats
    assert 0 < st["accepted"] < st["drafted"]  # the test exercised accepts and rejects
    if spec.get("prompt_lookup"):
        # rows with a match verified lookup drafts beside rows the draft model drafted
        assert sum(o.stats["lookup_steps"] for o in outs) > 0


# -- adaptive draft length: the stopper learns from verdicts ---------------------------
def _run_stopper(
    stopper, conf: float, accept_rate: float, steps: int, k: int = 8, batch: int = 4
) -> float:
    """Drive ``stopper`` with drafts of confidence ``conf`` accepted i.i.d. with
    ``accept_rate``; return the mean drafts per row over the last quarter of the steps."""
    g = torch.Generator().manual_seed(7)
    logits = torch.full((batch, 8), -30.0)
    logits[:, 0] = 0.0
    logits[:, 1] = -torch.log(torch.tensor(1.0 / conf - 1.0))  # softmax: conf on token 1
    tokens = torch.ones(batch, dtype=torch.int64)
    drafted_tail = []
    for step in range(steps):
        active, num = None, torch.zeros(batch, dtype=torch.int32)
        for _ in range(k):
            active = stopper.keep_going(logits, tokens, None, active)
            num += active.to(torch.int32)
            if not bool(active.any()):
                break
        accepted = []
        for d in num.tolist():
            a = 0
            while a < d and torch.rand((), generator=g) < accept_rate:
                a += 1
            accepted.append(a)
        stopper.observe(num.tolist(), accepted)
        if step >= 3 * steps // 4:
            drafted_tail.append(num.float().mean().item())
    return sum(drafted_tail) / len(drafted_tail)


def test_adaptive_stopper_explores_and_learns():
    # A draft less confident than the prior trusts, but always right: drafting resumes
    # (exploration) and reaches k_max.
    assert _run_stopper(AdaptiveStopper(0.35, 0.3), conf=0.15, accept_rate=1.0, steps=60) > 7
    # A confident draft that is never right: drafting stops almost entirely.
    assert _run_stopper(AdaptiveStopper(0.35, 0.3), conf=0.9, accept_rate=0.0, steps=60) < 0.5
    # Accepted half of the time: the chance of reaching position i is 0.5^i, so rows stop
    # after one or two drafts at a floor of 0.35 (0.5 >= 0.35 > 0.25).
    mid = _run_stopper(AdaptiveStopper(0.35, 0.3), conf=0.5, accept_rate=0.5, steps=200)
    assert 0.8 <= mid <= 2.2, mid
