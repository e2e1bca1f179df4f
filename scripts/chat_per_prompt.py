"""Per-prompt speedup on the chat pair: osd plain and the bench's best speculative row
(prompt lookup on 2+-token matches with lookup steps of up to 8 drafts, then the EAGLE
draft in Q8_0) alternating prompt by prompt over the first ``--prompts`` HumanEval chat
requests, greedy fp32, 128 new tokens, one pass. Prints each prompt's ratio (plain time
over speculative time) and the running ratio of the sums, then both engines' tokens/s;
asserts equal outputs.

    .venv/bin/python scripts/chat_per_prompt.py --prompts 40
"""
from __future__ import annotations

import argparse
import time

import torch

import osd
from osd import zoo
from osd.chat import apply_chat_template
from osd.zoo import humaneval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = zoo.chat_pair()
    spec = osd.SpecConfig(num_draft_tokens=4, prompt_lookup=True, ngram_min=2, lookup_tokens=8)
    spec_engine = osd.Engine.from_pretrained(target, draft=zoo.chat_eagle(), spec=spec,
                                             max_batch_size=1, max_seq_len=1024,
                                             quantize_draft="Q8_0")
    plain = osd.Engine.from_pretrained(target, max_batch_size=1, max_seq_len=1024)
    # the bench's prompts (seed 11); one more, past them, warms both engines up
    prompts = apply_chat_template(plain.tokenizer,
                                  humaneval.conversations(args.prompts + 1, seed=11))
    params = osd.SamplingParams(args.tokens)
    for engine in (plain, spec_engine):
        engine.generate([prompts[-1]], params)
    total_plain = total_spec = 0.0
    tokens = 0
    print("| prompt | prompt tokens | new tokens | ratio | running ratio |")
    print("|---|---|---|---|---|")
    for i, prompt in enumerate(prompts[:args.prompts]):
        t0 = time.perf_counter()
        want = plain.generate([prompt], params)[0].token_ids
        t1 = time.perf_counter()
        got = spec_engine.generate([prompt], params)[0].token_ids
        t2 = time.perf_counter()
        assert got == want, f"prompt {i}: speculative output differs from plain"
        total_plain += t1 - t0
        total_spec += t2 - t1
        tokens += len(want)
        print(f"| {i} | {len(prompt)} | {len(want)} | {(t1 - t0) / (t2 - t1):.2f} | "
              f"{total_plain / total_spec:.2f} |", flush=True)
    print(f"\n{tokens} tokens: plain {tokens / total_plain:.1f} tokens/s, speculative "
          f"{tokens / total_spec:.1f} tokens/s, {total_plain / total_spec:.2f}x")


if __name__ == "__main__":
    main()
