"""The chat prompts ``osd draft build`` distils the chat draft on, and the held-out ones
``osd draft build --measure`` measures it on: requests about standard-library functions
(explain, write, summarize, test, comment, improve, implement from a signature and
docstring), general programming concepts and topics, and a few HumanEval-style tasks
written for the build."""

from __future__ import annotations

import ast
import os
import random
import re
import textwrap
from dataclasses import dataclass

from osd.zoo import corpus


@dataclass(frozen=True)
class Function:
    """A function of the standard library with its source and docstring."""

    module: str
    name: str
    code: str
    doc: str | None
    skeleton: str | None = None  # the def line(s) and the docstring, without the body


def stdlib_functions(
    split: str, *, min_lines: int = 3, max_lines: int = 30, max_chars: int = 1400
) -> list[Function]:
    """Functions and methods of the stdlib files of ``split`` (see ``osd.zoo.corpus``),
    ``min_lines..max_lines`` lines and at most ``max_chars`` characters, in file order."""
    root = corpus.stdlib_root()
    found = []
    for rel in corpus.source_files(root):
        if corpus.split_of(rel) != split:
            continue
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                source = f.read()
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        segments, text_lines = _split_lines(source), source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            seg = _segment(segments, node)
            if seg is None:
                continue
            code = textwrap.dedent(" " * node.col_offset + seg)
            n_lines = code.count("\n") + 1
            if min_lines <= n_lines <= max_lines and len(code) <= max_chars:
                found.append(
                    Function(
                        module,
                        node.name,
                        code,
                        ast.get_docstring(node),
                        _skeleton(text_lines, node),
                    )
                )
    return found


# A source line with its end: the parser's line breaks are \r\n, \r and \n (not form feed).
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def _split_lines(source: str) -> list[str]:
    """``source``'s lines with their ends, split as ``ast.get_source_segment`` splits them."""
    return _LINE.findall(source)


def _segment(lines: list[str], node: ast.AST) -> str | None:
    """``ast.get_source_segment(source, node)`` from ``source``'s :func:`_split_lines`:
    the same text, without splitting the whole file again for every node (which made
    scanning the standard library take minutes)."""
    if getattr(node, "end_lineno", None) is None or getattr(node, "end_col_offset", None) is None:
        return None
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset : node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset :].decode()
    tail = lines[last].encode()[: node.end_col_offset].decode()
    return "".join([head, *lines[first + 1 : last], tail])


def _skeleton(text_lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The function's def line(s) and docstring (``text_lines``: the source's
    ``splitlines()``), dedented; None without a docstring or without a body after it."""
    if ast.get_docstring(node) is None or len(node.body) < 2:
        return None
    lines = text_lines[node.lineno - 1 : node.body[0].end_lineno]
    return textwrap.dedent("\n".join(lines)) + "\n"


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.strip().split("\n\n")[0].split())
    cut = text.find(". ")
    return (text if cut < 0 else text[: cut + 1]).strip()


# Prompt templates over a stdlib function: kind -> template (code, doc, sentence, name, module).
CODE_TEMPLATES = {
    "explain": "Explain what this Python function does:\n\n```python\n{code}\n```",
    "write": "Write a Python function `{name}` that does the following: {sentence}",
    "summarize": "Summarize this documentation in one or two sentences:\n\n{doc}",
    "test": "Write a unit test for this Python function:\n\n```python\n{code}\n```",
    "improve": "How could this Python code be improved?\n\n```python\n{code}\n```",
    "comment": "Add comments to this code and explain how it works:\n\n```python\n{code}\n```",
    # a function's signature and docstring to implement, in three phrasings
    "complete": (
        "Finish this Python function:\n\n```python\n{skeleton}```",
        "Write the implementation of this function.\n\n```python\n{skeleton}```",
        "Fill in the body of the following Python function and explain it.\n\n"
        "```python\n{skeleton}```",
    ),
}
CONCEPTS = [
    "list comprehensions",
    "generators",
    "decorators",
    "context managers",
    "the GIL",
    "dictionaries",
    "tuples and lists",
    "f-strings",
    "lambda functions",
    "exceptions",
    "classes and objects",
    "inheritance",
    "virtual environments",
    "type hints",
    "the `with` statement",
    "iterators",
    "recursion",
    "closures",
    "dataclasses",
    "`*args` and `**kwargs`",
    "modules and packages",
    "sets",
    "string slicing",
    "the `yield` keyword",
    "async and await",
    "unit tests with unittest",
    "regular expressions",
    "reading and writing files",
    "JSON parsing",
    "sorting with a key function",
    "the `enumerate` function",
    "the `zip` function",
    "mutable default arguments",
    "shallow and deep copies",
    "properties",
    "static and class methods",
    "logging",
    "command-line arguments with argparse",
    "the `collections` module",
    "threads and processes",
]
CONCEPT_TEMPLATES = [
    "What are {t} in Python?",
    "Explain {t} in Python with a short example.",
    "Give me a simple Python example that uses {t}.",
    "What are common mistakes beginners make with {t} in Python?",
]
TOPICS = [
    "photosynthesis",
    "the water cycle",
    "gravity",
    "the French Revolution",
    "machine learning",
    "the Internet",
    "climate change",
    "vaccines",
    "black holes",
    "the stock market",
    "inflation",
    "DNA",
    "the Roman Empire",
    "electric cars",
    "solar energy",
    "volcanoes",
    "the human heart",
    "sleep",
    "meditation",
    "chess",
    "coffee",
    "rainbows",
    "earthquakes",
    "the Moon",
    "bees",
    "democracy",
    "compound interest",
    "hash tables",
    "sorting algorithms",
    "operating systems",
    "databases",
    "encryption",
    "version control",
    "prime numbers",
    "probability",
    "music theory",
    "the printing press",
    "renewable energy",
    "the immune system",
    "ocean tides",
    "cloud computing",
    "the scientific method",
    "public speaking",
    "healthy eating",
    "time management",
    "the Olympic Games",
    "ancient Egypt",
    "dinosaurs",
]
TOPIC_TEMPLATES = [
    "What is {t}?",
    "Explain {t} to a ten-year-old.",
    "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t}.",
    "Why is {t} important?",
    "Write a haiku about {t}.",
    "Summarize what you know about {t} in three sentences.",
]
REQUESTS = [
    "Give me tips for staying productive when working from home.",
    "Write a short thank-you note to a colleague who helped me with a project.",
    "How do I make a good cup of tea?",
    "Suggest five names for a pet cat.",
    "What should I pack for a weekend camping trip?",
    "Write a limerick about a programmer.",
    "How can I improve my handwriting?",
    "Plan a simple three-day workout routine.",
    "Write a short story about a robot who learns to paint.",
    "What is the difference between weather and climate?",
    "Give me a recipe for a simple pasta dish.",
    "How do I prepare for a job interview?",
    "Explain how a bicycle works.",
    "Write an email asking my manager for a day off.",
    "What are some good habits for learning a new language?",
    "List the planets of the solar system in order.",
    "How do airplanes stay in the air?",
    "Describe a sunset at the beach.",
    "What is the capital of Australia, and why?",
    "How can I save money on groceries?",
]


@dataclass(frozen=True)
class Prompt:
    """A chat request: its text, kind and sampling temperature (0: greedy)."""

    text: str
    kind: str
    temperature: float


def training_prompts(n: int, recipe) -> list[Prompt]:
    """``n`` chat requests: about 70% over stdlib training-split functions (the kinds
    ``recipe.kinds`` in turn), 15% Python concepts, 15% general; shuffled with
    ``recipe.seed`` (a ``DataRecipe``); a ``sampled_fraction`` of them answered at
    ``recipe.temperature``."""
    rng = random.Random(recipe.seed)
    funcs = stdlib_functions("train")
    rng.shuffle(funcs)
    # "write" needs a public function with a docstring, "summarize" a docstring,
    # "complete" a public function with a docstring and a body.
    pools = {
        "any": funcs,
        "doc": [f for f in funcs if f.doc],
        "public": [f for f in funcs if f.doc and not f.name.startswith("_")],
        "skeleton": [f for f in funcs if f.skeleton and not f.name.startswith("_")],
    }
    needs = {"write": "public", "summarize": "doc", "complete": "skeleton"}
    used = {name: 0 for name in pools}
    general = [t.format(t=c) for c in CONCEPTS for t in CONCEPT_TEMPLATES]
    general += [t.format(t=c) for c in TOPICS for t in TOPIC_TEMPLATES] + REQUESTS
    rng.shuffle(general)
    kinds = list(recipe.kinds)
    out, gi, ci = [], 0, 0
    while len(out) < n:
        if rng.random() < 0.7 or gi >= len(general):
            kind = kinds[ci % len(kinds)]
            ci += 1
            pool = needs.get(kind, "any")
            if used[pool] >= len(pools[pool]):
                if all(used[p] >= len(pools[p]) for p in pools) and gi >= len(general):
                    break
                continue
            fn = pools[pool][used[pool]]
            used[pool] += 1
            template = CODE_TEMPLATES[kind]
            if isinstance(template, tuple):
                template = template[used[pool] % len(template)]
            text = template.format(
                code=fn.code,
                doc=fn.doc,
                name=fn.name,
                skeleton=fn.skeleton,
                sentence=fn.doc and _first_sentence(fn.doc),
                module=fn.module,
            )
        else:
            text, kind = general[gi], "general"
            gi += 1
        temp = recipe.temperature if rng.random() < recipe.sampled_fraction else 0.0
        out.append(Prompt(text, kind, temp))
    return out


# Held-out functions (files of corpus split "heldout") for the evaluation prompts.
EVAL_FUNCTIONS = [
    ("explain", "heapq", "heappush"),
    ("explain", "glob", "glob"),
    ("explain", "linecache", "getline"),
    ("write", "heapq", "heapify"),
    ("write", "getpass", "getuser"),
    ("explain", "random", "shuffle"),
    ("summarize", "functools", "total_ordering"),
    ("summarize", "linecache", "checkcache"),
    ("test", "heapq", "heappushpop"),
    ("write", "urllib.parse", "urldefrag"),
]
# HumanEval-style tasks written for this script (not from HumanEval).
EVAL_TASKS = [
    "Write a Python function `count_vowels(s)` that returns the number of vowels in a string.",
    "Write a Python function `is_palindrome(text)` that checks whether a string reads the "
    "same backwards, ignoring case and spaces.",
    "Write a Python function `second_largest(numbers)` that returns the second largest "
    "distinct number in a list, or None if there is none.",
    "Write a Python function `flatten(nested)` that flattens a list of lists into one list.",
    "Write a Python function `word_frequencies(text)` that returns a dictionary mapping "
    "each word to how many times it appears.",
    "Write a Python function `fizzbuzz(n)` that returns the FizzBuzz sequence from 1 to n "
    "as a list of strings.",
    "Write a Python function `merge_intervals(intervals)` that merges overlapping "
    "intervals given as (start, end) pairs.",
    "Write a Python function `rotate_list(items, k)` that rotates a list to the right by k "
    "positions.",
    "Write a Python function `celsius_to_fahrenheit(c)` and explain how it works.",
    "Write a Python function `unique_sorted(items)` that returns the unique elements of a "
    "list in sorted order.",
]


def eval_prompts() -> list[str]:
    """The 20 held-out evaluation requests: 10 over functions of held-out stdlib files,
    10 HumanEval-style tasks written here. Raises when a named function is missing."""
    by_name = {}
    for fn in stdlib_functions("heldout", max_lines=40, max_chars=2000):
        by_name.setdefault((fn.module, fn.name), fn)
    out = []
    for kind, module, name in EVAL_FUNCTIONS:
        fn = by_name.get((module, name))
        if fn is None:
            raise RuntimeError(f"held-out function {module}.{name} not found in this stdlib")
        out.append(
            CODE_TEMPLATES[kind].format(
                code=fn.code,
                doc=fn.doc,
                name=fn.name,
                sentence=fn.doc and _first_sentence(fn.doc),
                module=fn.module,
            )
        )
    return out + EVAL_TASKS
