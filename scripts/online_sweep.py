"""How much the online draft learns on the built-in pair, per learner setting.

Each setting serves the same code stream (``--queries`` prompts of seed 7, 48 tokens,
48 new tokens, greedy, batch 1, k = 4) with online distillation on (update every 4
requests, 8 AdamW steps at lr 5e-4, background learner unless ``--wait``), then freezes
the learned draft and measures α (the engine's exact 1 - TV) and τ on 32 unseen code
queries (seed 9), next to the static draft. Settings are ``POSITIONS:PROMPT[:wait]``:
the newest positions per update (``batch_positions``), the prompt positions distilled
(``prompt_positions``), and optionally ``wait_for_update=True``.

    .venv/bin/python scripts/online_sweep.py 4096:0 4096:256 2048:256 1024:256 4096:256:wait
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm.auto import tqdm

import osd
from osd import zoo

NEW_TOKENS = 48
PROMPT_TOKENS = 48
EVAL = 32


def evaluate(engine: osd.Engine) -> tuple[float, float]:
    """Mean α per query and tokens per verify step on the ``EVAL`` unseen queries."""
    stream = zoo.query_stream("code", n=EVAL, prompt_tokens=PROMPT_TOKENS, seed=9)
    engine.reset_stats()
    alphas = [engine.generate([p], osd.SamplingParams(NEW_TOKENS))[0].stats["alpha"]
              for p in stream]
    return sum(alphas) / len(alphas), engine.stats["mean_accepted_length"]


def run(setting: str, queries: int, target: str, draft: str) -> dict:
    positions, prompt, *rest = setting.split(":")
    cfg = osd.OnlineConfig(update_every_requests=4, steps_per_update=8, lr=5e-4, seed=0,
                           batch_positions=int(positions), prompt_positions=int(prompt),
                           wait_for_update=rest == ["wait"])
    spec = osd.SpecConfig(num_draft_tokens=4)
    max_len = PROMPT_TOKENS + NEW_TOKENS
    engine = osd.Engine.from_pretrained(target, draft=draft, spec=spec, max_batch_size=1,
                                        max_seq_len=max_len, online=cfg)
    stream = zoo.query_stream("code", n=queries, prompt_tokens=PROMPT_TOKENS, seed=7)
    start = time.perf_counter()
    for prompt_ids in tqdm(stream, desc=f"serving ({setting})", unit="query"):
        engine.generate([prompt_ids], osd.SamplingParams(NEW_TOKENS))
    engine.close()
    serve_s = time.perf_counter() - start
    history = engine.stats["online"]
    frozen = osd.Engine(engine.model, draft=engine.draft, spec=spec, max_batch_size=1,
                        max_seq_len=max_len)
    alpha, tau = evaluate(frozen)
    return dict(setting=setting, serve_s=serve_s, applied=history["updates_applied"],
                rejected=history["updates_rejected"], alpha=alpha, tau=tau)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("settings", nargs="+", help="POSITIONS:PROMPT[:wait]")
    parser.add_argument("--queries", type=int, default=200, help="served queries per setting")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft = zoo.default_pair()
    static = osd.Engine.from_pretrained(target, draft=draft,
                                        spec=osd.SpecConfig(num_draft_tokens=4),
                                        max_batch_size=1, max_seq_len=PROMPT_TOKENS + NEW_TOKENS)
    base_alpha, base_tau = evaluate(static)
    print(f"static draft: α {base_alpha:.3f}, τ {base_tau:.2f}", flush=True)
    rows = [run(s, args.queries, target, draft) for s in args.settings]
    print("| newest positions per update | prompt positions | serving waits | served in | "
          "updates applied (rejected) | online α | gain | τ |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        positions, prompt, *rest = r["setting"].split(":")
        print(f"| {positions} | {prompt} | {'yes' if rest else 'no'} | {r['serve_s']:.0f} s "
              f"| {r['applied']} ({r['rejected']}) | {r['alpha']:.3f} "
              f"| {r['alpha'] - base_alpha:+.3f} | {r['tau']:.2f} |")


if __name__ == "__main__":
    main()
