"""The teacher data of a draft for any target (``osd draft build --target``): its prompts,
the target's answers saved as they come, and the head vocabulary counted from them.

Prompts: the chat pair's requests (:func:`osd.draft_build.prompts.training_prompts`:
questions about standard-library functions, Python concepts and general topics) in the
tokenizer's chat template; a base model without one gets them as question-and-answer
transcripts (:func:`osd.chat_template.plain_transcript`, how a user asks a base model and
how ``osd draft eval`` measures it), every :data:`EXCERPT_EVERY`-th prompt replaced by an
excerpt of the standard library's training-split source files to continue. Both come
from the running Python, nothing is downloaded.

Answers are written to numbered shard files (:class:`TeacherStore`) every few seconds,
so a build that stops loses at most the answers since the last shard, and a rerun answers
only the prompts that have none.
"""

from __future__ import annotations

import collections
import json
import os
import random
import time

import torch

from osd.chat_template import apply_chat_template, plain_transcript
from osd.draft_build.common import Progress, ThreadTuner, log
from osd.draft_build.data import Example, _system_prefix, teacher_data
from osd.draft_build.prompts import Prompt, eval_prompts, training_prompts
from osd.draft_build.recipe import DataRecipe
from osd.zoo import corpus

EXCERPT_CHARS = 700  # a plain-text prompt's length, about
MIN_EXCERPT_CHARS = 200
EXCERPT_EVERY = 4  # a base model's prompts: one in this many is source text to continue


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def source_excerpts(n: int, split: str, seed: int) -> list[str]:
    """``n`` excerpts of about :data:`EXCERPT_CHARS` characters from the standard library's
    source files of corpus split ``split``, each starting at a line that opens a
    definition, a decorator, a comment or a docstring (a seeded choice of file and line)."""
    root = corpus.stdlib_root()
    files = [rel for rel in corpus.source_files(root) if corpus.split_of(rel) == split]
    rng = random.Random(seed)
    out, tries = [], 0
    while len(out) < n and tries < 20 * n + 100:
        tries += 1
        rel = rng.choice(files)
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        starts = [
            i
            for i, line in enumerate(lines)
            if line.lstrip().startswith(("def ", "class ", "@", "#", '"""', "async def "))
        ]
        if not starts:
            continue
        i = rng.choice(starts)
        text, j = [], i
        while j < len(lines) and sum(len(t) + 1 for t in text) < EXCERPT_CHARS:
            text.append(lines[j])
            j += 1
        excerpt = "\n".join(text).strip("\n")
        if len(excerpt) >= MIN_EXCERPT_CHARS:
            out.append(excerpt + "\n")
    return out


def plain_prompts(n: int, recipe: DataRecipe) -> list[Prompt]:
    """``n`` plain-text prompts (:func:`source_excerpts` of the training split), a
    ``recipe.sampled_fraction`` of them answered at ``recipe.temperature``."""
    rng = random.Random(recipe.seed + 1)
    return [
        Prompt(
            text, "continue", recipe.temperature if rng.random() < recipe.sampled_fraction else 0.0
        )
        for text in source_excerpts(n, "train", recipe.seed)
    ]


def base_model_prompts(recipe: DataRecipe) -> list[Prompt]:
    """``recipe.prompts`` prompts for a model without a chat template: the chat requests
    as :func:`~osd.chat_template.plain_transcript` texts, every :data:`EXCERPT_EVERY`-th
    one a source excerpt to continue (:func:`plain_prompts`)."""
    n = recipe.prompts
    excerpts = plain_prompts(n // EXCERPT_EVERY + 1, recipe)
    chat = training_prompts(n, recipe)
    out = []
    for i, p in enumerate(chat):
        if i % EXCERPT_EVERY == EXCERPT_EVERY - 1 and excerpts:
            out.append(excerpts.pop())
        else:
            text = plain_transcript([{"role": "user", "content": p.text}])
            out.append(Prompt(text, p.kind, p.temperature))
    return out


def encode_plain(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of ``texts`` as the tokenizer encodes a plain prompt (its BOS, if it adds
    one)."""
    return [list(tokenizer(t)["input_ids"]) for t in texts]


def make_prompts(tokenizer, recipe: DataRecipe) -> dict:
    """The build's prompts: ``{"chat", "start", "ids", "kinds", "temperatures"}``, those
    longer than ``recipe.max_prompt_tokens`` left out. ``start``: the first position with
    a target (after a chat template's shared system prefix; 1 for plain text)."""
    chat = has_chat_template(tokenizer)
    if chat:
        meta = training_prompts(recipe.prompts, recipe)
        ids = apply_chat_template(tokenizer, [[{"role": "user", "content": p.text}] for p in meta])
        start = _system_prefix(tokenizer)
    else:
        meta = base_model_prompts(recipe)
        ids = encode_plain(tokenizer, [p.text for p in meta])
        start = 1
    keep = [i for i, x in enumerate(ids) if start < len(x) <= recipe.max_prompt_tokens]
    return {
        "chat": chat,
        "start": start,
        "ids": [ids[i] for i in keep],
        "kinds": [meta[i].kind for i in keep],
        "temperatures": [meta[i].temperature for i in keep],
        "offered": len(ids),
    }


def measure_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` held-out prompts for the serving measurement: the chat pair's held-out
    requests (:func:`osd.draft_build.prompts.eval_prompts`, taken alternately from its
    explanations and its coding tasks) in the chat template, or as question-and-answer
    transcripts for a model without one."""
    texts = eval_prompts()
    half = len(texts) // 2
    mixed = [t for pair in zip(texts[:half], texts[half:]) for t in pair][:n]
    convs = [[{"role": "user", "content": t}] for t in mixed]
    if has_chat_template(tokenizer):
        return apply_chat_template(tokenizer, convs)
    return encode_plain(tokenizer, [plain_transcript(c) for c in convs])


class TeacherStore:
    """The teacher's answers in shard files ``shard-NNNNN.pt`` under ``path``, each
    ``{"indices": [prompt index, ...], "examples": [Example fields, ...]}``, written
    whole (to a ``.part`` file, then renamed): a shard is there complete or not at all."""

    def __init__(self, path: str, flush_every: float = 20.0) -> None:
        self.path = path
        self.flush_every = flush_every
        os.makedirs(path, exist_ok=True)
        self.shards = sorted(
            f for f in os.listdir(path) if f.startswith("shard-") and f.endswith(".pt")
        )
        self.pending: list[tuple[int, Example]] = []
        self.last_flush = time.monotonic()

    def load(self) -> dict[int, Example]:
        """Every saved example by prompt index."""
        out = {}
        for name in self.shards:
            shard = torch.load(os.path.join(self.path, name), weights_only=True)
            for i, e in zip(shard["indices"], shard["examples"]):
                out[int(i)] = Example(**e)
        return out

    def add(self, index: int, example: Example) -> None:
        self.pending.append((index, example))
        if time.monotonic() - self.last_flush >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        if not self.pending:
            return
        name = f"shard-{len(self.shards):05d}.pt"
        file = os.path.join(self.path, name)
        data = {
            "indices": [i for i, _ in self.pending],
            "examples": [dict(vars(e)) for _, e in self.pending],
        }
        torch.save(data, file + ".part")
        os.replace(file + ".part", file)
        self.shards.append(name)
        self.pending = []


def answer(
    model,
    prompts: dict,
    recipe: DataRecipe,
    store: TeacherStore,
    deadline: float,
    build_end: float,
    tuner: ThreadTuner,
) -> tuple[int, bool]:
    """The target ``model`` answers the prompts that have no answer in ``store`` yet,
    until ``deadline``; answers are saved as they come (also when interrupted).
    Returns ``(prompts answered now, stopped at the deadline)``."""
    have = set(store.load())
    todo = [i for i in range(len(prompts["ids"])) if i not in have]
    if not todo:
        return 0, False
    meta = [
        Prompt("", prompts["kinds"][i], prompts["temperatures"][i]) for i in todo
    ]  # the text is not needed any more
    progress = Progress(
        "teacher data", len(prompts["ids"]), "prompts answered", deadline, build_end
    )
    count = [0]
    t0 = time.monotonic()

    def on_example(j: int, example: Example, new_tokens: int) -> None:
        store.add(todo[j], example)
        count[0] += 1
        rate = new_tokens / max(time.monotonic() - t0, 1e-9)
        progress.update(len(have) + count[0], f"{rate:.0f} tokens/s, {tuner.current} threads")

    progress.update(len(have), force=True)
    try:
        _, stopped = teacher_data(
            model,
            [prompts["ids"][i] for i in todo],
            meta,
            prompts["start"],
            recipe,
            deadline,
            tuner,
            on_example=on_example,
            bar=False,
        )
    finally:
        store.flush()
    progress.close(len(have) + count[0])
    return count[0], stopped


def token_mass(examples) -> collections.Counter:
    """The teacher's probability mass per token id, summed over every stored top-k
    distribution of ``examples`` (prompt and answer positions): how often the target
    expects each token here."""
    if not examples:
        return collections.Counter()
    ids = torch.cat([e.topk_ids.flatten() for e in examples]).long()
    probs = torch.cat([e.topk_probs.flatten() for e in examples]).double()
    mass = torch.bincount(ids, weights=probs)
    nz = mass.nonzero().flatten()
    return collections.Counter(dict(zip(nz.tolist(), mass[nz].tolist())))


def corpus_counts(tokenizer, distinct: int, max_chars: int = 3_000_000) -> collections.Counter:
    """Token counts of the standard library's training-split source files, read in a
    seeded order until ``distinct`` different tokens are seen or ``max_chars`` read."""
    root = corpus.stdlib_root()
    files = [rel for rel in corpus.source_files(root) if corpus.split_of(rel) == "train"]
    random.Random(0).shuffle(files)
    counts: collections.Counter = collections.Counter()
    read = 0
    for rel in files:
        if len(counts) >= distinct or read >= max_chars:
            break
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                text = f.read()[:200_000]
        except (OSError, UnicodeDecodeError):
            continue
        read += len(text)
        counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    return counts


def special_ids(tokenizer, eos_ids=()) -> set[int]:
    """The tokenizer's special and added tokens and the model's end-of-sequence ids."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ()}
    added = getattr(tokenizer, "get_added_vocab", None)
    if added is not None:
        ids |= {int(i) for i in added().values()}
    return ids | {int(i) for i in eos_ids}


def head_vocab_ids(
    teacher: collections.Counter,
    fill: collections.Counter,
    special: set[int],
    size: int,
    vocab_size: int,
    min_size: int = 64,
) -> list[int]:
    """The ``size`` token ids a reduced head keeps, sorted: every special id, then the
    teacher's most expected tokens (``teacher``: :func:`token_mass`), then the most
    frequent of ``fill`` (other text), then the lowest ids not yet kept while fewer than
    ``min_size`` (top-k training targets need a head of at least twice k)."""
    keep = {i for i in special if 0 <= i < vocab_size}
    for counts in (teacher, fill):
        for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            if len(keep) >= size:
                break
            if 0 <= int(token) < vocab_size:
                keep.add(int(token))
    token = 0
    while len(keep) < min(max(size, min_size), vocab_size):
        keep.add(token)
        token += 1
    return sorted(keep)


def save_json(path: str, obj) -> None:
    """``obj`` as JSON at ``path``, written beside it first and moved into place."""
    with open(path + ".part", "w") as f:
        json.dump(obj, f, separators=(",", ":"))
    os.replace(path + ".part", path)


def build_head_vocab(tokenizer, examples, size: int, vocab_size: int, eos_ids) -> list[int]:
    """:func:`head_vocab_ids` from the teacher ``examples``, filled from the standard
    library's text when they name fewer than ``size`` tokens."""
    teacher = token_mass(examples)
    fill = collections.Counter()
    if len(teacher) < size:
        fill = corpus_counts(tokenizer, distinct=2 * size)
    ids = head_vocab_ids(teacher, fill, special_ids(tokenizer, eos_ids), size, vocab_size)
    log(
        f"head vocabulary: {len(ids)} of {vocab_size} tokens ({len(teacher)} named by the "
        f"teacher data, the rest by the standard library's text)"
    )
    return ids
