"""``osd draft build``'s stages put together: teacher data, training, head vocabulary
(:func:`build`), and the head vocabulary alone (:func:`build_head_vocab_only`)."""

from __future__ import annotations

import collections
import json
import os
import platform
import time
from dataclasses import asdict

import torch

import osd
from osd.draft_build.cli import command_line
from osd.draft_build.common import ThreadTuner, cache_dir, log, progress_bar, split_heldout
from osd.draft_build.data import Example, load_teacher_set, make_data, teacher_file
from osd.draft_build.recipe import DATA, DRAFT, HEAD_VOCAB, TEACHER_SETS, TRAIN, DataRecipe
from osd.draft_build.train import evaluate, init_draft, save_draft, train_draft
from osd.models.loading import HEAD_VOCAB_FILE, load_tokenizer
from osd.zoo import chat as zoo_chat
from osd.zoo.corpus import documents


def head_vocab(tokenizer, size: int, examples=()) -> list[int]:
    """The ``size`` most frequent token ids of the standard library's training files
    (prose and code documents) and of ``examples``' tokens, and every special token;
    sorted."""
    counts = collections.Counter()
    docs = documents("prose", "train") + documents("code", "train")
    bar = progress_bar(len(docs), "head vocabulary", "doc")
    for doc in docs:
        counts.update(tokenizer(doc.text, add_special_tokens=False)["input_ids"])
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    for e in examples:
        counts.update(e.tokens.tolist())
    special = {int(i) for i in tokenizer.all_special_ids}
    special |= {int(i) for i in tokenizer.convert_tokens_to_ids(list(tokenizer.get_added_vocab()))}
    keep = set(special)
    for token, _ in counts.most_common():
        if len(keep) >= size:
            break
        keep.add(int(token))
    return sorted(keep)


def write_head_vocab(path: str, ids: list[int] | None) -> None:
    """``head_vocab.json`` in the checkpoint ``path`` (removed when ``ids`` is None)."""
    file = os.path.join(path, HEAD_VOCAB_FILE)
    if ids is None:
        if os.path.exists(file):
            os.remove(file)
        return
    with open(file + ".part", "w") as f:
        json.dump(ids, f, separators=(",", ":"))
    os.chmod(file + ".part", 0o644)
    os.replace(file + ".part", file)


def build_head_vocab_only(args) -> int:
    """Write ``head_vocab.json`` into the draft at ``--out`` (with the cached teacher data
    of the default recipe when present)."""
    tokenizer = load_tokenizer(zoo_chat.fetch_target())
    examples = []
    data_file = teacher_file(DATA)
    if os.path.isfile(data_file):
        examples = [Example(**e) for e in torch.load(data_file, weights_only=True)["examples"]]
    size = HEAD_VOCAB if args.head_vocab is None else args.head_vocab
    ids = head_vocab(tokenizer, size, examples) if size else None
    write_head_vocab(args.out, ids)
    meta_file = os.path.join(args.out, "build.json")
    if os.path.isfile(meta_file):
        with open(meta_file) as f:
            meta = json.load(f)
        meta["head_vocab"] = size
        meta["head_vocab_command"] = command_line(args)
        with open(meta_file, "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")
    log(
        f"{args.out}: head vocabulary "
        + (f"of {len(ids)} tokens ({len(examples)} teacher examples counted)" if ids else "removed")
    )
    return 0


def build(args) -> int:
    """The whole build (``osd draft build`` without a mode option): teacher data (cached,
    or generated within ``--data-share`` of ``--minutes``), training within the rest of
    the budget, the checkpoint and its head vocabulary at ``--out``."""
    wall0 = time.monotonic()
    deadline = wall0 + 60.0 * args.minutes
    head_size = HEAD_VOCAB if args.head_vocab is None else args.head_vocab
    data_recipe = DataRecipe(prompts=args.prompts) if args.prompts else DATA
    target_path = zoo_chat.fetch_target()
    data_file = teacher_file(data_recipe)
    if args.reuse_data and os.path.isfile(data_file):
        log(f"reusing teacher data {data_file}")
        data = torch.load(data_file, weights_only=True)
    else:
        if args.reuse_data:
            log(f"no cached teacher data at {data_file}: generating it")
        # Generation gets its share of the budget; training plans itself into the rest.
        data = make_data(
            target_path, data_recipe, wall0 + 60.0 * args.minutes * args.data_share, args.threads
        )
        os.makedirs(cache_dir(), exist_ok=True)
        torch.save(data, data_file + ".part")
        os.replace(data_file + ".part", data_file)
        log(f"teacher data saved to {data_file}")
    if args.data_only:
        return 0
    examples = [Example(**e) for e in data["examples"]]
    sets = [{"examples": len(examples), "recipe": data["recipe"]}]
    for recipe in TEACHER_SETS[1 : args.data_sets]:
        extra = load_teacher_set(recipe, 60.0 * args.minutes * args.data_share, args.threads)
        examples += [Example(**e) for e in extra["examples"]]
        sets.append({"examples": len(extra["examples"]), "recipe": extra["recipe"]})
    for e in examples:
        e.features = None  # the EAGLE draft's inputs: not used here
    if len(examples) < 2:
        raise SystemExit(f"error: only {len(examples)} teacher examples; give more --minutes")
    train, heldout = split_heldout(examples, TRAIN.heldout_fraction, TRAIN.seed)
    n_resp = sum(e.tokens.numel() - e.prompt_len for e in train)
    n_prompt = sum(e.prompt_len - e.start for e in train)
    log(
        f"training on {len(train)} examples ({n_resp} response + {n_prompt} prompt "
        f"positions), {len(heldout)} held out"
    )
    target = osd.load_model(target_path)
    model = init_draft(DRAFT, target, TRAIN.seed, TRAIN.final_norm_init)
    del target
    before = evaluate(model, heldout, TRAIN.tokens_per_batch)
    log(f"initial draft: held-out overlap {before['overlap']}, agreement {before['agree']}")
    # Leave about 30 s for the last evaluation and saving.
    info = train_draft(model, train, heldout, TRAIN, deadline - 30.0, ThreadTuner(args.threads))
    final = evaluate(model, heldout, TRAIN.tokens_per_batch)
    wall = time.monotonic() - wall0
    meta = {
        "target": zoo_chat.FILENAME,
        "target_sha256": zoo_chat.SHA256,
        "shape": asdict(DRAFT),
        "data_recipe": data["recipe"],
        "train_recipe": asdict(TRAIN),
        "data": {
            "examples": len(examples),
            "train_examples": len(train),
            "heldout_examples": len(heldout),
            "train_response_positions": n_resp,
            "train_prompt_positions": n_prompt,
            "prompts_offered": data["prompts_offered"],
            "generation_seconds": data["seconds"],
            "generation_stopped_early": data["stopped_early"],
            "kinds": dict(collections.Counter(e.kind for e in examples)),
            "sets": sets,
        },
        "training": info,
        "heldout_initial": before,
        "heldout_final": final,
        "build_seconds": round(wall, 1),
        "reused_data": bool(args.reuse_data),
        "minutes_budget": args.minutes,
        "data_share": args.data_share,
        "max_threads": args.threads,
        "head_vocab": head_size,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": command_line(args),
    }
    save_draft(model, args.out, meta)
    if head_size:
        write_head_vocab(args.out, head_vocab(load_tokenizer(target_path), head_size, examples))
    log(
        f"wrote {args.out} in {wall:.0f} s: final loss {info['final_loss']}, held-out "
        f"overlap {final['overlap']}, greedy agreement {final['agree']}"
    )
    return 0
