"""The main job (``make demo`` / ``osd demo``): serve a shifted query stream with online
speculative decoding, and report what happened.

Two pairs:

- ``chat`` (default): SmolLM2-135M-Instruct from its GGUF and its shipped draft
  (``osd.zoo.chat_pair``), serving HumanEval's coding tasks as chat requests
  (``osd.zoo.humaneval``), which the draft was not trained on;
- ``builtin``: the 8.7M-parameter pair trained on the standard library
  (``osd.zoo.default_pair``), serving code windows to a draft trained mostly on prose.

Each request is served at batch size 1, greedy:

1. the target alone (plain decoding) on the first ``baseline_requests`` requests: the
   reference of the live progress and of the plots;
2. speculative decoding with **online** distillation on over the whole stream (the
   draft learns in a background thread from the target's verdicts; updates are swapped
   in between decode steps);
3. on the last ``static_requests`` requests (all of them for the built-in pair), side by
   side with the online engine: after the online engine serves a request, its learner
   holds while speculative decoding with the draft kept **static** and the target alone
   serve the same request. The report's speedups are the tokens/s of these three over
   that window, measured at the same time on the same requests, and every output there
   must equal the target's. With ``lookup_history``, the static engine's history first
   receives the answers of the requests before the window, as the online pass had them.

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
from osd.zoo import humaneval
from osd.chat import apply_chat_template
from osd.evaluate import analytic_speedup
from osd.models.eagle import is_eagle_checkpoint
from osd.models.loading import load_tokenizer
from osd.models.quant import FORMATS as QUANT_FORMATS
from osd.online.config import draft_online_recipe, with_recipe
from osd.scoring import draft_alphas

PAIRS = ("chat", "builtin")
DRAFTS = ("model", "eagle")


@dataclasses.dataclass
class DemoConfig:
    """What the demo serves and where it writes its report. ``None`` fields take the
    pair's defaults (:data:`DEFAULTS`)."""

    pair: str = "chat"  # "chat" or "builtin"
    requests: int = 200  # requests in the stream
    baseline_requests: int | None = None  # first n served by the target alone
    static_requests: int | None = None  # last n served by the static draft
    plain_every: int = 2  # in that window the target alone serves every
    #                                        n-th request (the speedups' requests)
    max_new_tokens: int | None = None  # tokens generated per request (greedy)
    num_draft_tokens: int | None = None  # k
    prompt_lookup: bool | None = None  # prompt lookup in front of the draft model
    lookup_history: int | None = None  # prompt lookup also over this many tokens of
    #                                        earlier answers (SpecConfig.lookup_history)
    lookup_tokens: int | None = None  # most drafts of a lookup step
    #                                        (SpecConfig.lookup_tokens; 0: k)
    lookup_min_match: int | None = None  # shortest suffix prompt lookup matches
    #                                        (SpecConfig.ngram_min; at most ngram_max, 3)
    lookup_tree_below: int | None = None  # shorter matches verify beside the draft
    #                                        model's chain, in one tree
    #                                        (SpecConfig.lookup_tree_below; 0: off)
    adaptive: bool = False  # the draft model's chains stop where it is
    #                                        unsure (SpecConfig.adaptive; k is the longest)
    draft: str | None = None  # chat pair: "model" (the standalone draft) or
    #                                        "eagle" (the EAGLE draft on the target's features)
    quantized: bool = False  # chat pair: the target keeps its GGUF weights
    #                                        quantized (Engine.from_pretrained(quantized=True))
    quantize_draft: str | None = None  # the draft served in this block format
    #                                        (Engine(quantize_draft=...); it still learns, in
    #                                        float32); "none": float32 (chat default Q8_0)
    prefix_cache: int = 0  # prompt tokens whose target K/V every engine
    #                                        keeps across requests (Engine(prefix_cache=...))
    seed: int = 0  # query-stream seed
    threads: int | None = None  # torch intra-op threads (1: serving and the
    # learner thread each keep a core busy)
    out_dir: str = "reports/demo"  # report directory
    online: osd.OnlineConfig | None = None

    def __post_init__(self):
        if self.pair not in PAIRS:
            raise ValueError(f"pair must be one of {PAIRS}, got {self.pair!r}")
        if self.adaptive and self.lookup_tree_below is None:
            self.lookup_tree_below = 0  # adaptive chains replace the lookup trees
        if self.prompt_lookup is False and self.lookup_min_match is None:
            self.lookup_min_match = 1  # the pair's default needs prompt lookup
        for name, value in DEFAULTS[self.pair].items():
            if getattr(self, name) is None:
                setattr(self, name, value() if callable(value) else value)
        if self.draft not in DRAFTS or (self.draft == "eagle" and self.pair != "chat"):
            raise ValueError(
                f"draft must be one of {DRAFTS} (eagle: the chat pair only), got {self.draft!r}"
            )
        if not 1 <= self.lookup_min_match <= osd.SpecConfig.ngram_max:
            raise ValueError(
                f"lookup_min_match must be in 1..{osd.SpecConfig.ngram_max}, got "
                f"{self.lookup_min_match}"
            )
        if self.lookup_history and not self.prompt_lookup:
            raise ValueError("lookup_history needs prompt_lookup")
        if self.lookup_min_match > 1 and not self.prompt_lookup:
            raise ValueError("lookup_min_match needs prompt_lookup")
        if self.lookup_tree_below and not self.prompt_lookup:
            raise ValueError("lookup_tree_below needs prompt_lookup")
        if self.lookup_tree_below and self.adaptive:
            raise ValueError(
                "lookup_tree_below and adaptive do not combine (pass "
                "--lookup-tree-below 0 with --adaptive)"
            )
        if self.quantized and self.pair != "chat":
            raise ValueError("quantized needs the chat pair (a GGUF target)")
        if self.quantize_draft == "none":
            self.quantize_draft = None
        if self.quantize_draft not in (None, *QUANT_FORMATS):
            raise ValueError(
                f"quantize_draft must be one of {QUANT_FORMATS} or 'none', got "
                f"{self.quantize_draft!r}"
            )
        if (
            self.requests < 1
            or self.baseline_requests < 1
            or self.static_requests < 1
            or self.plain_every < 1
        ):
            raise ValueError(
                "requests, baseline_requests, static_requests and plain_every must be >= 1"
            )
        self.baseline_requests = min(self.baseline_requests, self.requests)
        self.static_requests = min(self.static_requests, self.requests)


def online_recipe(pair: str) -> osd.OnlineConfig:
    """The online config the demo serves ``pair`` (``"chat"`` or ``"builtin"``) with: the
    recipe its draft carries in ``serving.json`` (``osd.online.config.draft_online_recipe``)
    over ``OnlineConfig()``, as ``Engine.from_pretrained`` applies it, so the demo learns
    as a user's engine would. The chat draft's recipe is the default one fed each request's
    newest 128 tokens (the demo's prompts are long, its answers short); ``docs/online.md``
    gives the reasons for each setting."""
    draft = zoo.chat.DRAFT_DIR if pair == "chat" else zoo.default_pair()[1]
    return with_recipe(osd.OnlineConfig(), draft_online_recipe(draft))


DEFAULTS = {
    "chat": dict(
        baseline_requests=8,
        static_requests=50,
        max_new_tokens=48,
        num_draft_tokens=3,
        threads=1,
        prompt_lookup=True,
        lookup_history=65536,
        lookup_min_match=2,
        lookup_tokens=8,
        lookup_tree_below=4,
        draft="model",
        quantize_draft="Q8_0",
        online=lambda: online_recipe("chat"),
    ),
    "builtin": dict(
        baseline_requests=40,
        static_requests=200,
        max_new_tokens=32,
        num_draft_tokens=4,
        threads=1,
        prompt_lookup=False,
        lookup_history=0,
        lookup_min_match=1,
        lookup_tokens=0,
        lookup_tree_below=0,
        draft="model",
        quantize_draft="none",
        online=lambda: online_recipe("builtin"),
    ),
}


def draft_cost_ratio(
    target_dir: str,
    draft_dir: str,
    steps: int = 30,
    quantized: bool = False,
    quantize_draft: str | None = None,
) -> float:
    """c: one draft decode step's time over one target decode step's, measured side by
    side (interleaved, median of ``steps``). An EAGLE draft's step reads a feature.
    ``quantized``: the target (a GGUF file) keeps its quantized weights;
    ``quantize_draft``: the draft's layers and head are kept in that block format."""
    target = osd.load_model(target_dir, quantized=quantized)
    draft = (
        osd.load_eagle(draft_dir, target)
        if is_eagle_checkpoint(draft_dir)
        else osd.load_model(draft_dir)
    )
    if quantize_draft is not None:
        draft = osd.models.quantize_linears(draft, quantize_draft)
    models = [target, draft]
    caches = [m.new_cache(1, 256) for m in models]
    ids = torch.tensor([[1]])
    kw = [
        {},
        {"features": torch.zeros(1, 1, target.config.hidden_size)}
        if isinstance(draft, osd.EagleLM)
        else {},
    ]
    times = [[], []]
    with torch.inference_mode():
        for c in caches:
            c.lens[0] = 64
            c.set_bound(64)
        for _ in range(steps):
            for i, (m, c) in enumerate(zip(models, caches)):
                t0 = time.perf_counter()
                m(ids, c, **kw[i])
                times[i].append(time.perf_counter() - t0)
    med = [sorted(t)[len(t) // 2] for t in times]
    return med[1] / med[0]


def _timed(engine, prompt, params, i: int):
    """Serve one request -> ``(output, record)``; the record's ``prefill_seconds`` is the
    time its prompt's prefill (and first token) took, from the engine's phase times."""
    prefill0 = engine.stats["time_s"]["prefill"]
    t0 = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    dt = time.perf_counter() - t0
    st = out.stats or {}
    return out, {
        "request": i,
        "tokens": len(out.token_ids),
        "seconds": dt,
        "prefill_seconds": engine.stats["time_s"]["prefill"] - prefill0,
        "alpha": st.get("alpha"),
        "accepted": st.get("accepted"),
        "drafted": st.get("drafted"),
    }


def _serve(
    engine,
    prompts,
    params,
    label: str,
    plain_tps: float | None = None,
    first_index: int = 0,
    outputs: list | None = None,
):
    """Serve prompts one at a time with a progress bar; per-request records (``request``
    numbered from ``first_index``). ``outputs``: a list to append the token ids to."""
    records = []
    bar = tqdm(prompts, desc=label, unit="req", dynamic_ncols=True)
    for i, prompt in enumerate(bar, start=first_index):
        out, rec = _timed(engine, prompt, params, i)
        if outputs is not None:
            outputs.append(out.token_ids)
        records.append(rec)
        window = records[-20:]
        tps = _tps(window)
        post = {"tok/s": f"{tps:.0f}"}
        alphas = [r["alpha"] for r in window if r["alpha"] is not None]
        if alphas:
            post["alpha"] = f"{sum(alphas) / len(alphas):.3f}"
        if plain_tps:
            post["speedup"] = f"{tps / plain_tps:.2f}x"
        bar.set_postfix(post)
    return records


def _side_by_side(
    online, static, plain, prompts, params, first_index: int, outputs: list, plain_every: int
) -> dict[str, list]:
    """The comparison window: each request served by the online engine (its learner
    running as in the rest of the stream), then, with the learner held
    (``Engine.learning_paused``), by the static draft and, every ``plain_every``-th
    request, by the target alone, so that the speedups compare the same requests at the
    same time on this shared machine. Every output must equal the online engine's (the
    target's). The online and static records also carry ``alpha_text``, each draft's
    teacher-forced α over the whole answer (``osd.scoring.draft_alphas``). Records per
    engine name."""
    recs = {"online": [], "static": [], "plain": []}
    bar = tqdm(prompts, desc="side by side", unit="req", dynamic_ncols=True)
    for n, prompt in enumerate(bar):
        i = first_index + n
        out, rec = _timed(online, prompt, params, i)
        outputs.append(out.token_ids)
        recs["online"].append(rec)
        engines = [("static", static)] + ([("plain", plain)] if n % plain_every == 0 else [])
        with online.learning_paused():
            for name, engine in engines:
                other, rec = _timed(engine, prompt, params, i)
                recs[name].append(rec)
                if other.token_ids != out.token_ids:
                    raise AssertionError(
                        f"request {i}: the {name} engine's output differs from the online engine's"
                    )
            # Each draft's α on the answer itself (teacher-forced, every position),
            # untimed: the online draft as it served this request.
            a_on, a_st = draft_alphas(
                online.model,
                [online.draft, static.draft],
                list(prompt) + out.token_ids,
                len(prompt),
            )
            recs["online"][-1]["alpha_text"] = a_on
            recs["static"][-1]["alpha_text"] = a_st
        post = {
            "alpha": f"{_mean([r['alpha'] for r in recs['online'][-20:]]):.3f}",
            "alpha on answers": _fmt(_mean([r.get("alpha_text") for r in recs["online"][-20:]])),
        }
        for name in ("online", "static"):
            post[name] = f"{_shared_speedup(recs[name], recs['plain']):.2f}x"
        bar.set_postfix(post)
    return recs


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


def _stream(cfg: DemoConfig):
    """``(target, draft, prompts, label)`` of the configured pair: token-id prompts."""
    if cfg.pair == "builtin":
        target, draft = zoo.default_pair()
        prompts = zoo.query_stream("code", n=cfg.requests, prompt_tokens=48, seed=cfg.seed)
        return target, draft, prompts, "built-in pair (`osd.zoo`), code queries"
    target, draft = zoo.chat_pair()
    if cfg.draft == "eagle":
        draft = zoo.chat_eagle()
    if draft is None:
        name, script = (
            ("chat_eagle", "build_chat_eagle.py")
            if cfg.draft == "eagle"
            else ("chat_draft", "build_chat_draft.py")
        )
        raise FileNotFoundError(
            f"the chat pair has no draft (osd/zoo/weights/{name}); build it with scripts/{script}"
        )
    prompts = apply_chat_template(
        load_tokenizer(target), humaneval.conversations(cfg.requests, seed=cfg.seed)
    )
    which = "its EAGLE draft" if cfg.draft == "eagle" else "its draft"
    return (
        target,
        draft,
        prompts,
        f"SmolLM2-135M-Instruct (GGUF) and {which}, HumanEval chat requests",
    )


def run_demo(cfg: DemoConfig | None = None) -> dict:
    """Run the demo and write the report; returns the summary dict."""
    cfg = cfg or DemoConfig()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    print(f"osd demo: preparing the {cfg.pair} pair ...", flush=True)
    target_dir, draft_dir, prompts, label = _stream(cfg)
    params = osd.SamplingParams(cfg.max_new_tokens)
    k = cfg.num_draft_tokens
    max_len = max(len(p) for p in prompts) + cfg.max_new_tokens + 8
    c = draft_cost_ratio(
        target_dir, draft_dir, quantized=cfg.quantized, quantize_draft=cfg.quantize_draft
    )
    print(f"osd demo: {cfg.requests} queries ({label}); draft cost ratio c = {c:.3f}", flush=True)

    plain = osd.Engine.from_pretrained(
        target_dir,
        max_batch_size=1,
        max_seq_len=max_len,
        quantized=cfg.quantized,
        prefix_cache=cfg.prefix_cache,
    )
    base_out = []
    base = _serve(plain, prompts[: cfg.baseline_requests], params, "target alone", outputs=base_out)
    plain_tps = _tps(base)
    spec = osd.SpecConfig(
        num_draft_tokens=k,
        prompt_lookup=cfg.prompt_lookup,
        lookup_history=cfg.lookup_history,
        lookup_tokens=cfg.lookup_tokens,
        ngram_min=cfg.lookup_min_match,
        adaptive=cfg.adaptive,
        lookup_tree_below=cfg.lookup_tree_below,
    )
    online = osd.Engine.from_pretrained(
        target_dir,
        draft=draft_dir,
        spec=spec,
        online=cfg.online,
        max_batch_size=1,
        max_seq_len=max_len,
        quantized=cfg.quantized,
        quantize_draft=cfg.quantize_draft,
        prefix_cache=cfg.prefix_cache,
    )
    static = osd.Engine.from_pretrained(
        target_dir,
        draft=draft_dir,
        spec=spec,
        max_batch_size=1,
        max_seq_len=max_len,
        quantized=cfg.quantized,
        quantize_draft=cfg.quantize_draft,
        prefix_cache=cfg.prefix_cache,
    )
    first_static = cfg.requests - cfg.static_requests
    outputs = []
    on_rec = _serve(
        online, prompts[:first_static], params, "online draft", plain_tps, outputs=outputs
    )
    if static.lookup_history is not None:
        # The answers served before its first request, as the online engine had them
        # (greedy outputs are the target's whichever draft served them).
        for prompt, ids in zip(prompts[:first_static], outputs):
            static.lookup_history.add(prompt, ids)
    window = _side_by_side(
        online,
        static,
        plain,
        prompts[first_static:],
        params,
        first_static,
        outputs,
        cfg.plain_every,
    )
    on_rec += window["online"]
    st_rec = window["static"]
    online.close()
    # Outputs are lossless: the online engine's answers equal the target's wherever both
    # served (the first requests, and the window, checked as it ran).
    for i, ref in enumerate(base_out):
        if ref != outputs[i]:
            raise AssertionError(f"request {i}: speculative output differs from the target's")
    summary = _report(
        cfg,
        label,
        c,
        base,
        st_rec,
        on_rec,
        window["plain"],
        online.stats,
        plain_tps,
        time.perf_counter() - t_start,
    )
    return summary


def _plots(cfg, c, st_rec, on_rec, plain_tps, n_base, window_speedup, xs_window) -> None:
    """alpha.png, tokens_per_s.png, speedup.png: rolling over 20 requests (α: mean, where
    the draft model drafted, and on the answers over the window ``xs_window``;
    tokens/s: tokens over seconds), against the target alone's rate on the first
    ``n_base`` requests, with the side-by-side window's measured speedup beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


# DemoConfig fields and the `osd demo` options that set them (the report's command)
_OPTIONS = (
    ("draft", "--draft"),
    ("quantized", "--quantized"),
    ("quantize_draft", "--quantize-draft"),
    ("lookup_history", "--lookup-history"),
    ("lookup_tokens", "--lookup-tokens"),
    ("lookup_min_match", "--lookup-min-match"),
    ("lookup_tree_below", "--lookup-tree-below"),
    ("adaptive", "--adaptive"),
    ("max_new_tokens", "--max-new-tokens"),
    ("num_draft_tokens", "-k"),
    ("requests", "--requests"),
    ("baseline_requests", "--baseline"),
    ("static_requests", "--static"),
    ("plain_every", "--plain-every"),
    ("prefix_cache", "--prefix-cache"),
    ("seed", "--seed"),
    ("threads", "--threads"),
)


def _command(cfg: DemoConfig) -> str:
    """The ``osd demo`` command line of ``cfg``: its pair and every option whose value is
    not the pair's default."""
    fields = {f.name: f.default for f in dataclasses.fields(DemoConfig)}
    parts = ["osd demo", f"--pair {cfg.pair}"]
    for name, flag in _OPTIONS:
        default = DEFAULTS[cfg.pair].get(name, fields[name])
        if name == "lookup_tree_below" and cfg.adaptive:
            default = 0  # --adaptive turns lookup trees off
        value = getattr(cfg, name)
        if value == (None if default == "none" else default):
            continue
        if isinstance(value, bool):
            parts.append(flag)
        else:
            parts.append(f"{flag} {'none' if value is None else value}")
    return " ".join(parts)


def _report(cfg, label, c, base, st_rec, on_rec, pl_rec, online_stats, plain_tps, seconds) -> dict:
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
        f". Produced by `{_command(cfg)}` in "
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
