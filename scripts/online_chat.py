"""How much the chat pair's draft learns online on the HumanEval chat stream, per setting.

Serves the demo's stream (``osd.zoo.humaneval.conversations(200, seed=0)``: the 164 tasks,
then repeats with another wording), greedy, batch 1, k = 4, prompt lookup in front of the
draft, 48 new tokens, and prints α (the engine's exact 1 - TV over the draft model's
positions) per 10 requests. ``--static`` serves requests ``--first`` .. ``-n`` with the
shipped draft frozen (the comparison); otherwise the draft learns with the demo's recipe
(``osd.demo.online_recipe("chat")``) updated by ``--set`` (JSON). The learner runs inline
(``background=False``: every update finishes before the next request), so the result
measures what the recipe learns from the stream, not how much CPU time the learner gets
beside serving; ``--background`` measures that instead. Timing is not the point here.
``--eagle`` serves the EAGLE draft (``osd.zoo.chat_eagle()``) instead.

    .venv/bin/python scripts/online_chat.py --static --first 150 --json /tmp/static.json
    .venv/bin/python scripts/online_chat.py --json /tmp/online.json
    .venv/bin/python scripts/online_chat.py --set '{"lr": 1e-3}' --json /tmp/lr.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
from tqdm.auto import tqdm

import osd
from osd import zoo
from osd.chat import apply_chat_template
from osd.demo import online_recipe
from osd.models.loading import load_tokenizer
from osd.zoo import humaneval


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=200, help="requests in the stream")
    ap.add_argument("--first", type=int, default=0, help="first request served")
    ap.add_argument("--static", action="store_true", help="the shipped draft, frozen")
    ap.add_argument("--set", default="{}", help="OnlineConfig fields over the recipe (JSON)")
    ap.add_argument("--background", action="store_true", help="learner beside serving")
    ap.add_argument("--eagle", action="store_true",
                    help="the EAGLE draft (osd.zoo.chat_eagle) instead of the standalone one")
    ap.add_argument("--tail", type=int, default=50, help="compare α over the last n requests")
    ap.add_argument("--json", help="write the per-request records here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target, draft = zoo.chat_pair()
    if args.eagle:
        draft = zoo.chat_eagle()
    prompts = apply_chat_template(load_tokenizer(target),
                                  humaneval.conversations(args.n, seed=0))
    online = None
    if not args.static:
        online = dataclasses.replace(online_recipe("chat"), background=args.background,
                                     **json.loads(args.set))
    eng = osd.Engine.from_pretrained(
        target, draft=draft, spec=osd.SpecConfig(num_draft_tokens=4, prompt_lookup=True),
        online=online, max_batch_size=1, max_seq_len=max(map(len, prompts)) + 56,
        quantize_draft=None)
    params = osd.SamplingParams(48)
    records, t0 = [], time.perf_counter()
    bar = tqdm(range(args.first, args.n), desc="static" if args.static else "online")
    for i in bar:
        out = eng.generate([prompts[i]], params)[0]
        records.append({"request": i, "alpha": (out.stats or {}).get("alpha")})
        if (i + 1) % 10 == 0:
            window = [r["alpha"] for r in records[-10:] if r["alpha"] is not None]
            bar.write(f"{i + 1:4d}  α over the last 10: {sum(window) / len(window):.3f}  "
                      f"({time.perf_counter() - t0:.0f} s)")
    result = {"static": args.static, "records": records,
              "config": dataclasses.asdict(online) if online else None}
    if online:
        eng.online.wait()
        hist = eng.stats["online"]
        result.update(updates_applied=hist["updates_applied"],
                      updates_rejected=hist["updates_rejected"])
    tail = [r["alpha"] for r in records if r["request"] >= args.n - args.tail
            and r["alpha"] is not None]
    result["alpha_tail"] = sum(tail) / len(tail) if tail else None
    print(f"α over requests {args.n - args.tail}..{args.n - 1}: {result['alpha_tail']:.3f}"
          + (f"; updates applied {result['updates_applied']}, rejected "
             f"{result['updates_rejected']}" if online else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    eng.close()
    return result


if __name__ == "__main__":
    main()
