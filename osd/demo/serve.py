"""The demo's serving loop (:mod:`osd.demo`): requests served one at a time with live
progress, the side-by-side comparison window, and the draft cost ratio c."""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

import osd
from osd.demo.report import _fmt, _mean, _shared_speedup, _tps
from osd.models.eagle import is_eagle_checkpoint
from osd.scoring import draft_alphas


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
