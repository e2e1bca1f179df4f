"""CUDA graphs of the speculative step (``osd.graphs``).

On CPU the static-buffer path runs emulated (``StepGraphs(emulate=True)``: the same
bucketing, padding, static inputs, warm-up with state restore and cache-bound bookkeeping,
with plain calls in place of capture and replay), with ``poison=True``: after every replay
the outputs of the other graphs that do not own them are overwritten with garbage, as the
shared pool of real graphs may. It must emit exactly what the eager engine emits. The real
capture runs only where CUDA is present."""

import pytest
import torch

import osd
from osd.spec_decode.model_drafter import sample_draft
from osd.graphs import StepGraphs, batch_bucket
from osd_kernels.warp import warp_probs
from tests.test_models import tiny_hf_model
from tests.conftest import devices
from tests.test_speculative import perturbed, prompts_of

DEVICES = devices()

TREE = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (2,)]
CASES = {
    "greedy-chain": (dict(num_draft_tokens=3), dict(temperature=0.0)),
    "sampled-chain": (dict(num_draft_tokens=4), dict(temperature=0.8)),
    "truncated-chain": (dict(num_draft_tokens=4), dict(temperature=0.8, top_k=20, top_p=0.9)),
    "greedy-tree": (dict(num_draft_tokens=len(TREE), tree=TREE), dict(temperature=0.0)),
    "sampled-tree": (dict(num_draft_tokens=len(TREE), tree=TREE), dict(temperature=1.0)),
    "self-speculation": (dict(num_draft_tokens=3, drafter="self"), dict(temperature=0.0)),
}


@pytest.fixture(scope="module")
def pair():
    target = tiny_hf_model("llama", seed=31)
    return target, perturbed(target, 0.3, seed=32)


def _engine(pair, spec, device="cpu", max_batch_size=4):
    target, draft = pair
    spec = osd.SpecConfig(**spec)
    return osd.Engine.from_pretrained(
        target,
        draft=draft if spec.drafter == "model" else None,
        spec=spec,
        device=device,
        max_batch_size=max_batch_size,
        max_seq_len=80,
    )


def test_batch_bucket():
    assert [batch_bucket(b, 8) for b in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert batch_bucket(5, 6) == 6
    assert batch_bucket(3, 3) == 3


def test_step_graphs_need_cuda_unless_emulated():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        StepGraphs(torch.device("cpu"))


PLAIN_SAMPLING = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.9),
    "truncated": dict(temperature=0.9, top_k=20, top_p=0.8),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampling", list(PLAIN_SAMPLING))
def test_graphs_in_plain_decoding(pair, sampling, device):
    """Plain decoding replayed from graphs (emulated on CPU, captured on CUDA) emits what
    the eager engine emits, in fp32."""
    prompts = prompts_of([7, 3, 11, 5, 9], seed=38)
    params = osd.SamplingParams(16, seed=39, **PLAIN_SAMPLING[sampling])

    def engine():
        return osd.Engine.from_pretrained(
            pair[0], max_batch_size=4, max_seq_len=48, device=device, cuda_graphs=False
        )

    eager = engine().generate(prompts, params)
    eng = engine()
    eng.use_graphs(_graphs(eng, device))
    assert [o.token_ids for o in eng.generate(prompts, params)] == [o.token_ids for o in eager]
    _assert_replayed(eng)


def _graphs(eng, device="cpu"):
    """Real graphs on CUDA; emulated ones with the pool poisoned elsewhere."""
    emulate = device != "cuda"
    return StepGraphs(eng.device, emulate=emulate, poison=emulate)


def _assert_replayed(eng, params=None):
    info = eng.stats["cuda_graphs"]
    assert info["replays"] > info["graphs"] > 0


@pytest.mark.parametrize("case", list(CASES))
def test_emulated_graphs_emit_what_eager_emits(pair, case):
    spec, sampling = CASES[case]
    # 5 ragged prompts on 4 rows: batches of 4, 3 (padded to 4), 2 and 1, with refills.
    prompts = prompts_of([7, 3, 11, 5, 9], seed=33)
    params = osd.SamplingParams(20, seed=34, **sampling)
    eager = _engine(pair, spec).generate(prompts, params)
    eng = _engine(pair, spec)
    eng.use_graphs(_graphs(eng))
    graphed = eng.generate(prompts, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    _assert_replayed(eng)
    info = eng.stats["cuda_graphs"]
    # A second call reuses the captured graphs (same buckets, same sampling params).
    again = eng.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in eager]
    assert eng.stats["cuda_graphs"]["graphs"] == info["graphs"]


def test_emulated_graphs_leave_the_draft_cache_as_eager_does(pair):
    spec, _ = CASES["greedy-chain"]
    prompts = prompts_of([6, 10], seed=35)
    engines = [_engine(pair, spec), _engine(pair, spec)]
    engines[1].use_graphs(_graphs(engines[1]))
    for eng in engines:
        eng.generate(prompts, osd.SamplingParams(12))
    a, b = (e.speculators[0].drafter for e in engines)
    assert torch.equal(a.cache.lens[:2], b.cache.lens[:2])
    assert a.cache.bound == b.cache.bound
    assert torch.equal(a._pending_len[:2], b._pending_len[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_graphs_emit_what_eager_emits(pair, case):
    spec, sampling = CASES[case]
    prompts = prompts_of([7, 3, 11, 5, 9], seed=36)
    params = osd.SamplingParams(20, seed=37, **sampling)
    eager_engine = _engine(pair, dict(spec, cuda_graphs=False), device="cuda")
    eager = eager_engine.generate(prompts, params)
    eng = _engine(pair, spec, device="cuda")
    assert eng.graphs is not None and not eng.graphs.emulate
    graphed = eng.generate(prompts, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    _assert_replayed(eng)
    if sampling["temperature"] == 0.0:
        plain = osd.Engine.from_pretrained(pair[0], device="cuda", max_batch_size=4, max_seq_len=80)
        assert plain.graphs is not None  # plain decoding is graphed too
        eager_plain = osd.Engine.from_pretrained(
            pair[0], device="cuda", max_batch_size=4, max_seq_len=80, cuda_graphs=False
        )
        want = [o.token_ids for o in eager_plain.generate(prompts, params)]
        assert [o.token_ids for o in plain.generate(prompts, params)] == want
        assert [o.token_ids for o in graphed] == want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["greedy-chain", "sampled-chain", "truncated-chain"])
def test_graphed_drafting_proposes_what_eager_drafting_proposes(pair, case, device):
    """Step by step, the steps replayed from graphs (the fused chain step; emulated on CPU,
    captured on CUDA) propose the same tokens with the same q as the eager draft loop."""
    spec, params = CASES[case]
    prompts = prompts_of([5, 9, 3, 12, 7, 4], seed=37)
    logs = {}
    for graphed in (False, True):
        target, draft = pair
        eng = osd.Engine.from_pretrained(
            target,
            draft=draft,
            spec=osd.SpecConfig(**spec),
            device=device,
            max_batch_size=4,
            max_seq_len=80,
            cuda_graphs=False,
        )
        if graphed:
            eng.use_graphs(_graphs(eng, device))
        log = []

        class Recorder:
            prompt_positions = 0

            def before_step(self):
                pass

            def on_prefill(self, *args):
                pass

            def on_verdict(self, v, _log=log):
                prop = v.proposal
                _log.append(
                    (
                        prop.tokens.cpu().clone(),
                        None if prop.probs is None else prop.probs.float().cpu().clone(),
                    )
                )

        eng.speculators[0].listeners.append(Recorder())
        eng.generate(prompts, osd.SamplingParams(16, seed=5, **params))
        if graphed:
            assert eng.graphs.replays > 0
            assert any(k[0] == "fused-chain" for k in eng.graphs.entries)
        logs[graphed] = log
    assert len(logs[False]) == len(logs[True]) > 3
    for (tok_e, q_e), (tok_g, q_g) in zip(logs[False], logs[True]):
        assert torch.equal(tok_e, tok_g)
        if q_e is not None:
            torch.testing.assert_close(q_g, q_e, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [131, 49_152])
@pytest.mark.parametrize(
    "warp",
    [
        dict(temperature=0.8),
        dict(temperature=0.8, top_k=6),
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=0.7, top_k=20, top_p=0.9),
    ],
    ids=["t", "top_k", "top_p", "top_k-top_p"],
)
@pytest.mark.parametrize("B", [4, 4096])
def test_cuda_graph_of_a_draft_draw_equals_eager(V, warp, B):
    """The draft loop's sampling ops alone (``warp_probs``, then ``sample_draft``),
    captured once and replayed on fresh logits, seeds and offsets: the same q and tokens
    as the eager ops. Localises a graph-unsafe op among the warps."""
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(B + V)
    static = {
        "logits": torch.randn(B, V, generator=gen).to(dev),
        "seed": torch.arange(B, dtype=torch.int64, device=dev),
        "offset": torch.zeros(B, dtype=torch.int64, device=dev),
    }

    def body():
        q = warp_probs(static["logits"], warp["temperature"], warp.get("top_k"), warp.get("top_p"))
        return q, sample_draft(q, static["seed"], static["offset"], 1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_g, x_g = body()
    for step in range(3):
        static["logits"].copy_(torch.randn(B, V, generator=gen).to(dev) * (1 + step))
        static["seed"].add_(7)
        static["offset"].fill_(step + 1)
        graph.replay()
        q_e, x_e = body()
        torch.testing.assert_close(q_g, q_e, rtol=1e-5, atol=1e-7)
        assert torch.equal(x_g, x_e)


# The torch ops warp_probs runs on CUDA for top-k and top-p, one at a time.
TORCH_OPS = {
    "topk-6": lambda x: torch.topk(x, 6, dim=-1).values,
    "topk-20": lambda x: torch.topk(x, 20, dim=-1).values,
    "sort": lambda x: torch.sort(x, dim=-1, descending=True)[0],
    "cumsum": lambda x: torch.cumsum(torch.softmax(x, -1), dim=-1),
    "searchsorted": lambda x: torch.searchsorted(
        -torch.sort(x, dim=-1, descending=True)[0].contiguous(), -x.contiguous()
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("V", [131, 49_152])
@pytest.mark.parametrize("op", list(TORCH_OPS))
@pytest.mark.parametrize("B", [4, 4096])
def test_cuda_graph_of_a_torch_op_equals_eager(V, op, B):
    """Each torch op of the top-k / top-p warps, captured alone and replayed on fresh
    inputs, returns what it returns eagerly: which op, if any, is unsafe in a graph."""
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(B + V)
    x = torch.randn(B, V, generator=gen).to(dev)
    fn = TORCH_OPS[op]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g = fn(x)
    for step in range(3):
        x.copy_(torch.randn(B, V, generator=gen).to(dev) * (1 + step))
        graph.replay()
        assert torch.equal(y_g, fn(x)), op


def test_mixed_sampling_rows_replay_and_emit_what_eager_emits(pair):
    """One row sampling with top-p among greedy rows, and outliving them: the forwards
    replay (the draft loop of mixed parameters runs eagerly), every row emits what the
    eager engine emits."""
    spec, _ = CASES["greedy-chain"]
    prompts = prompts_of([7, 3, 11, 5], seed=40)
    mixed = [osd.SamplingParams(12)] * 3 + [
        osd.SamplingParams(24, seed=41, temperature=0.9, top_p=0.8, ignore_eos=True)
    ]
    eager = _engine(pair, spec).generate(prompts, mixed)
    eng = _engine(pair, spec)
    eng.use_graphs(_graphs(eng))
    assert [o.token_ids for o in eng.generate(prompts, mixed)] == [o.token_ids for o in eager]
    _assert_replayed(eng)


def test_poison_overwrites_outputs_a_graph_does_not_own():
    """The memory invariant of ``osd.graphs``, checked by the poisoned emulation: after
    another graph replays, outputs read late are garbage unless their graph owns them."""
    graphs = StepGraphs(torch.device("cpu"), emulate=True, poison=True)

    def run(key, value, own):
        def build():
            return {"x": torch.zeros(3)}, lambda s: (s["x"] * 2, s["x"].long())

        return graphs.run(key, build, lambda s: s["x"].fill_(value), own_outputs=own)

    shared, _ = run("a", 1.0, own=False)
    owned, owned_ids = run("b", 2.0, own=True)
    assert shared.isnan().all()  # "b" replayed after "a"
    run("c", 3.0, own=False)
    assert torch.equal(owned, torch.full((3,), 4.0)) and torch.equal(
        owned_ids, torch.full((3,), 2)
    )  # owned outputs survive other replays
    fresh, _ = run("a", 5.0, own=False)
    assert torch.equal(fresh, torch.full((3,), 10.0))
    with pytest.raises(ValueError, match="emulate=True"):
        StepGraphs(torch.device("cpu"), poison=True)


def _buffers(model):
    return [model._arange.data_ptr()] + [
        t.data_ptr() for tables in model._tables.values() for t in tables
    ]


@pytest.mark.parametrize("spec", [None, CASES["sampled-chain"][0]], ids=["plain", "chain"])
def test_captured_buffers_never_move_when_a_longer_prompt_arrives(pair, spec):
    """The constant buffers a graph reads (``_arange``, the RoPE tables) are sized for the
    engine before any capture: short prompts, then a prompt longer than any before, leave
    every one where it was."""
    target, draft = pair
    eng = osd.Engine.from_pretrained(
        tiny_hf_model("llama", seed=31),
        draft=None if spec is None else perturbed(tiny_hf_model("llama", seed=31), 0.3, seed=32),
        spec=None if spec is None else osd.SpecConfig(**spec),
        max_batch_size=4,
        max_seq_len=400,
        cuda_graphs=False,
    )
    eng.use_graphs(_graphs(eng))
    models = [eng.model] + [sp.drafter.model for sp in eng.speculators]
    params = osd.SamplingParams(6, temperature=0.8, seed=3)
    eng.generate(prompts_of([3, 4, 5], seed=50), params)
    before = [_buffers(m) for m in models]
    eng.generate(prompts_of([300, 4], seed=51), params)
    assert [_buffers(m) for m in models] == before
    _assert_replayed(eng)


def test_a_pinned_model_refuses_to_grow_its_buffers(pair):
    model = osd.Engine.from_pretrained(
        tiny_hf_model("llama", seed=31), max_batch_size=2, max_seq_len=32
    ).model
    model.pin_buffers()
    cache = model.new_cache(1, 4096)  # reserving keeps the old buffers alive
    assert model._arange.shape[0] >= 4096
    model._arange = model._arange[:8]  # as if sized for a small engine
    with pytest.raises(RuntimeError, match=r"_arange holds 8 entries but a forward needs"):
        model(torch.zeros(1, 9, dtype=torch.int64), cache)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 4, 64, pytest.param(4096, marks=pytest.mark.slow)])
def test_graphed_truncated_sampling_equals_eager_at_every_batch(pair, batch, device):
    """Speculative chains sampled with top-k and top-p, replayed from graphs (poisoned and
    emulated on CPU, captured on CUDA): token for token what the eager engine emits, from
    1 row to 4,096."""
    target, draft = pair
    spec = osd.SpecConfig(num_draft_tokens=3)
    prompts = prompts_of([3 + i % 5 for i in range(batch)], seed=60)
    params = osd.SamplingParams(
        5 if batch > 64 else 10, seed=61, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True
    )
    outs = []
    for graphed in (False, True):
        eng = osd.Engine.from_pretrained(
            target,
            draft=draft,
            spec=spec,
            max_batch_size=batch,
            max_seq_len=24,
            cuda_graphs=False,
            device=device,
        )
        if graphed:
            eng.use_graphs(_graphs(eng, device))
        outs.append([o.token_ids for o in eng.generate(prompts, params)])
    assert outs[0] == outs[1]
    _assert_replayed(eng)
