"""Sampled speculative decoding on the chat pair, side by side with plain sampling.

CPU, fp32, batch 1, HumanEval chat prompts (seed 11), sampled with ``--temperature``,
``--top-k`` and ``--top-p`` (one Philox seed per request, the same for every mode); each
prompt is served by every mode in turn (plain first) and the second of two rounds is
timed. Sampled outputs differ between modes (the same distribution, other draws), so
tokens/s is each mode's own tokens over its own time.

Modes: plain sampling; the EAGLE draft in Q8_0 behind prompt lookup on 2+-token matches
(``bench_chat.py``'s fastest greedy row); the standalone draft behind prompt lookup; both
with lookup trees (``SpecConfig.lookup_tree_below``), whose model branch is the draft's
greedy chain whatever the sampling.
``--sort-paths`` also runs each speculative mode with the top-p set taken from a sort of
the whole row and the draft's noise from the PyTorch Philox (the paths a CUDA tensor
takes; on the CPU the engine decides top-p from the largest probabilities and draws the
noise in C++, ``osd_kernels.warp`` and ``osd.drafters.sample_draft``): the same tokens,
at the cost those paths have here.

    .venv/bin/python scripts/chat_sampled.py --prompts 4 --new-tokens 128 --sort-paths
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch

import osd
from osd import drafters, zoo
from osd.chat import apply_chat_template
from osd.zoo import humaneval
from osd_kernels import warp


@contextlib.contextmanager
def sort_paths():
    """Top-p from the full sort and the PyTorch Philox for the draft's noise."""
    candidates, native = warp.TOP_P_CANDIDATES, drafters.native_available
    warp.TOP_P_CANDIDATES, drafters.native_available = (), lambda: False
    try:
        yield
    finally:
        warp.TOP_P_CANDIDATES, drafters.native_available = candidates, native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=11, help="which HumanEval prompts")
    parser.add_argument("--sort-paths", action="store_true",
                        help="also run each speculative mode on the sort-based paths")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft = zoo.chat_pair()
    plain = osd.Engine.from_pretrained(target, max_batch_size=1, max_seq_len=1024)
    eagle = osd.models.quantize_linears(osd.load_eagle(zoo.chat_eagle(), plain.model), "Q8_0")
    specs = {
        "EAGLE Q8_0, lookup n>=2, k=4": (eagle, osd.SpecConfig(
            num_draft_tokens=4, prompt_lookup=True, ngram_min=2)),
        "standalone draft, lookup, k=4": (osd.load_model(draft), osd.SpecConfig(
            num_draft_tokens=4, prompt_lookup=True)),
        # lookup trees: the model's branch is its greedy chain (point masses) when sampling
        "EAGLE Q8_0, lookup trees, k=4": (eagle, osd.SpecConfig(
            num_draft_tokens=4, prompt_lookup=True, lookup_tokens=8, lookup_tree_below=3)),
        "standalone draft, lookup trees, k=3": (osd.load_model(draft), osd.SpecConfig(
            num_draft_tokens=3, prompt_lookup=True, lookup_tokens=8, lookup_tree_below=3)),
    }
    modes = {"plain": (plain, False)}
    for name, (model, spec) in specs.items():
        engine = osd.Engine(plain.model, draft=[model], spec=spec, max_batch_size=1,
                            max_seq_len=1024)
        modes[name] = (engine, False)
        if args.sort_paths:
            modes[f"{name}, sort paths"] = (engine, True)
    prompts = apply_chat_template(plain.tokenizer,
                                  humaneval.conversations(args.prompts, seed=args.seed))
    seconds = dict.fromkeys(modes, 0.0)
    tokens = dict.fromkeys(modes, 0)
    steps = dict.fromkeys(modes, 0)
    for rnd in range(2):
        for i, prompt in enumerate(prompts):
            params = osd.SamplingParams(max_new_tokens=args.new_tokens,
                                        temperature=args.temperature, top_k=args.top_k,
                                        top_p=args.top_p, seed=1000 * rnd + i)
            for name, (engine, slow) in modes.items():
                with sort_paths() if slow else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    out = engine.generate([prompt], params)[0]
                    dt = time.perf_counter() - t0
                if rnd == 1:
                    seconds[name] += dt
                    tokens[name] += len(out.token_ids)
                    steps[name] += (out.stats or {}).get("sequence_steps") or len(out.token_ids)
            print(f"round {rnd + 1}, prompt {i + 1}/{len(prompts)} done", flush=True)
    print(f"| decoding (T = {args.temperature}, top-k {args.top_k}, top-p {args.top_p}) | "
          "tokens/s | vs plain | tokens per target forward |")
    print("|---|---|---|---|")
    base = tokens["plain"] / seconds["plain"]
    for name in modes:
        tps = tokens[name] / seconds[name]
        print(f"| {name} | {tps:.1f} | {tps / base:.2f}x | {tokens[name] / steps[name]:.2f} |")


if __name__ == "__main__":
    main()
