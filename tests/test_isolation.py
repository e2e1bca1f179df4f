"""A step that raises fails only the request that makes it raise (``osd.isolation``).

A poisoned request (a test hook makes any step that holds it raise, from its admission
or from its k-th token on) shares a batch with others; the poisoned one fails with
``finish_reason="error"``, every other one finishes with exactly the output it gets
alone, through ``Engine.generate`` and ``AsyncEngine`` alike, plain and speculative,
greedy and sampled, with long contexts resumed piece by piece.
"""

import asyncio

import pytest
import torch

import osd
from osd.models.eagle import EagleLM
from osd.models.loading import load_model
from tests.test_models import tiny_hf_model
from tests.test_speculative import perturbed, prompts_of

MAX_SEQ = 96


@pytest.fixture(scope="module")
def pair():
    target = tiny_hf_model("llama", seed=41)
    return target, perturbed(target, 0.4, seed=42)


def _engine(pair, spec: bool, **kw):
    return osd.Engine.from_pretrained(
        pair[0],
        draft=pair[1] if spec else None,
        spec=osd.SpecConfig(num_draft_tokens=3) if spec else None,
        max_batch_size=4,
        max_seq_len=MAX_SEQ,
        **kw,
    )


def _poison(eng, prompt, after: int | None):
    """Every step holding the request with ``prompt`` raises: its prefill (``after``
    None) or, once it has ``after`` tokens, its decode / speculative steps."""

    def hit(requests):
        return any(
            r.prompt == prompt and (after is None or len(r.generated) >= after) for r in requests
        )

    real_prefill = eng.prefill

    def prefill(new, *a, **kw):
        if after is None and hit(new):
            raise RuntimeError("injected admission failure")
        return real_prefill(new, *a, **kw)

    eng.prefill = prefill
    for lane in eng.lanes:
        if lane.speculator is not None:
            real = lane.speculator.step

            def step(active, params, real=real):
                if after is not None and hit(active):
                    raise RuntimeError("injected step failure")
                return real(active, params)

            lane.speculator.step = step
    real_decode = eng.decode_step

    def decode_step(active, params, lane=None):
        if after is not None and hit(active):
            raise RuntimeError("injected step failure")
        return real_decode(active, params, lane=lane)

    eng.decode_step = decode_step


PARAMS = [
    osd.SamplingParams(20),
    osd.SamplingParams(17, temperature=0.9, seed=3),
    osd.SamplingParams(22, stop_token_ids=[5]),
    osd.SamplingParams(19),
    osd.SamplingParams(21, temperature=0.7, top_k=8, seed=4),
    osd.SamplingParams(18, logprobs=2),
]


def _alone(pair, spec, prompts, params, **kw):
    eng = _engine(pair, spec, **kw)
    return [eng.generate([p], sp)[0] for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
@pytest.mark.parametrize("after", [None, 1, 6], ids=["admission", "first-step", "mid-stream"])
def test_a_poisoned_request_fails_alone_in_engine_generate(pair, spec, after):
    prompts = prompts_of([5, 19, 3, 11, 8, 14], seed=90)
    poisoned = 2
    alone = _alone(pair, spec, prompts, PARAMS)
    eng = _engine(pair, spec)
    _poison(eng, prompts[poisoned], after)
    out = eng.generate(prompts, PARAMS)
    assert out[poisoned].finish_reason == "error" and "injected" in out[poisoned].error
    # It keeps the tokens it had before the step that failed (none when that step admitted
    # it: a prefill and the first decode step are one step).
    kept = out[poisoned].token_ids
    assert kept == alone[poisoned].token_ids[: len(kept)]
    assert len(kept) == 0 if after in (None, 1) else len(kept) >= after
    for i, (o, a) in enumerate(zip(out, alone)):
        if i != poisoned:
            assert (o.token_ids, o.finish_reason) == (a.token_ids, a.finish_reason), i
            if a.logprobs is not None:
                assert [e.token_id for e in o.logprobs] == a.token_ids
    stats = eng.stats
    assert stats["errors"]["step_error"] == 1 and stats["errors"]["failed_steps"] >= 1
    # The engine serves on: the next call is plain sailing.
    assert eng.generate([prompts[0]], PARAMS[0])[0].token_ids == alone[0].token_ids


def test_an_eagle_lane_resumes_from_the_targets_features(pair):
    """An EAGLE draft drafts from the target's features: a resumed row's come from the
    prefill of its context (staged when long). Greedy output stays the target's alone."""
    target = load_model(pair[0])
    draft = EagleLM.from_target(target, num_layers=1)
    draft.init_draft(std=0.3, generator=torch.Generator().manual_seed(5))
    prompts = prompts_of([5, 30, 3, 12], seed=95)
    params = osd.SamplingParams(24)
    alone = osd.Engine(target, max_batch_size=4, max_seq_len=MAX_SEQ).generate(prompts, params)
    eng = osd.Engine(
        target,
        draft=[draft],
        spec=osd.SpecConfig(num_draft_tokens=3),
        max_batch_size=4,
        max_seq_len=MAX_SEQ,
        prefill_chunk=8,
    )
    _poison(eng, prompts[2], 7)
    out = eng.generate(prompts, params)
    assert out[2].finish_reason == "error" and eng.stats["errors"]["failed_steps"] == 1
    assert [o.token_ids for i, o in enumerate(out) if i != 2] == [
        a.token_ids for i, a in enumerate(alone) if i != 2
    ]


def test_long_contexts_resume_piece_by_piece(pair):
    """Contexts longer than a prefill piece are staged again when they resume, with the
    prefix cache on; the survivors' greedy output is unchanged."""
    prompts = prompts_of([30, 26, 9, 33], seed=91)
    params = [osd.SamplingParams(30)] * 4
    kw = dict(prefill_chunk=8, prefix_cache=256)
    alone = _alone(pair, True, prompts, params, **kw)
    eng = _engine(pair, True, **kw)
    _poison(eng, prompts[1], 12)
    out = eng.generate(prompts, params)
    assert out[1].finish_reason == "error"
    assert [o.token_ids for i, o in enumerate(out) if i != 1] == [
        a.token_ids for i, a in enumerate(alone) if i != 1
    ]


@pytest.mark.parametrize("after", [None, 4], ids=["admission", "mid-stream"])
def test_async_engine_streams_survive_a_poisoned_neighbour(pair, after):
    prompts = prompts_of([7, 12, 4, 16, 9], seed=92)
    params = [osd.SamplingParams(16)] * 5
    alone = _alone(pair, True, prompts, params)
    eng = _engine(pair, True)
    _poison(eng, prompts[3], after)
    aeng = osd.AsyncEngine(eng)

    async def one(i):
        await asyncio.sleep(0.002 * i)  # arriving while the others run
        snapshots = []
        async for out in aeng.generate(prompts[i], params[i]):
            snapshots.append(list(out.token_ids))
        return snapshots

    async def main():
        return await asyncio.gather(*[one(i) for i in range(5)], return_exceptions=True)

    try:
        got = asyncio.run(main())
    finally:
        aeng.close()
    assert isinstance(got[3], osd.RequestError) and "injected" in str(got[3])
    for i, snaps in enumerate(got):
        if i == 3:
            continue
        assert snaps[-1] == alone[i].token_ids, i
        # Every snapshot extends the one before: nothing sent is ever taken back.
        assert all(b[: len(a)] == a for a, b in zip(snaps, snaps[1:])), i


def test_a_failure_no_request_reproduces_alone_resumes_everyone(pair, monkeypatch):
    """A step that fails once (nothing to do with any row) costs nobody their request."""
    prompts = prompts_of([6, 10, 4], seed=93)
    sp = osd.SamplingParams(15)
    alone = _alone(pair, False, prompts, [sp] * 3)
    eng = _engine(pair, False)
    real, calls = eng.decode_step, {"n": 0}

    def flaky(active, params, lane=None):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected transient failure")
        return real(active, params, lane=lane)

    monkeypatch.setattr(eng, "decode_step", flaky)
    out = eng.generate(prompts, sp)
    assert [o.token_ids for o in out] == [a.token_ids for a in alone]
    assert eng.stats["errors"] == {"failed_steps": 1}


def test_a_failure_that_needs_two_rows_fails_the_one_that_joins(pair, monkeypatch):
    """Steps that fail whenever two given requests share them, never alone: the one whose
    joining completes the pair fails, the other two get what they get alone."""
    prompts = prompts_of([6, 10, 4], seed=94)
    sp = osd.SamplingParams(15)
    alone = _alone(pair, False, prompts, [sp] * 3)
    eng = _engine(pair, False)
    real = eng.decode_step

    def picky(active, params, lane=None):
        if sum(r.prompt in prompts[:2] for r in active) == 2:
            raise RuntimeError("injected pair failure")
        return real(active, params, lane=lane)

    monkeypatch.setattr(eng, "decode_step", picky)
    out = eng.generate(prompts, sp)
    assert [o.finish_reason for o in out] == ["length", "error", "length"]
    assert [out[0].token_ids, out[2].token_ids] == [alone[0].token_ids, alone[2].token_ids]


def test_values_the_kernels_cannot_represent_never_reach_a_batch():
    """``SamplingParams`` refuses them (the server refuses them with a 400 naming the
    field, ``tests/test_server_hostile.py``)."""
    for kw in [
        dict(temperature=1e39),
        dict(temperature=1e-39),
        dict(top_p=1e-46),
        dict(top_k=2**63 - 1),
        dict(seed=2**64),
        dict(stop=["a"] * 17),
        dict(stop=["a" * 257]),
        dict(repetition_penalty=1e-300),
        dict(logit_bias={3: float("inf")}),
        dict(max_new_tokens=2**64),
    ]:
        with pytest.raises(ValueError):
            osd.SamplingParams(**{"max_new_tokens": 4, **kw})
