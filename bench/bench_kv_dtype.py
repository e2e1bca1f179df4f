"""The chat target's K/V cache in float16 (the default beside int8 activations) against
float32, on the same model object (the same weights in memory), 2 threads.

Speed: one cached forward of a decode step (1 new token a row) and of a chain verify (5
new tokens a row) at ``--contexts`` cached positions, batch 1 and ``--batch``, the two
caches alternating, best of ``--rounds`` rounds of 6 forwards. Attention reads every
cached key and value of every layer each forward (46 KB a position in float32 for
SmolLM2-135M), so the share it takes, and what a half cache saves, grows with the
context and the batch.

Prefill: the best tokens/s of a prompt of each context length over each cache.

Accuracy, per workload of the evaluation set (``--prompts`` each): the float32-activation
model's greedy answer (``--tokens``; ``quantized=True``, float32 K/V: the dequantized
model's logits), teacher-forced through the int8 model with each cache in cached
forwards of up to 16 tokens: the share of answer positions whose argmax agrees with the
float32 model's, and how many tokens each int8 model's own greedy answer shares with the
float32 one before they part (mean over prompts).

End to end (``--long``, 0 to skip): requests to summarise a long document
(``osd.zoo.workloads.long_documents``, about 1,500-2,000 prompt tokens) on the engine as
``from_pretrained`` builds it, plain and with the chat draft's settings, over each cache;
decode tokens/s per engine, a request's decode time being that of a 129-token request
minus that of a 1-token one (the prefill), the four engines taking turns request by
request; speculative output asserted equal to plain output over the same cache.

    .venv/bin/python bench/bench_kv_dtype.py [--contexts 128 512 1024 2048] [--prompts 3]
        [--long 4]
"""

import os
import sys

if __name__ == "__main__":  # run as a script: the repository root, for `bench.*`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import osd  # first: osd sets the OpenMP wait policy before torch loads libgomp

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import osd_kernels  # noqa: E402
from osd.chat_template import apply_chat_template  # noqa: E402
from osd.chat_template import encode_chat  # noqa: E402
from osd.zoo.workloads import evaluation_set, long_documents  # noqa: E402

from bench.bench_int8_activations import teacher_forced  # noqa: E402

KV = {"float32 K/V": torch.float32, "float16 K/V": torch.float16}


def forward_times(model, contexts, batch: int, rounds: int) -> dict:
    """Best µs of a cached forward of 1 and 5 new tokens a row, per (batch, context, cache)."""
    gen = torch.Generator().manual_seed(0)
    V = model.vocab_size
    out: dict = {}
    with torch.inference_mode():
        for B in sorted({1, batch}):
            for L in contexts:
                prompt = torch.randint(0, V, (B, L), generator=gen)
                caches = {}
                for name, dtype in KV.items():
                    model.kv_dtype = dtype
                    caches[name] = model.new_cache(B, L + 8)
                    model.prefill(prompt, caches[name], torch.full((B,), L, dtype=torch.int32))
                for T in (1, 5):
                    ids = torch.randint(0, V, (B, T), generator=gen)
                    best = {name: float("inf") for name in KV}
                    for r in range(rounds):
                        for name in KV if r % 2 == 0 else list(KV)[::-1]:
                            model(ids, caches[name])
                            start = time.perf_counter()
                            for _ in range(6):
                                model(ids, caches[name])
                            best[name] = min(best[name], (time.perf_counter() - start) / 6 * 1e6)
                    out[B, L, T] = best
                    print(
                        f"  batch {B} context {L:5d} {T} new: "
                        + "  ".join(f"{n} {us:7.0f} µs" for n, us in best.items())
                        + f"  half {best['float32 K/V'] / best['float16 K/V']:.2f}x faster",
                        flush=True,
                    )
                del caches
    model.kv_dtype = torch.float16
    return out


def accuracy(target: str, prompts: int, tokens: int) -> dict:
    """Per workload: argmax agreement with the float32 model and shared greedy tokens,
    for the int8 model over each cache."""
    exact = osd.Engine.from_pretrained(target, quantized=True, max_batch_size=1)
    int8 = {
        name: osd.Engine.from_pretrained(target, max_batch_size=1, kv_dtype=dtype)
        for name, dtype in KV.items()
    }
    tok = exact.tokenizer
    params = osd.SamplingParams(tokens, ignore_eos=True)
    out = {}
    for w in evaluation_set(n=prompts):
        agree = {n: 0 for n in KV}
        shared = {n: 0 for n in KV}
        total = 0
        for p in w.prompts:
            prompt = apply_chat_template(tok, [list(p)])[0]
            ref = exact.generate([prompt], params)[0].token_ids
            want = teacher_forced(exact.model, prompt + ref, len(prompt)).argmax(-1)
            total += want.numel()
            for name, eng in int8.items():
                own = eng.generate([prompt], params)[0].token_ids
                shared[name] += next(
                    (i for i, (a, b) in enumerate(zip(ref, own)) if a != b), len(ref)
                )
                got = teacher_forced(eng.model, prompt + ref, len(prompt)).argmax(-1)
                agree[name] += int((got == want).sum())
        out[w.name] = {
            n: dict(
                top1_agreement=round(agree[n] / total, 4),
                greedy_shared_tokens=round(shared[n] / len(w.prompts), 1),
            )
            for n in KV
        }
        print(
            f"  {w.name:10s} "
            + "   ".join(
                f"{n}: argmax {r['top1_agreement']:.2%}, "
                f"greedy shares {r['greedy_shared_tokens']:.0f}"
                for n, r in out[w.name].items()
            ),
            flush=True,
        )
    return out


def prefill_rates(model, contexts, rounds: int) -> dict:
    """Best prefill tokens/s of a random prompt per (context, cache), batch 1."""
    gen = torch.Generator().manual_seed(1)
    out: dict = {}
    with torch.inference_mode():
        for L in contexts:
            prompt = torch.randint(0, model.vocab_size, (1, L), generator=gen)
            best = {name: 0.0 for name in KV}
            for r in range(rounds):
                for name, dtype in KV.items() if r % 2 == 0 else list(KV.items())[::-1]:
                    model.kv_dtype = dtype
                    cache = model.new_cache(1, L + 8)
                    start = time.perf_counter()
                    model.prefill(prompt, cache, torch.tensor([L], dtype=torch.int32))
                    best[name] = max(best[name], L / (time.perf_counter() - start))
            out[L] = best
            print(
                f"  prefill {L:5d} tokens: "
                + "  ".join(f"{n} {v:6.0f} tokens/s" for n, v in best.items()),
                flush=True,
            )
    model.kv_dtype = torch.float16
    return out


def long_decode(n: int, tokens: int = 128) -> dict:
    """Decode tokens/s on ``n`` long-document requests per (engine, cache)."""
    target, draft = osd.zoo.chat_pair()
    engines = {
        f"{kind}, {name}": osd.Engine.from_pretrained(
            target, draft=d, kv_dtype=dtype, max_batch_size=1, max_seq_len=4096
        )
        for kind, d in (("plain", None), ("as served", draft))
        for name, dtype in KV.items()
    }
    names = list(engines)
    ids = encode_chat(engines[names[0]].tokenizer, [list(c) for c in long_documents(n)])
    print(f"  prompt tokens: {[len(p) for p in ids]}", flush=True)
    one, params = osd.SamplingParams(1), osd.SamplingParams(tokens + 1, ignore_eos=True)
    for e in engines.values():  # warm-up on other text
        e.generate([ids[0][:64]], osd.SamplingParams(4))
    spent = {k: 0.0 for k in names}
    made = {k: 0 for k in names}
    for i, p in enumerate(ids):
        outs = {}
        for k in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            engines[k].generate([p], one)
            mid = time.perf_counter()
            outs[k] = engines[k].generate([p], params)[0].token_ids
            spent[k] += (time.perf_counter() - mid) - (mid - start)
            made[k] += len(outs[k]) - 1
        for name in KV:
            assert outs[f"as served, {name}"] == outs[f"plain, {name}"], (i, name)
    out = {k: round(made[k] / spent[k], 1) for k in names}
    for k, rate in out.items():
        print(f"  {k:24s} {rate:6.1f} decode tokens/s", flush=True)
    return out


def run(args) -> dict:
    torch.set_num_threads(2)
    target = args.target or osd.zoo.chat.fetch_target()
    engine = osd.Engine.from_pretrained(target, max_batch_size=1)
    print(f"cached forwards, int8 activations, best of {args.rounds} rounds of 6:")
    times = forward_times(engine.model, args.contexts, args.batch, args.rounds)
    result = {"forward_us": {f"B{B}/L{L}/T{T}": v for (B, L, T), v in times.items()}}
    print(f"prefill, batch 1, best of {args.rounds}:")
    result["prefill_tokens_per_s"] = prefill_rates(engine.model, args.contexts, args.rounds)
    if args.prompts:
        print(f"accuracy against the float32-activation model ({args.tokens} tokens):")
        result["accuracy"] = accuracy(target, args.prompts, args.tokens)
    if args.long:
        print(f"long documents, {args.long} requests, 128 new tokens:")
        result["long_documents"] = long_decode(args.long)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=3, help="prompts a workload (0: no accuracy)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--long", type=int, default=4, help="long-document requests (0: none)")
    ap.add_argument("--target", default=None, help="a GGUF file (default: the chat target, Q4_1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def test_kv_dtype():
    """``make bench``: two contexts, batch 1 and 4, one prompt a workload, 32 tokens."""
    import pytest  # only here: the script runs without pytest

    if osd.zoo.chat.cached_target() is None:
        pytest.skip("the chat target is not cached: run osd.zoo.chat.fetch_target() once")
    if not osd_kernels.use_vnni():
        pytest.skip(
            "this CPU has no AVX-512 VNNI: its int8 targets keep float32 activations and a "
            "float32 K/V cache, so the float16 cache this measures is not what it serves"
        )
    print()
    run(
        argparse.Namespace(
            contexts=[128, 1024], batch=4, rounds=2, prompts=1, tokens=32, long=1, target=None
        )
    )


if __name__ == "__main__":
    main()
