"""What a learner training in the serving process costs serving, by torch thread count:
one engine built as a user builds it (``Engine.from_pretrained(target, draft=draft,
online=osd.OnlineConfig())``, the chat pair, the GGUF target kept quantized) serves a
stream of distinct "explain" requests (``osd.zoo.workloads.stream``, 128 new tokens,
greedy, batch 1), each request twice in a row: once with its background learner free to
train, once with the learner held at a step boundary (``Engine.learning_paused``), the
order alternating. torch's intra-op thread count is process-wide, so the learner's
training runs on as many threads as serving: at 1 thread they share 2 cores one each, at
2 they contend for both. Prints serving tokens/s learning and held, and their ratio.
``OSD_BENCH_CHAT_TARGET`` / ``OSD_BENCH_CHAT_DRAFT`` run another pair (``gemma``: Gemma 3
270M with a draft ``osd draft build`` made for it; a base model is asked the requests as
question-and-answer transcripts, ``osd.chat_template.encode_chat``).

    .venv/bin/python bench/bench_online_threads.py [--requests 40] [--threads 1 2]
"""

import os
import sys

if __name__ == "__main__":  # run as a script: the repository root, for `bench.*`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import osd  # first: osd sets the OpenMP wait policy before torch loads libgomp

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench.common import bench_draft, bench_target  # noqa: E402
from osd.chat_template import encode_chat  # noqa: E402
from osd.zoo import chat, workloads  # noqa: E402

WARMUP = 8  # requests left out of the rates: the first updates and allocations


def run(requests: int, threads: int) -> dict:
    """Serving tokens/s with the learner training and held, at ``threads`` threads."""
    torch.set_num_threads(threads)
    target, draft = chat.chat_pair()
    target, draft = bench_target(target), bench_draft(draft)
    engine = osd.Engine.from_pretrained(target, draft=draft, online=osd.OnlineConfig())
    params = osd.SamplingParams(max_new_tokens=128)
    seconds, tokens = collections.Counter(), collections.Counter()
    stream = workloads.stream("explain", requests, seed=9)
    try:
        for i, ids in enumerate(encode_chat(engine.tokenizer, [list(m) for m in stream])):
            for mode in ("held", "learning") if i % 2 else ("learning", "held"):
                hold = engine.learning_paused() if mode == "held" else contextlib.nullcontext()
                with hold:
                    start = time.perf_counter()
                    out = engine.generate([ids], params)[0]
                    took = time.perf_counter() - start
                if i >= WARMUP:
                    seconds[mode] += took
                    tokens[mode] += len(out.token_ids)
        rates = {m: tokens[m] / seconds[m] for m in seconds}
        return {
            "threads": threads,
            "learning_tokens_per_s": round(rates["learning"], 1),
            "held_tokens_per_s": round(rates["held"], 1),
            "ratio": round(rates["learning"] / rates["held"], 3),
            "updates_applied": engine.stats["online"].get("updates_applied"),
        }
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    for threads in args.threads:
        r = run(args.requests, threads)
        print(
            f"{threads} thread(s): serving {r['learning_tokens_per_s']} tok/s with the learner "
            f"training, {r['held_tokens_per_s']} held: {r['ratio']:.3f}x "
            f"({r['updates_applied']} updates applied)",
            flush=True,
        )


if __name__ == "__main__":
    main()


def test_online_threads():
    """``make bench``: 24 requests at 1 and 2 threads (the chat pair fetched on first use;
    skipped, naming why, only when it cannot be fetched)."""
    from bench.common import chat_pair_or_skip  # only here: the script runs without pytest

    chat_pair_or_skip(threads=1)
    print()
    for threads in (1, 2):
        print(run(24, threads))
