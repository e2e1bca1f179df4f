"""Prompt lookup's draft lengths from each request's record (``PromptLookup.min_reach``)
against drafting every continuation whole, per workload of the evaluation set.

The chat target (SmolLM2-135M-Instruct Q4_1, weights kept quantized: the CPU default),
2 threads, batch 1, greedy, 128 new tokens with EOS ignored, end to end; prompt lookup
alone (``SpecConfig(drafter="ngram")``) drafting up to ``K`` tokens with ``min_reach``
0 (the whole continuation) and with the values in ``REACHES`` (``None``: the device's
default, ``osd.spec.MIN_REACH``), beside plain decoding. Every provider runs prompt i
before any runs prompt i + 1, best of ``ROUNDS`` per prompt, and every output is asserted
equal to plain decoding's. Prints tokens/s and the ratio to plain per workload.

    .venv/bin/python bench/bench_lookup_lengths.py --prompts 3 --rounds 2

Under pytest (``make bench``): one prompt per workload, one round.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __name__ == "__main__":  # run as a script: the repository root, for `bench.*`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import osd  # first: its libgomp setting applies only before torch loads

import torch  # noqa: E402

from osd.chat_template import apply_chat_template  # noqa: E402
from osd.zoo.workloads import evaluation_set  # noqa: E402

K = 6
REACHES = (0.0, None, 0.3)
NEW_TOKENS = 128


def engines(target: str, k: int, reaches) -> dict:
    out = {"plain": osd.Engine.from_pretrained(target, max_batch_size=1)}
    for r in reaches:
        spec = osd.SpecConfig(
            drafter="ngram", num_draft_tokens=k, lookup=osd.PromptLookup(min_reach=r)
        )
        out[f"lookup k={k} min_reach={r}"] = osd.Engine.from_pretrained(
            target, max_batch_size=1, spec=spec
        )
    return out


def run(prompts: int, rounds: int, k: int = K, reaches=REACHES, log=print) -> dict:
    torch.set_num_threads(2)
    target = osd.zoo.chat_pair()[0]
    engs = engines(target, k, reaches)
    tok = engs["plain"].tokenizer
    params = osd.SamplingParams(NEW_TOKENS, ignore_eos=True)
    results = {}
    for w in evaluation_set(n=prompts):
        ids = [apply_chat_template(tok, [list(p)])[0] for p in w.prompts]
        for e in engs.values():
            e.generate([ids[0][:16]], osd.SamplingParams(4))  # warm-up
        best = {name: [0.0] * len(ids) for name in engs}
        for _ in range(rounds):
            for j, i in enumerate(ids):
                want = None
                for name, e in engs.items():
                    t = time.perf_counter()
                    out = e.generate([i], params)[0]
                    rate = len(out.token_ids) / (time.perf_counter() - t)
                    best[name][j] = max(best[name][j], rate)
                    want = out.token_ids if want is None else want
                    assert out.token_ids == want, (w.name, name)
        mean = {name: sum(v) / len(v) for name, v in best.items()}
        results[w.name] = mean
        log(
            f"{w.name:10s} "
            + "  ".join(f"{n}: {v:.1f} ({v / mean['plain']:.2f}x)" for n, v in mean.items())
        )
    return results


def test_lookup_lengths():
    # only here: bench.common imports pytest, and the script runs without it
    from bench.common import chat_target_or_skip

    chat_target_or_skip()
    print()
    run(prompts=1, rounds=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=3, help="prompts per workload")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=K)
    args = ap.parse_args()
    run(args.prompts, args.rounds, args.k)


if __name__ == "__main__":
    main()
