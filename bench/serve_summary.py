"""The table of ``bench/bench_serve_llamacpp.py``: its provider names, and the rows, ratios
and markdown it makes of a run's loads (medians over rounds, ratios paired round by
round); :func:`percentile`, which ``bench/bench_serve.py`` uses too."""

from __future__ import annotations

from osd._openmp import SPIN_COUNT

INPROC = "osd in-process"
INPROC_PLAIN = "osd in-process --no-draft"
SERVE = "osd serve"
SERVE_PLAIN = "osd serve --no-draft"
SERVE_EVERY = "osd serve --stream-interval 0"
LLAMA8 = "llama-server -np 8"
LLAMA1 = "llama-server -np 1"
LLAMA8P = f"llama-server -np 8, spin={SPIN_COUNT}"  # osd's libgomp setting
LLAMAS = (LLAMA8, LLAMA1, LLAMA8P)
# provider -> its in-process reference (the serve / in-process ratio at 1 client)
REFERENCE = {SERVE: INPROC, SERVE_PLAIN: INPROC_PLAIN, SERVE_EVERY: INPROC}
OSD_ROWS = (INPROC, INPROC_PLAIN, SERVE, SERVE_PLAIN, SERVE_EVERY)


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation; None for no samples."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _median_ratio(num: list[dict], den: list[dict]) -> float | None:
    """Median over rounds of ``num``'s tokens/s over ``den``'s in the same round."""
    pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(num, den) if b["tokens_per_s"]]
    return percentile(pairs, 50)


def summarize(runs: dict, clients) -> list[dict]:
    """One row per (provider, N): tokens/s (median, min, max over rounds), TTFT p50, CPU
    per token and the ratio columns."""
    rows = []
    for n in clients:
        llama = [runs[(name, n)] for name in LLAMAS if (name, n) in runs]
        # per round, the faster llama-server at this N
        best = [max(rs, key=lambda r: r["tokens_per_s"]) for rs in zip(*llama)] if llama else []
        for (name, m), rs in runs.items():
            if m != n:
                continue
            tps = [r["tokens_per_s"] for r in rs]
            cpu = [r["cpu_s"] for r in rs if r["cpu_s"] is not None]
            ttft = percentile([t for r in rs for t in r["ttft"]], 50)
            row = dict(
                provider=name,
                clients=n,
                tokens_per_s=percentile(tps, 50),
                tokens_per_s_min=min(tps),
                tokens_per_s_max=max(tps),
                tokens_per_s_rounds=tps,
                ttft_p50_ms=None if ttft is None else 1e3 * ttft,
                cpu_ms_per_token=(
                    1e3 * sum(cpu) / sum(r["tokens"] for r in rs) if len(cpu) == len(rs) else None
                ),
                client_cpu_ms_per_token=(
                    1e3 * sum(r["client_cpu_s"] for r in rs) / sum(r["tokens"] for r in rs)
                ),
                loadavg_1m=[r["loadavg"] for r in rs],
            )
            eng = [r["engine_s"] for r in rs]
            if None not in eng and (n == 1 or name in OSD_ROWS):
                tokens = sum(r["tokens"] for r in rs)
                row["step_ms_per_token"] = 1e3 * sum(eng) / tokens
                row["outside_ms_per_token"] = (
                    1e3 * (sum(r["wall_s"] for r in rs) - sum(eng)) / tokens
                )
            ref = REFERENCE.get(name)
            if n == 1 and ref and (ref, 1) in runs:
                row["vs_in_process"] = _median_ratio(rs, runs[(ref, 1)])
            if name in OSD_ROWS and (LLAMA8, n) in runs:
                row["vs_llama_np8"] = _median_ratio(rs, runs[(LLAMA8, n)])
            if name in OSD_ROWS and best:
                row["vs_llama_best"] = _median_ratio(rs, best)
            rows.append(row)
    return rows


def same_text(runs: dict) -> dict:
    """Per (provider, N): in how many conversations its first round's text equals its
    in-process counterpart's (the draft's defaults for ``osd serve``, the target alone for
    the rest); greedy, so osd's should all be equal (llama.cpp computes in its own
    precision and leaves osd's text after some tokens)."""
    out = {}
    for (name, n), rs in runs.items():
        ref = INPROC if name in (SERVE, SERVE_EVERY) else INPROC_PLAIN
        if name in (INPROC, INPROC_PLAIN) or (ref, 1) not in runs:
            continue
        a = [r["text"].rstrip("\ufffd") for r in rs[0]["results"]]
        b = [r["text"].rstrip("\ufffd") for r in runs[(ref, 1)][0]["results"]]
        out[f"{name} / N={n}"] = f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"
    return out


def _f(v, fmt: str, suffix: str = "") -> str:
    return "–" if v is None else format(v, fmt) + suffix


def markdown(out: dict) -> str:
    lines = [
        "| clients | provider | tokens/s (min–max) | TTFT p50 (ms) "
        "| CPU ms/token (server / client) | wall ms/token in steps + outside "
        "| ÷ in-process | ÷ llama-server -np 8 | ÷ fastest llama-server |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        steps = (
            f"{r['step_ms_per_token']:.1f} + {r['outside_ms_per_token']:.1f}"
            if "step_ms_per_token" in r
            else "–"
        )
        lines.append(
            f"| {r['clients']} | {r['provider']} | {r['tokens_per_s']:.1f} "
            f"({r['tokens_per_s_min']:.1f}–{r['tokens_per_s_max']:.1f}) | "
            f"{_f(r['ttft_p50_ms'], '.0f')} | {_f(r['cpu_ms_per_token'], '.1f')} / "
            f"{r['client_cpu_ms_per_token']:.1f} | {steps} | "
            f"{_f(r.get('vs_in_process'), '.2f', 'x')} | {_f(r.get('vs_llama_np8'), '.2f', 'x')} | "
            f"{_f(r.get('vs_llama_best'), '.2f', 'x')} |"
        )
    return "\n".join(lines)


def report(out: dict) -> str:
    m = out["machine"]
    lines = [
        markdown(out),
        "",
        f"load average at start {' '.join(f'{x:.2f}' for x in m['loadavg_start'])}, at end "
        f"{' '.join(f'{x:.2f}' for x in m['loadavg_end'])}; {out['duration_s']:.0f} s",
        "same text as in-process (first round): "
        + ", ".join(f"{k} {v}" for k, v in out["same_text_as_in_process"].items()),
    ]
    if out["problems"]:
        lines.append(f"{len(out['problems'])} PROBLEMS:")
        lines += ["  " + p for p in out["problems"][:20]]
    return "\n".join(lines)
