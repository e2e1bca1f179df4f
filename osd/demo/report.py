"""The demo's report (:mod:`osd.demo`): the rolling and windowed figures of the served
requests, the plots, ``summary.json`` and ``report.md``."""

from __future__ import annotations

import json
import os

import osd
from osd.evaluate import analytic_speedup


def _shared_speedup(records, plain_records) -> float:
    """tokens/s of ``records`` over the requests the target alone also served, over the
    target alone's."""
    served = {r["request"] for r in plain_records}
    return _tps([r for r in records if r["request"] in served]) / _tps(plain_records)


def _rolling(values, w=20):
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - w + 1) : i + 1] if v is not None]
        out.append(sum(chunk) / len(chunk) if chunk else None)
    return out


def _rolling_rate(records, w=20):
    """tokens/s over each request's last ``w`` requests (tokens over seconds)."""
    return [_tps(records[max(0, i - w + 1) : i + 1]) for i in range(len(records))]


def _tps(records):
    return sum(r["tokens"] for r in records) / sum(r["seconds"] for r in records)


def _decode_tps(records):
    """tokens/s after each request's first token: what speculation speeds up."""
    return sum(r["tokens"] - 1 for r in records) / sum(
        r["seconds"] - r["prefill_seconds"] for r in records
    )


def _tree_phrase(below: int) -> str:
    """How the report names ``SpecConfig.lookup_tree_below``."""
    if not below:
        return ""
    if below > osd.SpecConfig.ngram_max:
        return (
            ", every match verified beside the draft model's chain in one tree (its "
            "whole continuation)"
        )
    return f", shorter matches than {below} tokens verified beside the draft model in one tree"


def _fmt(x, sign: bool = False) -> str:
    """An α (or, with ``sign``, a difference of two) that may be missing (None or NaN:
    nothing scored)."""
    return "-" if x is None or x != x else f"{x:+.3f}" if sign else f"{x:.3f}"


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def _plots(cfg, c, st_rec, on_rec, plain_tps, n_base, window_speedup, xs_window) -> None:
    """alpha.png, tokens_per_s.png, speedup.png: rolling over 20 requests (α: mean, where
    the draft model drafted, and on the answers over the window ``xs_window``;
    tokens/s: tokens over seconds), against the target alone's rate on the first
    ``n_base`` requests, with the side-by-side window's measured speedup beside it."""
    # matplotlib loads only when plots are written (it is slow to import), and its Agg
    # backend must be chosen before pyplot is imported
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"), see above

    k = cfg.num_draft_tokens
    xs_on = [r["request"] for r in on_rec]
    xs_st = [r["request"] for r in st_rec]

    def plot(name, title, ylabel, series, hline=None):
        fig, ax = plt.subplots(figsize=(7, 4))
        for xs, ys, lab in series:
            ax.plot(xs, ys, label=lab)
        if hline is not None:
            ax.axhline(hline[0], color="gray", linestyle="--", label=hline[1])
        ax.set_xlabel("request")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(cfg.out_dir, name), dpi=120)
        plt.close(fig)

    a_online = _rolling([r["alpha"] for r in on_rec])
    window = on_rec[-len(xs_window) :]
    text = [
        (xs_window, _rolling([r.get("alpha_text") for r in recs]), f"{name}, on the answers")
        for name, recs in (("static draft", st_rec[-len(xs_window) :]), ("online draft", window))
        if any(r.get("alpha_text") is not None for r in recs)
    ]
    plot(
        "alpha.png",
        "Acceptance on the shifted stream",
        "α = 1 − TV(p, q) (rolling mean of 20)",
        [
            (xs_st, _rolling([r["alpha"] for r in st_rec]), "static draft, where it drafted"),
            (xs_on, a_online, "online draft, where it drafted"),
        ]
        + text,
    )
    rate_online = _rolling_rate(on_rec)
    plot(
        "tokens_per_s.png",
        "Throughput at batch size 1",
        "tokens/s (rolling, 20 requests)",
        [
            (xs_st, _rolling_rate(st_rec), "osd, static draft"),
            (xs_on, rate_online, "osd, online draft"),
        ],
        (plain_tps, f"target alone (first {n_base} requests)"),
    )
    plot(
        "speedup.png",
        "Speedup over the target alone",
        "speedup (rolling, 20 requests)",
        [
            (
                xs_on,
                [t / plain_tps for t in rate_online],
                f"online draft / target alone's first {n_base} requests",
            ),
            (
                xs_window,
                [window_speedup] * len(xs_window),
                "online draft, side by side with the target alone",
            ),
            (
                xs_on,
                [analytic_speedup(a, k, c) if a is not None else None for a in a_online],
                f"analytic bound, measured α, c={c:.2f}, k={k}",
            ),
        ],
        (1.0, "target alone"),
    )


def _report(
    cfg, label, command, c, base, st_rec, on_rec, pl_rec, online_stats, plain_tps, seconds
) -> dict:
    """Plots, ``summary.json`` and ``report.md``. ``base``: the target alone on the first
    requests (live progress and the plots' reference); ``st_rec``, ``pl_rec``: the static
    draft and the target alone side by side with the online engine's last requests,
    which give the report's speedups."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    k = cfg.num_draft_tokens
    n = len(on_rec)
    tail = min(50, len(st_rec))  # the comparison window: the last requests
    a_online = [r["alpha"] for r in on_rec]
    st_last, on_last = st_rec[-tail:], on_rec[-tail:]
    in_window = {r["request"] for r in st_last}
    pl_last = [r for r in pl_rec if r["request"] in in_window]
    shared = {r["request"] for r in pl_last}  # served by all three: the speedups'
    plain_window = _tps(pl_last)
    s = {
        "pair": cfg.pair,
        "requests": n,
        "k": k,
        "c": c,
        "plain_tokens_per_s": plain_tps,
        "plain_tokens_per_s_shared": plain_window,
        "shared_requests": len(shared),
        "max_new_tokens": cfg.max_new_tokens,
        "window": tail,
        "static": {
            "alpha_last": _mean([r["alpha"] for r in st_last]),
            "alpha_text_last": _mean([r.get("alpha_text") for r in st_last]),
            "tokens_per_s_last": _tps(st_last),
            "requests": len(st_rec),
        },
        "online": {
            "alpha_first20": _mean(a_online[:20]),
            "alpha_last": _mean([r["alpha"] for r in on_last]),
            "alpha_text_last": _mean([r.get("alpha_text") for r in on_last]),
            "tokens_per_s_last": _tps(on_last),
            "updates_applied": online_stats["online"]["updates_applied"],
            "updates_rejected": online_stats["online"]["updates_rejected"],
        },
        "seconds": seconds,
    }
    s["plain_prefill_share"] = sum(r["prefill_seconds"] for r in pl_last) / sum(
        r["seconds"] for r in pl_last
    )
    for key, last in (("static", st_last), ("online", on_last)):
        both = [r for r in last if r["request"] in shared]
        s[key]["tokens_per_s_shared"] = _tps(both)
        s[key]["speedup_last"] = s[key]["tokens_per_s_shared"] / plain_window
        s[key]["decode_speedup_last"] = _decode_tps(both) / _decode_tps(pl_last)
        s[key]["analytic_bound_last"] = analytic_speedup(s[key]["alpha_last"], k, c)
    _plots(
        cfg,
        c,
        st_rec,
        on_rec,
        plain_tps,
        len(base),
        s["online"]["speedup_last"],
        xs_window=[r["request"] for r in on_last],
    )
    with open(os.path.join(cfg.out_dir, "summary.json"), "w") as f:
        json.dump(
            {
                "summary": s,
                "static": st_rec,
                "online": on_rec,
                "plain": base,
                "plain_window": pl_rec,
            },
            f,
            indent=1,
        )
    gain = s["online"]["alpha_last"] - s["static"]["alpha_last"]
    gain_text = s["online"]["alpha_text_last"] - s["static"]["alpha_text_last"]
    history = (
        f" (also over {cfg.lookup_history} tokens of earlier answers)" if cfg.lookup_history else ""
    )
    lookup_tokens = (
        f", lookup steps verifying up to {cfg.lookup_tokens} drafts" if cfg.lookup_tokens else ""
    )
    min_match = (
        f", lookup on matches of {cfg.lookup_min_match}+ tokens" if cfg.lookup_min_match > 1 else ""
    )
    prefix = (
        f", every engine keeping up to {cfg.prefix_cache} prompt tokens of K/V across requests"
        if cfg.prefix_cache
        else ""
    )
    lookup_alpha = (
        " (steps drafted by prompt lookup alone are in neither that α nor its count, "
        "but are in tokens/s; lookup covers the positions that are easiest to guess, "
        "so this α depends on what lookup left)"
        if cfg.prompt_lookup
        else ""
    )
    lines = [
        "# osd demo report",
        "",
        f"{label}: {n} requests, greedy, batch size 1, k = {k}"
        f"{', prompt lookup in front of the draft' if cfg.prompt_lookup else ''}"
        f"{history}{lookup_tokens}{min_match}"
        f"{_tree_phrase(cfg.lookup_tree_below)}"
        f"{', draft chains stopping where the draft is unsure (adaptive)' if cfg.adaptive else ''}"
        f", up to "
        f"{cfg.max_new_tokens} "
        f"new tokens per request, CPU fp32"
        f"{' (the target computing on its quantized GGUF weights)' if cfg.quantized else ''}"
        f"{f', the draft served in {cfg.quantize_draft}' if cfg.quantize_draft else ''}"
        f"{prefix}"
        f". Produced by `{command}` in "
        f"{seconds:.0f} s.",
        "",
        f"The last {tail} requests were served side by side: each by the online engine, "
        f"then, with its learner held, by the static draft and"
        f"{'' if cfg.plain_every == 1 else f', on one request in {cfg.plain_every},'} by the "
        f"target alone, so the speedups compare the same {len(shared)} requests at the same "
        f"time; every output equalled the target's. Draft cost ratio c = {c:.3f} (draft "
        f"decode step / target decode step, measured).",
        "",
        f"| decoding | α on the answers, last {tail} | α where the draft model drafted "
        f"| tokens/s, last {tail} | tokens/s, the "
        f"{len(shared)} served by all three | speedup | speedup after the first token "
        f"| analytic bound |",
        "|---|---|---|---|---|---|---|---|",
        f"| target alone | | | | {plain_window:.1f} | 1.00x | 1.00x | |",
    ]
    for key in ("static", "online"):
        d = s[key]
        lines.append(
            f"| {key} | {_fmt(d['alpha_text_last'])} | {d['alpha_last']:.3f} | "
            f"{d['tokens_per_s_last']:.1f} | "
            f"{d['tokens_per_s_shared']:.1f} | {d['speedup_last']:.2f}x | "
            f"{d['decode_speedup_last']:.2f}x | {d['analytic_bound_last']:.2f}x |"
        )
    lines += [
        "",
        f"Over the last {tail} requests the online draft's α on the answers is "
        f"{_fmt(s['online']['alpha_text_last'])}, {_fmt(gain_text, True)} against the static "
        f"draft's on the same answers. Where the draft model drafted, online α over the "
        f"first 20 requests: {s['online']['alpha_first20']:.3f}; over the "
        f"last {tail}: {s['online']['alpha_last']:.3f} ({gain:+.3f} against the static draft "
        f"on the same requests). Online updates applied: {s['online']['updates_applied']}, "
        f"rejected by the guard: {s['online']['updates_rejected']}. The target alone "
        f"served the first {len(base)} requests at {plain_tps:.1f} tokens/s (the live "
        f"progress and the plots' reference line). On the shared requests the target alone "
        f"spent {100 * s['plain_prefill_share']:.0f}% of its time on the prompts' prefill "
        f"and first token, which speculation does not shorten; the column after the "
        f"speedup compares the time after each request's first token.",
        "",
        "α is the exact 1 − TV(p, q) between the target's and the draft's next-token "
        "distributions (greedy: their plain softmax). α on the answers averages it over "
        "every answer position, the draft reading the answer itself (teacher-forced, "
        "measured after each request, untimed, with the online draft as it served it): the "
        "draft's acceptance on the text, whichever drafter served each step. α where the "
        "draft model drafted averages it over the positions it drafted while serving"
        f"{lookup_alpha}"
        f". The static draft served the last {len(st_rec)} requests"
        f"{', its lookup history holding the answers before them' if cfg.lookup_history else ''}.",
        "",
        "![alpha](alpha.png)",
        "",
        "![tokens/s](tokens_per_s.png)",
        "",
        "![speedup](speedup.png)",
        "",
    ]
    with open(os.path.join(cfg.out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines[4:]))
    print(f"osd demo: report written to {os.path.join(cfg.out_dir, 'report.md')}")
    return s
