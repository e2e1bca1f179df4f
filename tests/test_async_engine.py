"""``osd.AsyncEngine``: requests join and leave a running batch, each with its own
sampling parameters, and each gets exactly what it gets alone; aborts, bad requests and
failing rows leave the rest of the batch untouched."""

import asyncio

import pytest
import torch

import osd
from tests.test_models import tiny_hf_model
from tests.test_speculative import perturbed, prompts_of

MAX_SEQ = 96


@pytest.fixture(scope="module")
def pair():
    target = tiny_hf_model("llama", seed=31)
    return target, perturbed(target, 0.4, seed=32), perturbed(target, 0.8, seed=33)


def _engine(pair, drafts=1, **kw):
    draft = list(pair[1 : 1 + drafts]) if drafts > 1 else pair[1] if drafts else None
    spec = osd.SpecConfig(num_draft_tokens=3) if drafts else None
    return osd.Engine.from_pretrained(
        pair[0], draft=draft, spec=spec, max_batch_size=4, max_seq_len=MAX_SEQ, **kw
    )


# Mixed parameters: greedy, sampled with top-k / top-p, stop ids, several lengths.
MIXED = [
    osd.SamplingParams(14),
    osd.SamplingParams(11, temperature=0.8, top_k=5, seed=3),
    osd.SamplingParams(16, temperature=1.1, top_p=0.9, seed=4),
    osd.SamplingParams(9, temperature=0.7, top_k=20, top_p=0.8, seed=5),
    osd.SamplingParams(13, stop_token_ids=[7, 8]),
    osd.SamplingParams(12, temperature=0.9, seed=6),
    osd.SamplingParams(10, temperature=0.5, top_k=3, seed=7),
]


async def _collect(aeng, prompt, params, request_id=None, delay=0.0, snapshots=None):
    await asyncio.sleep(delay)
    last = None
    async for out in aeng.generate(prompt, params, request_id=request_id):
        if snapshots is not None:
            snapshots.append(out)
        last = out
    return last


@pytest.mark.parametrize("drafts", [0, 1], ids=["plain", "spec"])
def test_staggered_requests_with_mixed_params_equal_each_alone(pair, drafts):
    prompts = prompts_of([5, 23, 2, 40, 9, 17, 31], seed=50)
    alone_engine = _engine(pair, drafts)
    alone = [alone_engine.generate([p], sp)[0] for p, sp in zip(prompts, MIXED)]
    aeng = osd.AsyncEngine(_engine(pair, drafts))

    async def main():
        # 7 requests over 4 rows, arriving while others run.
        return await asyncio.gather(
            *[
                _collect(aeng, p, sp, delay=0.003 * i)
                for i, (p, sp) in enumerate(zip(prompts, MIXED))
            ]
        )

    try:
        got = asyncio.run(main())
    finally:
        aeng.close()
    for a, g, p in zip(alone, got, prompts):
        assert g.token_ids == a.token_ids
        assert g.finish_reason == a.finish_reason
        assert g.prompt_token_ids == p


def test_snapshots_grow_and_the_last_one_finishes(pair):
    aeng = osd.AsyncEngine(_engine(pair))
    snaps = []
    try:
        asyncio.run(_collect(aeng, [1, 2, 3], osd.SamplingParams(12), snapshots=snaps))
    finally:
        aeng.close()
    assert all(s.finish_reason is None for s in snaps[:-1])
    assert snaps[-1].finish_reason == "length" and len(snaps[-1].token_ids) == 12
    lengths = [len(s.token_ids) for s in snaps]
    assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths)


def test_stream_interval_coalesces_snapshots_but_not_the_first_token_or_the_end(pair):
    params = osd.SamplingParams(40)
    every, coalesced = [], []
    aeng = osd.AsyncEngine(_engine(pair))
    try:
        asyncio.run(_collect(aeng, [1, 2, 3], params, snapshots=every))
    finally:
        aeng.close()
    # an interval longer than the request: the first token, then only the end
    aeng = osd.AsyncEngine(_engine(pair), stream_interval=60.0)
    try:
        asyncio.run(_collect(aeng, [1, 2, 3], params, snapshots=coalesced))
    finally:
        aeng.close()
    assert len(every) > 3
    with_tokens = [s for s in coalesced if s.token_ids]
    assert len(with_tokens) == 2
    assert len(with_tokens[0].token_ids) == len(next(s for s in every if s.token_ids).token_ids)
    assert coalesced[-1].finish_reason == "length"
    assert coalesced[-1].token_ids == every[-1].token_ids
    assert coalesced[-1].text == every[-1].text


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_a_bad_stream_interval_is_refused(pair, bad):
    with pytest.raises(ValueError, match="stream_interval"):
        osd.AsyncEngine(_engine(pair), stream_interval=bad)


def test_abort_frees_the_row_and_the_rest_go_on(pair):
    prompts = prompts_of([6, 12, 4], seed=60)
    sp = osd.SamplingParams(40)
    alone = _engine(pair).generate(prompts, sp)
    aeng = osd.AsyncEngine(_engine(pair))

    async def main():
        async def victim():
            n = 0
            async for out in aeng.generate(prompts[0], sp, request_id="victim"):
                n += 1
                if n == 2:
                    await aeng.abort("victim")
            return out

        return await asyncio.gather(
            victim(), _collect(aeng, prompts[1], sp), _collect(aeng, prompts[2], sp)
        )

    try:
        got = asyncio.run(main())
        stats = aeng.stats
    finally:
        aeng.close()
    assert got[0].finish_reason == "abort" and len(got[0].token_ids) < 40
    assert [o.token_ids for o in got[1:]] == [o.token_ids for o in alone[1:]]
    assert stats["aborted"] == 1 and stats["running"] == 0 and stats["waiting"] == 0


def test_a_consumer_that_stops_listening_aborts_its_request(pair):
    aeng = osd.AsyncEngine(_engine(pair))

    async def main():
        gen = aeng.generate([3, 4, 5], osd.SamplingParams(60))
        await gen.__anext__()
        await gen.aclose()
        return await _collect(aeng, [3, 4, 5], osd.SamplingParams(5))

    try:
        out = asyncio.run(main())
        for _ in range(100):
            stats = aeng.stats
            if stats["aborted"] == 1:
                break
            asyncio.run(asyncio.sleep(0.01))
    finally:
        aeng.close()
    assert len(out.token_ids) == 5
    assert stats["aborted"] == 1 and stats["running"] == 0


def test_bad_requests_mid_batch_are_refused_and_the_batch_is_unaffected(pair):
    prompts = prompts_of([8, 15], seed=70)
    sp = osd.SamplingParams(30, temperature=0.8, seed=1)
    alone = [_engine(pair).generate([p], sp)[0] for p in prompts]
    aeng = osd.AsyncEngine(_engine(pair))
    bad = [
        ([1, 2, 3], osd.SamplingParams(MAX_SEQ), "maximum context"),
        ([1] * MAX_SEQ, osd.SamplingParams(1), "longer than the maximum"),
        ([1, 2, 10_000], osd.SamplingParams(4), "outside the vocabulary"),
        ([1, 2], "greedy", "SamplingParams"),
        ([], osd.SamplingParams(4), "empty"),
    ]

    async def main():
        running = [asyncio.create_task(_collect(aeng, p, sp)) for p in prompts]
        await asyncio.sleep(0.01)
        errors = []
        for prompt, params, _ in bad:
            with pytest.raises((ValueError, TypeError)) as info:
                await _collect(aeng, prompt, params)
            errors.append(str(info.value))
        with pytest.raises(ValueError, match="unknown draft 3: this engine has 1"):
            async for _ in aeng.generate([1, 2], osd.SamplingParams(4), draft=3):
                pass
        dup = asyncio.create_task(_collect(aeng, [1, 2], osd.SamplingParams(50), "same"))
        await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="already in use"):
            await _collect(aeng, [1, 2], osd.SamplingParams(5), "same")
        await aeng.abort("same")
        await dup
        return errors, await asyncio.gather(*running)

    try:
        errors, got = asyncio.run(main())
        stats = aeng.stats
    finally:
        aeng.close()
    for msg, (_, _, want) in zip(errors, bad):
        assert want in msg
    assert [o.token_ids for o in got] == [o.token_ids for o in alone]
    assert stats["errors"]["bad_request"] == len(bad) + 2


def _poison(engine, victim_prompt, after=2):
    """Make the target's logits NaN for the request whose prompt is ``victim_prompt`` once
    it has ``after`` tokens (decode / verify forwards only)."""
    model = engine.model
    real = model.forward

    def forward(ids, cache, *args, **kw):
        logits = real(ids, cache, *args, **kw)
        for lane in engine.lanes:
            if cache is lane.cache and logits.shape[0] == len(lane.active):
                for b, r in enumerate(lane.active):
                    if r.prompt == victim_prompt and len(r.generated) >= after:
                        logits[b] = float("nan")
        return logits

    model.forward = forward


@pytest.mark.parametrize("online", [False, True], ids=["static", "online"])
def test_nonfinite_logits_fail_one_request_only(pair, online):
    prompts = prompts_of([7, 13, 5], seed=80)
    sp = osd.SamplingParams(15)
    alone = _engine(pair).generate(prompts, sp)
    cfg = osd.OnlineConfig(background=False, update_every_requests=1) if online else None
    eng = _engine(pair, online=cfg)
    _poison(eng, prompts[1])
    out = eng.generate(prompts, sp)
    assert out[1].finish_reason == "error" and "non-finite" in out[1].error
    assert [out[0].token_ids, out[2].token_ids] == [alone[0].token_ids, alone[2].token_ids]
    assert eng.stats["errors"]["nonfinite_logits"] == 1
    if online:
        eng.online.wait()
        for p in eng.online.drafts[0].parameters():
            assert torch.isfinite(p).all()
    # through the AsyncEngine: the failing request raises, the others finish.
    aeng = osd.AsyncEngine(eng)

    async def main():
        return await asyncio.gather(
            *[_collect(aeng, p, sp) for p in prompts], return_exceptions=True
        )

    try:
        got = asyncio.run(main())
    finally:
        aeng.close()
    assert isinstance(got[1], osd.RequestError) and "non-finite" in str(got[1])
    assert [got[0].token_ids, got[2].token_ids] == [alone[0].token_ids, alone[2].token_ids]


def test_a_failing_step_fails_its_requests_and_the_loop_serves_on(pair, monkeypatch):
    eng = _engine(pair)
    spec = eng.speculators[0]
    real_step = spec.step
    calls = {"n": 0}

    def failing_step(active, params):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step failure")
        return real_step(active, params)

    monkeypatch.setattr(spec, "step", failing_step)
    ref = _engine(pair).generate([[4, 5, 6]], osd.SamplingParams(10))[0]
    aeng = osd.AsyncEngine(eng)
    try:
        with pytest.raises(osd.RequestError, match="injected step failure"):
            asyncio.run(_collect(aeng, [1, 2, 3], osd.SamplingParams(10)))
        after = asyncio.run(_collect(aeng, [4, 5, 6], osd.SamplingParams(10)))
        stats = aeng.stats
    finally:
        aeng.close()
    assert after.token_ids == ref.token_ids
    assert stats["errors"]["step_error"] == 1


def test_requests_of_different_drafts_share_the_steps(pair):
    """Two drafts (routed per request) serve in the same steps, one lane each; every
    greedy output is the target's."""
    prompts = prompts_of([9, 4, 14, 6, 11, 3], seed=90)
    sp = osd.SamplingParams(12)
    plain = _engine(pair, drafts=0).generate(prompts, sp)
    eng = _engine(pair, drafts=2, online=osd.OnlineConfig(background=False))
    eng.online.choose = lambda prompt: len(prompt) % 2
    seen = []
    real = eng.step

    def step():
        seen.append(tuple(len(lane.active) for lane in eng.lanes))
        real()

    eng.step = step
    aeng = osd.AsyncEngine(eng)

    async def main():
        return await asyncio.gather(*[_collect(aeng, p, sp) for p in prompts])

    try:
        got = asyncio.run(main())
        stats = aeng.stats
    finally:
        aeng.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert {o.stats["draft_index"] for o in got} == {0, 1}
    assert any(a > 0 and b > 0 for a, b in seen)
    assert [d["requests"] for d in stats["per_draft"]] == [3, 3]


def test_generate_takes_params_per_prompt(pair):
    prompts = prompts_of([5, 23, 2, 40, 9, 17, 31], seed=51)
    eng = _engine(pair)
    alone = [eng.generate([p], sp)[0].token_ids for p, sp in zip(prompts, MIXED)]
    assert [o.token_ids for o in eng.generate(prompts, MIXED)] == alone
    with pytest.raises(ValueError, match="7 SamplingParams for 2 prompts"):
        eng.generate(prompts[:2], MIXED)


def test_a_request_may_pick_its_draft(pair):
    prompts = prompts_of([9, 4, 14, 6], seed=91)
    sp = osd.SamplingParams(10)
    plain = [o.token_ids for o in _engine(pair, drafts=0).generate(prompts, sp)]
    eng = _engine(pair, drafts=2)
    out = eng.generate(prompts, sp, draft=1)
    assert [o.token_ids for o in out] == plain
    assert {o.stats["draft_index"] for o in out} == {1}
    assert eng.stats["per_draft"][0]["requests"] == 0
    with pytest.raises(ValueError, match="unknown draft 2"):
        eng.generate(prompts, sp, draft=2)
    with pytest.raises(ValueError, match="no drafts"):
        _engine(pair, drafts=0).generate(prompts, sp, draft=1)


@pytest.mark.parametrize("online", [False, True], ids=["static", "online"])
def test_long_prompts_prefill_piece_by_piece_between_decode_steps(pair, online):
    """With 16-token prefill pieces, a 90-token prompt is staged: the running requests
    keep decoding while it prefills, and everyone's output equals its output alone."""

    def engine():
        cfg = osd.OnlineConfig(background=False, prompt_positions=24) if online else None
        return osd.Engine.from_pretrained(
            pair[0],
            draft=pair[1],
            online=cfg,
            spec=osd.SpecConfig(num_draft_tokens=3),
            max_batch_size=3,
            max_seq_len=160,
            prefill_chunk=16,
        )

    short, long_ = prompts_of([6, 90, 9], seed=95), None
    long_ = short.pop(1)
    sp, first_sp = osd.SamplingParams(30), osd.SamplingParams(80)
    params = {tuple(short[0]): first_sp, tuple(short[1]): sp, tuple(long_): sp}
    alone = {p: engine().generate([list(p)], sp_)[0].token_ids for p, sp_ in params.items()}
    eng = engine()
    overlap = []
    real = eng._step_lane

    def step_lane(lane):
        if lane.staging is not None and lane.active:
            overlap.append(len(lane.active))
        real(lane)

    eng._step_lane = step_lane
    aeng = osd.AsyncEngine(eng)

    async def main():
        # the long prompt arrives once the first request decodes (not after a fixed delay:
        # how far a request gets in a few milliseconds depends on the machine), which has
        # many more steps to go than the long prompt has pieces
        decoding = asyncio.Event()

        async def first():
            last = None
            async for out in aeng.generate(short[0], first_sp):
                decoding.set()
                last = out
            return last

        async def after(prompt, delay):
            await decoding.wait()
            return await _collect(aeng, prompt, sp, delay=delay)

        return await asyncio.gather(first(), after(long_, 0.0), after(short[1], 0.005))

    try:
        got = asyncio.run(main())
        stats = aeng.stats
    finally:
        aeng.close()
    for p, g in zip([short[0], long_, short[1]], got):
        assert g.token_ids == alone[tuple(p)]
    assert len(overlap) >= 3  # at least three pieces while others decoded
    assert stats["running"] == 0


@pytest.mark.parametrize("tree_below", [0, 2], ids=["chain", "lookup-tree"])
def test_prompt_lookup_rows_get_what_they_get_alone(pair, tree_below):
    """With prompt lookup in front of the draft, a row verifies its own lookup match
    whatever the rows beside it do, so staggered requests (repetitive prompts, where
    lookup matches come and go) still each get exactly what they get alone; with lookup
    trees too (a row's tree depends on its own match only)."""
    base = prompts_of([6, 9, 4, 7, 5, 8, 3], seed=51)
    prompts = [p * 3 for p in base]
    spec = osd.SpecConfig(num_draft_tokens=3, prompt_lookup=True, lookup_tree_below=tree_below)

    def engine():
        return osd.Engine.from_pretrained(
            pair[0], draft=pair[1], spec=spec, max_batch_size=4, max_seq_len=MAX_SEQ
        )

    alone_engine = engine()
    alone = [alone_engine.generate([p], sp)[0] for p, sp in zip(prompts, MIXED)]
    aeng = osd.AsyncEngine(engine())

    async def main():
        return await asyncio.gather(
            *[
                _collect(aeng, p, sp, delay=0.003 * i)
                for i, (p, sp) in enumerate(zip(prompts, MIXED))
            ]
        )

    try:
        got = asyncio.run(main())
        stats = aeng.engine.stats
    finally:
        aeng.close()
    assert [g.token_ids for g in got] == [a.token_ids for a in alone]
    # per request: steps whose row verified a lookup continuation; the engine's count:
    # steps drafted by lookup alone (every row matched), which lookup trees keep rarer
    assert sum(g.stats["lookup_steps"] for g in got) > stats["lookup_steps"] >= (tree_below == 0)
