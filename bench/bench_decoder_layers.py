"""A cached CPU forward's layers looped in C++ (``decoder_layers``) against the same ops
called from Python, on the chat target (SmolLM2-135M-Instruct Q4_1, 30 layers; or
``OSD_BENCH_CHAT_TARGET``, e.g. ``gemma``: Gemma 3 270M, 18 layers, most of them with a
512-token sliding window) loaded as ``Engine.from_pretrained`` loads it (weights kept
quantized, int8 activations), the torch threads of the run (``OSD_BENCH_THREADS``,
default 2 here).

One forward of ``rows`` new tokens (1: a decode step; 5: the verify of a chain of four
drafts) at ``context`` cached positions, output head included; the cache is not
committed, so every call sees the same context. Providers: ``python-loop``
(``fused_layers.LOOP_IN_CPP = False``) and ``cpp-loop`` (the default); their outputs are
checked equal bit for bit first. ``extra_info``: ``us_per_forward``.

``test_large_forwards``: forwards of more than 16 rows (a batch's verify, prefill pieces)
unfused, through the C++ layers on VNNI, and as loaded (AMX tiles where the CPU has them).

    OSD_BENCH_THREADS=2 .venv/bin/python -m pytest -q -p no:cacheprovider \
        bench/bench_decoder_layers.py
"""

import osd  # noqa: F401  (first: osd sets the OpenMP wait policy before torch loads libgomp)

import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from bench.common import bench_target, chat_target_or_skip  # noqa: E402
from osd.models import fused_layers, load_model  # noqa: E402
from osd_kernels import native_available  # noqa: E402

CALLS = 20
pytestmark = pytest.mark.usefixtures("torch_threads")


@pytest.fixture(scope="module")
def target():
    path = bench_target(None) or chat_target_or_skip()
    if not native_available():
        pytest.skip("osd_kernels._C is not built")
    return load_model(path, quantized="int8")


@pytest.mark.parametrize("context", [128, 1024])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("provider", ["python-loop", "cpp-loop"])
def test_decoder_layers(benchmark, target, provider, rows, context, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    vocab = target.vocab_size
    cache = target.new_cache(1, context + rows + 1)
    prompt = torch.randint(0, vocab, (1, context), generator=gen)
    ids = torch.randint(0, vocab, (1, rows), generator=gen)
    with torch.inference_mode():
        target.prefill(prompt, cache, torch.tensor([context], dtype=torch.int32), chunk=256)
        outs = []
        for loop in (False, True):
            monkeypatch.setattr(fused_layers, "LOOP_IN_CPP", loop)
            outs.append(target(ids, cache))
        assert torch.equal(outs[0], outs[1])
        monkeypatch.setattr(fused_layers, "LOOP_IN_CPP", provider == "cpp-loop")

        def run():
            for _ in range(CALLS):
                target(ids, cache)

        benchmark.pedantic(run, rounds=10, warmup_rounds=1)
    info = dict(provider=provider, rows=rows, context=context, threads=torch.get_num_threads())
    if benchmark.stats is not None:
        info["us_per_forward"] = round(benchmark.stats.stats.median / CALLS * 1e6, 1)
    benchmark.extra_info.update(info)


LARGE = {  # name: (batch, new tokens a row, cached positions)
    "batch-4-verify-k4": (4, 5, 200),
    "batch-8-verify-k4": (8, 5, 200),
    "prefill-piece-128": (1, 128, 64),
    "prefill-piece-256": (1, 256, 64),
    "batch-8-prefill-piece-256": (8, 256, 64),
}


@pytest.mark.parametrize("shape", list(LARGE))
def test_large_forwards(benchmark, target, shape, monkeypatch):
    """Forwards of more than 16 rows (a batch's verify, prefill pieces) in three set-ups,
    the same forward alternating between them, outputs checked equal bit for bit: the
    unfused forward on VNNI alone (``CPU_MAX_ROWS_QUANTIZED`` 16, ``OSD_NO_AMX``), the C++
    layers on VNNI alone, and as loaded (the C++ layers; AMX tiles for projections of 32
    rows and more where the CPU has them). ``extra_info``: ms per forward of each (best of
    10 rounds of 2) and the ratios to the first."""
    batch, rows, context = LARGE[shape]
    gen = torch.Generator().manual_seed(rows)
    vocab = target.vocab_size
    cache = target.new_cache(batch, context + rows + 1)
    prompt = torch.randint(0, vocab, (batch, context), generator=gen)
    ids = torch.randint(0, vocab, (batch, rows), generator=gen)
    setups = {
        "unfused_vnni": (16, True),
        "cpp_layers_vnni": (fused_layers.CPU_MAX_ROWS_QUANTIZED, True),
        "as_loaded": (fused_layers.CPU_MAX_ROWS_QUANTIZED, False),
    }

    def use(name):
        limit, no_amx = setups[name]
        monkeypatch.setattr(fused_layers, "CPU_MAX_ROWS_QUANTIZED", limit)
        if no_amx:
            monkeypatch.setenv("OSD_NO_AMX", "1")
        else:
            monkeypatch.delenv("OSD_NO_AMX", raising=False)

    best = {name: float("inf") for name in setups}
    with torch.inference_mode():
        target.prefill(prompt, cache, torch.full((batch,), context, dtype=torch.int32), chunk=256)
        outs = []
        for name in setups:
            use(name)
            outs.append(target(ids, cache))
        assert all(torch.equal(outs[0], o) for o in outs[1:])

        def run():
            for name in setups:
                use(name)
                start = time.perf_counter()
                for _ in range(2):
                    target(ids, cache)
                best[name] = min(best[name], (time.perf_counter() - start) / 2)

        benchmark.pedantic(run, rounds=10, warmup_rounds=1)
    info = dict(shape=shape, rows=batch * rows, context=context, threads=torch.get_num_threads())
    info.update({f"{name}_ms": round(t * 1e3, 2) for name, t in best.items()})
    first = best["unfused_vnni"]
    info.update({f"{name}_speedup": round(first / t, 2) for name, t in best.items()})
    benchmark.extra_info.update(info)
