"""Prompt lookup with and without the history of earlier answers, on a stream of distinct
requests.

Three engines on the chat target as ``Engine.from_pretrained`` loads it (on the CPU: the
weights kept quantized, int8 activations): plain decoding, prompt lookup over the
request's own text (``SpecConfig(drafter="ngram", num_draft_tokens=6)``) and the same
searching the newest 65,536 tokens of earlier answers too (``lookup_history=65536``, what
the chat draft's ``serving.json`` recommends beside a quantized target). Each request of
the stream (``osd.zoo.workloads.stream``: "explain" or "code"; "evalset": the evaluation
set's prompts in workload order) is served by the three in turn, greedy, batch 1, after
one warm-up request of other text; every output is asserted equal to plain decoding.
Prints tokens/s, the speedup over plain and tokens per target forward over the whole
stream and its last quarter.

    .venv/bin/python bench/bench_lookup_history.py --stream explain --requests 60

Under pytest (``make bench``): 12 requests of the explain stream.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run as a script: the repository root, for `bench.*`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import osd  # first: osd sets the OpenMP wait policy before torch loads libgomp

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench.common import chat_target_or_skip  # noqa: E402
from osd import zoo  # noqa: E402
from osd.chat_template import apply_chat_template  # noqa: E402
from osd.zoo.workloads import evaluation_set, stream  # noqa: E402

HISTORY = 65536
NEW_TOKENS = 128


def conversations(name: str, n: int) -> list:
    if name == "evalset":
        return [list(c) for w in evaluation_set(n=max(1, n // 4)) for c in w.prompts]
    return [list(c) for c in stream(name, n)]


def run(name: str = "explain", requests: int = 60, threads: int = 2) -> dict:
    torch.set_num_threads(threads)
    target = zoo.chat.fetch_target()  # downloaded on first use
    engines = {
        "plain": osd.Engine.from_pretrained(target),
        "lookup": osd.Engine.from_pretrained(
            target, spec=osd.SpecConfig(drafter="ngram", num_draft_tokens=6)
        ),
        "lookup + history": osd.Engine.from_pretrained(
            target,
            spec=osd.SpecConfig(drafter="ngram", num_draft_tokens=6, lookup_history=HISTORY),
        ),
    }
    tok = engines["plain"].tokenizer
    ids = [apply_chat_template(tok, [c])[0] for c in conversations(name, requests)]
    warm = apply_chat_template(tok, [[{"role": "user", "content": "Say hello."}]])[0]
    for e in engines.values():
        e.generate([warm], osd.SamplingParams(8))
    records = {k: [] for k in engines}
    for i, prompt in enumerate(ids):
        outs = {}
        for k, e in engines.items():
            t = time.perf_counter()
            out = e.generate([prompt], osd.SamplingParams(NEW_TOKENS))[0]
            n = len(out.token_ids)
            forwards = (out.stats or {}).get("target_forwards") or n
            records[k].append((time.perf_counter() - t, n, forwards))
            outs[k] = out.token_ids
        assert all(o == outs["plain"] for o in outs.values()), f"request {i} differs"
    q = max(1, len(ids) // 4)
    summary = {}
    for part, sl in (("all", slice(None)), ("last quarter", slice(-q, None))):
        base = sum(r[0] for r in records["plain"][sl])
        summary[part] = {
            k: {
                "tokens_per_s": sum(r[1] for r in v[sl]) / sum(r[0] for r in v[sl]),
                "speedup": base / sum(r[0] for r in v[sl]),
                "tokens_per_forward": sum(r[1] for r in v[sl]) / sum(r[2] for r in v[sl]),
            }
            for k, v in records.items()
        }
    for e in engines.values():
        e.close()
    return {"stream": name, "requests": len(ids), "summary": summary}


def report(res: dict) -> str:
    lines = [f"{res['stream']}: {res['requests']} requests"]
    for part, rows in res["summary"].items():
        lines.append(
            f"  {part}: "
            + "; ".join(
                f"{k} {v['tokens_per_s']:.1f} tok/s ({v['speedup']:.2f}x, "
                f"{v['tokens_per_forward']:.2f} tokens / forward)"
                for k, v in rows.items()
            )
        )
    return "\n".join(lines)


def test_lookup_history(benchmark):
    chat_target_or_skip()
    res = benchmark.pedantic(lambda: run("explain", 12), rounds=1, iterations=1)
    print("\n" + report(res))
    benchmark.extra_info.update(res)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stream", default="explain", choices=["explain", "code", "evalset"])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    print(report(run(a.stream, a.requests, a.threads)))
