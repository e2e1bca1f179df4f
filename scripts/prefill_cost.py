"""Prefill cost on the built-in pair: the time to serve one token of a 48-token code prompt
(the prompt's prefill plus sampling the first token), for the target alone and for the
target with the draft (speculation also prefills the draft). Best of ``--rounds`` per
prompt, averaged over 6 prompts, interleaved, torch on 1 thread.

    .venv/bin/python scripts/prefill_cost.py
"""
from __future__ import annotations

import argparse
import time

import torch

import osd
from osd import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft = zoo.default_pair()
    prompts = zoo.query_stream("code", n=6, prompt_tokens=48)
    engines = {
        "target alone": osd.Engine.from_pretrained(target, max_batch_size=1, max_seq_len=96),
        "target + draft": osd.Engine.from_pretrained(
            target, draft=draft, spec=osd.SpecConfig(num_draft_tokens=4), max_batch_size=1,
            max_seq_len=96),
    }
    best = {name: [float("inf")] * len(prompts) for name in engines}
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.generate([prompt], osd.SamplingParams(1))
                best[name][i] = min(best[name][i], time.perf_counter() - start)
    for name, times in best.items():
        print(f"{name}: {sum(times) / len(times) * 1e3:.1f} ms per 48-token prompt")


if __name__ == "__main__":
    main()
