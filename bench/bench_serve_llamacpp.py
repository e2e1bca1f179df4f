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
  libgomp would then spin long instead of ``import osd``'s ``GOMP_SPINCOUNT=10000``);
  ``osd in-process --no-draft``: the target alone. 1 client only: the reference of
  ``osd serve`` at one client;
- ``osd serve``: ``osd serve --threads THREADS`` as a user runs it (no ``--target``: the
  chat pair and its draft's settings, ``--max-batch-size`` 8, new tokens streamed at most
  every 20 ms, the CPU's ``--stream-interval``); ``osd serve --no-draft``: the target
  alone (kept quantized, the CPU default); ``osd serve --stream-interval 0``: every
  step's tokens sent at once (``--no-every-step`` leaves it out);
- ``llama-server -np 8``: ``llama-server -np 8 -c 8*2048 --poll 0 -t THREADS -tb
  THREADS`` (``bench.llamacpp``) started without ``OMP_WAIT_POLICY`` in its environment,
  as a user's shell starts it; ``llama-server -np 1`` (one slot, ``-c 2048``) too at one
  client, the server a single user would start. This llama.cpp is built with OpenMP and
  its threads meet at an OpenMP barrier after every graph node, so libgomp's wait policy
  matters to it as to torch: its spinning default is the faster on an idle CPU and many
  times slower on a busy one. ``llama-server -np 8, spin=10000`` is the same server with
  ``GOMP_SPINCOUNT=10000``, what ``import osd`` gives the osd processes
  (``--no-llama-passive`` leaves it out). The last ratio column takes the fastest
  ``llama-server`` of each round.

Both servers take the same body on ``/v1/chat/completions`` (``bench.chat_load.chat_body``:
the messages, ``max_tokens``, ``temperature: 0``, ``stream: true`` with a usage chunk,
``ignore_eos: true``, ``cache_prompt: false``). Before timing, every conversation's token
ids as ``llama-server`` builds them (its ``/apply-template`` then ``/tokenize``) are
compared with osd's (``osd.chat_template.apply_chat_template``): the two servers prefill
the same ids (the script stops when they do not), and each request's ``prompt_tokens``
is checked again. Before the rounds every provider answers one short conversation, and
each server a first load of N short ones at every N > 1 (a server's first batch of a
width is slower than the next).

A configuration is a provider and a number N of concurrent clients; client j sends
conversations j, j + N, ... one after another. A round starts every provider afresh (a
process keeps for its whole life the speed its memory placement gave it: the same server
restarted differs by several percent, and on a VM the later started ran the faster, see
``start_order``; rounds start them in turn in a rotated order and in its reverse, so
an even number of rounds starts each pair of providers as often in one order as in the
other), then runs
every configuration once, N = 1 first. At N = 1 the providers take turns conversation by
conversation (every provider answers conversation i before any answers i + 1), so a
burst of load from the other work on the machine hits them alike; at N = 8 they take
turns load by load. The order rotates with the round (and the conversation). Measured on the client:
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

    .venv/bin/python bench/bench_serve_llamacpp.py --rounds 4 \\
        --json results/bench_serve_llamacpp.json

Under pytest (``make bench``): two quick rounds, one per start order (``PROMPTS`` 2, 32
tokens, no ``-np 1`` row) printing the same table; skipped, with
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
from osd._openmp import SPIN_COUNT  # noqa: E402
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
ROUNDS = 4  # even: see start_order
THREADS = 2
SLOT_CTX = 2048  # context per sequence: osd serve's --max-seq-len default
NEEDS = ("fastapi", "uvicorn", "httpx")

from bench.serve_summary import (  # noqa: E402
    INPROC,
    INPROC_PLAIN,
    SERVE,
    SERVE_PLAIN,
    SERVE_EVERY,
    LLAMA8,
    LLAMA1,
    LLAMA8P,
    percentile,
    summarize,
    same_text,
    report,
)


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


# ---- Providers ----


def start_providers(
    clients,
    threads: int,
    llama_np1: bool,
    llama_passive: bool,
    every_step: bool,
    rotate: int = 0,
    log=print,
) -> dict:
    """Every provider, started and ready: ``{name: object}`` with ``pid`` and either
    ``url`` (a server) or ``run`` (in-process). They start one after another in
    :func:`start_order` of round ``rotate``; the dict keeps the canonical order."""
    target, draft = zoo.chat_pair()
    bins = llamacpp.find_binaries()
    makers = {
        SERVE: lambda: chat_load.OsdServe([], threads),
        SERVE_PLAIN: lambda: chat_load.OsdServe(["--no-draft"], threads),
    }
    if every_step:
        makers[SERVE_EVERY] = lambda: chat_load.OsdServe(["--stream-interval", "0"], threads)
    llamas = [(LLAMA8, 8, None)]
    if llama_np1 and 1 in clients:
        llamas.append((LLAMA1, 1, None))
    if llama_passive:
        llamas.append((LLAMA8P, 8, f"spin={SPIN_COUNT}"))
    for name, slots, policy in llamas:
        makers[name] = lambda s=slots, p=policy: chat_load.llama_server(
            bins, target, s, threads, SLOT_CTX, p
        )
    if 1 in clients:
        makers[INPROC] = lambda: chat_load.InProcess(target, draft, threads)
        makers[INPROC_PLAIN] = lambda: chat_load.InProcess(target, None, threads)
    names = list(makers)
    started: dict = {}
    try:
        log("starting " + ", ".join(start_order(names, rotate)))
        for name in start_order(names, rotate):
            started[name] = makers[name]()
    except BaseException:
        for p in started.values():
            p.close()
        raise
    return {name: started[name] for name in names}


def start_order(names: list[str], rnd: int) -> list[str]:
    """The order in which round ``rnd`` starts the providers: rotated by ``rnd // 2``,
    and reversed in odd rounds, so that every two rounds start each pair of providers in
    both orders. On a VM the order matters: of identical in-process engines started one
    after another and run in turns, the first started can run slower for its whole life
    (``scripts/start_order.py`` on the 2-core Intel VM: 1-7% slower than the last of
    three; 12% after 16 GB had just been freed), so a ratio of two providers is biased by
    which one started first."""
    k = (rnd // 2) % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if rnd % 2 else order


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
    every_step: bool = True,
    log=print,
) -> dict:
    """The whole interleaved run; a JSON-able dict with one row per (provider, N)."""
    load0 = list(os.getloadavg())
    t_start = time.time()
    convs = [list(c) for w in evaluation_set(n=prompts) for c in w.prompts]
    warm = [list(evaluation_set(n=1, seed=12345)[0].prompts[0])]
    runs: dict = {}
    problems: list[str] = []
    status: dict = {}
    cmds: dict = {}
    tok = load_tokenizer(zoo.chat_pair()[0])
    want_prompt = [len(apply_chat_template(tok, [c])[0]) for c in convs]
    for rnd in range(rounds):
        # Fresh processes every round, in start_order: a process keeps the
        # speed its memory placement gave it for its whole life (the same server
        # restarted differs by several percent), so one set of processes would bias
        # every ratio of the run.
        providers = start_providers(
            clients, threads, llama_np1, llama_passive, every_step, rotate=rnd, log=log
        )
        try:
            if rnd == 0:
                check_prompt_ids(providers, convs, tok)
            # Warm-up: first-call allocations, lazy imports, and a server's first batch
            # of every width it will run (a first load of N clients is slower than the
            # next).
            for name, prov in providers.items():
                measure(prov, warm, 1, 8)
                for n in clients:
                    if n > 1 and name in providers_at(n, providers):
                        measure(prov, warm * n, n, 8)
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
            for name, p in providers.items():
                p.close()
                code = getattr(getattr(p, "proc", None), "returncode", None)
                if status.get(name) in (None, 0):
                    status[name] = code
                cmds[name] = dict(
                    cmd=p.cmd,
                    omp_wait_policy=getattr(
                        p, "omp_wait_policy", os.environ.get("OMP_WAIT_POLICY")
                    ),
                )
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
            + ("" if every_step else " --no-every-step")
        ),
        providers=cmds,
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
        help="leave out the llama-server -np 8 started with osd's GOMP_SPINCOUNT",
    )
    p.add_argument(
        "--no-every-step",
        action="store_true",
        help="leave out osd serve --stream-interval 0 (every step's tokens sent at once)",
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
        every_step=not args.no_every_step,
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


# ---- pytest-benchmark: two quick rounds (start_order's two orders) ----

QUICK = dict(
    clients=CLIENTS,
    prompts=2,
    max_tokens=32,
    rounds=2,
    llama_np1=False,
    llama_passive=True,
    every_step=False,
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
