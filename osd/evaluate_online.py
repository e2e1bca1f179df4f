"""Online learning on a stream nobody tuned for: the online draft against the static one.

    >>> s = online_stream(target, draft, stream("explain", 160))     # doctest: +SKIP

Two engines built as a user builds them serve the same stream, request by request,
interleaved: ``Engine.from_pretrained(target, draft=draft, online=OnlineConfig())`` (the
draft's own recipe from its ``serving.json``, learning in a background thread) and the
same without ``online`` (the static draft). Every output must be equal (both are the
target's greedy output). The summary compares the last quarter of the stream: tokens per
target forward (what the draft's acceptance buys), tokens/s (serving with the learner on
against off, side by side), and α where the draft model drafted.
"""

from __future__ import annotations

import statistics
import sys
import time

import osd
from osd.chat_template import encode_chat
from osd.evaluate import settle_memory


def _serve(engine, ids, params):
    t = time.perf_counter()
    out = engine.generate([ids], params)[0]
    st = out.stats or {}
    return out.token_ids, {
        "seconds": time.perf_counter() - t,
        "tokens": len(out.token_ids),
        "forwards": st.get("target_forwards") or 0,
        "alpha": st.get("alpha"),
        "drafted": st.get("drafted") or 0,
    }


def _window(records):
    tokens = sum(r["tokens"] for r in records)
    drafted = sum(r["drafted"] for r in records if r["alpha"] is not None)
    alpha = sum(r["alpha"] * r["drafted"] for r in records if r["alpha"] is not None)
    return {
        "tokens_per_forward": tokens / max(1, sum(r["forwards"] for r in records)),
        "tokens_per_s": tokens / sum(r["seconds"] for r in records),
        "alpha": alpha / drafted if drafted else None,
    }


def online_stream(
    target,
    draft,
    conversations,
    *,
    max_new_tokens: int = 128,
    online: osd.OnlineConfig | None = None,
    engine_kwargs: dict | None = None,
    encode=None,
    progress: bool = True,
) -> dict:
    """Serve ``conversations`` with the online and the static draft side by side (each
    request by the online engine, then by the static one while the learner holds, so that
    the learner's work counts against the online engine's time alone); returns
    ``{"online": [...], "static": [...]}`` per-request records and ``summary`` (the last
    quarter, and the first for reference). ``encode``: conversations -> token ids
    (default: ``osd.chat_template.encode_chat``)."""
    kw = dict(max_batch_size=1, **(engine_kwargs or {}))
    learning = osd.Engine.from_pretrained(
        target, draft=draft, online=online or osd.OnlineConfig(), **kw
    )
    static = osd.Engine.from_pretrained(target, draft=draft, **kw)
    settle_memory()  # neither engine favoured by being built last
    convs = [list(c) for c in conversations]
    prompts = encode(convs) if encode is not None else encode_chat(static.tokenizer, convs)
    params = osd.SamplingParams(max_new_tokens)
    recs = {"online": [], "static": []}
    started = time.perf_counter()
    try:
        for i, ids in enumerate(prompts):
            out_on, rec_on = _serve(learning, ids, params)
            # the learner holds (its current step finished) while the static engine
            # serves: its work lands on the online engine's time, as when it serves alone
            with learning.learning_paused():
                if learning.online is not None:
                    learning.online.wait()
                out_st, rec_st = _serve(static, ids, params)
            if out_on != out_st:
                raise AssertionError(
                    f"request {i}: the online engine's output differs from "
                    f"the static engine's (both must be the target's)"
                )
            recs["online"].append(rec_on)
            recs["static"].append(rec_st)
            if progress and (i + 1) % 10 == 0:
                last = slice(max(0, i - 19), i + 1)
                on, st = _window(recs["online"][last]), _window(recs["static"][last])
                eta = (time.perf_counter() - started) / (i + 1) * (len(prompts) - i - 1)
                print(
                    f"[osd.evaluate_online] {i + 1}/{len(prompts)}: tokens per forward "
                    f"online {on['tokens_per_forward']:.2f} static "
                    f"{st['tokens_per_forward']:.2f} (last 20), ETA {eta:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
        learning.close()  # finish pending updates
        stats = learning.stats
        updates = stats["online"].get("updates_applied")
        # the chain lengths' goodput and steps (osd.SpecConfig.auto_k), while the learner
        # was idle and while it trained
        arms = {k: stats[k] for k in ("auto_k", "auto_k_learning") if k in stats}
    finally:
        learning.close()
        static.close()
    q = max(1, len(prompts) // 4)
    summary = {}
    for part, sl in (("first_quarter", slice(0, q)), ("last_quarter", slice(-q, None))):
        on, st = _window(recs["online"][sl]), _window(recs["static"][sl])
        summary[part] = {
            "online": on,
            "static": st,
            "tokens_per_forward_gain": on["tokens_per_forward"] - st["tokens_per_forward"],
            "speed_ratio": on["tokens_per_s"] / st["tokens_per_s"],
        }
    summary["requests"] = len(prompts)
    summary["updates_applied"] = updates
    summary.update(arms)
    summary["median_tokens"] = statistics.median(r["tokens"] for r in recs["static"])
    return {**recs, "summary": summary}


__all__ = ["online_stream"]
