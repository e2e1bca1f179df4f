"""``/metrics`` of ``osd serve``: the server's counters and the engine's statistics in the
Prometheus text format, under vLLM's spec-decode metric names prefixed ``osd:``
(``docs/serving.md`` lists them)."""

import math
from dataclasses import dataclass, field


@dataclass
class Counters:
    """Server-side counters for ``/metrics`` (touched only on the event loop's thread)."""

    running: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finished: dict = field(default_factory=lambda: {"stop": 0, "length": 0})
    aborted: dict = field(default_factory=lambda: {"client_disconnect": 0})
    stop_strings: int = 0  # requests a stop string ended
    api_errors: dict = field(default_factory=dict)  # (status, type) -> count


def _position_counts(async_engine, stats: dict) -> tuple[list[int], list[int]]:
    """Per draft position: (drafted, accepted) counts, summed over drafts. ``stats``
    carries them when the engine reports counts; otherwise they are read from the
    speculators' ``SpecStats`` (``as_dict`` reports only their ratios)."""
    if "drafted_at" in stats and "accepted_at" in stats:
        return list(stats["drafted_at"]), list(stats["accepted_at"])
    drafted: list[int] = []
    accepted: list[int] = []
    for sp in getattr(async_engine.engine, "speculators", None) or []:
        st = sp.stats
        for i, (d, a) in enumerate(zip(list(st.drafted_at), list(st.accepted_at))):
            if i == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d
            accepted[i] += a
    return drafted, accepted


def _label(labels: dict) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""


def _num(v) -> str:
    if v is None:
        return "NaN"
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")
    return repr(float(v)) if isinstance(v, float) else str(int(v))


def engine_snapshot(async_engine) -> tuple[dict, list[int], list[int]]:
    """``(stats, drafted_at, accepted_at)``: what ``/metrics`` reports of the engine.
    Blocking (``AsyncEngine.stats`` waits for the running step), so called in a thread."""
    stats = async_engine.stats
    return (stats, *_position_counts(async_engine, stats))


def metrics_text(snapshot: tuple[dict, list[int], list[int]], counters: Counters) -> str:
    """The Prometheus text exposition (format 0.0.4) of an :func:`engine_snapshot` and
    the server's counters."""
    stats, drafted_at, accepted_at = snapshot
    online = stats.get("online") or {}
    lines: list[str] = []

    def family(name: str, typ: str, help_: str, samples) -> None:
        # Counter names end in "_total" in the TYPE line too, as prometheus_client writes
        # them (its parser then reports the family without the suffix).
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {typ}")
        if not isinstance(samples, list):
            samples = [({}, samples)]
        for labels, value in samples:
            lines.append(f"{name}{_label(labels)} {_num(value)}")

    family(
        "osd:spec_decode_num_drafts_total",
        "counter",
        "Speculative steps that drafted at least one token, per request.",
        drafted_at[0] if drafted_at else 0,
    )
    family(
        "osd:spec_decode_num_draft_tokens_total",
        "counter",
        "Draft tokens proposed.",
        stats.get("drafted", 0),
    )
    family(
        "osd:spec_decode_num_accepted_tokens_total",
        "counter",
        "Draft tokens accepted.",
        stats.get("accepted", 0),
    )
    family(
        "osd:spec_decode_num_accepted_tokens_per_pos_total",
        "counter",
        "Draft tokens accepted at each draft position.",
        [({"position": i}, a) for i, a in enumerate(accepted_at)],
    )
    family(
        "osd:spec_decode_num_draft_tokens_per_pos_total",
        "counter",
        "Draft tokens proposed at each draft position.",
        [({"position": i}, d) for i, d in enumerate(drafted_at)],
    )
    family(
        "osd:spec_decode_num_lookup_steps_total",
        "counter",
        "Verify steps drafted by prompt lookup.",
        stats.get("lookup_steps", 0),
    )
    family(
        "osd:spec_decode_acceptance_rate",
        "gauge",
        "Accepted / drafted tokens since start (NaN before any draft).",
        stats.get("acceptance_rate"),
    )
    family(
        "osd:spec_decode_alpha",
        "gauge",
        "Exact per-position acceptance probability 1 - TV(p, q), averaged over drafted "
        "positions (NaN when not measured).",
        stats.get("alpha"),
    )
    family(
        "osd:spec_decode_mean_accepted_length",
        "gauge",
        "Tokens emitted per sequence per verify step.",
        stats.get("mean_accepted_length"),
    )
    family(
        "osd:target_forwards_total",
        "counter",
        "Target decode / verify forwards (one per batch step).",
        stats.get("target_forwards", 0),
    )
    family(
        "osd:engine_requests_total",
        "counter",
        "Requests the engine finished.",
        stats.get("requests", 0),
    )
    family(
        "osd:generation_tokens_total",
        "counter",
        "Tokens the engine generated.",
        stats.get("generated_tokens", 0),
    )
    family(
        "osd:engine_tokens_per_second",
        "gauge",
        "Generated tokens over the engine's busy wall time.",
        stats.get("tokens_per_s"),
    )
    family(
        "osd:engine_time_seconds_total",
        "counter",
        "Engine time by phase.",
        [({"phase": k}, v) for k, v in sorted((stats.get("time_s") or {}).items())],
    )
    family(
        "osd:engine_errors_total",
        "counter",
        "Engine request failures by kind.",
        [({"kind": k}, v) for k, v in sorted((stats.get("errors") or {}).items())],
    )
    prefix = stats.get("prefix_cache") or {}
    family(
        "osd:prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache (0 without --prefix-cache).",
        prefix.get("tokens_looked_up", 0),
    )
    family(
        "osd:prefix_cache_hits_total",
        "counter",
        "Prompt tokens whose K/V came from the prefix cache.",
        prefix.get("tokens_reused", 0),
    )
    family(
        "osd:prefix_cache_tokens",
        "gauge",
        "Prompt tokens of K/V the prefix cache holds.",
        prefix.get("tokens", 0),
    )
    family(
        "osd:online_updates_applied_total",
        "counter",
        "Online draft updates applied (0 without --online).",
        online.get("updates_applied", 0),
    )
    family(
        "osd:online_updates_rejected_total",
        "counter",
        "Online draft updates rejected by the guard.",
        online.get("updates_rejected", 0),
    )
    family(
        "osd:online_learners_busy",
        "gauge",
        "Online learners with an update queued or running (0 when idle).",
        online.get("learners_busy", 0),
    )
    windows = [a for a in online.get("alpha_per_window", []) if a is not None]
    family(
        "osd:online_alpha_last_window",
        "gauge",
        "Mean acceptance of the latest window of requests (online learning).",
        windows[-1] if windows else None,
    )
    family(
        "osd:num_requests_running", "gauge", "Requests in flight on this server.", counters.running
    )
    family(
        "osd:request_success_total",
        "counter",
        "Finished requests by finish reason.",
        [({"finished_reason": k}, v) for k, v in sorted(counters.finished.items())],
    )
    family(
        "osd:request_aborted_total",
        "counter",
        "Requests aborted in the engine because the client left.",
        [({"reason": k}, v) for k, v in sorted(counters.aborted.items())],
    )
    family(
        "osd:request_stop_string_total",
        "counter",
        "Requests a stop string ended.",
        counters.stop_strings,
    )
    family(
        "osd:prompt_tokens_total",
        "counter",
        "Prompt tokens of accepted requests.",
        counters.prompt_tokens,
    )
    family(
        "osd:completion_tokens_total",
        "counter",
        "Completion tokens returned.",
        counters.completion_tokens,
    )
    family(
        "osd:api_errors_total",
        "counter",
        "Error responses by status and type.",
        [({"status": s, "type": t}, v) for (s, t), v in sorted(counters.api_errors.items())],
    )
    return "\n".join(lines) + "\n"
