"""The main job (``make demo`` / ``osd demo``): serve a shifted query stream with online
speculative decoding on the built-in pair, and report what happened.

Three passes over the same stream of code prompts (the draft was trained mostly on
prose, so this is the shifted domain), each request served at batch size 1:

1. the target alone (plain decoding) on the first ``baseline_requests`` requests: the
   tokens/s that every speedup is measured against;
2. speculative decoding with the draft kept **static**;
3. speculative decoding with **online** distillation on (the draft learns in a background
   thread from the target's verdicts; updates are swapped in between decode steps).

Live progress shows the rolling α, tokens/s and speedup. The report (markdown and PNG
plots) goes to ``out_dir``: α over requests (static against online), tokens/s over
requests, and measured speedup against the analytic bound
``(1 - α^(k+1)) / ((1 - α)(c k + 1))`` with the measured α and draft cost ratio c.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import torch
from tqdm import tqdm

import osd
from osd import zoo


@dataclasses.dataclass
class DemoConfig:
    """What the demo serves and where it writes its report."""

    requests: int = 200             # requests in the stream
    baseline_requests: int = 40     # of them served by the target alone (speedup baseline)
    max_new_tokens: int = 32        # tokens generated per request (greedy)
    prompt_tokens: int = 48         # prompt length
    num_draft_tokens: int = 4       # k
    seed: int = 0                   # query-stream seed
    threads: int | None = 1         # torch intra-op threads: serving and the learner thread
                                    # then each keep one core of a 2-core machine busy
    out_dir: str = "reports/demo"   # report directory
    online: osd.OnlineConfig = dataclasses.field(default_factory=lambda: osd.OnlineConfig(
        update_every_requests=8, steps_per_update=8, lr=5e-4, batch_positions=1024,
        background=True))


def analytic_speedup(alpha: float, k: int, c: float) -> float:
    """Expected speedup ``(1 - α^(k+1)) / ((1 - α)(c k + 1))`` (REFERENCE.md §1)."""
    if alpha >= 1.0:
        return (k + 1) / (c * k + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (c * k + 1))


def draft_cost_ratio(target_dir: str, draft_dir: str, steps: int = 30) -> float:
    """c: one draft decode step's time over one target decode step's, measured side by
    side (interleaved, median of ``steps``)."""
    models = [osd.load_model(d) for d in (target_dir, draft_dir)]
    caches = [m.new_cache(1, 256) for m in models]
    ids = torch.tensor([[1]])
    times = [[], []]
    with torch.inference_mode():
        for c in caches:
            c.lens[0] = 64
            c.set_bound(64)
        for _ in range(steps):
            for i, (m, c) in enumerate(zip(models, caches)):
                t0 = time.perf_counter()
                m(ids, c)
                times[i].append(time.perf_counter() - t0)
    med = [sorted(t)[len(t) // 2] for t in times]
    return med[1] / med[0]


def _serve(engine, prompts, params, label: str, plain_tps: float | None = None):
    """Serve prompts one at a time with a progress bar; per-request records."""
    records = []
    bar = tqdm(prompts, desc=label, unit="req", dynamic_ncols=True)
    for i, prompt in enumerate(bar):
        t0 = time.perf_counter()
        out = engine.generate([prompt], params)[0]
        dt = time.perf_counter() - t0
        st = out.stats or {}
        records.append({"request": i, "tokens": len(out.token_ids), "seconds": dt,
                        "alpha": st.get("alpha"), "accepted": st.get("accepted"),
                        "drafted": st.get("drafted")})
        window = records[-20:]
        tps = sum(r["tokens"] for r in window) / sum(r["seconds"] for r in window)
        post = {"tok/s": f"{tps:.0f}"}
        alphas = [r["alpha"] for r in window if r["alpha"] is not None]
        if alphas:
            post["alpha"] = f"{sum(alphas) / len(alphas):.3f}"
        if plain_tps:
            post["speedup"] = f"{tps / plain_tps:.2f}x"
        bar.set_postfix(post)
    return records


def _rolling(values, w=20):
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - w + 1):i + 1] if v is not None]
        out.append(sum(chunk) / len(chunk) if chunk else None)
    return out


def _tps(records):
    return sum(r["tokens"] for r in records) / sum(r["seconds"] for r in records)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def run_demo(cfg: DemoConfig | None = None) -> dict:
    """Run the demo and write the report; returns the summary dict."""
    cfg = cfg or DemoConfig()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    print("osd demo: preparing the built-in pair (osd.zoo) ...", flush=True)
    target_dir, draft_dir = zoo.default_pair()
    prompts = zoo.query_stream("code", n=cfg.requests, prompt_tokens=cfg.prompt_tokens,
                               seed=cfg.seed)
    params = osd.SamplingParams(cfg.max_new_tokens)
    k = cfg.num_draft_tokens
    max_len = cfg.prompt_tokens + cfg.max_new_tokens + 8
    c = draft_cost_ratio(target_dir, draft_dir)
    print(f"osd demo: {cfg.requests} code queries; draft cost ratio c = {c:.3f}", flush=True)

    plain = osd.Engine.from_pretrained(target_dir, max_batch_size=1, max_seq_len=max_len)
    base = _serve(plain, prompts[:cfg.baseline_requests], params, "target alone")
    plain_tps = _tps(base)
    spec = osd.SpecConfig(num_draft_tokens=k)
    static = osd.Engine.from_pretrained(target_dir, draft=draft_dir, spec=spec,
                                        max_batch_size=1, max_seq_len=max_len)
    st_rec = _serve(static, prompts, params, "static draft", plain_tps)
    online = osd.Engine.from_pretrained(target_dir, draft=draft_dir, spec=spec,
                                        online=cfg.online, max_batch_size=1,
                                        max_seq_len=max_len)
    on_rec = _serve(online, prompts, params, "online draft", plain_tps)
    online.close()
    # Outputs are lossless: spot-check the first requests against the target alone.
    for i in range(min(5, cfg.baseline_requests)):
        ref = plain.generate([prompts[i]], params)[0].token_ids
        got = online.generate([prompts[i]], params)[0].token_ids
        if ref != got:
            raise AssertionError(f"request {i}: speculative output differs from the target's")
    summary = _report(cfg, c, base, st_rec, on_rec, online.stats, plain_tps,
                      time.perf_counter() - t_start)
    return summary


def _report(cfg, c, base, st_rec, on_rec, online_stats, plain_tps, seconds) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(cfg.out_dir, exist_ok=True)
    k = cfg.num_draft_tokens
    n = len(st_rec)
    tail = max(1, n // 4)
    a_static = [r["alpha"] for r in st_rec]
    a_online = [r["alpha"] for r in on_rec]
    tps_static = [r["tokens"] / r["seconds"] for r in st_rec]
    tps_online = [r["tokens"] / r["seconds"] for r in on_rec]
    xs = list(range(n))

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, _rolling(a_static), label="static draft")
    ax.plot(xs, _rolling(a_online), label="online draft")
    ax.set_xlabel("request")
    ax.set_ylabel("α = 1 − TV(p, q) (rolling mean of 20)")
    ax.set_title("Acceptance on the shifted (code) stream")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(cfg.out_dir, "alpha.png"), dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, _rolling(tps_static), label="osd, static draft")
    ax.plot(xs, _rolling(tps_online), label="osd, online draft")
    ax.axhline(plain_tps, color="gray", linestyle="--", label="target alone")
    ax.set_xlabel("request")
    ax.set_ylabel("tokens/s (rolling mean of 20)")
    ax.set_title("Throughput at batch size 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(cfg.out_dir, "tokens_per_s.png"), dpi=120)
    plt.close(fig)

    ra = _rolling(a_online)
    measured = [t / plain_tps for t in _rolling(tps_online)]
    bound = [analytic_speedup(a, k, c) if a is not None else None for a in ra]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, measured, label="measured (online draft)")
    ax.plot(xs, bound, label=f"analytic bound, measured α, c={c:.2f}, k={k}")
    ax.axhline(1.0, color="gray", linestyle="--")
    ax.set_xlabel("request")
    ax.set_ylabel("speedup over the target alone")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(cfg.out_dir, "speedup.png"), dpi=120)
    plt.close(fig)

    first = slice(0, min(20, n))
    last = slice(n - tail, n)
    s = {
        "requests": n, "k": k, "c": c, "plain_tokens_per_s": plain_tps,
        "static": {"alpha_first20": _mean(a_static[first]), "alpha_last": _mean(a_static[last]),
                   "tokens_per_s": _tps(st_rec), "tokens_per_s_last": _tps(st_rec[last])},
        "online": {"alpha_first20": _mean(a_online[first]), "alpha_last": _mean(a_online[last]),
                   "tokens_per_s": _tps(on_rec), "tokens_per_s_last": _tps(on_rec[last]),
                   "updates_applied": online_stats["online"]["updates_applied"],
                   "updates_rejected": online_stats["online"]["updates_rejected"]},
        "seconds": seconds,
    }
    for key in ("static", "online"):
        s[key]["speedup_last"] = s[key]["tokens_per_s_last"] / plain_tps
        s[key]["analytic_bound_last"] = analytic_speedup(s[key]["alpha_last"], k, c)
    with open(os.path.join(cfg.out_dir, "summary.json"), "w") as f:
        json.dump({"summary": s, "static": st_rec, "online": on_rec, "plain": base}, f, indent=1)
    lines = [
        "# osd demo report", "",
        f"Built-in pair (`osd.zoo`), {n} code queries (the draft's shifted domain), greedy, "
        f"batch size 1, k = {k}, {cfg.max_new_tokens} new tokens per request, CPU fp32. "
        f"Produced by `make demo` in {seconds:.0f} s.", "",
        f"Target alone: **{plain_tps:.1f} tokens/s** (first {len(base)} requests). "
        f"Draft cost ratio c = {c:.3f} (draft decode step / target decode step, measured).", "",
        f"| draft | α first 20 | α last {tail} | tokens/s last {tail} | speedup last {tail} "
        f"| analytic bound |",
        "|---|---|---|---|---|---|",
    ]
    for key in ("static", "online"):
        d = s[key]
        lines.append(f"| {key} | {d['alpha_first20']:.3f} | {d['alpha_last']:.3f} | "
                     f"{d['tokens_per_s_last']:.1f} | {d['speedup_last']:.2f}x | "
                     f"{d['analytic_bound_last']:.2f}x |")
    lines += [
        "", f"Online updates applied: {s['online']['updates_applied']}, rejected by the guard: "
        f"{s['online']['updates_rejected']}.", "",
        "α is the exact 1 − TV(p, q) between the target's and the draft's next-token "
        "distributions, averaged over drafted positions.", "",
        "![alpha](alpha.png)", "", "![tokens/s](tokens_per_s.png)", "", "![speedup](speedup.png)",
        "",
    ]
    with open(os.path.join(cfg.out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines[4:12 + 2]))
    print(f"osd demo: report written to {os.path.join(cfg.out_dir, 'report.md')}")
    return s
