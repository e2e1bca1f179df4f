"""The demo's last part: the speedup on each workload of the evaluation set.

The demo's stream is one workload; a user's traffic is others. After the stream, the demo
builds the engines as a user does (``Engine.from_pretrained(target)`` and
``Engine.from_pretrained(target, draft=draft)``, the draft's own settings, nothing per
workload) and reports the median speedup, α, acceptance, tokens per target forward and c
on each workload of :func:`osd.zoo.workloads.evaluation_set` (``osd.evaluate``), greedy,
appending the table to the report.
"""

from __future__ import annotations

import json
import os

from osd.evaluate import evaluate, table
from osd.zoo.workloads import evaluation_set


def workloads_report(
    target: str, draft: str, out_dir: str, prompts: int = 3, max_new_tokens: int = 128
) -> list[dict]:
    """Measure, print, and append to ``out_dir/report.md`` (rows also in
    ``out_dir/workloads.json``)."""
    print(
        f"osd demo: speedup per workload ({prompts} prompts each, {max_new_tokens} new "
        f"tokens, greedy, the engines built as a user builds them) ...",
        flush=True,
    )
    rows = evaluate(
        target, draft, workloads=evaluation_set(n=prompts), max_new_tokens=max_new_tokens
    )
    unserved = (
        ""
        if rows[0]["draft_served"]
        else " (the draft recommends it beside this target, and is not served)"
    )
    text = "\n".join(
        [
            "",
            "## Speedup per workload",
            "",
            f"The same target and draft on the evaluation set (`osd.zoo.workloads`: text from "
            f"standard-library modules no shipped draft trained on), {prompts} prompts per "
            f"workload, {max_new_tokens} new tokens, greedy, batch 1: plain and speculative "
            f"engines built with `Engine.from_pretrained` and the draft's own settings, "
            f"interleaved prompt by prompt (`osd.evaluate`). Speculation as configured: "
            f"`SpecConfig({rows[0]['spec']})`{unserved}. The bound is the analytic speedup "
            f"of the draft model's chain alone; prompt lookup can beat it.",
            "",
            table(rows),
            "",
        ]
    )
    print(text)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "report.md"), "a") as f:
        f.write(text)
    with open(os.path.join(out_dir, "workloads.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows
