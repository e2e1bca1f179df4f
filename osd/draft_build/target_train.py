"""Training a draft for any target (``osd draft build --target``), resumable.

The draft (:class:`HeadDraft`) is a transformers ``LlamaModel`` body under an embedding
tied to its output head, as the saved checkpoint has it (``tie_word_embeddings``). Only
the rows of the head vocabulary are trained (they are the head and, for those tokens, the
input embedding); the other rows stay at their initial value, the target's embedding
projected onto its top principal directions, and serve only as inputs. The head's
softmax is over the head vocabulary, as osd serves a draft with ``head_vocab.json``, so
the cost of a step does not grow with the target's vocabulary. The teacher's top-k
targets are mapped to the head's columns with :func:`osd.online.distill.to_head_vocab`.

A checkpoint (weights, optimizer, schedule, position in the epoch) is written every
minute and when the build is interrupted; a rerun continues from it, and, given the same
plan, ends with the weights an uninterrupted run would have.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaModel

from osd.draft_build.build import write_head_vocab
from osd.draft_build.common import Progress, ThreadTuner, log
from osd.draft_build.data import Example
from osd.draft_build.recipe import DraftShape, TrainRecipe
from osd.draft_build.train import _batches, _collate, llama_config
from osd.online.config import cpu_has_fast_bf16
from osd.online.distill import to_head_vocab
from osd_kernels import distill_loss


def projection(embed: torch.Tensor, width: int) -> tuple[torch.Tensor, float]:
    """``(P [width, H], scale)``: the top ``width`` right singular vectors of the target's
    embedding ``embed [V, H]`` (from the Gram matrix of every fourth row, uncentred PCA),
    and the factor that gives ``embed @ P.T`` the per-entry RMS of ``embed``."""
    E = embed.float()
    sub = E[::4].double()
    _, vectors = torch.linalg.eigh(sub.T @ sub)  # ascending eigenvalues
    P = vectors[:, -width:].flip(-1).T.float().contiguous()
    proj = E @ P.T
    return P, float(E.pow(2).mean().sqrt() / proj.pow(2).mean().sqrt().clamp(min=1e-12))


class HeadDraft(nn.Module):
    """A Llama draft whose output head is the rows ``head_ids`` of its tied embedding.

    ``embed_init [V, hidden]`` starts every row; the rows of ``head_ids`` become the
    trainable ``head`` (columns of the logits, in ``head_ids`` order), the others stay
    fixed (``None`` when the head keeps the whole vocabulary)."""

    def __init__(self, config, head_ids: torch.Tensor, embed_init: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        body_config = copy.deepcopy(config)
        body_config.vocab_size, body_config.pad_token_id = 1, None  # inputs come embedded
        self.body = LlamaModel(body_config).float()
        V = config.vocab_size
        head_ids = head_ids.to(torch.int64)
        column = torch.full((V,), -1, dtype=torch.int64)
        column[head_ids] = torch.arange(head_ids.numel())
        self.register_buffer("head_ids", head_ids)
        self.register_buffer("column", column, persistent=False)
        full = head_ids.numel() == V
        self.register_buffer(
            "embed_rest", None if full else embed_init.float().clone(), persistent=False
        )
        self.head = nn.Parameter(embed_init.float()[head_ids].clone())

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        local = self.column[ids]
        if self.embed_rest is None:
            return self.head[local]
        hit = local >= 0
        return torch.where(hit[..., None], self.head[local.clamp(min=0)], self.embed_rest[ids])

    def forward(self, ids, mask, rows) -> torch.Tensor:
        """Logits ``[M, V_head]`` at the flattened positions ``rows`` of ``ids [N, T]``."""
        hidden = self.body(inputs_embeds=self.embed(ids), attention_mask=mask).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
        return F.linear(hidden, self.head)

    def full_embedding(self) -> torch.Tensor:
        """The saved ``[V, hidden]`` embedding: the fixed rows with the head's in place."""
        if self.embed_rest is None:
            return self.head.detach()[self.column]
        E = self.embed_rest.clone()
        E[self.head_ids] = self.head.detach()
        return E


def init_draft(
    shape: DraftShape,
    target_config,
    head_ids: torch.Tensor,
    P: torch.Tensor,
    scale: float,
    target_embed: torch.Tensor,
    seed: int,
    final_norm: float,
) -> HeadDraft:
    """A fresh :class:`HeadDraft`: embedding ``target_embed @ P.T * scale``, final norm
    weight ``final_norm``, residual branches scaled down so it starts near its
    embedding's bigram (as :func:`osd.draft_build.train.init_draft`)."""
    torch.manual_seed(seed)
    config = llama_config(shape, target_config)
    config.pad_token_id = None
    model = HeadDraft(config, head_ids, (target_embed.float() @ P.T) * scale)
    with torch.no_grad():
        model.body.norm.weight.fill_(final_norm)
        for layer in model.body.layers:
            layer.self_attn.o_proj.weight.mul_(0.5 / math.sqrt(shape.num_layers))
            layer.mlp.down_proj.weight.mul_(0.5 / math.sqrt(shape.num_layers))
    return model


def map_examples(examples: list[Example], head_ids: torch.Tensor) -> list[Example]:
    """``examples`` with their top-k targets over the head's columns (a token the head
    lacks keeps probability 0: its mass joins the loss's leftover bucket)."""
    if int(head_ids.numel()) == int(head_ids.max()) + 1:
        return examples  # the whole vocabulary, in order: columns are token ids
    out = []
    for e in examples:
        ids, probs, _ = to_head_vocab(head_ids, e.topk_ids.long(), e.topk_probs.float(), None)
        out.append(
            dataclasses.replace(
                e, topk_ids=ids.to(torch.int32), topk_probs=probs.to(torch.float16), features=None
            )
        )
    return out


@torch.no_grad()
def evaluate(model: HeadDraft, examples: list[Example], tokens_per_batch: int) -> dict:
    """Over the answer positions of ``examples`` (mapped to head columns): the mean top-k
    overlap ``sum min(p, q)`` (a lower bound of 1 - TV) and greedy agreement."""
    model.eval()
    overlap = agree = count = 0.0
    for batch in _batches(examples, tokens_per_batch, torch.Generator().manual_seed(0)):
        ids, mask, rows, tk_ids, tk_p, _ = _collate([examples[i] for i in batch], False)
        q = torch.softmax(model(ids, mask, rows).float(), dim=-1)
        overlap += torch.minimum(tk_p, q.gather(1, tk_ids)).sum().item()
        top = tk_p[:, 0] > 0  # the target's first choice is in the head
        agree += ((q.argmax(-1) == tk_ids[:, 0]) & top).sum().item()
        count += rows.numel()
    model.train()
    n = max(count, 1)
    return {"overlap": round(overlap / n, 4), "agree": round(agree / n, 4), "positions": int(count)}


def _lr(recipe: TrainRecipe, step: int, total: int) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, total - recipe.warmup)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _save(path: str, obj) -> None:
    torch.save(obj, path + ".part")
    os.replace(path + ".part", path)


def train(
    model: HeadDraft,
    examples: list[Example],
    heldout: list[Example],
    recipe: TrainRecipe,
    deadline: float,
    build_end: float,
    tuner: ThreadTuner,
    checkpoint: str,
    every: float = 60.0,
    stop_after: int | None = None,
) -> dict | None:
    """Distil ``examples`` (mapped to the head's columns) into ``model`` until
    ``recipe.epochs`` or the steps that fit before ``deadline``, continuing from the
    checkpoint file ``checkpoint`` when it exists and writing it every ``every`` seconds,
    at the end and on an interruption. ``stop_after``: stop (checkpointed) after that
    many steps, as an interruption would (tests). Returns the training figures, or None
    when stopped by ``stop_after``."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": recipe.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )
    use_bf16 = recipe.bf16_autocast and cpu_has_fast_bf16()
    per_epoch = len(_batches(examples, recipe.tokens_per_batch, torch.Generator()))
    planned = max(recipe.warmup + 1, round(recipe.epochs * per_epoch))
    st = {"step": 0, "total": planned, "epoch": 0, "pos": 0, "losses": [], "history": []}
    st["seconds"] = 0.0
    if os.path.isfile(checkpoint):
        ck = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        st = ck["state"]
        log(f"training resumes at step {st['step']} of {st['total']} ({checkpoint})")
    first = st["step"]
    plan_at = first + (recipe.warmup if first == 0 else 3)  # steps timed before planning
    model.train()
    progress = Progress("draft training", st["total"], "steps", deadline, build_end)
    t0 = time.monotonic()
    last_save = t0

    def save() -> None:
        st["seconds"] = round(seconds_before + time.monotonic() - t0, 1)
        _save(checkpoint, {"model": model.state_dict(), "opt": opt.state_dict(), "state": st})

    seconds_before = st["seconds"]
    try:
        while st["step"] < st["total"]:
            gen = torch.Generator().manual_seed(recipe.seed * 1000 + st["epoch"])
            batches = _batches(examples, recipe.tokens_per_batch, gen)
            while st["pos"] < len(batches) and st["step"] < st["total"]:
                lr = _lr(recipe, st["step"], st["total"])
                for group in opt.param_groups:
                    group["lr"] = lr
                t_step = time.perf_counter()
                ids, mask, rows, tk_ids, tk_p, _ = _collate(
                    [examples[i] for i in batches[st["pos"]]], recipe.prompt_positions
                )
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
                    logits = model(ids, mask, rows)
                loss = distill_loss(logits, (tk_ids, tk_p), loss="fkl")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                st["losses"] = (st["losses"] + [loss.item()])[-20:]
                tuner.record(time.perf_counter() - t_step, rows.numel())
                st["step"] += 1
                st["pos"] += 1
                if st["step"] == plan_at:
                    # the rest of the plan from this run's pace, so training ends by deadline
                    pace = (time.monotonic() - t0) / (st["step"] - first)
                    fit = st["step"] + int((deadline - time.monotonic()) / (pace * 1.08))
                    st["total"] = max(st["step"], min(planned, fit))
                    progress.total = st["total"]
                    log(
                        f"{pace:.2f} s/step: {st['total']} steps of {planned} planned "
                        f"({st['total'] / per_epoch:.2f} epochs of {per_epoch} steps)"
                    )
                progress.update(
                    st["step"],
                    f"loss {statistics.fmean(st['losses']):.3f}, lr {lr:.1e}, "
                    f"{tuner.current} threads",
                )
                if stop_after is not None and st["step"] >= stop_after:
                    save()
                    return None
                if time.monotonic() - last_save >= every:
                    save()
                    last_save = time.monotonic()
            if st["pos"] >= len(batches):
                st["epoch"] += 1
                st["pos"] = 0
                if heldout:
                    ev = evaluate(model, heldout, recipe.tokens_per_batch)
                    loss_now = round(statistics.fmean(st["losses"]), 4)
                    st["history"].append({"step": st["step"], "loss": loss_now, **ev})
    except KeyboardInterrupt:
        save()
        log(f"interrupted: training checkpoint at step {st['step']} in {checkpoint}")
        raise
    save()
    progress.close(st["step"])
    return {
        "steps": st["step"],
        "planned_steps": planned,
        "steps_per_epoch": per_epoch,
        "epochs": round(st["step"] / per_epoch, 2),
        "final_loss": round(statistics.fmean(st["losses"]), 4) if st["losses"] else None,
        "seconds": st["seconds"],
        "resumed_at_step": first or None,
        "history": st["history"],
        "threads_final": tuner.current,
    }


def save_draft(model: HeadDraft, out: str, head_vocab: list[int] | None) -> None:
    """Write the draft's ``config.json`` and fp16 ``model.safetensors`` (tied head left
    out) into ``out``, file by file (each written beside its place, then renamed, so the
    build's work directory there stays), and its ``head_vocab.json`` (removed when
    ``head_vocab`` is None: the whole vocabulary)."""
    os.makedirs(out, exist_ok=True)
    state = {"model.embed_tokens.weight": model.full_embedding()}
    for name, tensor in model.body.state_dict().items():
        if name != "embed_tokens.weight":
            state["model." + name] = tensor.detach()
    state = {k: v.to(torch.float16).contiguous() for k, v in state.items()}
    with tempfile.TemporaryDirectory(dir=out, prefix=".save-") as tmp:
        model.config.save_pretrained(tmp)
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        for name in ("config.json", "model.safetensors"):
            os.chmod(os.path.join(tmp, name), 0o644)
            os.replace(os.path.join(tmp, name), os.path.join(out, name))
    write_head_vocab(out, head_vocab)
