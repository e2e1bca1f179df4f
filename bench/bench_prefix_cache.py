"""The prefix cache on the chat target: time to the first token with and without it.

SmolLM2-135M-Instruct (fetched on first use by ``osd.zoo.chat_pair()``; skipped, with the
reason, only when it cannot be: no network and no cache), fp32, batch 1,
one torch thread, ``max_new_tokens=1`` (the prefill and one sampled token), two engines
side by side, the same prompts in the same order, taking turns prompt by prompt:

- ``test_humaneval_stream``: the demo's stream (``osd.zoo.humaneval``, seed 0), its first
  ``N_STREAM`` chat requests. Prompts share the chat template's system prompt and the
  ask's first line, so each reuses a few blocks of the ones before it.
- ``test_multi_turn``: one conversation of ``TURNS`` turns (HumanEval tasks as user
  messages, the target's own greedy 64-token answers as the assistant's), each turn's
  prompt the whole conversation so far: with the cache, a turn prefills only its newest
  messages.

Prints a table row per test (``pytest -s``): prompt tokens, tokens reused, total time to
first token without and with the cache, and the ratio; ``extra_info`` holds the same.

    .venv/bin/python -m pytest -q -s -p no:cacheprovider bench/bench_prefix_cache.py
"""

from __future__ import annotations

import time

import pytest
import torch

import osd
from osd.chat_template import apply_chat_template
from osd import zoo
from osd.zoo import humaneval

N_STREAM = 48
TURNS = 6


@pytest.fixture(scope="module")
def engines():
    try:
        target = zoo.chat_pair()[0]
    except Exception as exc:  # no network and no cache: nothing to measure
        pytest.skip(f"the chat target is not available: {exc}")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    kw = dict(max_batch_size=1, max_seq_len=4096)
    yield (
        osd.Engine.from_pretrained(target, **kw),
        osd.Engine.from_pretrained(target, prefix_cache=65536, **kw),
    )
    torch.set_num_threads(before)


def _side_by_side(plain, cached, prompts) -> dict:
    one = osd.SamplingParams(1)
    seconds = [0.0, 0.0]
    reused0 = cached.prefix_cache.tokens_reused
    for n, p in enumerate(prompts):
        for i in (0, 1) if n % 2 == 0 else (1, 0):  # who goes first alternates
            t0 = time.perf_counter()
            (plain, cached)[i].generate([p], one)
            seconds[i] += time.perf_counter() - t0
    return {
        "prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "tokens_reused": cached.prefix_cache.tokens_reused - reused0,
        "ttft_s_plain": round(seconds[0], 3),
        "ttft_s_cached": round(seconds[1], 3),
        "ratio": round(seconds[0] / seconds[1], 2),
    }


def _report(benchmark, name: str, row: dict) -> None:
    print(
        f"\n| {name} | {row['prompts']} | {row['prompt_tokens']} | {row['tokens_reused']} | "
        f"{row['ttft_s_plain']} | {row['ttft_s_cached']} | {row['ratio']}x |"
    )
    benchmark.extra_info.update(row)


def test_humaneval_stream(benchmark, engines):
    plain, cached = engines
    convs = humaneval.conversations(N_STREAM, seed=0)
    prompts = apply_chat_template(plain.tokenizer, convs)
    rows = []
    benchmark.pedantic(
        lambda: rows.append(_side_by_side(plain, cached, prompts)), rounds=1, iterations=1
    )
    _report(benchmark, "HumanEval chat stream", rows[0])


def test_multi_turn(benchmark, engines):
    plain, cached = engines
    tasks = humaneval.tasks()[:TURNS]
    conv, prompts = [], []
    for task in tasks:
        conv.append({"role": "user", "content": f"Next one:\n\n```python\n{task['prompt']}```"})
        prompt = apply_chat_template(plain.tokenizer, [conv])[0]
        prompts.append(prompt)
        answer = plain.generate([prompt], osd.SamplingParams(64))[0]
        conv.append({"role": "assistant", "content": answer.text})
    rows = []
    benchmark.pedantic(
        lambda: rows.append(_side_by_side(plain, cached, prompts)), rounds=1, iterations=1
    )
    _report(benchmark, f"one conversation, {TURNS} turns", rows[0])
