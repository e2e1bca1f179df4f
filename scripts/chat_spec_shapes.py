"""Draft shapes on the chat pair, side by side: chains, static and dynamic trees, with and
without prompt lookup in front, with the draft's reduced head vocabulary and with its
full head, against plain decoding.

CPU, fp32, greedy, batch 1, HumanEval chat prompts (seed 11), each prompt served by every
mode in turn (plain first); the second of two rounds is timed. Every speculative output
is asserted equal to plain greedy decoding.

    .venv/bin/python scripts/chat_spec_shapes.py --prompts 4 --new-tokens 128 --threads 2

``--head-sizes N ...`` also runs the first shape with heads of the N most frequent tokens
(``build_chat_draft.head_vocab``, the recipe of the shipped ``head_vocab.json``).
``--eagle-ks K ...`` also runs the EAGLE draft (``osd/zoo/weights/chat_eagle``, or each
of ``--eagle DIR ...`` side by side) in chains of each K, without prompt lookup and with
lookup in front for each shortest match of ``--eagle-ngram-mins`` (default 1, as
``SpecConfig``); ``--eagle-trees NAME ...`` adds those rows with the draft model's chain
replaced by one of ``EAGLE_TREES`` (lookup chains stay of length K); ``--lookup-tokens N
...`` runs the rows with lookup at each ``SpecConfig.lookup_tokens``. ``--seed`` picks
other prompts. ``--quantize-draft Q8_0`` serves the standalone draft's shapes in Q8_0, as
``osd demo`` does; the lookup-tree shapes are ``SpecConfig.lookup_tree_below``'s:

    .venv/bin/python scripts/chat_spec_shapes.py --prompts 16 --new-tokens 48 --threads 1 \
        --quantize-draft Q8_0 --seed 0 --shapes "chain k=4, lookup 8" "chain k=3, lookup 8" \
        "lookup tree k=3, below 3" "lookup tree k=4, below 3" "lookup tree k=3, below 2" \
        "lookup tree k=3, below 4"
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import osd
from osd import zoo
from osd.chat import apply_chat_template
from osd.zoo import chat as zoo_chat
from osd.zoo import humaneval

STATIC = [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)]
DYNAMIC = osd.DynamicTree(topk=3, depth=4, max_nodes=10)
SHAPES = {
    "chain k=4, lookup": dict(num_draft_tokens=4, prompt_lookup=True),
    "chain k=4": dict(num_draft_tokens=4),
    "chain k<=6 adaptive, lookup": dict(num_draft_tokens=6, prompt_lookup=True, adaptive=True),
    "chain k<=6 auto, lookup": dict(num_draft_tokens=6, prompt_lookup=True, auto_k=True),
    "dynamic tree 3x4, 10 nodes": dict(tree=DYNAMIC),
    "static tree, 8 nodes": dict(tree=STATIC),
    "static tree, 8 nodes, lookup": dict(num_draft_tokens=4, prompt_lookup=True, tree=STATIC),
    "dynamic tree, lookup": dict(num_draft_tokens=4, prompt_lookup=True, tree=DYNAMIC),
    # lookup steps of up to 8 drafts; lookup trees (SpecConfig.lookup_tree_below)
    "chain k=4, lookup 8": dict(num_draft_tokens=4, prompt_lookup=True, lookup_tokens=8),
    "chain k=3, lookup 8": dict(num_draft_tokens=3, prompt_lookup=True, lookup_tokens=8),
    "lookup tree k=3, below 3": dict(num_draft_tokens=3, prompt_lookup=True, lookup_tokens=8,
                                     lookup_tree_below=3),
    "lookup tree k=4, below 3": dict(num_draft_tokens=4, prompt_lookup=True, lookup_tokens=8,
                                     lookup_tree_below=3),
    "lookup tree k=3, below 2": dict(num_draft_tokens=3, prompt_lookup=True, lookup_tokens=8,
                                     lookup_tree_below=2),
    "lookup tree k=3, below 4": dict(num_draft_tokens=3, prompt_lookup=True, lookup_tokens=8,
                                     lookup_tree_below=4),
}
# Trees for the EAGLE draft: ones that fit the packed decode kernel's six-row AVX2 pass (at
# most five drafts), and larger ones for its 12-row AVX-512 pass.
EAGLE_TREES = {
    "tree 3+2": [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)],
    "tree 4+1": [(0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0)],
    "tree 9": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)],
    "dynamic 2x4, 5 nodes": osd.DynamicTree(topk=2, depth=4, max_nodes=5),
    "dynamic 2x4, 8 nodes": osd.DynamicTree(topk=2, depth=4, max_nodes=8),
    "dynamic 3x5, 11 nodes": osd.DynamicTree(topk=3, depth=5, max_nodes=11),
}
# Shapes also run with the draft's full 49,152-row head (head_vocab.json ignored).
FULL_HEAD = {"chain k=4, lookup", "chain k=4"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES),
                        help="which shapes (default: all)")
    parser.add_argument("--head-sizes", type=int, nargs="*", default=[],
                        help="head vocabulary sizes to run the first shape with as well")
    parser.add_argument("--eagle-ks", type=int, nargs="*", default=[],
                        help="chain lengths to run the EAGLE draft with (none by default)")
    parser.add_argument("--eagle-ngram-mins", type=int, nargs="*", default=[1],
                        help="shortest prompt-lookup matches to run the EAGLE chains with")
    parser.add_argument("--lookup-tokens", type=int, nargs="*", default=[0],
                        help="SpecConfig.lookup_tokens of the EAGLE rows with lookup, each "
                        "side by side (0: k)")
    parser.add_argument("--eagle-trees", nargs="*", default=[], choices=list(EAGLE_TREES),
                        help="also run the EAGLE rows with these trees in place of the chain")
    parser.add_argument("--seed", type=int, default=11, help="which HumanEval prompts")
    parser.add_argument("--eagle", nargs="+", default=[zoo_chat.EAGLE_DIR],
                        help="EAGLE draft directories (default the shipped one)")
    parser.add_argument("--quantized", action="store_true",
                        help="the target keeps its GGUF weights quantized (osd.models.quant) "
                             "in every mode; a plain row with float32 weights is added")
    parser.add_argument("--quantize-draft", default=None, choices=["Q8_0", "Q4_1"],
                        help="serve the standalone draft's shapes in this block format")
    parser.add_argument("--quantize-eagle", default=None, choices=["Q8_0", "Q4_1"],
                        help="also run each EAGLE shape with the draft's own layers quantized")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft = zoo.chat_pair()
    plain = osd.Engine.from_pretrained(target, max_batch_size=1, max_seq_len=1024,
                                       quantized=args.quantized)
    prompts = apply_chat_template(plain.tokenizer,
                                  humaneval.conversations(args.prompts, seed=args.seed))
    engines = {}
    if args.quantized:
        engines["plain, float32 weights"] = osd.Engine.from_pretrained(
            target, max_batch_size=1, max_seq_len=1024)
    for name in args.shapes:
        engines[name] = osd.Engine(plain.model, draft=[osd.load_model(draft)],
                                   spec=osd.SpecConfig(**SHAPES[name]), max_batch_size=1,
                                   max_seq_len=1024, quantize_draft=args.quantize_draft)
        if name in FULL_HEAD:
            full = osd.load_model(draft, head_vocab=False)
            engines[name + ", full head"] = osd.Engine(
                plain.model, draft=[full], spec=osd.SpecConfig(**SHAPES[name]),
                max_batch_size=1, max_seq_len=1024)
    for size in args.head_sizes:
        from build_chat_draft import head_vocab

        name = args.shapes[0]
        model = osd.load_model(draft, head_vocab=False).restrict_head(
            head_vocab(plain.tokenizer, size))
        engines[f"{name}, head {size}"] = osd.Engine(
            plain.model, draft=[model], spec=osd.SpecConfig(**SHAPES[name]),
            max_batch_size=1, max_seq_len=1024)
    for path in args.eagle if args.eagle_ks else []:
        eagle = osd.load_eagle(path, plain.model)
        label = "EAGLE" if len(args.eagle) == 1 else f"EAGLE {os.path.basename(path)}"
        for k in args.eagle_ks:
            for n in [0] + args.eagle_ngram_mins:
                name = f"{label} chain k={k}" + ("" if n == 0 else ", lookup" if n == 1
                                                 else f", lookup n>={n}")
                for tree, lt in [(t, lt) for t in [None, *args.eagle_trees]
                                 for lt in (args.lookup_tokens if n else [0])]:
                    row = (name if tree is None else f"{name}, {tree}") + \
                        (f", lookup_tokens {lt}" if lt else "")
                    spec = osd.SpecConfig(num_draft_tokens=k, prompt_lookup=n > 0,
                                          ngram_min=max(n, 1), ngram_max=max(n, 3),
                                          lookup_tokens=lt,
                                          tree=None if tree is None else EAGLE_TREES[tree])
                    engines[row] = osd.Engine(plain.model, draft=[eagle], max_batch_size=1,
                                              max_seq_len=1024, spec=spec)
                    if args.quantize_eagle:
                        small = osd.models.quantize_linears(osd.load_eagle(path, plain.model),
                                                            args.quantize_eagle)
                        engines[f"{row}, draft {args.quantize_eagle}"] = osd.Engine(
                            plain.model, draft=[small], max_batch_size=1, max_seq_len=1024,
                            spec=spec)
    params = osd.SamplingParams(max_new_tokens=args.new_tokens)
    seconds = dict.fromkeys(["plain", *engines], 0.0)
    tokens = dict.fromkeys(seconds, 0)
    plain_ids = []  # every token plain greedy decoding emitted (timed round)
    for rnd in range(2):
        for i, prompt in enumerate(prompts):
            ref = None
            for name in seconds:
                eng = plain if name == "plain" else engines[name]
                t0 = time.perf_counter()
                out = eng.generate([prompt], params)[0]
                dt = time.perf_counter() - t0
                ref = out.token_ids if ref is None else ref
                assert out.token_ids == ref, f"{name} differs from plain greedy on prompt {i}"
                if rnd == 1:
                    seconds[name] += dt
                    tokens[name] += len(out.token_ids)
                    if name == "plain":
                        plain_ids += out.token_ids
            print(f"round {rnd + 1}, prompt {i + 1}/{len(prompts)} done", flush=True)
    print("| decoding | tokens/s | vs plain | tokens per target forward | draft head: rows, "
          "share of plain's tokens in it |")
    print("|---|---|---|---|---|")
    emitted = torch.tensor(plain_ids)
    for name in seconds:
        drafted = name != "plain" and engines[name].draft is not None
        tau = f"{engines[name].stats['mean_accepted_length']:.2f}" if drafted else "1"
        head = head_coverage(engines[name].draft, emitted) if drafted else "-"
        print(f"| {name} | {tokens[name] / seconds[name]:.1f} | "
              f"{seconds['plain'] / seconds[name]:.2f}x | {tau} | {head} |")


def head_coverage(draft: osd.DecoderLM, emitted: torch.Tensor) -> str:
    """The draft's head rows and the share of ``emitted`` token ids it can propose."""
    if draft.head_ids is None:
        return f"{draft.head_vocab_size}, 100%"
    share = torch.isin(emitted, draft.head_ids.cpu()).float().mean()
    return f"{draft.head_vocab_size}, {100 * float(share):.1f}%"


if __name__ == "__main__":
    main()
