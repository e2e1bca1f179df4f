"""Build the draft of the chat pair (SmolLM2-135M-Instruct) by distillation, or measure it.

    python scripts/build_chat_draft.py               # data + training (osd/zoo/weights/chat_draft)
    python scripts/build_chat_draft.py --reuse-data  # train again on the cached data
    python scripts/build_chat_draft.py --minutes 4 --prompts 48 --out /tmp/d   # smoke build
    python scripts/build_chat_draft.py --measure     # c, alpha, tau, tokens/s (docs/chat_draft.md)
    python scripts/build_chat_draft.py --shapes      # decode latency of candidate shapes

The build has four stages, each with a progress bar:

1. Prompts. Chat requests made from text that ships with Python: functions of the
   standard library's *training* files (``osd.zoo.corpus``; held-out files are kept for
   the evaluation prompts) phrased as "Explain what this function does", "Write a Python
   function ...", "Summarize ...", "Write a unit test ...", plus Python-concept and
   general questions written here. No HumanEval.
2. Teacher data. The target answers every prompt with osd's own model and KV cache
   (fp32, continuous batching, greedy for most prompts and temperature 0.7 for the
   rest). Its top-k distribution is kept at every response position and, from the
   prefill, at every prompt position after the chat template's fixed system prefix.
   Saved in the cache directory (``$OSD_CACHE/chat_draft``, default
   ``~/.cache/osd/chat_draft``) so that ``--reuse-data`` skips this stage. With
   ``--data-sets 2`` or ``3`` the draft also trains on the second and third sets
   (``chat_draft_data.TEACHER_SETS``: other functions, and more requests to implement a
   function from its signature and docstring), each generated first when not cached.
3. Training. A fresh Llama draft (:data:`DRAFT`) whose tied embedding starts as the
   target's embedding projected onto its top principal directions learns forward
   KL(p || q) on the stored top-k distributions (``osd_kernels.distill_loss``, the
   leftover mass as an "other" bucket): AdamW, linear warm-up, cosine decay. The number
   of steps is planned from the measured step time so that the whole build fits
   ``--minutes``.
4. Head vocabulary. The draft's output head is the embedding (tied), 49,152 rows of its
   cost. ``head_vocab.json`` lists the :data:`HEAD_VOCAB` most frequent target tokens in
   the standard library's training files and the teacher data, plus every special token:
   osd keeps only those head rows (``DecoderLM.restrict_head``); the draft's other logits
   are -inf, so it never proposes the rare tokens, and verification stays exact.
   ``--head-vocab-only`` writes this file into an existing draft (``--head-vocab 0``
   removes it).

The checkpoint (``config.json``, fp16 ``model.safetensors`` without the tied LM head,
``head_vocab.json``, ``build.json`` with the recipe and the build's figures) loads with
``osd.Engine.from_pretrained(target, draft=DIR)`` and (with the full head) with
transformers.

``--measure`` loads the target and the draft once and, on held-out chat prompts written
here (stdlib functions of held-out files, and HumanEval-style tasks written for this
script), reports the draft cost c, greedy acceptance and tokens per step, and tokens/s of
plain vs speculative decoding, timed side by side with the order rotated per prompt.

The prompts are in ``scripts/chat_draft_prompts.py``, the teacher data in
``scripts/chat_draft_data.py``, ``--measure`` and ``--shapes`` in
``scripts/chat_draft_measure.py``.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import osd  # noqa: E402
from osd.online.config import cpu_has_fast_bf16  # noqa: E402
from osd.models.loading import load_tokenizer  # noqa: E402
from osd.zoo import chat as zoo_chat  # noqa: E402
from osd_kernels import distill_loss  # noqa: E402

from chat_draft_data import (
    DATA,
    TEACHER_SETS,
    DataRecipe,
    Example,  # noqa: E402
    ThreadTuner,
    _bar,
    _data_file,
    _log,
    cache_dir,
    load_teacher_set,
    make_data,
)

DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "osd",
    "zoo",
    "weights",
    "chat_draft",
)


@dataclass(frozen=True)
class DraftShape:
    """Shape of the draft (a ``LlamaForCausalLM`` with the target's vocabulary)."""

    hidden_size: int = 256  # width; the 49,152 x hidden LM head dominates latency
    num_layers: int = 4  # decoder layers (each adds ~0.15 ms per decode step here)
    num_heads: int = 4  # query heads, head_dim 64 like the target
    num_kv_heads: int = 2  # key/value heads
    intermediate_size: int = 704  # SwiGLU width
    rope_theta: float = 100000.0  # the target's
    max_position_embeddings: int = 8192


@dataclass(frozen=True)
class TrainRecipe:
    """How the draft is trained."""

    epochs: float = 16.0  # upper bound; the time budget usually allows fewer
    tokens_per_batch: int = 3072  # padded tokens per optimizer step
    lr: float = 2e-3  # peak AdamW learning rate
    warmup: int = 20  # linear warm-up steps (their time plans the rest)
    weight_decay: float = 0.01  # on matrices (not norms)
    bf16_autocast: bool = True  # bf16 matmuls, fp32 weights, where the CPU has fast bf16
    #                                 (osd.online.config.cpu_has_fast_bf16; fp32 otherwise)
    final_norm_init: float = 0.3  # final RMSNorm weight at init (1.0 starts at loss ~25)
    prompt_positions: bool = True  # also distill the target at prompt positions
    heldout_fraction: float = 0.03  # examples kept out of training for the alpha report
    seed: int = 0


# Rows the draft's output head keeps (stage 4).
HEAD_VOCAB = 8192

DRAFT = DraftShape()
TRAIN = TrainRecipe()


# ---------------------------------------------------------------------------- training


def llama_config(shape: DraftShape, target_config):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.hidden_size // shape.num_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=float(f"{target_config.rms_norm_eps:.6g}"),
        rope_theta=shape.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=target_config.bos_token_id,
        eos_token_id=list(target_config.eos_token_ids)[0],
        pad_token_id=2,
        architectures=["LlamaForCausalLM"],
    )


def init_draft(shape: DraftShape, target, seed: int, final_norm: float = 1.0):
    """A fresh transformers ``LlamaForCausalLM`` draft; its tied embedding is the target's
    embedding projected onto its top ``hidden_size`` right singular vectors (uncentred
    PCA), so the draft's head starts as the best rank-``hidden`` approximation of the
    target's, rescaled to the target's per-entry RMS. ``final_norm`` is the initial weight
    of the final RMSNorm: at init the residual stream is about the current token's
    embedding, so a large scale makes the draft confidently predict the token it just
    saw."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(shape, target.config)).float()
    E = target.embed_tokens.weight.detach().float()  # [V, 576]
    _, _, vh = torch.linalg.svd(E[::4], full_matrices=False)  # rows subsampled: faster
    proj = E @ vh[: shape.hidden_size].T  # [V, hidden]
    proj *= E.pow(2).mean().sqrt() / proj.pow(2).mean().sqrt()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(proj)
        model.model.norm.weight.fill_(final_norm)
        # Residual branches start small, so the draft starts near its embedding's bigram.
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.5 / math.sqrt(shape.num_layers))
            layer.mlp.down_proj.weight.mul_(0.5 / math.sqrt(shape.num_layers))
    return model


def _rows(ex: Example, prompt_positions: bool) -> torch.Tensor:
    """Indices into ``ex.topk_*`` of the positions trained on."""
    first = 0 if prompt_positions else ex.prompt_len - ex.start
    return torch.arange(first, ex.topk_ids.shape[0])


def _batches(examples: list[Example], tokens_per_batch: int, gen: torch.Generator) -> list:
    """Examples grouped by length into padded batches of at most ``tokens_per_batch``
    (length x rows), in random order."""
    order = sorted(range(len(examples)), key=lambda i: examples[i].tokens.numel())
    batches, cur = [], []
    for i in order:
        L = examples[i].tokens.numel()
        if cur and L * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[p] for p in perm]


def _collate(examples: list[Example], prompt_positions: bool):
    """``(input_ids [N, T], attention_mask [N, T], rows [M], topk_ids [M, k], topk_probs
    [M, k], is_response [M])``: the draft's logits at flattened position ``rows[m]``
    predict the token with target ``m``."""
    T = max(e.tokens.numel() for e in examples)
    ids = torch.zeros(len(examples), T, dtype=torch.int64)
    mask = torch.zeros(len(examples), T, dtype=torch.int64)
    rows, tk_ids, tk_p, resp = [], [], [], []
    for n, e in enumerate(examples):
        L = e.tokens.numel()
        ids[n, :L] = e.tokens.long()
        mask[n, :L] = 1
        sel = _rows(e, prompt_positions)
        pos = e.start + sel  # token positions predicted
        rows.append(n * T + pos - 1)
        tk_ids.append(e.topk_ids[sel].long())
        tk_p.append(e.topk_probs[sel].float())
        resp.append(pos >= e.prompt_len)
    return ids, mask, torch.cat(rows), torch.cat(tk_ids), torch.cat(tk_p), torch.cat(resp)


def _draft_logits(model, ids, mask, rows):
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    return model.lm_head(hidden)


@torch.no_grad()
def evaluate(model, examples: list[Example], tokens_per_batch: int) -> dict:
    """Over the response positions of ``examples``: mean top-k overlap
    ``sum_{x in topk} min(p(x), q(x))`` (a lower bound of 1 - TV) and greedy agreement
    (the draft's argmax is the target's)."""
    model.eval()
    overlap = agree = count = 0.0
    for batch in _batches(examples, tokens_per_batch, torch.Generator().manual_seed(0)):
        ids, mask, rows, tk_ids, tk_p, resp = _collate([examples[i] for i in batch], False)
        q = torch.softmax(_draft_logits(model, ids, mask, rows).float(), dim=-1)
        overlap += torch.minimum(tk_p, q.gather(1, tk_ids)).sum().item()
        agree += (q.argmax(-1) == tk_ids[:, 0]).sum().item()
        count += rows.numel()
    model.train()
    return {
        "overlap": round(overlap / max(count, 1), 4),
        "agree": round(agree / max(count, 1), 4),
        "positions": int(count),
    }


def train_draft(
    model,
    examples: list[Example],
    heldout: list[Example],
    recipe: TrainRecipe,
    deadline: float,
    tuner: ThreadTuner,
) -> dict:
    """Distil the teacher data into ``model`` (in place) until ``recipe.epochs`` or the
    planned number of steps that fits before ``deadline``. Returns the training figures."""
    gen = torch.Generator().manual_seed(recipe.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    use_bf16 = recipe.bf16_autocast and cpu_has_fast_bf16()
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": recipe.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )
    per_epoch = len(_batches(examples, recipe.tokens_per_batch, torch.Generator()))
    planned = max(recipe.warmup + 1, round(recipe.epochs * per_epoch))
    total = planned
    model.train()
    losses, history = [], []
    t0 = time.monotonic()
    bar = _bar(total, "draft training", "step")
    step, epoch = 0, 0
    while step < total:
        for batch in _batches(examples, recipe.tokens_per_batch, gen):
            if step >= total:
                break
            if step < recipe.warmup:
                lr = recipe.lr * (step + 1) / recipe.warmup
            else:
                progress = (step - recipe.warmup) / max(1, total - recipe.warmup)
                lr = recipe.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))
            for group in opt.param_groups:
                group["lr"] = lr
            t_step = time.perf_counter()
            ids, mask, rows, tk_ids, tk_p, resp = _collate(
                [examples[i] for i in batch], recipe.prompt_positions
            )
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
                logits = _draft_logits(model, ids, mask, rows)
            loss = distill_loss(logits, (tk_ids, tk_p), loss="fkl")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())  # host sync once per step, for the progress bar
            tuner.record(time.perf_counter() - t_step, rows.numel())
            step += 1
            if step == recipe.warmup:
                # Plan the rest from the warm-up's pace so the build ends before deadline.
                pace = (time.monotonic() - t0) / step
                fit = recipe.warmup + int((deadline - time.monotonic()) / (pace * 1.08))
                total = max(recipe.warmup + 1, min(planned, fit))
                if bar is not None:
                    bar.total = total
                    bar.refresh()
                _log(
                    f"{pace:.2f} s/step: {total} steps of {planned} planned "
                    f"({total / per_epoch:.2f} epochs of {per_epoch} steps)"
                )
            if bar is not None:
                bar.update(1)
                bar.set_postfix(
                    loss=f"{statistics.fmean(losses[-20:]):.3f}",
                    lr=f"{lr:.1e}",
                    threads=tuner.current,
                )
        epoch += 1
        if heldout:
            ev = evaluate(model, heldout, recipe.tokens_per_batch)
            history.append({"step": step, "loss": round(statistics.fmean(losses[-20:]), 4), **ev})
            _log(
                f"epoch {epoch}, step {step}: loss {history[-1]['loss']}, held-out "
                f"overlap {ev['overlap']}, greedy agreement {ev['agree']}"
            )
    if bar is not None:
        bar.close()
    return {
        "steps": step,
        "planned_steps": planned,
        "steps_per_epoch": per_epoch,
        "epochs": round(step / per_epoch, 2),
        "final_loss": round(statistics.fmean(losses[-20:]), 4),
        "seconds": round(time.monotonic() - t0, 1),
        "history": history,
        "threads_final": tuner.current,
        "thread_switches": tuner.switches,
    }


def write_checkpoint_dir(path: str, write) -> None:
    """Call ``write(tmp)`` on a fresh directory beside ``path``, then move it into place
    (readable by all), replacing ``path``."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".chat-checkpoint-", dir=os.path.dirname(path))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def split_heldout(examples: list, fraction: float, seed: int) -> tuple[list, list]:
    """``(train, heldout)``: a seeded shuffle, at least one example held out."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_held = max(1, round(fraction * len(examples)))
    return [examples[i] for i in order[n_held:]], [examples[i] for i in order[:n_held]]


def save_draft(model, path: str, meta: dict) -> None:
    """``config.json``, fp16 ``model.safetensors`` (tied head left out) and ``build.json``
    into ``path``, written beside it first and moved into place."""
    from safetensors.torch import save_file

    def write(tmp):
        model.config.save_pretrained(tmp)
        state = {
            k: v.detach().to(torch.float16).contiguous()
            for k, v in model.state_dict().items()
            if k != "lm_head.weight"
        }
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "build.json"), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")

    write_checkpoint_dir(path, write)


def head_vocab(tokenizer, size: int, examples=()) -> list[int]:
    """The ``size`` most frequent token ids of the standard library's training files
    (prose and code documents) and of ``examples``' tokens, and every special token;
    sorted."""
    from osd.zoo.corpus import documents

    counts = collections.Counter()
    docs = documents("prose", "train") + documents("code", "train")
    bar = _bar(len(docs), "head vocabulary", "doc")
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
    from osd.models.loading import HEAD_VOCAB_FILE

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
    data_file = _data_file(DATA)
    if os.path.isfile(data_file):
        examples = [Example(**e) for e in torch.load(data_file, weights_only=True)["examples"]]
    ids = head_vocab(tokenizer, args.head_vocab, examples) if args.head_vocab else None
    write_head_vocab(args.out, ids)
    meta_file = os.path.join(args.out, "build.json")
    if os.path.isfile(meta_file):
        with open(meta_file) as f:
            meta = json.load(f)
        meta["head_vocab"] = args.head_vocab
        meta["head_vocab_command"] = "python scripts/build_chat_draft.py " + " ".join(sys.argv[1:])
        with open(meta_file, "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")
    _log(
        f"{args.out}: head vocabulary "
        + (f"of {len(ids)} tokens ({len(examples)} teacher examples counted)" if ids else "removed")
    )
    return 0


def build(args) -> int:
    wall0 = time.monotonic()
    deadline = wall0 + 60.0 * args.minutes
    data_recipe = DataRecipe(prompts=args.prompts) if args.prompts else DATA
    target_path = zoo_chat.fetch_target()
    data_file = _data_file(data_recipe)
    if args.reuse_data and os.path.isfile(data_file):
        _log(f"reusing teacher data {data_file}")
        data = torch.load(data_file, weights_only=True)
    else:
        if args.reuse_data:
            _log(f"no cached teacher data at {data_file}: generating it")
        # Generation gets its share of the budget; training plans itself into the rest.
        data = make_data(
            target_path, data_recipe, wall0 + 60.0 * args.minutes * args.data_share, args.threads
        )
        os.makedirs(cache_dir(), exist_ok=True)
        torch.save(data, data_file + ".part")
        os.replace(data_file + ".part", data_file)
        _log(f"teacher data saved to {data_file}")
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
    _log(
        f"training on {len(train)} examples ({n_resp} response + {n_prompt} prompt "
        f"positions), {len(heldout)} held out"
    )
    target = osd.load_model(target_path)
    model = init_draft(DRAFT, target, TRAIN.seed, TRAIN.final_norm_init)
    del target
    before = evaluate(model, heldout, TRAIN.tokens_per_batch)
    _log(f"initial draft: held-out overlap {before['overlap']}, agreement {before['agree']}")
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
        "head_vocab": args.head_vocab,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": "python scripts/build_chat_draft.py " + " ".join(sys.argv[1:]),
    }
    save_draft(model, args.out, meta)
    if args.head_vocab:
        write_head_vocab(
            args.out, head_vocab(load_tokenizer(target_path), args.head_vocab, examples)
        )
    _log(
        f"wrote {args.out} in {wall:.0f} s: final loss {info['final_loss']}, held-out "
        f"overlap {final['overlap']}, greedy agreement {final['agree']}"
    )
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help="checkpoint directory (default osd/zoo/weights/chat_draft)",
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=33.0,
        help="wall-time budget of the whole build (default 33)",
    )
    parser.add_argument(
        "--data-share",
        type=float,
        default=0.4,
        help="share of --minutes after which no new prompt is answered (0.4)",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=None,
        help=f"chat requests to answer (default {DATA.prompts})",
    )
    parser.add_argument(
        "--reuse-data",
        action="store_true",
        help="train on the cached teacher data of the same recipe if present",
    )
    parser.add_argument(
        "--data-sets",
        type=int,
        choices=(1, 2, 3),
        default=1,
        help="teacher sets to train on: the first, or also the second and "
        "third (TEACHER_SETS, each generated when not cached; default 1)",
    )
    parser.add_argument(
        "--data-only",
        action="store_true",
        help="stop after the teacher data is cached (for the EAGLE head's build)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="most torch CPU threads; the build switches between 1 and this "
        "by measured pace (default 2); --measure uses exactly this",
    )
    parser.add_argument(
        "--head-vocab",
        type=int,
        default=HEAD_VOCAB,
        help=f"rows the draft's output head keeps (default {HEAD_VOCAB}; 0: all)",
    )
    parser.add_argument(
        "--head-vocab-only",
        action="store_true",
        help="only write head_vocab.json into the draft at --out",
    )
    parser.add_argument(
        "--measure", action="store_true", help="measure the draft at --out instead of building"
    )
    parser.add_argument(
        "--shapes",
        action="store_true",
        help="time decode forwards of candidate draft shapes and exit",
    )
    parser.add_argument("--eval-prompts", type=int, default=20, help="with --measure (20)")
    parser.add_argument("--new-tokens", type=int, default=128, help="with --measure (128)")
    parser.add_argument(
        "--ks", type=int, nargs="*", default=[3, 4, 5], help="with --measure: chain lengths (3 4 5)"
    )
    parser.add_argument(
        "--lookup-ks",
        type=int,
        nargs="*",
        default=[4],
        help="with --measure: chain lengths with prompt lookup (4)",
    )
    parser.add_argument(
        "--cost-reps",
        type=int,
        default=30,
        help="with --measure/--shapes: single-forward repetitions for c (30)",
    )
    parser.add_argument("--json", default=None, help="with --measure: write the report here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.shapes:
        from chat_draft_measure import time_shapes

        return time_shapes(args)
    if args.measure:
        from chat_draft_measure import measure

        return measure(args)
    if args.head_vocab_only:
        return build_head_vocab_only(args)
    return build(args)


if __name__ == "__main__":
    sys.exit(main())
