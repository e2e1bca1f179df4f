"""The serving settings of a freshly built draft, measured on this machine (the last stage
of ``osd draft build --target``): a few speculation shapes timed against plain decoding,
the fastest written to the draft's ``serving.json``.

A GGUF target is measured twice, as ``osd.Engine.from_pretrained`` loads it by default (on
the CPU it keeps its quantized weights: the ``quantized_target`` settings) and in float32
(``quantized=False``: the plain settings); batch 1, greedy. Each round runs one held-out prompt
through plain decoding and every candidate, in a rotated order, so that a busy machine
slows them alike; a candidate's score is the median over rounds of plain time over its
time. Rounds go on until the stage's deadline; fewer candidates are tried when a round
would not fit twice.
"""

from __future__ import annotations

import statistics
import time

import torch

import osd
from osd.draft_build.common import Progress, log
from osd.models.loading import load_model
from osd.spec import SpecConfig

# (name, SpecConfig fields, block format of the served draft), in the order they are
# given up when time is short: the middle chain, prompt lookup alone (free: the draft must
# beat it to be served), the chain's neighbours, then lookup in front, Q8_0, the longest.
CANDIDATES = (
    ("chain k=3", {"num_draft_tokens": 3}, None),
    ("prompt lookup alone k=6", {"drafter": "ngram", "num_draft_tokens": 6}, None),
    ("chain k=2", {"num_draft_tokens": 2}, None),
    ("chain k=4", {"num_draft_tokens": 4}, None),
    (
        "chain k=3 + prompt lookup",
        {"num_draft_tokens": 3, "prompt_lookup": True, "lookup_tokens": 8, "lookup_tree_below": 3},
        None,
    ),
    ("chain k=3, Q8_0 draft", {"num_draft_tokens": 3}, "Q8_0"),
    ("chain k=5", {"num_draft_tokens": 5}, None),
)
NEW_TOKENS = 64  # tokens per measured answer
# Tokens of earlier answers a chosen prompt lookup also searches (SpecConfig.lookup_history).
# Measured on streams of distinct requests (bench/bench_workloads.py, docs/benchmarks.md)
# it drafted more on every one; this measurement cannot see it: it times each prompt once
# per candidate, and an answer's own earlier run would be in the history.
LOOKUP_HISTORY = 65536


def with_history(fields: dict | None) -> dict | None:
    """``fields`` with ``lookup_history`` added where they use prompt lookup."""
    if fields is None or not (fields.get("drafter") == "ngram" or fields.get("prompt_lookup")):
        return fields
    return {**fields, "lookup_history": LOOKUP_HISTORY}


def _engine(target, draft, fields, fmt, seq):
    spec = None if fields is None else SpecConfig(**fields)
    served = None if fields is None or fields.get("drafter") == "ngram" else draft
    return osd.Engine(
        target, draft=served, max_batch_size=1, max_seq_len=seq, spec=spec, quantize_draft=fmt
    )


def measure_serving(
    target_path: str,
    draft_dir: str,
    prompts: list[list[int]],
    deadline: float,
    build_end: float,
    new_tokens: int = NEW_TOKENS,
    candidates=CANDIDATES,
    max_threads: int = 2,
    quantized: bool = False,
) -> dict:
    """Time plain decoding and ``candidates`` on ``prompts`` (token ids) until
    ``deadline``, beside the target loaded with ``quantized`` (a GGUF file's block
    weights kept, multiplied as ``Engine.from_pretrained`` does by default: int8
    activations where the CPU has VNNI); returns ``{"rows", "best", "choice", "rounds", ...}`` where
    ``choice`` is the fastest candidate's ``{"spec", "quantize_draft"}``."""
    target = load_model(target_path, quantized="int8" if quantized else False)
    draft = load_model(draft_dir)
    seq = max(map(len, prompts)) + new_tokens + 32
    warm = osd.SamplingParams(max_new_tokens=8)
    plain = _engine(target, draft, None, None, seq)
    plain.generate([prompts[0]], warm)
    # On a shared machine a team of threads larger than the free cores can run many times
    # slower than one thread, and the sync-heavy speculative steps suffer most: the
    # measurement runs with whichever of 1 and max_threads decodes faster now.
    paces = {}
    for n in sorted({1, max(1, max_threads)}):
        torch.set_num_threads(n)
        t = time.perf_counter()
        plain.generate([prompts[0]], warm)
        paces[n] = time.perf_counter() - t
    threads = min(paces, key=paces.get)
    torch.set_num_threads(threads)
    t = time.perf_counter()
    plain.generate([prompts[0]], osd.SamplingParams(max_new_tokens=1))
    t_prefill = time.perf_counter() - t
    t = time.perf_counter()
    plain.generate([prompts[0]], warm)
    per_token = max(time.perf_counter() - t - t_prefill, 1e-4) / 7
    # As many candidates as let two rounds fit (a speculative answer taking up to 1.5
    # plain ones, warm-ups included), at least one; on a slow target, shorter answers.
    left = deadline - time.monotonic()

    def two_rounds(n: int, tokens: int) -> float:
        answer_s = t_prefill + per_token * tokens
        return (1 + 1.5 * n) * (2 * answer_s + t_prefill + 8 * per_token)

    n = len(candidates)
    while n > 1 and two_rounds(n, new_tokens) > left:
        n -= 1
    while new_tokens > 16 and two_rounds(n, new_tokens) > left:
        new_tokens //= 2
    params = osd.SamplingParams(max_new_tokens=new_tokens)
    engines = {"plain": plain}
    for name, fields, fmt in candidates[:n]:
        engines[name] = _engine(target, draft, fields, fmt, seq)
        engines[name].generate([prompts[0]], warm)
    names = list(engines)
    times = {name: [] for name in names}
    tokens = {name: 0 for name in names}
    totals = {name: {"target_forwards": 0, "drafted": 0, "accepted": 0} for name in names}
    differ = 0
    progress = Progress("serving measurement", len(prompts), "prompts", deadline, build_end)
    rounds, round_s = 0, 0.0
    for r, prompt in enumerate(prompts):
        if rounds and time.monotonic() + round_s > deadline:
            break
        # the first round in order of likely use, so the deadline cuts the least likely;
        # later rounds rotated
        order = names[r % len(names) :] + names[: r % len(names)] if rounds else list(names)
        t_round = time.perf_counter()
        outs = {}
        for name in order:
            if not rounds and name != "plain" and len(names) > 2 and time.monotonic() > deadline:
                names.remove(name)  # not measured once: left out
                continue
            engine = engines[name]
            engine.reset_stats()
            t = time.perf_counter()
            out = engine.generate([prompt], params)[0]
            times[name].append(time.perf_counter() - t)
            tokens[name] += len(out.token_ids)
            outs[name] = out.token_ids
            for key in totals[name]:
                totals[name][key] += engine.stats.get(key) or 0
        differ += sum(outs[name] != outs["plain"] for name in names[1:])
        round_s = time.perf_counter() - t_round
        rounds += 1
        progress.update(rounds, f"{round_s:.1f} s per round")
    progress.close(rounds)
    if len(names) < len(candidates) + 1:
        log(
            f"serving measurement: {len(names) - 1} of {len(candidates)} candidates fit "
            "the time left"
        )
    chosen = [c for c in candidates if c[0] in names]
    rows = []
    for (name, fields, fmt), key in zip([("plain", None, None), *chosen], names):
        assert name == key
        ratios = [p / c for p, c in zip(times["plain"], times[key])]
        tot = totals[key]
        rows.append(
            {
                "name": name,
                "spec": fields,
                "quantize_draft": fmt,
                "tokens_per_s": round(tokens[key] / sum(times[key]), 2),
                "speedup": round(statistics.median(ratios), 3),
                "accepted": round(tot["accepted"] / tot["drafted"], 3) if tot["drafted"] else None,
                "tokens_per_forward": round(tokens[key] / tot["target_forwards"], 3)
                if fields is not None and tot["target_forwards"]
                else None,
            }
        )
    best = max(rows[1:], key=lambda row: row["speedup"])
    kind = "quantized" if quantized else "float"
    log(f"serving measurement beside the {kind} target, {threads} thread(s):")
    for row in rows:
        log(
            f"  {row['name']}: {row['tokens_per_s']} tokens/s, {row['speedup']:.2f}x plain, "
            f"accepted {row['accepted']}, tokens per forward {row['tokens_per_forward']}"
        )
    log(f"fastest: {best['name']} ({best['speedup']:.2f}x plain over {rounds} prompts)")
    if best["speedup"] < 1.0:
        log(f"warning: no candidate beat plain decoding here (best {best['speedup']:.2f}x)")
    for e in engines.values():
        e.close()
    return {
        "rows": rows,
        "best": best["name"],
        "choice": {"spec": with_history(best["spec"]), "quantize_draft": best["quantize_draft"]},
        "rounds": rounds,
        "new_tokens": new_tokens,
        "quantized_target": quantized,
        "threads": threads,
        "outputs_differing_from_plain": differ,
    }
