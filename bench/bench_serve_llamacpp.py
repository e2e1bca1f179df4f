"""``osd serve`` against ``llama-server`` on the chat target, streaming, 1 and 8 clients.

The chat target (SmolLM2-135M-Instruct Q4_1, ``osd.zoo.chat.fetch_target()``) on the CPU,
``THREADS`` threads on every side. The same conversations go to every provider: the
evaluation set's prompts (``osd.zoo.workloads.evaluation_set(n=PROMPTS)``: explain,
summarise, multiturn and code, ``PROMPTS`` conversations each). Every request is greedy
(``temperature`` 0) with ``MAX_TOKENS`` new tokens, EOS ignored (``ignore_eos``, which
both servers read), so every provider generates the same number of tokens. Providers:

- ``osd in-process``: ``osd.Engine.from_pretrained(target, draft=chat draft)`` with its
  defaults (the draft's ``serving.json`` settings, the target kept quantized,
  ``max_batch_size`` 8, as ``osd serve`` loads it), one conversation at a time through
  ``Engine.run`` (what ``Engine.generate`` runs; the first step that yields a token gives
  the TTFT), in a worker process of its own that imports osd first, as a user's script
  does (``bench/inprocess_worker.py``; in this process torch may already be loaded, and
  libgomp would then spin long instead of ``import osd``'s ``GOMP_SPINCOUNT=1000``);
  ``osd in-process --no-draft``: the target alone. 1 client only: the reference of
  ``osd serve`` at one client;
- ``osd serve``: ``osd serve --threads THREADS`` as a user runs it (no ``--target``: the
  chat pair and its draft's settings, ``--max-batch-size`` 8); ``osd serve --no-draft``:
  the target alone (kept quantized, the CPU default);
- ``llama-server -np 8``: ``llama-server -np 8 -c 8*2048 --poll 0 -t THREADS -tb
  THREADS`` (``bench.llamacpp``) started without ``OMP_WAIT_POLICY`` in its environment,
  as a user's shell starts it; ``llama-server -np 1`` (one slot, ``-c 2048``) too at one
  client, the server a single user would start. This llama.cpp is built with OpenMP and
  its threads meet at an OpenMP barrier after every graph node, so libgomp's wait policy
  matters to it as to torch: its spinning default is the faster on an idle CPU and many
  times slower on a busy one. ``llama-server -np 8, spin=1000`` is the same server with
  ``GOMP_SPINCOUNT=1000``, what ``import osd`` gives the osd processes
  (``--no-llama-passive`` leaves it out). The last ratio column takes the fastest
  ``llama-server`` of each round.

Both servers take the same body on ``/v1/chat/completions`` (``bench.chat_load.chat_body``:
the messages, ``max_tokens``, ``temperature: 0``, ``stream: true`` with a usage chunk,
``ignore_eos: true``, ``cache_prompt: false``). Before timing, every conversation's token
ids as ``llama-server`` builds them (its ``/apply-template`` then ``/tokenize``) are
compared with osd's (``osd.chat_template.apply_chat_template``): the two servers prefill
the same ids (the script stops when they do not), and each request's ``prompt_tokens``
is checked again.

A configuration is a provider and a number N of concurrent clients; client j sends
conversations j, j + N, ... one after another. A round runs every configuration once,
N = 1 first. At N = 1 the providers take turns conversation by conversation (every
provider answers conversation i before any answers i + 1), so a burst of load from the
other work on the machine hits them alike; at N = 8 they take turns load by load. The
order rotates with the round (and the conversation). Measured on the client:
**tokens/s** = completion tokens (``usage``) of all requests / wall time (N = 8: from the
first request sent to the last stream done; N = 1: the requests' walls added up), the
median over rounds with min–max beside it; **TTFT** = from sending a request to its first
chunk with text (p50 over every request of every round); **CPU ms/token** = the
provider process's user + system CPU seconds (``/proc``) per generated token, and beside
it this process's (the streaming clients'; 0 in-process). The ratio columns pair rows of
the same round, then take the median over rounds: ``osd serve`` ÷ its in-process engine
at 1 client, and osd ÷ ``llama-server`` (``-np 8`` as a user starts it, and the fastest
``llama-server`` row of the round at that N).

Run as a script (prints a line per configuration and a markdown table, writes JSON):

    .venv/bin/python bench/bench_serve_llamacpp.py --rounds 3 \\
        --json results/bench_serve_llamacpp.json

Under pytest (``make bench``): one quick round (``PROMPTS`` 2, 32 tokens, no ``-np 1``
row) printing the same table; skipped, with
the reason, when ``llama-server`` is not built (``make llamacpp``), the chat GGUF is not
cached or its draft is missing, or the serve extra is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the repository root, for `bench.*`
    sys.path.insert(0, ROOT)

from bench import llamacpp  # noqa: E402
from osd import zoo  # noqa: E402
from osd.chat_template import apply_chat_template  # noqa: E402
from osd.models.loading import load_tokenizer  # noqa: E402
from osd.zoo.workloads import evaluation_set  # noqa: E402

try:
    from bench import chat_load
except ImportError:  # httpx missing: missing_reason() says so
    chat_load = None

CLIENTS = (1, 8)
MAX_TOKENS = 96
PROMPTS = 4  # conversations per workload of the evaluation set
ROUNDS = 3
THREADS = 2
SLOT_CTX = 2048  # context per sequence: osd serve's --max-seq-len default
NEEDS = ("fastapi", "uvicorn", "httpx")

INPROC = "osd in-process"
INPROC_PLAIN = "osd in-process --no-draft"
SERVE = "osd serve"
SERVE_PLAIN = "osd serve --no-draft"
LLAMA8 = "llama-server -np 8"
LLAMA1 = "llama-server -np 1"
LLAMA8P = "llama-server -np 8, spin=1000"
LLAMAS = (LLAMA8, LLAMA1, LLAMA8P)
# provider -> its in-process reference (the serve / in-process ratio at 1 client)
REFERENCE = {SERVE: INPROC, SERVE_PLAIN: INPROC_PLAIN}
OSD_ROWS = (INPROC, INPROC_PLAIN, SERVE, SERVE_PLAIN)


def missing_reason() -> str | None:
    """Why the benchmark cannot run here, or None."""
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing or chat_load is None:
        return f"needs {', '.join(missing or ['httpx'])}: pip install osd[serve] httpx"
    if llamacpp.find_binaries() is None:
        return llamacpp.missing_reason()
    if zoo.chat.cached_target() is None:
        return (
            "the chat GGUF is not cached (osd.zoo.chat.fetch_target() downloads it; "
            "osd serve only serves the chat pair when it is cached)"
        )
    if zoo.locate.find("chat_draft") is None:
        return zoo.locate.missing_message("chat_draft")
    return None


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation; None for no samples."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ---- Providers ----


def start_providers(clients, threads: int, llama_np1: bool, llama_passive: bool, log=print) -> dict:
    """Every provider, started and ready: ``{name: object}`` with ``pid`` and either
    ``url`` (a server) or ``run`` (in-process)."""
    target, draft = zoo.chat_pair()
    bins = llamacpp.find_binaries()
    llamas = [(LLAMA8, 8, None)]
    if llama_np1 and 1 in clients:
        llamas.append((LLAMA1, 1, None))
    if llama_passive:
        llamas.append((LLAMA8P, 8, "spin=1000"))
    out: dict = {}
    try:
        log(f"starting {SERVE}, {SERVE_PLAIN}, " + ", ".join(n for n, _, _ in llamas))
        out[SERVE] = chat_load.OsdServe([], threads)
        out[SERVE_PLAIN] = chat_load.OsdServe(["--no-draft"], threads)
        for name, slots, policy in llamas:
            out[name] = chat_load.llama_server(bins, target, slots, threads, SLOT_CTX, policy)
        if 1 in clients:
            log(f"loading {INPROC} and {INPROC_PLAIN}")
            out[INPROC] = chat_load.InProcess(target, draft, threads)
            out[INPROC_PLAIN] = chat_load.InProcess(target, None, threads)
    except BaseException:
        for p in out.values():
            p.close()
        raise
    return out


def providers_at(n: int, providers: dict) -> list[str]:
    """The providers measured at ``n`` clients (in-process and one-slot: 1 only)."""
    one_only = (INPROC, INPROC_PLAIN, LLAMA1)
    return [p for p in providers if n == 1 or p not in one_only]


def check_prompt_ids(providers: dict, convs: list, tokenizer) -> None:
    """Raise when ``llama-server`` would prefill other ids than osd for a conversation."""
    url = providers[LLAMA8].url
    for i, msgs in enumerate(convs):
        ours = apply_chat_template(tokenizer, [msgs])[0]
        theirs = chat_load.llama_prompt_ids(url, msgs)
        if ours != theirs:
            raise RuntimeError(
                f"conversation {i}: llama-server's prompt ({len(theirs)} ids) differs from "
                f"osd's ({len(ours)} ids); the requests would not be the same"
            )


def measure(prov, convs: list, clients: int, max_tokens: int) -> dict:
    """One load: wall time, tokens, TTFTs, results, and the CPU seconds of the provider's
    process and of this one (the clients)."""
    cpu0 = chat_load.cpu_seconds(prov.pid)
    e0 = prov.engine_wall_s() if hasattr(prov, "engine_wall_s") else None
    if hasattr(prov, "run"):
        (wall, results), client_cpu = prov.run(convs, max_tokens), 0.0
    else:
        wall, results, client_cpu = chat_load.run_load(prov.url, convs, clients, max_tokens)
    cpu1 = chat_load.cpu_seconds(prov.pid)
    e1 = prov.engine_wall_s() if e0 is not None else None
    if e0 is not None and e1 is not None:
        engine_s = e1 - e0
    elif all(r.get("server_s") is not None for r in results):
        engine_s = sum(r["server_s"] for r in results)  # llama-server's own timings
    else:
        engine_s = None
    return dict(
        wall_s=wall,
        tokens=sum(r["completion_tokens"] or 0 for r in results),
        ttft=[r["t_first"] - r["t0"] for r in results if r["t_first"] is not None],
        results=results,
        cpu_s=None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
        client_cpu_s=client_cpu,
        engine_s=engine_s,
        loadavg=os.getloadavg()[0],
    )


def merge(parts: list[dict]) -> dict:
    """One run from loads run one after another (their walls add up)."""
    cpu = [p["cpu_s"] for p in parts]
    return dict(
        wall_s=sum(p["wall_s"] for p in parts),
        tokens=sum(p["tokens"] for p in parts),
        ttft=[t for p in parts for t in p["ttft"]],
        results=[r for p in parts for r in p["results"]],
        cpu_s=None if None in cpu else sum(cpu),
        client_cpu_s=sum(p["client_cpu_s"] for p in parts),
        engine_s=None
        if any(p["engine_s"] is None for p in parts)
        else sum(p["engine_s"] for p in parts),
        loadavg=sum(p["loadavg"] for p in parts) / len(parts),
    )


def one_round(providers: dict, convs: list, n: int, rnd: int, max_tokens: int) -> dict:
    """Every provider at ``n`` clients once: ``{name: run}``. At one client the providers
    take turns conversation by conversation (a burst of load from elsewhere hits them
    alike), at more clients load by load; the order rotates with the round and the
    conversation."""
    names = providers_at(n, providers)
    if n > 1:
        k = rnd % len(names)
        return {
            name: measure(providers[name], convs, n, max_tokens) for name in names[k:] + names[:k]
        }
    parts: dict = {name: [] for name in names}
    for i, conv in enumerate(convs):
        k = (rnd + i) % len(names)
        for name in names[k:] + names[:k]:
            parts[name].append(measure(providers[name], [conv], 1, max_tokens))
    return {name: merge(ps) for name, ps in parts.items()}


def bench(
    clients=CLIENTS,
    prompts: int = PROMPTS,
    max_tokens: int = MAX_TOKENS,
    rounds: int = ROUNDS,
    threads: int = THREADS,
    llama_np1: bool = True,
    llama_passive: bool = True,
    log=print,
) -> dict:
    """The whole interleaved run; a JSON-able dict with one row per (provider, N)."""
    load0 = list(os.getloadavg())
    t_start = time.time()
    convs = [list(c) for w in evaluation_set(n=prompts) for c in w.prompts]
    warm = [list(evaluation_set(n=1, seed=12345)[0].prompts[0])]
    providers = start_providers(clients, threads, llama_np1, llama_passive, log)
    runs: dict = {}
    problems: list[str] = []
    try:
        tok = load_tokenizer(zoo.chat_pair()[0])
        check_prompt_ids(providers, convs, tok)
        want_prompt = [len(apply_chat_template(tok, [c])[0]) for c in convs]
        for name, prov in providers.items():  # warm-up: first-call allocations, lazy imports
            measure(prov, warm, 1, 8)
        for rnd in range(rounds):
            for n in clients:
                for name, run in one_round(providers, convs, n, rnd, max_tokens).items():
                    run["tokens_per_s"] = run["tokens"] / run["wall_s"]
                    runs.setdefault((name, n), []).append(run)
                    for i, r in enumerate(run["results"]):
                        if (
                            r["completion_tokens"] != max_tokens
                            or r["prompt_tokens"] != (want_prompt[i])
                        ):
                            problems.append(
                                f"{name} N={n} conversation {i}: {r['completion_tokens']} "
                                f"tokens of a {r['prompt_tokens']}-token prompt (expected "
                                f"{max_tokens} of {want_prompt[i]}), finish {r['finish']}"
                            )
                    ttft = percentile(run["ttft"], 50)
                    log(
                        f"round {rnd + 1}/{rounds} N={n} {name:26s} {run['tokens']} tokens in "
                        f"{run['wall_s']:6.2f} s = {run['tokens_per_s']:6.1f} tok/s, TTFT p50 "
                        + ("-" if ttft is None else f"{1e3 * ttft:.0f} ms")
                        + f", load {run['loadavg']:.2f}"
                    )
    finally:
        status = {}
        for name, p in providers.items():
            p.close()
            status[name] = getattr(getattr(p, "proc", None), "returncode", None)
    rows = summarize(runs, clients)
    texts = same_text(runs)
    for r in runs.values():
        for run in r:  # per request, in conversation order: [TTFT, wall] in seconds
            run["requests"] = [
                [None if x["t_first"] is None else round(x["t_first"] - x["t0"], 4),
                 round(x["t_end"] - x["t0"], 4)]
                for x in run.pop("results")
            ]  # fmt: skip
            run.pop("ttft")
    return dict(
        command=(
            f"bench/bench_serve_llamacpp.py --clients {' '.join(map(str, clients))} "
            f"--prompts {prompts} --max-tokens {max_tokens} --rounds {rounds} "
            f"--threads {threads}"
            + ("" if llama_np1 else " --no-llama-np1")
            + ("" if llama_passive else " --no-llama-passive")
        ),
        providers={
            name: dict(
                cmd=p.cmd,
                omp_wait_policy=getattr(p, "omp_wait_policy", os.environ.get("OMP_WAIT_POLICY")),
            )
            for name, p in providers.items()
        },
        exit_status=status,
        machine=dict(
            platform=platform.platform(),
            python=platform.python_version(),
            cpus=os.cpu_count(),
            loadavg_start=load0,
            loadavg_end=list(os.getloadavg()),
            omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
            gomp_spincount=os.environ.get("GOMP_SPINCOUNT"),
        ),
        params=dict(
            conversations=len(convs),
            prompts_per_workload=prompts,
            max_tokens=max_tokens,
            rounds=rounds,
            threads=threads,
            clients=list(clients),
            temperature=0,
        ),
        started=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_start)),
        duration_s=time.time() - t_start,
        problems=problems,
        same_text_as_in_process=texts,
        runs={f"{name} / N={n}": rs for (name, n), rs in runs.items()},
        rows=rows,
    )


# ---- Summary ----


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
        ref = INPROC if name == SERVE else INPROC_PLAIN
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=list(CLIENTS))
    p.add_argument(
        "--prompts", type=int, default=PROMPTS, help="conversations per workload (4 workloads)"
    )
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument(
        "--no-llama-np1", action="store_true", help="leave out the one-slot llama-server row"
    )
    p.add_argument(
        "--no-llama-passive",
        action="store_true",
        help="leave out the llama-server -np 8 started with GOMP_SPINCOUNT=1000",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    why = missing_reason()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    load0 = os.getloadavg()
    print(
        f"bench_serve_llamacpp: clients {args.clients}, {4 * args.prompts} conversations x "
        f"{args.max_tokens} tokens, {args.rounds} rounds, {args.threads} threads; load "
        f"average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}",
        flush=True,
    )
    out = bench(
        args.clients,
        args.prompts,
        args.max_tokens,
        args.rounds,
        args.threads,
        llama_np1=not args.no_llama_np1,
        llama_passive=not args.no_llama_passive,
        log=lambda s: print(s, flush=True),
    )
    print()
    print(report(out))
    if args.json:
        if os.path.dirname(args.json):
            os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 1 if out["problems"] else 0


# ---- pytest-benchmark: one quick round ----

QUICK = dict(
    clients=CLIENTS, prompts=2, max_tokens=32, rounds=1, llama_np1=False, llama_passive=True
)


def test_serve_vs_llamacpp(benchmark, capsys):
    why = missing_reason()
    if why:
        pytest.skip(why)
    result = {}

    def once():
        with capsys.disabled():
            result["out"] = bench(**QUICK, threads=THREADS, log=lambda s: print(s, flush=True))

    benchmark.pedantic(once, rounds=1, iterations=1)
    out = result["out"]
    with capsys.disabled():
        print("\n" + report(out))
    benchmark.extra_info.update(rows=out["rows"], params=out["params"], machine=out["machine"])
    assert not out["problems"], out["problems"]


if __name__ == "__main__":
    sys.exit(main())
