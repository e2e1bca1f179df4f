"""Training the chat draft (the third stage of ``osd draft build``): a fresh Llama draft
whose tied embedding starts as the target's embedding projected onto its top principal
directions learns forward KL(p || q) on the teacher's stored top-k distributions."""

from __future__ import annotations

import json
import math
import os
import statistics
import time

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from osd.draft_build.common import ThreadTuner, log, progress_bar, write_checkpoint_dir
from osd.draft_build.data import Example
from osd.draft_build.recipe import DraftShape, TrainRecipe
from osd.online.config import cpu_has_fast_bf16
from osd_kernels import distill_loss


def llama_config(shape: DraftShape, target_config) -> LlamaConfig:
    """The transformers config of a draft of ``shape`` for the target of ``target_config``
    (an osd ``ModelConfig``): its vocabulary, norm epsilon and special tokens."""
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
        eos_token_id=next(iter(target_config.eos_token_ids), None),
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
    bar = progress_bar(total, "draft training", "step")
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
                log(
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
            log(
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


def save_draft(model, path: str, meta: dict) -> None:
    """``config.json``, fp16 ``model.safetensors`` (tied head left out) and ``build.json``
    into ``path``, written beside it first and moved into place."""

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
