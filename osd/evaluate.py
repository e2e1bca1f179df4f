"""Speedup per workload: plain against speculative decoding, prompt by prompt.

    >>> rows = evaluate(target, draft, workloads=evaluation_set(n=6))   # doctest: +SKIP

For each workload of :func:`osd.zoo.workloads.evaluation_set` (or the caller's), every
prompt runs through a plain engine and a speculative engine built as a user builds them
(``Engine.from_pretrained(target)`` and ``Engine.from_pretrained(target, draft=draft)``,
the draft's own ``serving.json`` settings), interleaved prompt by prompt so that a noisy
machine hits both alike. Each prompt runs once on each engine, after one warm-up request
of other text at the start: an engine whose prompt lookup searches earlier answers
(``lookup_history``) would otherwise find the timed answer in the warm-up's. Each row
reports:

- ``speedup``: the median over prompts of speculative tokens/s / plain tokens/s (end to
  end, prefill included; greedy outputs are equal, so this is plain time / speculative
  time, while sampled outputs differ and may stop at different lengths), and the tokens/s
  of both over the workload;
- ``alpha``: the draft model's mean 1 - TV(p, q) where it drafted; ``accept``: the share of
  drafted tokens accepted (prompt lookup's included); ``tokens_per_forward``: tokens
  emitted per target forward;
- ``c``: the cost of one draft-model token against one plain decode step (time per
  drafted token over plain time per token), and ``bound``: the analytic speedup
  ``(1 - α^(k+1)) / ((1 - α)(c k + 1))`` of a chain of ``k`` drafts of the draft model
  alone (prompt lookup can beat it: its drafts cost almost nothing);
- ``equal``: greedy only, whether every speculative output equals the plain one.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import osd
from osd.chat_template import encode_chat
from osd.spec import describe
from osd.zoo.workloads import evaluation_set


WARM_UP = "Say hello in one short sentence."


def analytic_speedup(alpha: float, k: int, c: float) -> float:
    """Expected speedup ``(1 - α^(k+1)) / ((1 - α)(c k + 1))`` of a chain of ``k`` drafts
    accepted i.i.d. with probability ``alpha``, each costing ``c`` target forwards
    (Leviathan et al.; ``REFERENCE.md`` §1)."""
    if k <= 0:
        return 1.0
    tokens = (k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (c * k + 1)


def _timed(engine, ids, params):
    engine.reset_stats()
    t = time.perf_counter()
    out = engine.generate([ids], params)[0]
    return time.perf_counter() - t, out, engine.stats


def settle_memory(gigabytes: float = 1.0) -> None:
    """Touch and free ``gigabytes`` of fresh memory. On the 2-core VM the benchmarks ran
    on, of identical engines built one after another in a process the last built often
    ran a few percent faster than the others; a gigabyte touched after building them, or a
    few minutes' wait, evened them out in most runs of ``scripts/build_order.py``, though
    not in every comparison. A side-by-side comparison calls this after building its
    engines to reduce that bias. About 0.3 s a gigabyte."""
    ballast = torch.ones(int(gigabytes * 2**30), dtype=torch.uint8)  # every page written
    del ballast


def evaluate(
    target,
    draft=None,
    *,
    workloads=None,
    max_new_tokens: int = 128,
    sampling: dict | None = None,
    spec=None,
    engine_kwargs: dict | None = None,
    encode=None,
    progress: bool = True,
) -> list[dict]:
    """One row per workload (see the module docstring). ``sampling``: extra
    :class:`~osd.SamplingParams` fields (default greedy); ``spec``: a
    :class:`~osd.SpecConfig` instead of the draft's recommendations (None); a draft-free
    ``spec`` (``drafter="ngram"`` or ``"self"``) needs ``draft=None``. ``encode``:
    conversations -> token ids (default: ``osd.chat_template.encode_chat``: the target
    tokenizer's chat template or, for a base model, a question-and-answer transcript)."""
    workloads = evaluation_set() if workloads is None else workloads
    kw = dict(max_batch_size=1, **(engine_kwargs or {}))
    plain = osd.Engine.from_pretrained(target, **kw)
    fast = osd.Engine.from_pretrained(target, draft=draft, spec=spec, **kw)
    settle_memory()
    sampling = dict(sampling or {})
    greedy = float(sampling.get("temperature", 0.0)) == 0.0
    k = fast.spec.num_draft_tokens if fast.spec is not None else 0
    warm = [[{"role": "user", "content": WARM_UP}]]
    warm_ids = (encode(warm) if encode is not None else encode_chat(plain.tokenizer, warm))[0]
    for engine in (plain, fast):
        engine.generate([warm_ids], osd.SamplingParams(16))
    rows = []
    for w in workloads:
        convs = [list(p) for p in w.prompts]
        ids = encode(convs) if encode is not None else encode_chat(plain.tokenizer, convs)
        ratios, t_plain, t_fast, n_plain, n_fast = [], 0.0, 0.0, 0, 0
        equal, forwards, drafted, accepted = True, 0, 0, 0
        alpha_sum = alpha_n = draft_s = plain_decode_s = 0.0
        started = time.perf_counter()
        for i, prompt in enumerate(ids):
            params = osd.SamplingParams(max_new_tokens, seed=i, **sampling)
            tp, op, sp = _timed(plain, prompt, params)
            tf, of, sf = _timed(fast, prompt, params)
            # per token: a sampled answer of either engine may end early (EOS)
            ratios.append((len(of.token_ids) / tf) / max(1, len(op.token_ids)) * tp)
            t_plain, t_fast = t_plain + tp, t_fast + tf
            n_plain, n_fast = n_plain + len(op.token_ids), n_fast + len(of.token_ids)
            equal = equal and op.token_ids == of.token_ids
            forwards += sf["target_forwards"]
            drafted, accepted = drafted + sf["drafted"], accepted + sf["accepted"]
            if sf["alpha"] is not None:
                alpha_sum += sf["alpha"] * sf["drafted"]
                alpha_n += sf["drafted"]
            draft_s += sf["time_s"]["draft"]
            plain_decode_s += sp["time_s"]["verify"] + sp["time_s"]["sample"]
            if progress:
                done = i + 1
                eta = (time.perf_counter() - started) / done * (len(ids) - done)
                print(
                    f"\r[osd.evaluate] {w.name}: {done}/{len(ids)} prompts, "
                    f"speedup so far {statistics.median(ratios):.2f}x, ETA {eta:.0f} s",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
        if progress:
            print(file=sys.stderr)
        alpha = alpha_sum / alpha_n if alpha_n else None
        c = (draft_s / drafted) / (plain_decode_s / max(1, n_plain)) if drafted else None
        rows.append(
            {
                "workload": w.name,
                "prompts": len(ids),
                "speedup": statistics.median(ratios),
                "plain_tokens_per_s": n_plain / t_plain,
                "spec_tokens_per_s": n_fast / t_fast,
                "alpha": alpha,
                "accept": accepted / drafted if drafted else None,
                "tokens_per_forward": n_fast / forwards if forwards else None,
                "c": c,
                "k": k,
                "bound": analytic_speedup(alpha, k, c) if alpha is not None and c else None,
                "equal": equal if greedy else None,
                "spec": describe(fast.spec) if fast.spec is not None else None,
                "draft_served": fast.draft is not None,
            }
        )
    plain.close()
    fast.close()
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = [
        "| workload | prompts | plain tok/s | spec tok/s | speedup (median) | α | "
        "accepted | tokens / forward | c | bound (model chain) | greedy equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['prompts']} | {r['plain_tokens_per_s']:.1f} | "
            f"{r['spec_tokens_per_s']:.1f} | **{r['speedup']:.2f}x** | {f(r['alpha'], '.3f')} | "
            f"{f(r['accept'], '.2f')} | {f(r['tokens_per_forward'], '.2f')} | "
            f"{f(r['c'], '.3f')} | {f(r['bound'], '.2f')} | "
            f"{'-' if r['equal'] is None else ('yes' if r['equal'] else 'NO')} |"
        )
    return "\n".join(lines)


def plot(
    cases: dict[str, list[dict]],
    path: str,
    *,
    goals: dict[str, float] | None = None,
    title: str | None = None,
) -> None:
    """A PNG of the speedup per workload: one group of bars a workload, one bar a case
    (``cases``: a label, such as ``"greedy"`` or ``"sampled"``, to its :func:`evaluate`
    rows), each bar labelled with its speedup and tokens per target forward; a dashed line
    at 1x (plain decoding) and a dotted line per entry of ``goals`` (a label to a
    speedup)."""
    # matplotlib loads only when a plot is drawn (it is slow to import), and its Agg
    # backend must be chosen before pyplot is imported
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"), see above

    labels = [name for name, rows in cases.items() if rows]
    workloads: list[str] = []
    for name in labels:
        workloads += [r["workload"] for r in cases[name] if r["workload"] not in workloads]
    if not workloads:
        raise ValueError("plot needs at least one case with rows")
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(workloads) * max(1, len(labels) / 2), 3.8))
    top = 1.0
    for j, name in enumerate(labels):
        by = {r["workload"]: r for r in cases[name]}
        xs = [i + (j - (len(labels) - 1) / 2) * width for i, w in enumerate(workloads) if w in by]
        rows = [by[w] for w in workloads if w in by]
        bars = ax.bar(xs, [r["speedup"] for r in rows], width * 0.95, label=name)
        for bar, r in zip(bars, rows):
            tpf = r.get("tokens_per_forward")
            note = f"{r['speedup']:.2f}x" + ("" if tpf is None else f"\n{tpf:.2f} t/f")
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                bar.get_height(),
                note,
                ha="center",
                va="bottom",
                fontsize=7,
            )
            top = max(top, r["speedup"])
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    for name, value in (goals or {}).items():
        ax.axhline(value, color="tab:red", linestyle=":", linewidth=1)
        ax.text(
            len(workloads) - 0.5,
            value,
            f" {name}",
            color="tab:red",
            va="bottom",
            ha="right",
            fontsize=7,
        )
        top = max(top, value)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylim(0, top * 1.25)
    ax.set_ylabel("speedup over plain decoding (median)")
    ax.set_title(title or "speedup per workload (t/f: tokens per target forward)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["evaluate", "table", "plot", "analytic_speedup"]
