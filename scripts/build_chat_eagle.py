"""Build the chat pair's EAGLE draft: one decoder layer that drafts from the target's
features (``osd.models.eagle``), trained on the target's own answers.

    python scripts/build_chat_eagle.py                          # ~75 min, data not cached
    python scripts/build_chat_eagle.py --data-sets 2 --minutes 50   # a shorter build

Stages (a progress bar each):

1. Teacher data: ``osd draft build``'s (chat requests made from the standard
   library's text, answered by the target through osd), which keeps the target's features
   (last layer before the final norm) at every position with its top-32 distributions,
   plus a second and a third set (``osd.draft_build.recipe.TEACHER_SETS``: other functions,
   and half or two thirds of the code requests ask to implement a function from its
   signature and docstring). Each is cached in ``~/.cache/osd/chat_draft``; when absent it
   is generated here (7 to 10 minutes each on the 2-core machine).
2. Training: the draft's own tensors (feature norm, ``fc``, one Llama layer as wide as the
   target) learn ``osd.models.eagle.eagle_loss``: cross-entropy from the target's
   distribution over the draft head's 8,192 columns plus smooth-L1 regression onto the
   target's next feature, over two passes (the second reads the draft's own predicted
   features, as it does when drafting several tokens deep). The target's embedding, final
   norm and head rows are shared and frozen. AdamW, warm-up and cosine decay, bf16
   autocast; the steps are sized to the time budget.
3. The checkpoint (``osd/zoo/weights/chat_eagle``: ``config.json`` with the build record,
   fp16 ``model.safetensors``, ``head_vocab.json``), written beside it first and moved
   into place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import osd  # noqa: E402
from osd.draft_build.common import log, progress_bar, split_heldout, write_checkpoint_dir  # noqa: E402
from osd.draft_build.data import Example, load_teacher_set  # noqa: E402
from osd.draft_build.recipe import TEACHER_SETS, DataRecipe  # noqa: E402
from osd.models.eagle import EagleLM, eagle_loss, save_eagle  # noqa: E402
from osd.models.loading import read_head_vocab  # noqa: E402
from osd.online.config import cpu_has_fast_bf16  # noqa: E402
from osd.online.distill import to_head_vocab  # noqa: E402
from osd.zoo import chat as zoo_chat  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "osd", "zoo", "weights", "chat_eagle")
HEAD_FROM = os.path.join(ROOT, "osd", "zoo", "weights", "chat_draft")


@dataclass(frozen=True)
class EagleRecipe:
    """The EAGLE draft's shape and training."""

    num_layers: int = 1  # decoder layers as wide as the target (EAGLE: 1)
    intermediate_size: int = 1536  # SwiGLU width (the target's)
    tokens_per_batch: int = 2048  # padded tokens per optimizer step
    lr: float = 3e-3  # peak AdamW learning rate
    warmup: int = 20  # linear warm-up steps
    weight_decay: float = 0.01
    feature_weight: float = 1.0  # smooth-L1 feature loss next to the token loss
    unroll: int = 2  # passes (the second reads predicted features)
    noise: float = 0.0  # uniform feature noise (relative to the feature's rms)
    epochs: float = 16.0  # upper bound; the time budget may allow fewer
    bf16_autocast: bool = True  # bf16 matmuls, fp32 weights, where the CPU has fast bf16
    #                                 (osd.online.config.cpu_has_fast_bf16; fp32 otherwise)
    heldout_fraction: float = 0.03
    seed: int = 0


RECIPE = EagleRecipe()


def _load_examples(args, recipes: tuple[DataRecipe, ...]) -> tuple[list[Example], list[dict]]:
    """The examples of every teacher set in ``recipes`` (each generated when not cached),
    and each set's record without its examples."""
    examples, records = [], []
    for recipe in recipes:
        data = load_teacher_set(recipe, 60.0 * args.data_minutes, args.threads)
        part = [Example(**e) for e in data.pop("examples")]
        if not part or part[0].features is None:
            raise SystemExit(f"error: the teacher data of {recipe} has no features")
        examples += part
        records.append({**data, "recipe": asdict(recipe), "examples": len(part)})
    return examples, records


def _collate(examples: list[Example], head_ids: torch.Tensor, dtype: torch.dtype):
    """Tokens ``[N, T]``, features ``[N, T, H]``, dense head targets ``[N, T, V_head]`` and
    the scored-position mask ``[N, T]``. Each example drops its last token (the target
    never read it, so it has no feature); position ``p`` scores token ``p + 1``."""
    N = len(examples)
    T = max(e.tokens.numel() - 1 for e in examples)
    H = examples[0].features.shape[1]
    tokens = torch.zeros(N, T, dtype=torch.int64)
    feats = torch.zeros(N, T, H, dtype=dtype)
    probs = torch.zeros(N, T, head_ids.numel())
    mask = torch.zeros(N, T, dtype=torch.bool)
    for b, e in enumerate(examples):
        L = e.tokens.numel() - 1
        tokens[b, :L] = e.tokens[:L].long()
        feats[b, :L] = e.features[:L].to(dtype)
        # topk row i is the distribution of token start + i: position start + i - 1.
        lo = e.start - 1
        rows = L - lo  # positions lo .. L - 1
        cols, p, _ = to_head_vocab(
            head_ids, e.topk_ids[:rows].long(), e.topk_probs[:rows].float(), None
        )
        probs[b, lo:L].scatter_(1, cols, p)
        mask[b, lo:L] = True
    return tokens, feats, probs, mask


def _batches(examples: list[Example], tokens_per_batch: int, gen: random.Random) -> list:
    """Length-sorted groups of about ``tokens_per_batch`` padded tokens, shuffled."""
    order = sorted(range(len(examples)), key=lambda i: examples[i].tokens.numel())
    groups, cur, longest = [], [], 0
    for i in order:
        n = examples[i].tokens.numel()
        if cur and max(longest, n) * (len(cur) + 1) > tokens_per_batch:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        groups.append(cur)
    gen.shuffle(groups)
    return groups


@torch.no_grad()
def evaluate(model: EagleLM, examples: list[Example], recipe: EagleRecipe) -> dict:
    """Held-out top-1 agreement with the target: teacher-forced features (the first
    drafted token) and the draft's own predicted features (the second)."""
    head = model.head_ids
    agree, second, n = 0.0, 0.0, 0
    for group in _batches(examples, recipe.tokens_per_batch, random.Random(0)):
        batch = [examples[i] for i in group]
        tokens, feats, probs, mask = _collate(batch, head, model.dtype)
        m = int(mask[:, 1:].sum())
        agree += eagle_loss(model, tokens, feats, probs, mask, unroll=1)["agree"] * m
        second += _second_pass_agree(model, tokens, feats, probs, mask) * m
        n += m
    return {
        "agree_first": round(agree / max(n, 1), 4),
        "agree_second": round(second / max(n, 1), 4),
        "positions": n,
    }


def _second_pass_agree(model, tokens, feats, probs, mask) -> float:
    """Top-1 agreement when every input feature is the draft's own prediction."""
    ids, x = tokens[:, 1:], feats[:, :-1]
    attn = mask[:, 1:].long()
    rows = mask[:, 1:].reshape(-1).nonzero()[:, 0]
    _, g = model.forward_train(ids, attn, features=x, return_hidden=True)
    x2 = torch.cat([x[:, :1], g[:, :-1].to(x.dtype)], 1)
    logits = model.forward_train(ids, attn, rows=rows, full_vocab=False, features=x2)
    goal = probs[:, 1:].reshape(-1, probs.shape[-1]).index_select(0, rows)
    return float((logits.argmax(-1) == goal.argmax(-1)).float().mean())


def train(model: EagleLM, examples: list[Example], recipe: EagleRecipe, deadline: float) -> dict:
    """AdamW on the draft's own tensors until ``deadline`` (``time.monotonic()``) or
    ``recipe.epochs``, learning rate warmed up then cosine-decayed over the planned
    steps (replanned every 25 steps from the recent step time)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    use_bf16 = recipe.bf16_autocast and cpu_has_fast_bf16()
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": recipe.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=recipe.lr,
    )
    gen = random.Random(recipe.seed)
    tgen = torch.Generator().manual_seed(recipe.seed)
    per_epoch = len(_batches(examples, recipe.tokens_per_batch, gen))
    cap = max(recipe.warmup + 1, int(recipe.epochs * per_epoch))
    planned = cap
    step, t_start = 0, time.monotonic()
    t_mark, step_mark = t_start, 0
    bar = progress_bar(planned, "EAGLE training", "step")
    losses = []
    model.train()
    while step < planned:
        for group in _batches(examples, recipe.tokens_per_batch, gen):
            if step >= planned:
                break
            if step >= recipe.warmup and step % 25 == 0:  # replan from the recent pace
                now = time.monotonic()
                pace = (now - t_mark) / max(step - step_mark, 1)
                t_mark, step_mark = now, step
                planned = min(cap, step + max(1, int((deadline - now) / pace)))
                if bar is not None:
                    bar.total = planned
                    bar.refresh()
            frac = step / max(planned, 1)
            lr = (
                recipe.lr
                * min(1.0, (step + 1) / recipe.warmup)
                * (0.5 * (1 + math.cos(math.pi * min(frac, 1.0))) if step >= recipe.warmup else 1)
            )
            for g in opt.param_groups:
                g["lr"] = lr
            tokens, feats, probs, mask = _collate(
                [examples[i] for i in group], model.head_ids, model.dtype
            )
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
                out = eagle_loss(
                    model,
                    tokens,
                    feats,
                    probs,
                    mask,
                    feature_weight=recipe.feature_weight,
                    unroll=recipe.unroll,
                    noise=recipe.noise,
                    generator=tgen,
                )
            opt.zero_grad(set_to_none=True)
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(float(out["loss"].detach()))
            step += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(
                    loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}",
                    tok=f"{out['token']:.3f}",
                    feat=f"{out['feature']:.3f}",
                    agree=f"{out['agree']:.3f}",
                )
            if time.monotonic() > deadline:
                planned = step
    if bar is not None:
        bar.close()
    model.eval()
    return {
        "steps": step,
        "epochs": round(step / max(per_epoch, 1), 2),
        "seconds": round(time.monotonic() - t_start, 1),
        "final_loss": round(sum(losses[-20:]) / max(len(losses[-20:]), 1), 4),
    }


def build(args) -> int:
    wall0 = time.monotonic()
    torch.manual_seed(RECIPE.seed)
    examples, data = _load_examples(args, TEACHER_SETS[: args.data_sets])
    target_path = zoo_chat.fetch_target()
    train_set, heldout = split_heldout(examples, RECIPE.heldout_fraction, RECIPE.seed)
    positions = sum(e.tokens.numel() - e.start for e in train_set)
    log(
        f"training on {len(train_set)} examples ({positions} scored positions), "
        f"{len(heldout)} held out"
    )
    target = osd.load_model(target_path)
    head_ids = read_head_vocab(Path(args.head_from))
    model = EagleLM.from_target(
        target,
        num_layers=RECIPE.num_layers,
        intermediate_size=RECIPE.intermediate_size,
        head_ids=head_ids,
    )
    model.init_draft(generator=torch.Generator().manual_seed(RECIPE.seed))
    before = evaluate(model, heldout, RECIPE)
    log(f"initial draft: held-out agreement {before}")
    info = train(model, train_set, RECIPE, wall0 + 60.0 * args.minutes - 60.0)
    final = evaluate(model, heldout, RECIPE)
    log(f"trained: {info}; held-out agreement {final}")
    meta = {
        "target": zoo_chat.FILENAME,
        "target_sha256": zoo_chat.SHA256,
        "recipe": asdict(RECIPE),
        "training": info,
        "heldout_initial": before,
        "heldout_final": final,
        "data": data,
        "data_examples": len(examples),
        "build_seconds": round(time.monotonic() - wall0, 1),
        "minutes_budget": args.minutes,
        "torch": torch.__version__,
        "command": "python scripts/build_chat_eagle.py " + " ".join(sys.argv[1:]),
    }
    write_checkpoint_dir(args.out, lambda tmp: save_eagle(model, tmp, meta))
    log(f"wrote {os.path.abspath(args.out)} in {time.monotonic() - wall0:.0f} s")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help="checkpoint directory (default osd/zoo/weights/chat_eagle)",
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=100.0,
        help="wall-time budget of the whole build: teacher data not cached, "
        "training and saving (default 100; training stops at the recipe's "
        "16 epochs)",
    )
    parser.add_argument(
        "--data-minutes",
        type=float,
        default=15.0,
        help="generation budget of each teacher set not cached (15)",
    )
    parser.add_argument(
        "--data-sets",
        type=int,
        choices=(1, 2, 3),
        default=3,
        help="teacher sets trained on: the first (osd draft build's), "
        "the first two, or all three (default)",
    )
    parser.add_argument(
        "--head-from",
        default=HEAD_FROM,
        help="checkpoint whose head_vocab.json the draft keeps (default the chat draft's)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (2)")
    parser.add_argument(
        "--set",
        default=None,
        metavar="JSON",
        help="recipe overrides, e.g. '{\"lr\": 3e-3}' (EagleRecipe fields)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.set:
        global RECIPE
        RECIPE = dataclasses.replace(RECIPE, **json.loads(args.set))
    return build(args)


if __name__ == "__main__":
    sys.exit(main())
