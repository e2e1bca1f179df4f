"""The GPU speed goals in one table: samplers, verification attention, decode against the
HBM roofline, and speculative against plain decoding at batch 1, 8 and 64.

    python scripts/gpu_goals.py [--json out/gpu_goals.json]   # on a CUDA machine (~2 min)
    python scripts/gpu_goals.py --smoke                         # tiny shapes, any device

Sizes are the goals' own (``docs/benchmarks.md``): samplers at V = 128,256, K = 4, bf16
logits; ``tree_attention`` with 32 query / 8 KV heads of width 128, bf16; decode and
speculation on a TinyLlama-shaped 1.1B Llama with random bf16 weights (22 layers, hidden
2048), CUDA graphs on. Kernel times are CUDA-event medians; the roofline is the bytes a
kernel must read over ``HBM_BYTES_PER_S`` (an H100/H200-class 4.8 TB/s; pass
``--hbm-tbps`` for another part). The speculative rows use a 2-layer random draft, whose
proposals the target almost never accepts: they show what drafting costs when it does not
pay, and whether ``SpecConfig(auto_k=True)`` falls back to plain decoding there.

``--smoke`` shrinks every shape so the script runs anywhere in seconds (the suite runs it
on CPU to keep it working); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import osd
import osd_kernels
from osd.models import fused_layers
from osd.models.config import ModelConfig
from osd.models.llama import DecoderLM

HBM_BYTES_PER_S = 4.8e12
# the native chain sampler with its split-vocabulary kernels switched on (OSD_SAMPLER_SPLIT=1;
# off by default on CUDA until they have run on a GPU), and its goals (mode, batch, µs)
SPLIT = "native-split"
SAMPLER_GOALS = [
    ("T0.8 top-k 50 top-p 0.9", 1, 40),
    ("T0.8 top-k 50 top-p 0.9", 64, 150),
    ("draft probs", 1, 25),
    ("greedy", 1, 15),
    ("greedy", 64, 35),
]


def _time_us(fn, reps: int, device) -> float:
    """Median microseconds of ``fn()`` (CUDA events on a GPU, wall clock elsewhere)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def samplers(dev, V: int, reps: int, backends: list[str]) -> list[dict]:
    """``rejection_sample`` and ``tree_rejection_sample`` (a 4-node chain tree) per mode,
    batch size and backend."""
    K, rows = 4, []
    g = torch.Generator(device="cpu").manual_seed(0)
    modes = {
        "greedy": {},
        "draft probs": dict(temperature=1.0),
        "T0.8 top-k 50 top-p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    }
    for B in (1, 64):
        logits = torch.randn(B, K + 1, V, generator=g).to(dev, torch.bfloat16)
        drafts = torch.randint(0, V, (B, K), generator=g).to(dev)
        q = torch.softmax(torch.randn(B, K, V, generator=g), -1).to(dev, torch.bfloat16)
        parents = torch.arange(-1, K, dtype=torch.int32, device=dev).expand(B, K + 1)
        nodes = torch.cat([drafts[:, :1], drafts], 1)
        seed = torch.arange(B, dtype=torch.int64, device=dev)
        offset = torch.zeros(B, dtype=torch.int64, device=dev)
        for mode, kw in modes.items():
            probs = q if mode == "draft probs" else None
            per_row = {k: torch.full((B,), v, device=dev) for k, v in kw.items()}
            read = logits.numel() * 2 + (probs.numel() * 2 if probs is not None else 0)
            for backend in backends:
                kernel = "native" if backend == SPLIT else backend
                before = os.environ.get("OSD_SAMPLER_SPLIT")
                os.environ["OSD_SAMPLER_SPLIT"] = "1" if backend == SPLIT else "0"
                chain = _time_us(
                    lambda: osd_kernels.rejection_sample(
                        logits, drafts, probs, seed=seed, offset=offset, backend=kernel, **per_row
                    ),
                    reps,
                    dev,
                )
                os.environ.pop("OSD_SAMPLER_SPLIT")
                if before is not None:
                    os.environ["OSD_SAMPLER_SPLIT"] = before
                tree = (
                    _time_us(
                        lambda: osd_kernels.tree_rejection_sample(
                            logits,
                            nodes,
                            parents,
                            None,
                            seed=seed,
                            offset=offset,
                            max_depth=K,
                            backend=backend,
                            **per_row,
                        ),
                        reps,
                        dev,
                    )
                    if probs is None and backend != SPLIT
                    else None
                )
                rows.append(
                    {
                        "B": B,
                        "mode": mode,
                        "backend": backend,
                        "chain_us": chain,
                        "tree_us": tree,
                        "roofline_us": read / HBM_BYTES_PER_S * 1e6,
                    }
                )
    return rows


def attention(dev, cases, heads, reps: int) -> list[dict]:
    """``tree_attention`` (Triton on CUDA) over a cached prefix, causal tree of T queries."""
    hq, hkv, d = heads
    rows = []
    for B, S, T in cases:
        k = torch.randn(B, hkv, S + T, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(B, T, hq, d, device=dev, dtype=torch.bfloat16)
        lens = torch.full((B,), S, dtype=torch.int32, device=dev)
        mask = osd_kernels.causal_tree_mask(B, T, device=dev) if T > 1 else None
        us = _time_us(
            lambda: osd_kernels.tree_attention(q, k, v, lens, mask, max_kv_len=S + T), reps, dev
        )
        read = 2 * B * hkv * (S + T) * d * 2
        rows.append(
            {"B": B, "prefix": S, "T": T, "us": us, "roofline_us": read / HBM_BYTES_PER_S * 1e6}
        )
    return rows


def _model(cfg: ModelConfig, dev, dtype) -> DecoderLM:
    model = DecoderLM(cfg, device=dev, dtype=dtype)
    model.init_weights(generator=torch.Generator(device=dev).manual_seed(0))
    return model.requires_grad_(False)


def _tokens_per_s(engine, B: int, new: int, vocab: int) -> float:
    prompts = [[(7 * i + j) % vocab for j in range(16)] for i in range(B)]
    params = osd.SamplingParams(new)
    engine.generate(prompts, params)  # warm-up (captures graphs)
    best = 0.0
    for _ in range(2):
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
    return best


def decode_and_speculation(dev, target_cfg, draft_cfg, batches, new: int) -> dict:
    """Plain decode tokens/s and its roofline fraction at batch 1; plain vs speculative
    (k = 4 fixed, and auto_k) per batch size."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target, draft = _model(target_cfg, dev, dtype), _model(draft_cfg, dev, dtype)
    # Random weights never emit EOS on purpose; none is configured.
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    out = {"weights_GB": weight_bytes / 1e9, "batches": []}
    for B in batches:
        row = {"B": B}
        for name, spec in (
            ("plain", None),
            ("spec k=4", osd.SpecConfig(num_draft_tokens=4)),
            ("spec auto_k", osd.SpecConfig(num_draft_tokens=4, auto_k=True)),
        ):
            eng = osd.Engine(
                target,
                draft=None if spec is None else draft,
                spec=spec,
                max_batch_size=B,
                max_seq_len=16 + new + 8,
            )
            row[name] = _tokens_per_s(eng, B, new, target_cfg.vocab_size)
        # the fused decode layer (osd.models.fused_layers), off by default until measured
        before, fused_layers.FUSED_LAYERS = fused_layers.FUSED_LAYERS, "auto"
        try:
            eng = osd.Engine(target, max_batch_size=B, max_seq_len=16 + new + 8)
            row["plain fused"] = _tokens_per_s(eng, B, new, target_cfg.vocab_size)
        finally:
            fused_layers.FUSED_LAYERS = before
        out["batches"].append(row)
    roof = HBM_BYTES_PER_S / weight_bytes
    out["roofline_tokens_per_s_b1"] = roof
    out["plain_b1_fraction"] = out["batches"][0]["plain"] / roof
    out["plain_fused_b1_fraction"] = out["batches"][0]["plain fused"] / roof
    return out


def host_time_per_step(dev, vocab: int, new: int) -> dict:
    """Wall time per step at batch 1 of a 1-layer, 64-wide target and draft, whose device
    work is a few microseconds: what is left is the host's time per step (Python,
    bookkeeping, launches and the one read-back)."""
    tcfg = ModelConfig("LlamaForCausalLM", vocab, 64, 128, 1, 4, 2, 16)
    target, draft = _model(tcfg, dev, torch.float32), _model(tcfg, dev, torch.float32)
    out = {}
    for name, spec in (("plain", None), ("spec k=4", osd.SpecConfig(num_draft_tokens=4))):
        eng = osd.Engine(
            target,
            draft=None if spec is None else draft,
            spec=spec,
            max_batch_size=1,
            max_seq_len=16 + new + 8,
        )
        eng.generate([[1] * 16], osd.SamplingParams(new, ignore_eos=True))
        steps = []
        for _ in range(3):
            eng.reset_stats()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            eng.generate([[1] * 16], osd.SamplingParams(new, ignore_eos=True))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            n = eng.stats["target_forwards"]
            steps.append((time.perf_counter() - t) / max(1, n) * 1e6)
        out[name] = min(steps)
    return out


def main(argv=None) -> int:
    global HBM_BYTES_PER_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (any device)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth (TB/s)")
    args = ap.parse_args(argv)
    HBM_BYTES_PER_S = args.hbm_tbps * 1e12
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        V, reps, heads, new = 1000, 2, (4, 2, 32), 4
        att_cases = [(1, 64, 1), (1, 64, 8), (2, 96, 8)]
        tcfg = ModelConfig("LlamaForCausalLM", 512, 64, 128, 2, 4, 2, 16)
        dcfg = ModelConfig("LlamaForCausalLM", 512, 32, 64, 1, 2, 1, 16)
        batches = (1, 2)
    else:
        if dev.type != "cuda":
            print("error: no CUDA device (use --smoke to check the script)", file=sys.stderr)
            return 2
        V, reps, heads, new = 128256, 30, (32, 8, 128), 64
        att_cases = [
            (1, 4096, 1),
            (1, 4096, 8),
            (1, 16384, 1),
            (1, 16384, 8),
            (1, 32768, 8),
            (8, 4096, 1),
            (8, 4096, 8),
        ]
        tcfg = ModelConfig("LlamaForCausalLM", 32000, 2048, 5632, 22, 32, 4, 64)
        dcfg = ModelConfig("LlamaForCausalLM", 32000, 512, 1408, 2, 8, 2, 64)
        batches = (1, 8, 64)
    backends = ["native", SPLIT, "triton"] if dev.type == "cuda" else ["native", SPLIT]
    res = {
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "hbm_tbps": args.hbm_tbps,
        "smoke": args.smoke,
    }
    res["samplers"] = samplers(dev, V, reps, backends)
    res["attention"] = attention(dev, att_cases, heads, reps)
    res["decode"] = decode_and_speculation(dev, tcfg, dcfg, batches, new)
    res["host_us_per_step"] = host_time_per_step(dev, 512 if args.smoke else 32000, new)
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def report(res: dict) -> str:
    """The results as markdown tables."""
    lines = [
        f"device {res['device']}, torch {res['torch']}, HBM {res['hbm_tbps']} TB/s"
        f"{' (smoke: shapes shrunk, numbers meaningless)' if res['smoke'] else ''}",
        "",
        "| sampler B | mode | backend | chain µs | tree µs | roofline µs |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["samplers"]:
        tree = "-" if r["tree_us"] is None else f"{r['tree_us']:.1f}"
        lines.append(
            f"| {r['B']} | {r['mode']} | {r['backend']} | {r['chain_us']:.1f} | "
            f"{tree} | {r['roofline_us']:.1f} |"
        )
    lines += [
        "",
        "| attention B | prefix | T | µs | roofline µs | roofline fraction |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["attention"]:
        lines.append(
            f"| {r['B']} | {r['prefix']} | {r['T']} | {r['us']:.1f} | "
            f"{r['roofline_us']:.1f} | {r['roofline_us'] / r['us']:.0%} |"
        )
    d = res["decode"]
    lines += [
        "",
        f"decode: {d['weights_GB']:.2f} GB of weights; batch 1 roofline "
        f"{d['roofline_tokens_per_s_b1']:.0f} tokens/s; plain reaches "
        f"{d['plain_b1_fraction']:.0%} ({d['plain_fused_b1_fraction']:.0%} with the fused "
        f"decode layer)",
        "",
        "| batch | plain tokens/s | plain fused | spec k=4 | spec auto_k | auto_k / plain |",
        "|---|---|---|---|---|---|",
    ]
    for r in d["batches"]:
        lines.append(
            f"| {r['B']} | {r['plain']:.0f} | {r['plain fused']:.0f} | "
            f"{r['spec k=4']:.0f} | {r['spec auto_k']:.0f} | "
            f"{r['spec auto_k'] / r['plain']:.2f}x |"
        )
    h = res.get("host_us_per_step")
    lines += [
        "",
        "| goal | target | measured |",
        "|---|---|---|",
        f"| plain decode, batch 1, fused decode layer | >= 60% of the HBM roofline | "
        f"{d['plain_fused_b1_fraction']:.0%} |",
    ]
    for mode, B, goal in SAMPLER_GOALS:
        for r in res["samplers"]:
            if (r["mode"], r["B"], r["backend"]) == (mode, B, SPLIT):
                lines.append(
                    f"| chain sampler {mode}, batch {B} ({SPLIT}) | <= {goal} µs | "
                    f"{r['chain_us']:.1f} µs |"
                )
    for r in d["batches"]:
        lines.append(
            f"| random draft, auto_k / plain, batch {r['B']} | >= 0.97x | "
            f"{r['spec auto_k'] / r['plain']:.2f}x |"
        )
    if h:
        lines.append(
            f"| host time per speculative step, batch 1 (tiny models) | <= 60 µs | "
            f"{h['spec k=4']:.0f} µs (plain step {h['plain']:.0f} µs) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
