"""Speedup per workload: the chat pair as a user builds it, on traffic nobody tuned for.

``osd.Engine.from_pretrained(target)`` against ``osd.Engine.from_pretrained(target,
draft=draft)`` (the draft's own ``serving.json`` settings, nothing per workload) on each
workload of ``osd.zoo.workloads.evaluation_set`` (explain, summarise, multiturn, code:
text from held-out standard-library modules), CPU, batch 1, ``OSD_BENCH_THREADS`` threads
(default 2), 128 new tokens, greedy and sampled (T 0.7, top-p 0.9), interleaved prompt by
prompt (``osd.evaluate``). Each row prints the median speedup over the workload's
prompts, α, acceptance, tokens per target forward, the draft cost c and the analytic
bound of the draft model's chain; greedy rows assert that every speculative output equals
the plain one. The zero-setup options run too, greedy: prompt lookup alone
(``SpecConfig(drafter="ngram")``) and self-speculation (``drafter="self"``, the target
with every other layer skipped). ``OSD_BENCH_WORKLOAD_PROMPTS`` (default 6) sets the
prompts per workload, ``OSD_BENCH_CHAT_DRAFT`` another draft directory (the EAGLE one;
``none``: the zero-setup rows only), ``OSD_BENCH_CHAT_TARGET`` another target (``gemma``:
Gemma 3 270M, ``osd.zoo.gemma``, asked in question-and-answer transcripts). Each case's
rows are also drawn, with the cases before it in the run, to
``$OSD_BENCH_WORKLOADS_PLOT`` (default ``results/bench_workloads.png``; empty: no plot),
beside the goals (2x greedy, 1.6x sampled).

    .venv/bin/python -m pytest -q -s -p no:cacheprovider bench/bench_workloads.py
"""

import os

import pytest

import osd
from bench.common import bench_draft, bench_target, chat_pair_or_skip
from osd.evaluate import evaluate, plot, table
from osd.spec import draft_serving_defaults
from osd.zoo.workloads import evaluation_set

NEW_TOKENS = 128
PROMPTS = int(os.environ.get("OSD_BENCH_WORKLOAD_PROMPTS", "6"))
MODES = {"greedy": {}, "sampled": dict(temperature=0.7, top_p=0.9)}
GOALS = {"greedy goal 2x": 2.0, "sampled goal 1.6x": 1.6}
PLOT = os.environ.get("OSD_BENCH_WORKLOADS_PLOT", os.path.join("results", "bench_workloads.png"))
NAMES = {
    "draft": "as served",
    "draft-model": "draft model",
    "ngram": "lookup alone",
    "self": "self-speculation",
}
_drawn: dict[str, list[dict]] = {}  # the run's cases so far, for the plot
# "draft": as from_pretrained builds it (beside a quantized target the chat draft
# recommends prompt lookup alone); "draft-model": the draft model with its float-target
# settings (serving.json's "spec")
CASES = [
    ("draft", "greedy"),
    ("draft", "sampled"),
    ("draft-model", "greedy"),
    ("draft-model", "sampled"),
    ("ngram", "greedy"),
    ("self", "greedy"),
]


@pytest.fixture(scope="module")
def pair():
    target, draft = chat_pair_or_skip(threads=2)
    return bench_target(target), bench_draft(draft)


@pytest.mark.parametrize("drafter,mode", CASES, ids=[f"{d}-{m}" for d, m in CASES])
def test_workloads(benchmark, pair, drafter, mode):
    target, draft = pair
    if drafter.startswith("draft") and draft is None:
        pytest.skip(
            "OSD_BENCH_CHAT_DRAFT=none: the draft rows need a draft; the zero-setup rows run"
        )
    spec = (
        None
        if drafter == "draft"
        else draft_serving_defaults(draft)[0]
        if drafter == "draft-model"
        else osd.SpecConfig(drafter=drafter)
    )
    rows = benchmark.pedantic(
        lambda: evaluate(
            target,
            draft if drafter.startswith("draft") else None,
            spec=spec,
            workloads=evaluation_set(n=PROMPTS),
            max_new_tokens=NEW_TOKENS,
            sampling=MODES[mode],
        ),
        rounds=1,
        iterations=1,
    )
    print(
        f"\n{drafter}, {mode}, {NEW_TOKENS} new tokens, {PROMPTS} prompts per workload\n"
        + table(rows)
    )
    benchmark.extra_info.update(drafter=drafter, mode=mode, rows=rows)
    if PLOT:
        _drawn[f"{NAMES[drafter]}, {mode}"] = rows
        os.makedirs(os.path.dirname(PLOT) or ".", exist_ok=True)
        plot(
            _drawn,
            PLOT,
            goals=GOALS,
            title=f"chat pair, {PROMPTS} prompts per workload, "
            f"{NEW_TOKENS} new tokens, batch 1 (t/f: tokens per target forward)",
        )
    if mode == "greedy":
        assert all(r["equal"] for r in rows), "a speculative output differs from plain greedy"
