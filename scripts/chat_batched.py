"""Batched speculative decoding on the chat pair: prompt lookup per row, side by side.

CPU, fp32, greedy, HumanEval chat prompts (seed 11) served in batches of each ``--batch``
size; every mode serves the same batches in turn (plain first) and the second of two
rounds is timed; every output is asserted equal to plain greedy decoding.

Modes: plain; the EAGLE draft in Q8_0 with prompt lookup on 2+-token matches in front,
k = 4. In a batch, the rows whose context has a lookup match verify their lookup
continuation while the draft model drafts the others (``osd.prompt_lookup.LookupDrafter``);
``--whole-batch`` also runs the same engine with lookup used only in steps where every
row has a match (the draft model drafts every row otherwise). ``--defaults`` also serves
each shipped draft with the settings its ``serving.json`` recommends (what
``Engine.from_pretrained(target, draft=...)`` and ``osd serve`` use without spec flags).

    .venv/bin/python scripts/chat_batched.py --batch 4 8 --prompts 16 --whole-batch
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch

import osd
from osd import prompt_lookup, zoo
from osd.chat import apply_chat_template
from osd.zoo import humaneval


@contextlib.contextmanager
def whole_batch_lookup():
    """Lookup drafts only when every row of the step has a match."""
    overlay = prompt_lookup.overlay_lookup
    prompt_lookup.overlay_lookup = lambda prop, conts: prop
    try:
        yield
    finally:
        prompt_lookup.overlay_lookup = overlay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=11, help="which HumanEval prompts")
    parser.add_argument("--whole-batch", action="store_true",
                        help="also run lookup only in steps where every row matches")
    parser.add_argument("--defaults", action="store_true",
                        help="also serve each shipped draft as Engine.from_pretrained(target, "
                        "draft=...) does without spec= (its serving.json settings)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = zoo.chat_pair()
    top = max(args.batch)
    plain = osd.Engine.from_pretrained(target, max_batch_size=top, max_seq_len=1024)
    eagle = osd.models.quantize_linears(osd.load_eagle(zoo.chat_eagle(), plain.model), "Q8_0")
    spec = osd.Engine(plain.model, draft=[eagle], max_batch_size=top, max_seq_len=1024,
                      spec=osd.SpecConfig(num_draft_tokens=4, prompt_lookup=True, ngram_min=2))
    modes = {"plain": (plain, False), "EAGLE Q8_0, lookup n>=2 per row": (spec, False)}
    if args.whole_batch:
        modes["EAGLE Q8_0, lookup n>=2 when every row matches"] = (spec, True)
    if args.defaults:
        for name, path in (("standalone", zoo.chat_pair()[1]), ("EAGLE", zoo.chat_eagle())):
            engine = osd.Engine.from_pretrained(target, draft=path, max_batch_size=top,
                                                max_seq_len=1024)
            modes[f"{name} draft, serving.json defaults"] = (engine, False)
    prompts = apply_chat_template(plain.tokenizer,
                                  humaneval.conversations(args.prompts, seed=args.seed))
    params = osd.SamplingParams(max_new_tokens=args.new_tokens)
    rows = []
    for B in args.batch:
        seconds = dict.fromkeys(modes, 0.0)
        tokens = dict.fromkeys(modes, 0)
        seq_steps = dict.fromkeys(modes, 0)
        for rnd in range(2):
            for i in range(0, len(prompts) - B + 1, B):
                batch = prompts[i:i + B]
                ref = None
                for name, (engine, whole) in modes.items():
                    with whole_batch_lookup() if whole else contextlib.nullcontext():
                        t0 = time.perf_counter()
                        outs = engine.generate(batch, params)
                        dt = time.perf_counter() - t0
                    ids = [o.token_ids for o in outs]
                    ref = ids if ref is None else ref
                    assert ids == ref, f"{name} differs from plain greedy (batch {B}, at {i})"
                    if rnd == 1:
                        seconds[name] += dt
                        tokens[name] += sum(map(len, ids))
                        seq_steps[name] += sum(
                            (o.stats or {}).get("sequence_steps") or len(o.token_ids)
                            for o in outs)
            print(f"batch {B}: round {rnd + 1} done", flush=True)
        for name in modes:
            rows.append((B, name, tokens[name] / seconds[name],
                         seconds["plain"] / seconds[name] * tokens[name] / tokens["plain"],
                         tokens[name] / seq_steps[name]))
    print("| batch | decoding | tokens/s | vs plain | tokens per row per target forward |")
    print("|---|---|---|---|---|")
    for B, name, tps, ratio, tau in rows:
        print(f"| {B} | {name} | {tps:.1f} | {ratio:.2f}x | {tau:.2f} |")


if __name__ == "__main__":
    main()
