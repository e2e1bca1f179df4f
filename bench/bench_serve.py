"""``osd serve`` under load: concurrent streaming clients, speculative against plain.

Two ``osd serve`` processes on the built-in pair (``osd.zoo.default_pair()``), up at the
same time on free ports, each at ``--threads 1`` (the benchmark machine's 2 cores are
shared) with the default ``--max-batch-size`` 8 and ``--max-seq-len`` 2048:

- ``spec``: ``--target TARGET --draft DRAFT -k 4`` (the built-in draft, chain of 4);
- ``plain``: ``--target TARGET`` alone (no draft: plain decoding).

A configuration is one server and a number N of concurrent clients. The N clients are
asyncio tasks in this process, each with its share of the same fixed set of requests
(request i goes to client i mod N; a client sends its requests one after another), all
through one ``openai.AsyncOpenAI`` client: ``completions.create(prompt=TEXT,
max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage":
True}, extra_body={"return_token_ids": True})``. The prompts are the stdlib ``code``
queries of ``osd.zoo.query_records`` (seed 0; ``--domain prose``: the prose stream) cut to
a length drawn in 32..64 tokens (seeded) and sent as text. The built-in draft learned
mostly prose, so it drafts the ``code`` stream poorly (that is what online distillation is
for); ``--domain prose`` shows the pair where the draft fits better. Greedy decoding, so
both servers must return the same tokens for a prompt whatever the load: every request's
token ids are compared with the first answer to that prompt (``mismatches`` in the JSON,
printed when not 0).

Side by side: a round runs every N once on both servers, the two servers alternating
(plain then spec, then spec then plain for the next N, and so on; the next round starts
where this one ended), so a burst of load from elsewhere hits both. Only one server is
busy at a time; the idle one waits on its socket.

Measured on the client, with ``time.perf_counter()`` when each streamed chunk arrives
(both servers run with ``--stream-interval 0``, so a chunk carries the token ids of one
engine step: with speculation, up to k + 1 tokens):

- **TTFT**: from sending the request to the first chunk with tokens (the engine's first
  step for a request prefills and then decodes, so that chunk usually holds 2 tokens);
- **ITL per token**: each later chunk's gap since the previous chunk divided by its token
  count, counted once per token (a chunk of 3 tokens 60 ms after the previous one gives
  three samples of 20 ms); tokens that arrive in the first chunk give no sample. This is
  the number to compare between speculative and plain decoding;
- **chunk gap**: the gap between consecutive chunks, once per chunk (what a reader of the
  stream sees as stalls; with speculation, larger than per-token ITL);
- **TPOT**: per request, (last chunk − first chunk) / (tokens − tokens of the first chunk);
- **requests/s** and **tokens/s**: requests and generated tokens (``usage``) over the wall
  time from the first request sent to the last stream done.

Latency percentiles (p50, p99, linear interpolation) pool every request of every round;
requests/s and tokens/s are the median over rounds (min and max in the JSON). From each
server's ``/metrics`` (differences over the configuration): tokens per target forward
(a batch step; only ``spec`` counts its forwards, the plain server's
``osd:target_forwards_total`` stays 0) and the draft acceptance rate of ``spec``. From
``/proc``: each server's CPU seconds (user + system) per configuration.

The servers (``osd serve`` child processes) and the streaming clients are
``bench/serve_load.py``; this file measures, summarizes and reports.

Run as a script (prints a line per configuration and a markdown table, writes JSON; with
``--plot``, a PNG of tokens/s and p50 ITL against N):

    nice -n 5 .venv/bin/python bench/bench_serve.py [--clients 1 4 16] [--requests 48] \\
        [--max-tokens 32] [--rounds 3] [--json results/bench_serve.json] \\
        [--plot results/bench_serve.png]

``--tcp-nodelay`` starts both servers through ``bench.serve_load.NODELAY_WRAPPER``, which
sets TCP_NODELAY on their listening socket. ``osd serve`` sets it itself
(``osd/server/run.py``), so for it the flag changes nothing; without TCP_NODELAY the first
event of a stream on a reused connection waits for the client's delayed ACK.

Under pytest (``make bench``, ``pytest bench/bench_serve.py``): a short load (4 clients,
8 requests of 16 tokens) on each server, one timed round each; skipped when fastapi,
uvicorn, openai or httpx is missing. ``OSD_BENCH_THREADS`` sets the servers' torch threads
(default 1).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import sys
import time

import pytest

from osd import zoo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the repository root, for `bench.serve_load`
    sys.path.insert(0, ROOT)

from bench.serve_load import (  # noqa: E402
    K,
    SERVERS,
    SPEC_FLAGS,
    THREADS,
    ServeProcess,
    run_load,
    start_servers,
)
from bench.serve_summary import percentile  # noqa: E402

CLIENTS = (1, 4, 16)
REQUESTS = 48
MAX_TOKENS = 32
ROUNDS = 3
PROMPT_MIN, PROMPT_MAX = 32, 64
PROMPT_SEED = 0
NEEDS = ("fastapi", "uvicorn", "openai", "httpx")


def missing_modules() -> list[str]:
    return [m for m in NEEDS if importlib.util.find_spec(m) is None]


# ---- Prompts ----


def make_prompts(n: int, seed: int = PROMPT_SEED, domain: str = "code") -> list[str]:
    """``n`` prompt texts: stdlib queries of ``domain`` (``osd.zoo.query_records``) cut to
    32..64 tokens, the lengths drawn with ``seed``."""
    tok = zoo.tokenizer()
    rng = random.Random(f"bench_serve/{seed}")
    records = zoo.query_records(domain, n=n, prompt_tokens=PROMPT_MAX, seed=seed)
    return [tok.decode(r.ids[: rng.randint(PROMPT_MIN, PROMPT_MAX)]) for r in records]


# ---- Statistics ----


def latency_samples(results: list[dict]) -> dict:
    """TTFT, per-token ITL, chunk gaps and TPOT (seconds) over ``results``."""
    ttft, itl, gaps, tpot, per_chunk, first_extra = [], [], [], [], [], 0
    for r in results:
        ch = r["chunks"]
        if not ch:
            continue
        ttft.append(ch[0][0] - r["t0"])
        first_extra += ch[0][1] - 1
        for (t_prev, _), (t, n) in zip(ch, ch[1:]):
            gaps.append(t - t_prev)
            itl.extend([(t - t_prev) / n] * n)
        per_chunk.extend(n for _, n in ch)
        later = sum(n for _, n in ch[1:])
        if later:
            tpot.append((ch[-1][0] - ch[0][0]) / later)
    return dict(
        ttft=ttft,
        itl=itl,
        gap=gaps,
        tpot=tpot,
        tokens_per_chunk=per_chunk,
        first_chunk_extra_tokens=first_extra,
    )


def summarize(server: str, clients: int, runs: list[dict]) -> dict:
    """One configuration's row from its runs (one per round)."""
    results = [r for run in runs for r in run["results"]]
    lat = latency_samples(results)
    ms = {}
    for key in ("ttft", "itl", "gap", "tpot"):
        for q in (50, 99):
            v = percentile(lat[key], q)
            ms[f"{key}_p{q}_ms"] = None if v is None else 1e3 * v
    tok_s = [run["tokens"] / run["wall_s"] for run in runs]
    req_s = [run["requests"] / run["wall_s"] for run in runs]
    row = dict(
        server=server,
        clients=clients,
        rounds=len(runs),
        requests_per_round=runs[0]["requests"],
        tokens_per_s=percentile(tok_s, 50),
        tokens_per_s_min=min(tok_s),
        tokens_per_s_max=max(tok_s),
        tokens_per_s_rounds=tok_s,
        requests_per_s=percentile(req_s, 50),
        requests_per_s_rounds=req_s,
        wall_s_rounds=[run["wall_s"] for run in runs],
        generated_tokens_rounds=[run["tokens"] for run in runs],
        **ms,
        mean_tokens_per_chunk=(sum(lat["tokens_per_chunk"]) / max(len(lat["tokens_per_chunk"]), 1)),
        itl_samples=len(lat["itl"]),
        first_chunk_extra_tokens=lat["first_chunk_extra_tokens"],
        finish_reasons={
            f: sum(str(r["finish"]) == f for r in results)
            for f in sorted({str(r["finish"]) for r in results})
        },
        usage_mismatch=sum(r["usage"] != r["ntok"] for r in results),
        loadavg_1m=[run["loadavg"] for run in runs],
    )
    cpu = [run["server_cpu_s"] for run in runs if run["server_cpu_s"] is not None]
    if cpu:
        row["server_cpu_ms_per_token"] = 1e3 * sum(cpu) / sum(run["tokens"] for run in runs)
    fw = sum(run["target_forwards"] for run in runs)
    if fw:
        row["tokens_per_target_forward"] = sum(run["engine_tokens"] for run in runs) / fw
    drafted = sum(run["draft_tokens"] for run in runs)
    if drafted:
        row["acceptance_rate"] = sum(run["accepted_tokens"] for run in runs) / drafted
    return row


# ---- The benchmark ----


def measure(server: ServeProcess, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """One load on ``server``: wall time, tokens, results and the server's counters."""
    m0, cpu0 = server.metrics(), server.cpu_seconds()
    wall, results = run_load(server.url, prompts, clients, max_tokens)
    cpu1, m1 = server.cpu_seconds(), server.metrics()

    def diff(name):
        return m1.get(name, 0.0) - m0.get(name, 0.0)

    return dict(
        wall_s=wall,
        results=results,
        requests=len(results),
        tokens=sum(r["usage"] if r["usage"] is not None else r["ntok"] for r in results),
        server_cpu_s=None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
        target_forwards=diff("osd:target_forwards_total"),
        engine_tokens=diff("osd:generation_tokens_total"),
        draft_tokens=diff("osd:spec_decode_num_draft_tokens_total"),
        accepted_tokens=diff("osd:spec_decode_num_accepted_tokens_total"),
        loadavg=os.getloadavg()[0],
    )


def check_outputs(reference: dict, prompts: list[str], results: list[dict], label: str) -> int:
    """Compare each result's token ids with the first answer to its prompt (greedy: all
    answers must be equal); the number of mismatches (each printed)."""
    bad = 0
    for i, r in enumerate(results):
        if i not in reference:
            reference[i] = (r["ids"], label)
        elif r["ids"] != reference[i][0]:
            bad += 1
            ref, where = reference[i]
            first = next(
                (j for j, (a, b) in enumerate(zip(ref, r["ids"])) if a != b),
                min(len(ref), len(r["ids"])),
            )
            print(
                f"  MISMATCH prompt {i} ({label} vs {where}): first difference at token "
                f"{first}: {r['ids'][first : first + 4]} vs {ref[first : first + 4]} "
                f"(lengths {len(r['ids'])} / {len(ref)})",
                flush=True,
            )
    return bad


def bench(
    clients=CLIENTS,
    requests=REQUESTS,
    max_tokens=MAX_TOKENS,
    rounds=ROUNDS,
    threads=THREADS,
    servers: dict | None = None,
    log=print,
    nodelay: bool = False,
    domain: str = "code",
) -> dict:
    """The whole side-by-side run; a JSON-able dict with one row per (server, N)."""
    load0 = list(os.getloadavg())
    prompts = make_prompts(requests, domain=domain)
    own = servers is None
    t_start = time.time()
    if own:
        servers = start_servers(threads=threads, nodelay=nodelay)
    runs = {(s, n): [] for s in SERVERS for n in clients}
    reference: dict = {}
    mismatches = {f"{s}/{n}": 0 for s in SERVERS for n in clients}
    status = {}
    try:
        # Warm-up: one request per server (first-call allocations, lazy imports).
        for name, srv in servers.items():
            run_load(srv.url, prompts[:1], 1, max_tokens)
        order = list(SERVERS)
        for rnd in range(rounds):
            for n in clients:
                for name in order:
                    run = measure(servers[name], prompts, n, max_tokens)
                    runs[(name, n)].append(run)
                    bad = check_outputs(reference, prompts, run["results"], f"{name}/N={n}")
                    mismatches[f"{name}/{n}"] += bad
                    lat = latency_samples(run["results"])
                    p50 = percentile(lat["itl"], 50)
                    ttft = percentile(lat["ttft"], 50)
                    log(
                        f"round {rnd + 1}/{rounds} {name:5s} N={n:2d}: {run['requests']} req, "
                        f"{run['tokens']} tokens in {run['wall_s']:.2f} s = "
                        f"{run['tokens'] / run['wall_s']:.1f} tok/s, "
                        f"{run['requests'] / run['wall_s']:.2f} req/s, TTFT p50 "
                        f"{1e3 * ttft:.0f} ms, ITL p50 {1e3 * p50:.1f} ms/token, "
                        f"load {run['loadavg']:.2f}" + (f", {bad} MISMATCHES" if bad else "")
                    )
                    for r in run["results"]:
                        r.pop("ids")  # kept only for the comparison
                order.reverse()
    finally:
        if own:
            status = {name: srv.stop() for name, srv in servers.items()}
    rows = [summarize(s, n, runs[(s, n)]) for n in clients for s in SERVERS]
    return dict(
        command=" ".join(
            [
                "bench/bench_serve.py",
                "--clients",
                *map(str, clients),
                "--requests",
                str(requests),
                "--max-tokens",
                str(max_tokens),
                "--rounds",
                str(rounds),
            ]
            + (["--tcp-nodelay"] if nodelay else [])
            + (["--auto-k"] if "--auto-k" in SPEC_FLAGS else [])
            + (["--domain", domain] if domain != "code" else [])
        ),
        tcp_nodelay=nodelay,
        servers={name: srv.cmd[3:] for name, srv in servers.items()},
        server_exit_status=status,
        machine=dict(
            platform=platform.platform(),
            python=platform.python_version(),
            cpus=os.cpu_count(),
            nice=os.nice(0),
            threads=threads,
            loadavg_start=load0,
            loadavg_end=list(os.getloadavg()),
        ),
        params=dict(
            k=K,
            max_tokens=max_tokens,
            requests=requests,
            rounds=rounds,
            prompt_tokens=[PROMPT_MIN, PROMPT_MAX],
            prompt_seed=PROMPT_SEED,
            prompt_domain=domain,
            temperature=0,
            max_batch_size=8,
        ),
        started=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_start)),
        duration_s=time.time() - t_start,
        mismatches=mismatches,
        rows=rows,
    )


def _f(v, fmt):
    return "–" if v is None else format(v, fmt)


def markdown(out: dict) -> str:
    lines = [
        "| N | server | tokens/s | req/s | TTFT p50 / p99 (ms) | ITL/token p50 / p99 (ms) "
        "| chunk gap p50 / p99 (ms) | tokens/chunk | draft acceptance "
        "| tokens/s spec ÷ plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["server"], r["clients"]): r for r in out["rows"]}
    for r in out["rows"]:
        plain = by.get(("plain", r["clients"]))
        ratio = (
            f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}x"
            if r["server"] == "spec" and plain
            else ""
        )
        lines.append(
            f"| {r['clients']} | {r['server']} | {r['tokens_per_s']:.1f} "
            f"({r['tokens_per_s_min']:.0f}–{r['tokens_per_s_max']:.0f}) | "
            f"{r['requests_per_s']:.2f} | {_f(r['ttft_p50_ms'], '.0f')} / "
            f"{_f(r['ttft_p99_ms'], '.0f')} | {_f(r['itl_p50_ms'], '.1f')} / "
            f"{_f(r['itl_p99_ms'], '.1f')} | {_f(r['gap_p50_ms'], '.1f')} / "
            f"{_f(r['gap_p99_ms'], '.1f')} | {r['mean_tokens_per_chunk']:.2f} | "
            f"{_f(r.get('acceptance_rate'), '.3f')} | {ratio} |"
        )
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    # only --plot needs matplotlib (slow to import); the backend is chosen before pyplot
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use (see above)

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, color in (("plain", "tab:gray"), ("spec", "tab:blue")):
        rows = [r for r in out["rows"] if r["server"] == name]
        n = [r["clients"] for r in rows]
        tps = [r["tokens_per_s"] for r in rows]
        err = [
            [t - r["tokens_per_s_min"] for t, r in zip(tps, rows)],
            [r["tokens_per_s_max"] - t for t, r in zip(tps, rows)],
        ]
        label = "speculative (k = 4)" if name == "spec" else "plain"
        a.errorbar(n, tps, yerr=err, marker="o", capsize=3, color=color, label=label)
        b.plot(n, [r["itl_p50_ms"] for r in rows], marker="o", color=color, label=label)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["clients"] for r in out["rows"] if r["server"] == "plain"])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent streaming clients")
        ax.grid(alpha=0.3)
        ax.legend()
    a.set_ylabel("generated tokens/s (median of rounds, min–max)")
    a.set_ylim(bottom=0)
    b.set_ylabel("p50 inter-token latency (ms per token)")
    b.set_ylim(bottom=0)
    fig.suptitle(
        f"osd serve, built-in pair, {out['params']['requests']} "
        f"{out['params']['prompt_domain']} requests × "
        f"{out['params']['max_tokens']} tokens, greedy, 1 torch thread, "
        f"shared 2-core CPU",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=list(CLIENTS))
    p.add_argument("--requests", type=int, default=REQUESTS)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--threads", type=int, default=THREADS, help="torch threads per server")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument(
        "--domain",
        default="code",
        choices=["code", "prose"],
        help="prompt stream (osd.zoo.query_records): code (default; the built-in "
        "draft learned mostly prose, so it drafts code poorly) or prose",
    )
    p.add_argument(
        "--tcp-nodelay",
        action="store_true",
        help="start the servers with TCP_NODELAY on their listening socket "
        "(see bench.serve_load.NODELAY_WRAPPER)",
    )
    p.add_argument(
        "--auto-k",
        action="store_true",
        help="serve spec with SpecConfig(auto_k=True): the chain length per step "
        "from measured goodput, 0 when drafting does not pay",
    )
    args = p.parse_args(argv)
    if args.auto_k:
        SPEC_FLAGS.append("--auto-k")
    missing = missing_modules()
    if missing:
        print(
            f"error: bench_serve.py needs {', '.join(missing)}: pip install osd[serve] openai",
            file=sys.stderr,
        )
        return 2
    load0 = os.getloadavg()
    print(
        f"bench_serve: clients {args.clients}, {args.requests} {args.domain} requests x "
        f"{args.max_tokens} tokens, {args.rounds} rounds; load average "
        f"{load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}",
        flush=True,
    )
    out = bench(
        args.clients,
        args.requests,
        args.max_tokens,
        args.rounds,
        args.threads,
        log=lambda s: print(s, flush=True),
        nodelay=args.tcp_nodelay,
        domain=args.domain,
    )
    print()
    print(markdown(out))
    print(
        f"\nload average at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, at end "
        + " ".join(f"{x:.2f}" for x in out["machine"]["loadavg_end"])
        + f"; {out['duration_s']:.0f} s; greedy mismatches: {sum(out['mismatches'].values())}"
    )
    for path in (args.json, args.plot):
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    if args.plot:
        plot(out, args.plot)
    return 1 if sum(out["mismatches"].values()) else 0


# ---- pytest-benchmark: a short load per server ----

SHORT = dict(clients=4, requests=8, max_tokens=16)


@pytest.fixture(scope="module")
def serve_pair():
    missing = missing_modules()
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    servers = start_servers()
    prompts = make_prompts(SHORT["requests"])
    yield dict(servers=servers, prompts=prompts, reference={})
    for s in servers.values():
        s.stop()


@pytest.mark.parametrize("server", SERVERS)
def test_serve_load(benchmark, serve_pair, server):
    srv = serve_pair["servers"][server]
    prompts = serve_pair["prompts"]
    run_load(srv.url, prompts[:1], 1, SHORT["max_tokens"])  # warm-up
    runs = []

    def once():
        runs.append(measure(srv, prompts, SHORT["clients"], SHORT["max_tokens"]))

    benchmark.pedantic(once, rounds=1, iterations=1)
    run = runs[-1]
    assert all(r["finish"] in ("stop", "length") for r in run["results"])
    assert all(r["usage"] == len(r["ids"]) for r in run["results"])
    assert check_outputs(serve_pair["reference"], prompts, run["results"], server) == 0
    row = summarize(server, SHORT["clients"], [run])
    benchmark.extra_info.update(
        {
            k: row[k]
            for k in (
                "tokens_per_s",
                "requests_per_s",
                "ttft_p50_ms",
                "itl_p50_ms",
                "itl_p99_ms",
                "gap_p50_ms",
                "mean_tokens_per_chunk",
            )
        },
        clients=SHORT["clients"],
        requests=SHORT["requests"],
        max_tokens=SHORT["max_tokens"],
        acceptance_rate=row.get("acceptance_rate"),
    )


if __name__ == "__main__":
    sys.exit(main())
