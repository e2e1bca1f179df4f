"""Soak test: serve many requests through one engine that learns online, and watch memory.

One ``osd.Engine`` on the built-in pair with online learning on (background learner,
default ``OnlineConfig``) serves ``-n`` requests (default 20,000), each ``generate`` call a
batch of ``--batch`` prompts (default 8) cut from the running Python's standard-library
source files (present on every machine), ``--new-tokens`` new tokens each (12) at
``--temperature`` 0.7. Every output must come back whole (a finish reason and at least
one token); a request that does not, or a ``generate`` call that raises, counts as an
error. Every ``--every`` requests (1,000) a progress line gives requests done, resident
memory (VmRSS of /proc/self/status), GPU memory on CUDA, requests/s, errors and learner
faults. Memory is sampled with the learner idle (``engine.online.wait()``), so that an
update's temporary tensors do not enter the figure.

At the end the growth of RSS from request ``--baseline`` (2,000: the replay buffer is full
and every cache warm by then) to the last sample is compared with ``--max-growth`` (2%),
and a JSON and a markdown summary are written (``--json``, ``--md``; the markdown keeps
whatever follows its ``<!-- notes -->`` line). The exit status is 1 when a request was
lost or RSS grew more than allowed. ``--malloc`` compares ways of treating the C heap
(``docs/soak.md``), ``--trace`` adds what the live objects hold to each sample.

    nice -n 10 .venv/bin/python scripts/soak.py                   # 20,000 requests
    .venv/bin/python scripts/soak.py -n 3000 --every 500 --json /tmp/s.json --md /tmp/s.md
    # against a running `osd serve --online --port 8000` (its pid for its memory):
    .venv/bin/python scripts/soak.py --server http://127.0.0.1:8000 --server-pid PID

With ``--server`` the same prompts go to ``/v1/completions``, ``--batch`` at a time in
parallel; memory is the server process's (``--server-pid``, read from /proc, so the server
must run on this machine; without it only errors and rates are reported).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import platform
import random
import shlex
import sys
import sysconfig
import time
import tracemalloc
import urllib.request
import warnings

NOTES = "<!-- notes -->"
MALLOC = {
    "config": {},
    "none": {"trim_after_update": False, "mmap_threshold": None},
    "trim": {"trim_after_update": True, "mmap_threshold": None},
    "pin": {"trim_after_update": False, "mmap_threshold": 131072},
}


def rss_mb(pid: int | str = "self") -> float | None:
    """Resident memory of process ``pid`` in MB (VmRSS), None if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def census(torch) -> dict:
    """What live objects hold (``--trace``): the Python heap as tracemalloc sees it, and
    the tensors the garbage collector can reach (count, bytes of their distinct storages).
    RSS growing while both stay flat points at the C allocator, not at a retained object."""
    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch aliases warns
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in objects:
        if o.device.type == "cpu":
            try:
                st = o.untyped_storage()
            except RuntimeError:  # e.g. a tensor without storage
                continue
            storages[st.data_ptr()] = st.nbytes()
    del objects
    return {
        "python_heap_mb": round(tracemalloc.get_traced_memory()[0] / 2**20, 2),
        "tensors": len(storages),
        "tensor_mb": round(sum(storages.values()) / 2**20, 2),
    }


def stdlib_files() -> list[str]:
    """The standard library's ``.py`` files (no site-packages), sorted: the text source."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for base, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        out += [os.path.join(base, f) for f in sorted(files) if f.endswith(".py")]
    if not out:
        raise SystemExit(f"no .py files under the standard library at {root!r}")
    return out


class Prompts:
    """Deterministic prompts: a window of a random stdlib file, starting at a line.

    Nothing is cached across prompts (only the file list), so the source itself does not
    grow the process being measured."""

    def __init__(self, seed: int, min_chars: int = 80, max_chars: int = 400):
        self.files = stdlib_files()
        self.rng = random.Random(seed)
        self.min_chars, self.max_chars = min_chars, max_chars

    def next(self) -> str:
        while True:
            path = self.files[self.rng.randrange(len(self.files))]
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
            except OSError:
                continue
            if len(text) < 2 * self.max_chars:
                continue
            start = text.find("\n", self.rng.randrange(len(text) - self.max_chars)) + 1
            piece = text[start : start + self.rng.randint(self.min_chars, self.max_chars)]
            if piece.strip():
                return piece


class LocalTarget:
    """Serves through an in-process ``osd.Engine`` learning online."""

    def __init__(self, args):
        # torch and osd load only for a local engine: --server mode runs without them
        import torch

        import osd  # (see above)
        from osd import zoo  # (see above)

        torch.set_num_threads(args.threads)
        self.torch = torch
        self.osd = osd
        target, draft = zoo.default_pair()
        self.device = args.device
        self.engine = osd.Engine.from_pretrained(
            target,
            draft=draft,
            device=args.device,
            spec=osd.SpecConfig(num_draft_tokens=4),
            online=osd.OnlineConfig(**MALLOC[args.malloc]),
            max_batch_size=args.batch,
            max_seq_len=512,
        )
        self.params = dict(max_new_tokens=args.new_tokens, temperature=args.temperature)
        self.calls = 0
        self.trace = args.trace
        if args.trace:
            tracemalloc.start()

    def generate(self, prompts: list[str]) -> list[tuple[str | None, int]]:
        """-> (finish_reason, generated tokens) per prompt."""
        self.calls += 1
        params = self.osd.SamplingParams(**self.params, seed=self.calls * len(prompts))
        return [(o.finish_reason, len(o.token_ids)) for o in self.engine.generate(prompts, params)]

    def sample(self) -> dict:
        self.engine.online.wait()  # no update in flight: its tensors are not counted
        out = {"rss_mb": rss_mb()}
        if self.trace:
            out.update(census(self.torch))
        if self.device.startswith("cuda"):
            out["gpu_allocated_mb"] = self.torch.cuda.memory_allocated() / 2**20
            out["gpu_reserved_mb"] = self.torch.cuda.memory_reserved() / 2**20
        return out

    def online(self) -> dict:
        h = self.engine.stats["online"]
        return {
            k: h[k]
            for k in (
                "requests",
                "alpha_mean",
                "updates_applied",
                "updates_rejected",
                "update_seconds",
                "faults",
                "last_error",
            )
        }

    def faults(self) -> int:
        return sum(self.engine.online.faults().values())

    def close(self) -> None:
        self.engine.close()


class ServerTarget:
    """Serves through an OpenAI-compatible server (``osd serve``) at ``/v1/completions``;
    memory is the server process's (``--server-pid``) when it runs on this machine."""

    def __init__(self, args):
        self.url = args.server.rstrip("/") + "/v1/completions"
        self.metrics_url = args.server.rstrip("/") + "/metrics"
        self.pid = args.server_pid
        self.body = dict(max_tokens=args.new_tokens, temperature=args.temperature)
        self.pool = concurrent.futures.ThreadPoolExecutor(args.batch)
        self.calls = 0

    def _one(self, prompt: str, seed: int) -> tuple[str | None, int]:
        body = json.dumps(dict(self.body, prompt=prompt, seed=seed, return_token_ids=True)).encode()
        req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            choice = json.load(resp)["choices"][0]
        tokens = choice.get("token_ids")
        return choice.get("finish_reason"), len(tokens) if tokens is not None else len(
            choice.get("text") or ""
        )

    def generate(self, prompts: list[str]) -> list[tuple[str | None, int]]:
        self.calls += 1
        seed = self.calls * len(prompts)
        futures = [self.pool.submit(self._one, p, seed + i) for i, p in enumerate(prompts)]
        out = []
        for f in futures:
            try:
                out.append(f.result())
            except Exception as e:  # one lost request, not the whole batch
                print(f"[soak] request failed: {type(e).__name__}: {e}", file=sys.stderr)
                out.append((None, 0))
        return out

    def _metric(self, name: str) -> float | None:
        with urllib.request.urlopen(self.metrics_url, timeout=60) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return None

    def sample(self) -> dict:
        # As in engine mode, memory is read with the learner idle: between two batches no
        # request is in flight, so at most the update they triggered is still running.
        deadline = time.monotonic() + 300
        while (self._metric("osd:online_learners_busy") or 0) > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        return {"rss_mb": rss_mb(self.pid) if self.pid else None}

    def online(self) -> dict:
        return {
            "updates_applied": self._metric("osd:online_updates_applied_total"),
            "updates_rejected": self._metric("osd:online_updates_rejected_total"),
        }

    def faults(self) -> int:
        return 0

    def close(self) -> None:
        self.pool.shutdown()


def run(args) -> dict:
    source = Prompts(args.seed)
    target = ServerTarget(args) if args.server else LocalTarget(args)
    samples, done, errors, lost = [], 0, 0, 0
    baseline = None
    t0 = time.perf_counter()
    next_sample = min(args.every, args.requests)
    stopped = None
    while done < args.requests:
        if args.max_minutes and time.perf_counter() - t0 > 60 * args.max_minutes:
            stopped = f"time budget of {args.max_minutes:g} minutes reached"
            break
        prompts = [source.next() for _ in range(min(args.batch, args.requests - done))]
        try:
            results = target.generate(prompts)
        except Exception as e:  # the whole call failed: all its requests lost
            print(f"[soak] generate failed: {type(e).__name__}: {e}", file=sys.stderr)
            results = [(None, 0)] * len(prompts)
            errors += 1
        done += len(prompts)
        lost += sum(1 for reason, n in results if reason is None or n < 1)
        budget_over = args.max_minutes and time.perf_counter() - t0 > 60 * args.max_minutes
        if done >= next_sample or done == args.requests or budget_over:
            wall = time.perf_counter() - t0
            s = dict(
                requests=done,
                wall_s=round(wall, 1),
                req_per_s=round(done / wall, 2),
                errors=errors,
                lost=lost,
                learner_faults=target.faults(),
                **target.sample(),
            )
            samples.append(s)
            if baseline is None and done >= args.baseline:
                baseline = s
            gpu = (
                f"  GPU {s['gpu_allocated_mb']:.1f} MB alloc / {s['gpu_reserved_mb']:.1f} reserved"
                if "gpu_allocated_mb" in s
                else ""
            )
            rss = f"{s['rss_mb']:.1f} MB" if s["rss_mb"] is not None else "n/a"
            if "tensors" in s:
                rss += (
                    f" (Python heap {s['python_heap_mb']:.1f} MB, {s['tensors']} CPU "
                    f"tensors {s['tensor_mb']:.1f} MB)"
                )
            print(
                f"[soak] {done:>6}/{args.requests} requests  RSS {rss}{gpu}  "
                f"{s['req_per_s']:.1f} req/s  errors {errors + lost}  "
                f"learner faults {s['learner_faults']}",
                flush=True,
            )
            next_sample += args.every
    wall = time.perf_counter() - t0
    online = target.online()
    target.close()
    end = samples[-1]
    growth = None
    if baseline is not None and baseline is not end and baseline["rss_mb"] and end["rss_mb"]:
        growth = 100.0 * (end["rss_mb"] - baseline["rss_mb"]) / baseline["rss_mb"]
    return {
        "command": (f"nice -n {os.nice(0)} " if os.nice(0) > 0 else "")
        + " ".join(
            shlex.quote(a) for a in [sys.executable.replace(os.getcwd() + "/", "")] + sys.argv
        ),
        "mode": "server" if args.server else "engine",
        "requests": done,
        "requests_asked": args.requests,
        "stopped_early": stopped,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "malloc": args.malloc,
        "errors": errors,
        "lost": lost,
        "wall_s": round(wall, 1),
        "req_per_s": round(done / wall, 2),
        "rss_baseline_at": baseline["requests"] if baseline else None,
        "rss_baseline_mb": baseline["rss_mb"] if baseline else None,
        "rss_end_mb": end["rss_mb"],
        "rss_growth_pct": round(growth, 3) if growth is not None else None,
        "max_growth_pct": args.max_growth,
        "online": online,
        "samples": samples,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "device": args.device,
        },
    }


def markdown(r: dict, old: str | None) -> str:
    fmt = lambda v, f="{:.1f}": "n/a" if v is None else f.format(v)  # noqa: E731
    lines = [
        "# Soak test",
        "",
        "| requests | RSS at {} | RSS at the end | growth | errors | wall time |".format(
            fmt(r["rss_baseline_at"], "{:,}")
        ),
        "|---|---|---|---|---|---|",
        f"| {r['requests']:,} | {fmt(r['rss_baseline_mb'])} MB | {fmt(r['rss_end_mb'])} MB "
        f"| {fmt(r['rss_growth_pct'], '{:+.2f}')}% | {r['errors'] + r['lost']} "
        f"| {r['wall_s'] / 60:.1f} min |",
        "",
        f"Command ({r['mode']} mode; {r['machine']['cpus']} CPUs, {r['machine']['device']}, "
        f"Python {r['machine']['python']}):",
        "",
        "```",
        r["command"],
        "```",
        "",
        *(
            [
                f"**Stopped after {r['requests']:,} of the {r['requests_asked']:,} requests asked: "
                f"{r['stopped_early']}.**",
                "",
            ]
            if r.get("stopped_early")
            else []
        ),
        f"Batch {r['batch']}, {r['new_tokens']} new tokens, temperature {r['temperature']}, "
        f"{r['req_per_s']} requests/s. Goal: RSS growth from request "
        f"{fmt(r['rss_baseline_at'], '{:,}')} to the end under {r['max_growth_pct']}%.",
        "",
    ]
    if r["online"] and "faults" not in r["online"]:  # server mode: from /metrics
        o = r["online"]
        lines += [
            f"Online learning: {fmt(o['updates_applied'], '{:.0f}')} updates applied, "
            f"{fmt(o['updates_rejected'], '{:.0f}')} rejected.",
            "",
        ]
    elif r["online"]:
        o = r["online"]
        faults = {k: v for k, v in o["faults"].items() if v}
        lines += [
            f"Online learning: {o['updates_applied']} updates applied, "
            f"{o['updates_rejected']} rejected, {o['update_seconds']:.0f} s of learner "
            f"time, mean α {fmt(o['alpha_mean'], '{:.3f}')}; learner faults: "
            f"{faults or 'none'}.",
            "",
        ]
    trace = any("tensors" in s for s in r["samples"])
    extra = " Python heap MB | CPU tensors | tensor MB |" if trace else ""
    lines += [
        "| requests | RSS MB | GPU MB (allocated) | requests/s | errors |" + extra,
        "|---|---|---|---|---|" + "---|" * (3 if trace else 0),
    ]
    for s in r["samples"]:
        row = (
            f"| {s['requests']:,} | {fmt(s['rss_mb'])} | "
            f"{fmt(s.get('gpu_allocated_mb'))} | {s['req_per_s']} | "
            f"{s['errors'] + s['lost']} |"
        )
        if trace:
            row += f" {s['python_heap_mb']} | {s['tensors']} | {s['tensor_mb']} |"
        lines.append(row)
    lines += ["", NOTES]
    if old and NOTES in old:
        lines.append(old.split(NOTES, 1)[1].lstrip("\n"))
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--requests", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=8, help="prompts per generate call")
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--every", type=int, default=1000, help="requests between progress lines")
    ap.add_argument(
        "--baseline",
        type=int,
        default=2000,
        help="request count whose RSS the growth is measured from",
    )
    ap.add_argument("--max-growth", type=float, default=2.0, help="allowed RSS growth, %%")
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop early (and say so in the summary) once this much time passed",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (engine mode)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--malloc",
        choices=sorted(MALLOC),
        default="config",
        help="how the learner treats the C heap: 'config' as OnlineConfig's "
        "defaults, 'none' leaves it alone, 'trim' trims it after each update, "
        "'pin' pins glibc's mmap threshold at 128 KiB (to compare)",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="also report the Python heap (tracemalloc; slows serving) and the "
        "live CPU tensors at each progress line",
    )
    ap.add_argument("--server", help="URL of an OpenAI-compatible osd server to soak instead")
    ap.add_argument("--server-pid", type=int, help="the server's pid, to read its RSS")
    ap.add_argument("--json", default="results/soak.json")
    ap.add_argument("--md", default="results/soak.md")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.batch < 1 or args.every < 1:
        ap.error("--requests, --batch and --every must be >= 1")
    r = run(args)
    for path in (args.json, args.md):
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    if args.md:
        old = open(args.md).read() if os.path.exists(args.md) else None
        with open(args.md, "w") as f:
            f.write(markdown(r, old))
    ok = (
        r["errors"] == 0
        and r["lost"] == 0
        and (r["rss_growth_pct"] is None or r["rss_growth_pct"] < args.max_growth)
    )
    mb = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    print(
        f"[soak] {r['requests']} requests in {r['wall_s']:.0f} s, errors {r['errors']}, "
        f"lost {r['lost']}, RSS {mb(r['rss_baseline_mb'])} -> {mb(r['rss_end_mb'])} MB "
        f"({r['rss_growth_pct']}%): {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
