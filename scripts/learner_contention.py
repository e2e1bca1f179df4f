"""What the background learner costs serving: the chat pair served as ``osd demo`` serves
it (one torch thread, the draft in Q8_0 behind prompt lookup, the demo's online recipe, so
the learner has the other core), each speculative step timed from its start to its
verdict and sorted by whether the learner was training at that moment. Prints a markdown
table per block of requests: steps and their mean / median duration with the learner idle
and busy, and the share of the block's wall time the learner was busy.

    .venv/bin/python scripts/learner_contention.py --requests 100
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import osd
from osd import zoo
from osd.chat import apply_chat_template
from osd.demo import online_recipe
from osd.zoo import humaneval


class StepTimer:
    """A speculator listener: each step's duration (start to verdict) and whether the
    learner was busy at its start or its end."""

    prompt_positions = 0

    def __init__(self, learner):
        self.learner = learner
        self.steps: list[tuple[bool, float]] = []
        self._t0 = None
        self._busy = False

    def before_step(self) -> None:
        self._t0 = time.perf_counter()
        self._busy = self.learner.busy

    def on_prefill(self, requests, prompt_logits, prompt_hidden=None) -> None:
        pass

    def on_verdict(self, verdict) -> None:
        self.steps.append((self._busy or self.learner.busy, time.perf_counter() - self._t0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--block", type=int, default=20, help="requests per table row")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft = zoo.chat_pair()
    spec = osd.SpecConfig(num_draft_tokens=4, prompt_lookup=True)
    eng = osd.Engine.from_pretrained(target, draft=draft, spec=spec,
                                     online=online_recipe("chat"), max_batch_size=1,
                                     max_seq_len=1024, quantize_draft="Q8_0")
    learner = eng.online.learners[0]
    timer = StepTimer(learner)
    eng.speculators[0].listeners.append(timer)
    prompts = apply_chat_template(eng.tokenizer,
                                  humaneval.conversations(args.requests, seed=0))
    params = osd.SamplingParams(args.max_new_tokens)
    print("| requests | steps, learner idle | ms, idle (mean / median) | steps, learner busy "
          "| ms, busy (mean / median) | learner busy, share of wall time |")
    print("|---|---|---|---|---|---|")
    for start in range(0, args.requests, args.block):
        first_step = len(timer.steps)
        busy_before = learner.history.as_dict()["update_seconds"]
        t0 = time.perf_counter()
        for p in prompts[start:start + args.block]:
            eng.generate([p], params)
        wall = time.perf_counter() - t0
        # updates finished in the block; one still running is counted in the next block
        busy = learner.history.as_dict()["update_seconds"] - busy_before
        cells = []
        for flag in (False, True):
            ms = [1000 * s for b, s in timer.steps[first_step:] if b == flag]
            cells += [str(len(ms)), f"{statistics.mean(ms):.1f} / {statistics.median(ms):.1f}"
                      if ms else "-"]
        print(f"| {start}-{start + args.block - 1} | {' | '.join(cells)} | "
              f"{min(1.0, busy / wall):.2f} |", flush=True)
    eng.close()


if __name__ == "__main__":
    main()
