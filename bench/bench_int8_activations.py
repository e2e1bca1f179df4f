"""The chat target's int8 activations (``quantized="int8"``, the CPU default on VNNI CPUs)
against its float32 activations (``quantized=True``: the dequantized model's logits bit
for bit), on the same Q4_1 / Q8_0 weights, 2 threads.

Speed: one cached forward of ``rows`` new tokens (1: a decode step; 3, 5: the verify of a
chain of 2 or 4 drafts; 8, 12: trees) at ``--context`` cached positions, output head
included, the two models alternating, best of ``--rounds``; the ratio of each to its own
1-row forward is what a verify costs in decode steps.

Accuracy, per workload of the evaluation set (``--prompts`` each): the float32-activation
model's greedy answer (``--tokens``), then both models teacher-forced over the prompt and
that answer in cached forwards of up to 16 tokens (the decode path): the share of answer
positions where the two argmaxes agree, the largest logit difference over the logits'
standard deviation, and how many tokens the int8 model's own greedy answer shares with
the float32 one before they part.

    .venv/bin/python bench/bench_int8_activations.py [--prompts 3] [--target F.gguf]
"""

import osd  # first: osd sets the OpenMP wait policy before torch loads libgomp

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import osd_kernels  # noqa: E402

from osd.chat_template import apply_chat_template  # noqa: E402
from osd.zoo.workloads import evaluation_set  # noqa: E402

ROWS = (1, 2, 3, 5, 8, 12)


def forward_times(models: dict, context: int, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=gen)
    caches = {}
    with torch.inference_mode():
        for name, m in models.items():
            cache = m.new_cache(1, context + max(ROWS) + 1)
            m.prefill(prompt, cache, torch.tensor([context], dtype=torch.int32), chunk=256)
            caches[name] = cache
        best: dict = {}
        for _ in range(rounds):
            for rows in ROWS:
                ids = torch.randint(0, vocab, (1, rows), generator=gen)
                for name, m in models.items():
                    m(ids, caches[name])
                    start = time.perf_counter()
                    for _ in range(10):
                        m(ids, caches[name])
                    us = (time.perf_counter() - start) / 10 * 1e6
                    best[name, rows] = min(best.get((name, rows), float("inf")), us)
    return {f"{name}/{rows}": round(v, 1) for (name, rows), v in best.items()}


def teacher_forced(model, ids: list[int], start: int) -> torch.Tensor:
    """Logits after each of ``ids[start - 1:-1]`` (predicting ``ids[start:]``), from
    cached forwards of at most 16 tokens after a prefill of ``ids[:start - 1]``."""
    cache = model.new_cache(1, len(ids) + 1)
    out = []
    with torch.inference_mode():
        model.prefill(
            torch.tensor([ids[: start - 1]]), cache, torch.tensor([start - 1], dtype=torch.int32)
        )
        pos = start - 1
        while pos < len(ids) - 1:
            piece = ids[pos : min(pos + 16, len(ids) - 1)]
            out.append(model(torch.tensor([piece]), cache)[0])
            cache.commit(torch.tensor([len(piece)], dtype=torch.int32), len(piece))
            pos += len(piece)
    return torch.cat(out)


def run(args) -> dict:
    """The two tables (module docstring) for ``args`` (``main``'s options); prints them."""
    torch.set_num_threads(2)
    target = getattr(args, "target", None) or osd.zoo.chat.fetch_target()
    engines = {
        name: osd.Engine.from_pretrained(target, quantized=mode, max_batch_size=1)
        for name, mode in (("float32", True), ("int8", "int8"))
    }
    models = {name: e.model for name, e in engines.items()}
    result: dict = {"forward_us": forward_times(models, args.context, args.rounds)}
    print(f"cached forward at {args.context} positions, us (÷ its own 1-row forward):")
    for rows in ROWS:
        cells = []
        for name in models:
            us = result["forward_us"][f"{name}/{rows}"]
            cells.append(f"{name} {us:8.0f} ({us / result['forward_us'][f'{name}/1']:.2f}x)")
        ratio = result["forward_us"][f"float32/{rows}"] / result["forward_us"][f"int8/{rows}"]
        print(f"  {rows:2d} rows: " + "   ".join(cells) + f"   int8 {ratio:.2f}x faster")
    tok = engines["float32"].tokenizer
    params = osd.SamplingParams(args.tokens, ignore_eos=True)
    result["workloads"] = {}
    for w in evaluation_set(n=args.prompts):
        agree = total = shared = 0
        worst = 0.0
        for p in w.prompts:
            prompt = apply_chat_template(tok, [list(p)])[0]
            ref = engines["float32"].generate([prompt], params)[0].token_ids
            own = engines["int8"].generate([prompt], params)[0].token_ids
            shared += next((i for i, (a, b) in enumerate(zip(ref, own)) if a != b), len(ref))
            ids = prompt + ref
            a = teacher_forced(models["float32"], ids, len(prompt))
            b = teacher_forced(models["int8"], ids, len(prompt))
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += a.shape[0]
            worst = max(worst, float(((a - b).abs().amax(-1) / a.std(-1)).max()))
        row = dict(
            top1_agreement=round(agree / total, 4),
            max_diff_over_std=round(worst, 3),
            greedy_shared_tokens=round(shared / len(w.prompts), 1),
        )
        result["workloads"][w.name] = row
        print(
            f"{w.name:10s} argmax agreement {row['top1_agreement']:.2%} over {total} positions; "
            f"max |diff| / std {row['max_diff_over_std']:.3f}; int8 greedy shares "
            f"{row['greedy_shared_tokens']:.0f} of {args.tokens} tokens before parting (mean)"
        )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=3, help="prompts a workload")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--target", default=None, help="a GGUF file (default: the chat target, Q4_1)")
    args = ap.parse_args()
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def test_int8_activations():
    """``make bench``: one prompt a workload, 64 tokens, 2 rounds."""
    if osd.zoo.chat.cached_target() is None or not osd_kernels.use_vnni():
        import pytest  # only here: the script runs without pytest

        pytest.skip("needs the chat target (osd.zoo.chat.fetch_target()) and AVX-512 VNNI")
    print()
    run(argparse.Namespace(prompts=1, tokens=64, context=300, rounds=2, json=None))


if __name__ == "__main__":
    main()
