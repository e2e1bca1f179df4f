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

    OSD_BENCH_THREADS=2 .venv/bin/python -m pytest -q -p no:cacheprovider \
        bench/bench_decoder_layers.py
"""

import osd  # noqa: F401  (first: osd sets the OpenMP wait policy before torch loads libgomp)

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
