"""Verify cost on the chat target: one forward of T rows (a chain's causal block, or a tree
with its ancestor mask) over a cache of ``--context`` tokens, in one-row forwards; and the
prefill of a ``--context``-token prompt (logits at its last position only, as the engine
asks). Random token ids; best of ``--rounds`` rounds of 10 forwards (one prefill) each,
the shapes interleaved. The weights are packed as an engine packs them
(``DecoderLM.pack_weights``); ``--compare-pack`` times every shape from the packed and
the unpacked weights in turn within each round; ``--compare-isa`` times them with the
packed kernel's AVX-512 passes and with its AVX2 passes only (``OSD_NO_AVX512``) in turn.
``--attention`` also reports, per shape, the attention kernel's time per layer (the mean
self time of ``osd::tree_attention`` under the torch profiler, 10 forwards).

    .venv/bin/python scripts/verify_cost.py --threads 2
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import osd
from osd import zoo
from osd.tree import depths_from_parents, mask_from_parents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=300, help="cached tokens (300)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 5, 11, 16])
    parser.add_argument("--no-pack", action="store_true",
                        help="leave the weights unpacked (the engine packs them by default)")
    parser.add_argument("--compare-pack", action="store_true",
                        help="time each shape packed and unpacked, side by side")
    parser.add_argument("--compare-isa", action="store_true",
                        help="time each shape with and without the AVX-512 passes, side by side")
    parser.add_argument("--attention", action="store_true",
                        help="also time the attention kernel per layer in each shape")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = osd.load_model(zoo.chat_pair()[0])
    if not args.no_pack:
        model.pack_weights()
    packs = {m: m.osd_packed for m in model.modules() if hasattr(m, "osd_packed")}

    def use_packs(on: bool) -> None:
        for m, p in packs.items():
            if on:
                m.osd_packed = p
            elif hasattr(m, "osd_packed"):
                del m.osd_packed
    vocab = model.config.vocab_size
    cache = model.new_cache(1, args.context + max(args.rows) + 1)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model(torch.randint(0, vocab, (1, args.context), generator=gen), cache)
        cache.commit(torch.tensor([args.context], dtype=torch.int32), args.context)

        def forward(T: int, tree: bool):
            ids = torch.randint(0, vocab, (1, T), generator=gen)
            if not tree:
                return model(ids, cache)
            # a 3-ary tree in breadth-first order
            par = torch.tensor([[-1] + [(i - 1) // 3 for i in range(1, T)]], dtype=torch.int32)
            return model(ids, cache, tree_mask=mask_from_parents(par),
                         depths=depths_from_parents(par).long())

        prompt = torch.randint(0, vocab, (1, args.context), generator=gen)
        scratch = model.new_cache(1, args.context)

        def prefill():
            scratch.reset()
            model.prefill(prompt, scratch, torch.tensor([args.context], dtype=torch.int32),
                          logits_index=torch.tensor([[args.context - 1]]))

        shapes = [(T, False) for T in args.rows] + [(T, True) for T in args.rows if T > 1]
        if args.compare_isa:
            modes = ("AVX-512", "AVX2")
        else:
            modes = (True, False) if args.compare_pack else (not args.no_pack,)
        best = {(m, s): float("inf") for m in modes for s in shapes + ["prefill"]}
        for _ in range(args.rounds):
            for mode in modes:
                if args.compare_isa:
                    use_packs(not args.no_pack)
                    if mode == "AVX2":
                        os.environ["OSD_NO_AVX512"] = "1"
                    else:
                        os.environ.pop("OSD_NO_AVX512", None)
                else:
                    use_packs(mode)
                t0 = time.perf_counter()
                prefill()
                best[mode, "prefill"] = min(best[mode, "prefill"], time.perf_counter() - t0)
                for s in shapes:
                    t0 = time.perf_counter()
                    for _ in range(10):
                        forward(*s)
                    best[mode, s] = min(best[mode, s], (time.perf_counter() - t0) / 10)
        if args.attention:
            print(attention_table(shapes, forward, prefill, args.context))
    for mode in modes:
        one = best[mode, (1, False)] if (1, False) in shapes else min(
            t for (m, _), t in best.items() if m == mode)
        print(f"{mode} passes:" if args.compare_isa else
              f"weights {'packed' if mode else 'unpacked'}:")
        print("| rows | mask | ms per forward | one-row forwards |")
        print("|---|---|---|---|")
        for s in shapes + ["prefill"]:
            t = best[mode, s]
            name = f"prefill of {args.context} | causal" if s == "prefill" else \
                f"{s[0]} | {'tree' if s[1] else 'causal'}"
            print(f"| {name} | {1e3 * t:.1f} | {t / one:.2f} |")


def attention_table(shapes, forward, prefill, context: int) -> str:
    """The attention kernel's mean time per call (one per layer) in each shape, in µs."""
    from torch.profiler import ProfilerActivity, profile

    lines = ["| rows | mask | attention per layer (µs) |", "|---|---|---|"]
    for s in shapes + ["prefill"]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(1 if s == "prefill" else 10):
                prefill() if s == "prefill" else forward(*s)
        calls = [e for e in prof.key_averages() if e.key == "osd::tree_attention"]
        us = calls[0].self_cpu_time_total / calls[0].count if calls else float("nan")
        name = f"prefill of {context} | causal" if s == "prefill" else \
            f"{s[0]} | {'tree' if s[1] else 'causal'}"
        lines.append(f"| {name} | {us:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
