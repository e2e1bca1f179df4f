"""The chat draft's teacher data: chat requests answered by the target through osd, with
its top-k distributions (and features) at every position (the second stage of
``osd draft build``; the EAGLE draft's build reads the same sets).

Each set (:class:`osd.draft_build.recipe.DataRecipe`) is cached in ``$OSD_CACHE/chat_draft``
under a key of its recipe and the target's hash, so a build that finds it skips the
generation.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass

import torch

import osd
from osd.chat_template import apply_chat_template
from osd.draft_build.common import ThreadTuner, cache_dir, log, progress_bar
from osd.draft_build.prompts import Prompt, training_prompts
from osd.draft_build.recipe import DataRecipe
from osd.models.loading import load_tokenizer
from osd.zoo import chat as zoo_chat


# ------------------------------------------------------------------------ teacher data


@dataclass
class Example:
    """One prompt and the target's answer, with its top-k distributions.

    ``topk_ids`` / ``topk_probs`` row ``i`` is the target's distribution of token
    ``tokens[start + i]`` given ``tokens[:start + i]``.
    """

    tokens: torch.Tensor  # [L] int32: prompt then response
    prompt_len: int
    start: int  # first position with a target (after the system prefix)
    topk_ids: torch.Tensor  # [L - start, k] int32
    topk_probs: torch.Tensor  # [L - start, k] float16
    kind: str
    temperature: float
    # [L - 1, H] float16: the target's last-layer output before the final norm at
    # positions 0 .. L - 2 (the last token is never fed), or None.
    features: torch.Tensor | None = None


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return ids.to(torch.int32), probs.to(torch.float16)


@torch.inference_mode()
def teacher_data(
    model,
    prompts: list[list[int]],
    meta: list[Prompt],
    start: int,
    recipe: DataRecipe,
    deadline: float,
    tuner: ThreadTuner,
    on_example=None,
    bar: bool = True,
) -> tuple[list[Example], bool]:
    """Answer ``prompts`` with the target ``model`` (osd ``DecoderLM``), continuous batching.

    Rows that finish (EOS or ``max_new_tokens``) leave the batch and waiting prompts are
    prefilled into the free rows. Past ``deadline`` (``time.monotonic()``) no new prompt
    starts; rows in flight finish. Returns ``(examples in prompt order, stopped early)``.
    ``on_example(i, example, new_tokens)``, when given, sees each example as it finishes
    (``i``: its index in ``prompts``; ``new_tokens``: tokens generated so far), so a
    caller can save them as they come; ``bar=False`` leaves out the tqdm bar.
    """
    B, k = recipe.batch_size, recipe.topk
    eos = set(model.config.eos_token_ids)
    cap = max(len(p) for p in prompts) + recipe.max_new_tokens + 2
    cache = model.new_cache(B, cap)
    gen = torch.Generator().manual_seed(recipe.seed)
    waiting = collections.deque(range(len(prompts)))
    active: list[dict] = []  # active[b] occupies cache row b
    next_tok = torch.zeros(B, dtype=torch.int64)
    ones = torch.ones(B, dtype=torch.int32)
    done: dict[int, Example] = {}
    stopped = False
    bar = progress_bar(len(prompts), "teacher answers", "prompt") if bar else None
    new_tokens = 0
    t0 = time.monotonic()

    def sample(logits: torch.Tensor, rows: list[dict]) -> torch.Tensor:
        temps = torch.tensor([r["temp"] for r in rows])
        greedy = logits.argmax(-1)
        if not (temps > 0).any():
            return greedy
        probs = torch.softmax(logits / temps.clamp(min=1e-3)[:, None], dim=-1)
        drawn = torch.multinomial(probs, 1, generator=gen)[:, 0]
        return torch.where(temps > 0, drawn, greedy)

    while waiting or active:
        # At least one batch is answered, however late it starts.
        if waiting and time.monotonic() > deadline and len(waiting) < len(prompts) - B:
            stopped = True
            waiting.clear()
            if not active:
                break
        free = B - len(active)
        if waiting and (free >= min(4, len(waiting)) or not active):
            new = [waiting.popleft() for _ in range(min(free, len(waiting), recipe.prefill_group))]
            first = len(active)
            longest = max(len(prompts[i]) for i in new)
            ids = torch.zeros(len(new), longest, dtype=torch.int64)
            for b, i in enumerate(new):
                ids[b, : len(prompts[i])] = torch.tensor(prompts[i])
            lengths = torch.tensor([len(prompts[i]) for i in new], dtype=torch.int32)
            rows = cache.rows(first, len(new))
            rows.reset()
            logits, hidden = model.prefill(ids, rows, lengths, return_hidden=True)  # [n, T, V]
            cache.set_bound(max(cache.bound, longest))
            fresh = []
            for b, i in enumerate(new):
                L = len(prompts[i])
                tk_ids, tk_p = _topk(logits[b, start - 1 : L], k)  # prompt targets + response 0
                fresh.append(
                    {
                        "index": i,
                        "temp": meta[i].temperature,
                        "response": [],
                        "ids": [tk_ids],
                        "probs": [tk_p],
                        "cached": L,
                        "feats": [hidden[b, :L].to(torch.float16)] if recipe.features else [],
                    }
                )
            last = logits[torch.arange(len(new)), lengths.long() - 1]
            del logits
            tokens = sample(last, fresh)
            active += fresh
            next_tok[first : first + len(new)] = tokens
        else:
            n = len(active)
            t_step = time.perf_counter()
            logits, hidden = model(next_tok[:n, None], cache, return_hidden=True)
            logits = logits[:, 0]  # [n, V]
            cache.commit(ones[:n], 1)
            tuner.record(time.perf_counter() - t_step, n)
            tk_ids, tk_p = _topk(logits, k)
            for b, r in enumerate(active):
                r["cached"] += 1
                r["ids"].append(tk_ids[b : b + 1])
                r["probs"].append(tk_p[b : b + 1])
                if recipe.features:
                    r["feats"].append(hidden[b, :1].to(torch.float16))
            tokens = sample(logits, active)
            next_tok[:n] = tokens
            first = 0
        # Record the sampled tokens; retire finished rows (the last row fills each hole).
        for r, t in zip(active[first:], tokens.tolist()):
            r["response"].append(t)
            new_tokens += 1
        for b in reversed(range(len(active))):
            r = active[b]
            if r["response"][-1] in eos or len(r["response"]) >= recipe.max_new_tokens:
                i = r["index"]
                toks = torch.tensor(prompts[i] + r["response"], dtype=torch.int32)
                done[i] = Example(
                    tokens=toks,
                    prompt_len=len(prompts[i]),
                    start=start,
                    topk_ids=torch.cat(r["ids"]),
                    topk_probs=torch.cat(r["probs"]),
                    kind=meta[i].kind,
                    temperature=meta[i].temperature,
                    features=torch.cat(r["feats"]) if recipe.features else None,
                )
                assert done[i].topk_ids.shape[0] == toks.numel() - start
                assert not recipe.features or done[i].features.shape[0] == toks.numel() - 1
                if on_example is not None:
                    on_example(i, done[i], new_tokens)
                last = len(active) - 1
                if b != last:
                    cache.move_row(last, b)
                    next_tok[b] = next_tok[last]
                    active[b] = active[last]
                active.pop()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(
                        tok_s=f"{new_tokens / (time.monotonic() - t0):.0f}", threads=tuner.current
                    )
        cache.set_bound(max((r["cached"] for r in active), default=0))
    if bar is not None:
        bar.close()
    return [done[i] for i in sorted(done)], stopped


def _system_prefix(tokenizer) -> int:
    """Tokens shared by every chat prompt (the template's system turn and the user header)."""
    a, b = apply_chat_template(
        tokenizer, [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "What?"}]]
    )
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def make_data(target_path: str, recipe: DataRecipe, deadline: float, threads: int) -> dict:
    """Prompts, teacher answers and top-k targets (see :func:`teacher_data`)."""
    model = osd.load_model(target_path, dtype=getattr(torch, recipe.teacher_dtype))
    tokenizer = load_tokenizer(target_path)
    start = _system_prefix(tokenizer)
    meta = training_prompts(recipe.prompts, recipe)
    ids = apply_chat_template(tokenizer, [[{"role": "user", "content": p.text}] for p in meta])
    keep = [i for i, x in enumerate(ids) if len(x) <= recipe.max_prompt_tokens]
    meta, ids = [meta[i] for i in keep], [ids[i] for i in keep]
    log(
        f"{len(ids)} prompts ({sum(map(len, ids))} tokens; {recipe.prompts - len(keep)} "
        f"longer than {recipe.max_prompt_tokens} tokens skipped), system prefix {start} tokens"
    )
    t0 = time.perf_counter()
    tuner = ThreadTuner(threads)
    examples, stopped = teacher_data(model, ids, meta, start, recipe, deadline, tuner)
    seconds = time.perf_counter() - t0
    response = sum(e.tokens.numel() - e.prompt_len for e in examples)
    log(
        f"teacher answered {len(examples)} prompts in {seconds:.0f} s ({response} response "
        f"tokens, {response / seconds:.1f} tokens/s)"
        + (" -- stopped at the time budget" if stopped else "")
    )
    # Plain dicts of tensors, so the cache loads without these classes.
    return {
        "examples": [dict(vars(e)) for e in examples],
        "recipe": asdict(recipe),
        "seconds": round(seconds, 1),
        "stopped_early": stopped,
        "prompts_offered": len(ids),
        "threads_final": tuner.current,
        "thread_switches": tuner.switches,
        "target_sha256": zoo_chat.SHA256,
    }


def load_teacher_set(recipe: DataRecipe, seconds: float, threads: int) -> dict:
    """The cached teacher data of ``recipe``, generated first (within ``seconds``) when
    not cached."""
    data_file = teacher_file(recipe)
    if os.path.isfile(data_file):
        log(f"teacher data {data_file}")
        return torch.load(data_file, weights_only=True)
    log(f"no cached teacher data at {data_file}: generating it")
    data = make_data(zoo_chat.fetch_target(), recipe, time.monotonic() + seconds, threads)
    os.makedirs(cache_dir(), exist_ok=True)
    torch.save(data, data_file + ".part")
    os.replace(data_file + ".part", data_file)
    return data


def teacher_file(recipe: DataRecipe) -> str:
    key = hashlib.sha1(json.dumps([asdict(recipe), zoo_chat.SHA256]).encode()).hexdigest()[:12]
    return os.path.join(cache_dir(), f"teacher-{key}.pt")
