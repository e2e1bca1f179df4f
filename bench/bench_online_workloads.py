"""Online learning on streams nobody tuned for: the chat pair's draft learning online
against the static draft, side by side, on two workloads of held-out standard-library
text (``osd.zoo.workloads.stream``: "explain" and "code", ``OSD_BENCH_ONLINE_REQUESTS``
requests each, default 160, 128 new tokens, greedy, batch 1).

Both engines are built as a user builds them: ``Engine.from_pretrained(target,
draft=draft, online=osd.OnlineConfig())`` (the draft's own online recipe from its
``serving.json``, a background learner) and the same without ``online``. Serving runs on
one torch thread, so the learner has the other core (``OSD_BENCH_THREADS`` changes it).
``OSD_BENCH_ONLINE_QUANTIZED=0`` dequantizes the target to float32;
``OSD_BENCH_CHAT_TARGET`` / ``OSD_BENCH_CHAT_DRAFT`` run another pair (``gemma``: Gemma 3
270M, ``osd.zoo.gemma``, with a draft ``osd draft build`` made for it).
Prints tokens per target forward and tokens/s over the first and the last quarter
(``osd.evaluate_online``); every output is asserted equal.

    .venv/bin/python -m pytest -q -s -p no:cacheprovider bench/bench_online_workloads.py
"""

import json
import os

import pytest

from bench.common import bench_draft, bench_target, chat_pair_or_skip
from osd.evaluate_online import online_stream
from osd.zoo.workloads import stream

REQUESTS = int(os.environ.get("OSD_BENCH_ONLINE_REQUESTS", "160"))
# OSD_BENCH_ONLINE_QUANTIZED=0: the GGUF target dequantized to float32 (quantized=False)
ENGINE = {} if os.environ.get("OSD_BENCH_ONLINE_QUANTIZED", "1") != "0" else {"quantized": False}


@pytest.fixture(scope="module")
def pair():
    target, draft = chat_pair_or_skip(threads=1)
    target, draft = bench_target(target), bench_draft(draft)
    if draft is None:
        pytest.skip("OSD_BENCH_CHAT_DRAFT=none: online learning needs a draft model to train")
    return target, draft


@pytest.mark.parametrize("workload", ["explain", "code"])
def test_online_workload(benchmark, pair, workload):
    target, draft = pair
    res = benchmark.pedantic(
        lambda: online_stream(target, draft, stream(workload, REQUESTS), engine_kwargs=ENGINE),
        rounds=1,
        iterations=1,
    )
    s = res["summary"]
    print(f"\n{workload}: " + json.dumps(s, indent=1))
    benchmark.extra_info.update(workload=workload, summary=s)
