"""An evaluation set of chat workloads that share nothing with HumanEval or the demo.

Speculative decoding pays in proportion to how predictable the answer is, so one stream
says little about another. These workloads differ in what the answer copies:

============  ======================================================================
``explain``   general explanation chat: "what does this function do?" (new text)
``summarise`` summarise or rewrite a passage given in the prompt (copies the context)
``multiturn`` a conversation with earlier turns, a follow-up question (copies history)
``code``      write a function from its specification (code, some copying)
============  ======================================================================

The text comes from Python's own standard library (module and function docstrings,
read with :mod:`inspect`), so the set is on every machine, needs no download and is the
same wherever the same Python runs. Only modules whose files are in the corpus's
held-out split (``osd.zoo.corpus``) are used: no shipped draft trained on them.
Independent checks should use text of their own: :func:`evaluation_set` only fixes the
shapes.

    >>> from osd.zoo.workloads import evaluation_set
    >>> [w.name for w in evaluation_set(n=2)]
    ['explain', 'summarise', 'multiturn', 'code']
"""

from __future__ import annotations

import importlib
import inspect
import random
from dataclasses import dataclass

# Held-out modules whose docstrings are long enough to summarise (a few hundred words).
PASSAGE_MODULES = (
    "json",
    "heapq",
    "random",
    "subprocess",
    "urllib.parse",
    "urllib.request",
    "socket",
    "inspect",
    "xmlrpc.client",
    "http.server",
)
# Held-out modules whose public functions are asked about and written.
FUNCTION_MODULES = (
    "inspect",
    "urllib.parse",
    "urllib.request",
    "socket",
    "pickletools",
    "random",
    "heapq",
    "subprocess",
    "sysconfig",
    "linecache",
    "functools",
    "getpass",
    "json",
    "glob",
    "pstats",
    "email.iterators",
)
MAX_PER_MODULE = 6
PASSAGE_CHARS = 1800  # about 400-500 tokens of the chat models' vocabulary


@dataclass(frozen=True)
class Workload:
    """One workload: ``prompts`` are conversations (lists of ``{"role", "content"}``
    messages) ending with a user turn."""

    name: str
    description: str
    prompts: tuple[tuple[dict, ...], ...]


def _functions(rng: random.Random) -> list[tuple[str, str, str]]:
    """``(qualified name, signature, first docstring paragraph)`` of public stdlib
    functions with a docstring, in a seeded order."""
    out = []
    for m in FUNCTION_MODULES:
        mod, found = importlib.import_module(m), []
        for name in sorted(dir(mod)):
            f = getattr(mod, name)
            if name.startswith("_") or not callable(f) or inspect.isclass(f):
                continue
            # defined here (or in the module's C accelerator), not imported from elsewhere
            if getattr(f, "__module__", None) not in (m, "_" + m.rsplit(".", 1)[-1]):
                continue
            doc = inspect.getdoc(f) or ""
            first = doc.split("\n\n")[0].replace("\n", " ").strip()
            if len(first) < 40 or "deprecated" in first.lower():
                continue
            try:
                sig = str(inspect.signature(f))
            except (TypeError, ValueError):
                sig = "(...)"
            found.append((f"{m}.{name}", sig, first))
        rng.shuffle(found)
        out += found[:MAX_PER_MODULE]  # no module dominates
    rng.shuffle(out)
    return out


def _passages(rng: random.Random) -> list[tuple[str, str]]:
    """``(module, passage)``: a module docstring cut at a paragraph near PASSAGE_CHARS."""
    out = []
    for m in PASSAGE_MODULES:
        doc = inspect.getdoc(importlib.import_module(m)) or ""
        if len(doc) < 600:
            continue
        cut = doc[:PASSAGE_CHARS]
        if len(doc) > PASSAGE_CHARS and "\n\n" in cut[PASSAGE_CHARS // 2 :]:
            cut = cut[: cut.rindex("\n\n")]
        out.append((m, cut.strip()))
    rng.shuffle(out)
    return out


def _pick(items: list, n: int) -> list:
    return [items[i % len(items)] for i in range(n)]


EXPLAIN = (
    "What does the Python function `{name}` do? Explain it in a short paragraph "
    "and give one example of its use.",
    "I found `{name}` in some code I maintain. What is it for, and what does it return?",
    "Explain the arguments of `{name}{sig}` and what happens when they are left at their defaults.",
)
CODE = (
    "Write a Python function `{short}{sig}` from scratch, without importing `{module}`. "
    "It should do this: {doc}",
    "Write a few pytest unit tests for `{name}{sig}`, whose documentation says: {doc}",
)


def stream(name: str, n: int, seed: int = 0) -> tuple[tuple[dict, ...], ...]:
    """``n`` distinct prompts of the workload ``name`` (``"explain"`` or ``"code"``) for
    a long stream: each function asked in several phrasings, in a seeded order."""
    rng = random.Random(seed)
    funcs = _functions(rng)
    templates = {"explain": EXPLAIN, "code": CODE}[name]
    prompts = [
        (t.format(name=f, sig=sig, doc=doc, short=f.rsplit(".", 1)[1], module=f.rsplit(".", 1)[0]),)
        for t in templates
        for f, sig, doc in funcs
    ]
    if n > len(prompts):
        raise ValueError(f"the {name} workload has {len(prompts)} distinct prompts, asked for {n}")
    rng.shuffle(prompts)
    return tuple(({"role": "user", "content": c},) for (c,) in prompts[:n])


def evaluation_set(n: int = 8, seed: int = 0) -> list[Workload]:
    """The four workloads, ``n`` prompts each, chosen with ``seed``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    funcs, passages = _functions(rng), _passages(rng)
    explain = tuple(
        (
            {
                "role": "user",
                "content": f"What does the Python function `{name}` do? Explain it "
                f"in a short paragraph and give one example of its use.",
            },
        )
        for name, _, _ in _pick(funcs, n)
    )
    verbs = (
        "Summarise the following passage in a few sentences.",
        "Rewrite the following passage in plain, simple English.",
        "Summarise the main points of this documentation as a short list.",
    )
    summarise = tuple(
        ({"role": "user", "content": f"{verbs[i % len(verbs)]}\n\n{text}"},)
        for i, (_, text) in enumerate(_pick(passages, n))
    )
    by_module: dict[str, list] = {}
    for f in funcs:
        by_module.setdefault(f[0].rsplit(".", 1)[0], []).append(f)
    pairs = [fs[j : j + 2] for fs in by_module.values() for j in range(0, len(fs) - 1, 2)]
    rng.shuffle(pairs)
    multiturn = []
    for a, b in _pick(pairs, n):
        multiturn.append(
            (
                {"role": "user", "content": f"I am reading about `{a[0]}`. What is it for?"},
                {"role": "assistant", "content": f"`{a[0]}{a[1]}`: {a[2]}"},
                {"role": "user", "content": f"And `{b[0]}`?"},
                {"role": "assistant", "content": f"`{b[0]}{b[1]}`: {b[2]}"},
                {
                    "role": "user",
                    "content": f"Can you explain the difference between `{a[0]}` "
                    f"and `{b[0]}` and when I would use each?",
                },
            )
        )
    code = tuple(
        (
            {
                "role": "user",
                "content": f"Write a Python function `{name.rsplit('.', 1)[1]}"
                f"{sig}` from scratch, without importing "
                f"`{name.rsplit('.', 1)[0]}`. It should do this: {doc}",
            },
        )
        for name, sig, doc in _pick(funcs[::-1], n)
    )
    return [
        Workload("explain", "explain what a standard-library function does (new text)", explain),
        Workload(
            "summarise",
            "summarise or rewrite a documentation passage given in the prompt",
            summarise,
        ),
        Workload(
            "multiturn",
            "a third turn comparing two functions discussed in the earlier turns",
            tuple(multiturn),
        ),
        Workload("code", "write a function from its signature and specification", code),
    ]


def long_documents(n: int, chars: int = 5500, seed: int = 0) -> tuple[tuple[dict, ...], ...]:
    """``n`` requests to summarise a long document given in the prompt: documentation
    passages of consecutive modules until the text holds ``chars`` characters (5,500:
    about 1,500-2,000 tokens of the chat models' vocabulary), each request's from a
    different starting module. For the cost of long contexts: every decode step of such
    a request attends over its whole prompt."""
    if n < 1 or chars < 1:
        raise ValueError(f"n and chars must be >= 1, got {n}, {chars}")
    passages = _passages(random.Random(seed))
    out = []
    for i in range(n):
        parts, j = [], i * max(1, len(passages) // n)
        while sum(len(p) for p in parts) < chars and len(parts) < len(passages):
            module, text = passages[j % len(passages)]
            parts.append(f"## {module}\n\n{text}")
            j += 1
        body = "\n\n".join(parts)
        out.append(({"role": "user", "content": f"Summarise this documentation.\n\n{body}"},))
    return tuple(out)


__all__ = ["Workload", "evaluation_set", "long_documents", "stream"]
