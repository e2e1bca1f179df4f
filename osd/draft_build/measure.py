"""``osd draft build --measure`` and ``--shapes``: the chat draft's cost and speed next to
plain decoding (side by side), and the cost of candidate draft shapes."""

from __future__ import annotations

import json
import statistics
import time

import torch

import osd
from osd.chat_template import apply_chat_template
from osd.draft_build.cli import command_line
from osd.draft_build.common import log, progress_bar
from osd.draft_build.prompts import eval_prompts
from osd.draft_build.recipe import DRAFT
from osd.models.config import ModelConfig
from osd.models.llama import DecoderLM
from osd.models.loading import load_tokenizer
from osd.zoo import chat as zoo_chat


def _forward_costs(target, draft, prompt: list[int], reps: int) -> dict:
    """Single one-token decode forwards of both models after ``prompt``, interleaved:
    best and median seconds of each, and the verify forward of 5 tokens."""
    caches = {}
    ids = torch.tensor([prompt])
    models = {"target": target, "draft": draft}
    with torch.inference_mode():
        for name, m in models.items():
            c = m.new_cache(1, len(prompt) + 8)
            m(ids, c)
            c.commit(torch.tensor([len(prompt)], dtype=torch.int32), len(prompt))
            caches[name] = c
        step, chain = ids[:, -1:], ids[:, -5:]
        calls = {
            "target": lambda: target(step, caches["target"]),
            "draft": lambda: draft(step, caches["draft"]),
            "verify5": lambda: target(chain, caches["target"]),
        }
        times = {n: [] for n in calls}
        for _ in range(reps):
            for n, call in calls.items():
                t = time.perf_counter()
                call()
                times[n].append(time.perf_counter() - t)
    out = {}
    for n, ts in times.items():
        out[n] = {
            "best_ms": round(min(ts) * 1e3, 3),
            "median_ms": round(statistics.median(ts) * 1e3, 3),
        }
    out["c_best"] = round(min(times["draft"]) / min(times["target"]), 4)
    out["c_median"] = round(
        statistics.median(times["draft"]) / statistics.median(times["target"]), 4
    )
    return out


# Draft shapes timed by --shapes: (layers, hidden, heads, KV heads, MLP width).
SHAPES = [
    (1, 256, 4, 2, 704),
    (2, 256, 4, 2, 704),
    (4, 256, 4, 2, 704),
    (6, 256, 4, 2, 704),
    (2, 192, 3, 1, 512),
    (2, 320, 5, 1, 864),
    (2, 576, 9, 3, 1536),
]


def time_shapes(args) -> int:
    """Single one-token decode forwards (osd, fp32, batch 1, after a 64-token prompt) of
    randomly initialised drafts of each shape in :data:`SHAPES`, interleaved with the
    target's: best and median ms, and c = draft / target."""
    target = osd.load_model(zoo_chat.fetch_target())
    models = {"target": target}
    for layers, hidden, heads, kv, mlp in SHAPES:
        cfg = ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=target.vocab_size,
            hidden_size=hidden,
            intermediate_size=mlp,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=64,
            rope_theta=DRAFT.rope_theta,
            tie_word_embeddings=True,
        )
        model = DecoderLM(cfg)
        model.init_weights(generator=torch.Generator().manual_seed(0))
        models[f"{layers} x {hidden}, {heads}/{kv} heads, MLP {mlp}"] = model
    prompt = torch.randint(
        0, target.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)
    )
    caches, times = {}, {n: [] for n in models}
    with torch.inference_mode():
        for n, m in models.items():
            caches[n] = m.new_cache(1, 72)
            m(prompt, caches[n])
            caches[n].commit(torch.tensor([64], dtype=torch.int32), 64)
        step = prompt[:, -1:]
        for _ in range(args.cost_reps):
            for n, m in models.items():
                t = time.perf_counter()
                m(step, caches[n])  # lens unchanged: every repetition decodes position 64
                times[n].append(time.perf_counter() - t)
    best_t, med_t = min(times["target"]), statistics.median(times["target"])
    print(
        f"threads {torch.get_num_threads()}, best and median of {args.cost_reps} interleaved "
        f"forwards"
    )
    print("| model | params | best ms | tokens/s (best) | c (best) | median ms | c (median) |")
    print("|---|---|---|---|---|---|---|")
    for n, ts in times.items():
        params = sum(p.numel() for p in models[n].parameters()) / 1e6
        print(
            f"| {n} | {params:.1f}M | {min(ts) * 1e3:.2f} | {1 / min(ts):.0f} | "
            f"{min(ts) / best_t:.3f} | {statistics.median(ts) * 1e3:.2f} | "
            f"{statistics.median(ts) / med_t:.3f} |"
        )
    return 0


def measure(args) -> int:
    """Plain vs speculative decoding with the draft at ``args.out`` on the eval prompts."""
    target_path = zoo_chat.fetch_target()
    target = osd.load_model(target_path)
    draft = osd.load_model(args.out)
    tokenizer = load_tokenizer(target_path)
    texts = eval_prompts()[: args.eval_prompts]
    prompts = apply_chat_template(tokenizer, [[{"role": "user", "content": t}] for t in texts])
    params = osd.SamplingParams(max_new_tokens=args.new_tokens)
    seq = max(map(len, prompts)) + args.new_tokens + 16
    configs = {"plain": None}
    for k in args.ks:
        configs[f"spec k={k}"] = osd.SpecConfig(num_draft_tokens=k)
    for k in args.lookup_ks:
        configs[f"spec k={k} + lookup"] = osd.SpecConfig(num_draft_tokens=k, prompt_lookup=True)
    engines = {
        name: osd.Engine(
            target,
            draft=None if spec is None else draft,
            tokenizer=tokenizer,
            max_batch_size=1,
            max_seq_len=seq,
            spec=spec,
        )
        for name, spec in configs.items()
    }
    # The draft decoding on its own (plain): its tokens/s against the target's gives c too.
    engines["draft alone"] = osd.Engine(
        draft, tokenizer=tokenizer, max_batch_size=1, max_seq_len=seq
    )
    names = list(engines)
    costs = _forward_costs(target, draft, prompts[0], reps=args.cost_reps)
    log(f"forward costs: {json.dumps(costs)}")
    # Warm-up: one short generation each.
    for e in engines.values():
        e.generate([prompts[0]], osd.SamplingParams(max_new_tokens=8))
        e.reset_stats()
    secs = {n: 0.0 for n in names}
    toks = {n: 0 for n in names}
    per_prompt = []
    plain_out = {}
    mismatches = 0
    bar = progress_bar(len(prompts) * len(names), "measure", "run")
    for i, p in enumerate(prompts):
        order = names[i % len(names) :] + names[: i % len(names)]  # rotate the order
        row = {}
        for n in order:
            t = time.perf_counter()
            out = engines[n].generate([p], params)[0]
            dt = time.perf_counter() - t
            secs[n] += dt
            toks[n] += len(out.token_ids)
            row[n] = {"tokens": len(out.token_ids), "s": round(dt, 3)}
            if n == "plain":
                plain_out[i] = out.token_ids
            elif n != "draft alone":
                row[n]["ids"] = out.token_ids
            if bar is not None:
                bar.update(1)
        for n in names:
            if "ids" in row[n]:
                mismatches += row[n].pop("ids") != plain_out[i]
        per_prompt.append(row)
    if bar is not None:
        bar.close()
    results = {}
    for n in names:
        st = engines[n].stats
        r = {
            "tokens": toks[n],
            "seconds": round(secs[n], 2),
            "tokens_per_s": round(toks[n] / secs[n], 2),
            "vs_plain": round((toks[n] / secs[n]) / (toks["plain"] / secs["plain"]), 3),
        }
        if n not in ("plain", "draft alone"):
            r.update(
                acceptance=round(st["acceptance_rate"], 4)
                if st.get("acceptance_rate") is not None
                else None,
                tau=round(st["mean_accepted_length"], 3),
                lookup_steps=st.get("lookup_steps"),
                target_forwards=st.get("target_forwards"),
                position_acceptance=[
                    None if x is None else round(x, 3) for x in st.get("position_acceptance") or []
                ],
                time_s={k: round(v, 2) for k, v in st["time_s"].items()},
            )
        results[n] = r
    report = {
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
        "costs": costs,
        "results": results,
        "outputs_differ_from_plain": mismatches,
        "per_prompt": per_prompt,
        "command": command_line(args),
    }
    print("| decoding | tokens/s | vs plain | greedy acceptance | tau |")
    print("|---|---|---|---|---|")
    for n, r in results.items():
        print(
            f"| {n} | {r['tokens_per_s']:.1f} | {r['vs_plain']:.2f}x | "
            f"{r.get('acceptance', '-')} | {r.get('tau', '-')} |"
        )
    c_e2e = results["plain"]["tokens_per_s"] / results["draft alone"]["tokens_per_s"]
    report["c_end_to_end"] = round(c_e2e, 4)
    print(f"c (plain target tokens/s over draft-alone tokens/s) = {c_e2e:.4f}")
    print(
        f"c (best of {args.cost_reps}) = {costs['c_best']}, c (median) = {costs['c_median']}; "
        f"target {costs['target']['best_ms']} ms, draft {costs['draft']['best_ms']} ms, "
        f"5-token verify {costs['verify5']['best_ms']} ms (best)"
    )
    print(f"speculative outputs differing from plain greedy: {mismatches}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0
