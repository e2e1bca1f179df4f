"""The servers and clients of ``bench/bench_serve.py``: ``osd serve`` child processes on
the built-in pair, and the streaming clients that load them.

- :class:`ServeProcess` starts ``osd serve`` on a free port (``plain``: the target alone;
  ``spec``: with the built-in draft, a chain of ``K``), waits for ``/health``, reads its
  ``/metrics`` and CPU seconds, and stops it with Ctrl-C;
- :func:`run_load` runs N concurrent streaming clients over a list of prompts and
  returns the wall time and, per request, the send time, each chunk's arrival time and
  token count, the token ids, finish reason and usage.

httpx and openai are imported where they are used: ``bench_serve.py`` skips (under
pytest) or exits with a message when they are missing.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

from osd import zoo

MODEL = "osd-zoo"
K = 4
THREADS = int(os.environ.get("OSD_BENCH_THREADS", "1"))
SERVERS = ("plain", "spec")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- Servers ----


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its threads (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# ``--tcp-nodelay``: run ``osd serve`` with TCP_NODELAY set on its listening socket (the
# accepted connections inherit it). Without it, on a reused keep-alive connection Nagle's
# algorithm holds the first event of a stream until the client's delayed ACK (about 40 ms),
# and the events queued behind it arrive in one burst. ``osd serve`` sets TCP_NODELAY
# itself, so the wrapper only matters for a server that does not.
NODELAY_WRAPPER = (
    "import socket, sys\n"
    "_bind = socket.socket.bind\n"
    "def bind(self, addr):\n"
    "    if self.type == socket.SOCK_STREAM and self.family in (socket.AF_INET, socket.AF_INET6):\n"
    "        self.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
    "    return _bind(self, addr)\n"
    "socket.socket.bind = bind\n"
    "from osd import cli\n"
    "sys.exit(cli.main(sys.argv[1:]))\n"
)


# Extra `osd serve` flags of the speculative server (--auto-k sets ["--auto-k"]).
SPEC_FLAGS: list[str] = []


class ServeProcess:
    """``osd serve`` on the built-in pair as a child process on a free port."""

    def __init__(self, name: str, threads: int = THREADS, k: int = K, nodelay: bool = False):
        target, draft = zoo.default_pair()
        self.name = name
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        launcher = ["-c", NODELAY_WRAPPER] if nodelay else ["-m", "osd.cli"]
        self.cmd = [
            sys.executable,
            *launcher,
            "serve",
            "--target",
            target,
            "--model-name",
            MODEL,
            "--port",
            str(self.port),
            "--threads",
            str(threads),
            "--log-level",
            "warning",
            # every step's tokens in an event of their own: the chunks time the steps
            "--stream-interval",
            "0",
        ]
        if name == "spec":
            self.cmd += ["--draft", draft, "-k", str(k), *SPEC_FLAGS]
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix=f"bench_serve_{name}_", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_ready(self, timeout: float = 180.0) -> None:
        import httpx  # optional: bench_serve skips (or exits) without it

        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"osd serve ({self.name}) exited with status "
                    f"{self.proc.returncode}:\n{self.output()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(
                    f"osd serve ({self.name}) not up after {timeout:.0f} s:\n{self.output()}"
                )
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def cpu_seconds(self) -> float | None:
        return _cpu_seconds(self.proc.pid)

    def metrics(self) -> dict:
        """``/metrics`` samples without labels, as {name: value}."""
        import httpx  # optional: bench_serve skips (or exits) without it

        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self) -> int | None:
        """Ctrl-C (uvicorn's clean shutdown), then kill after 20 s; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


def start_servers(names=SERVERS, threads: int = THREADS, nodelay: bool = False) -> dict:
    """The servers ``names``, started together and waited for."""
    servers = {n: ServeProcess(n, threads, nodelay=nodelay) for n in names}
    try:
        for s in servers.values():
            s.wait_ready()
    except BaseException:
        for s in servers.values():
            s.stop()
        raise
    return servers


# ---- Clients ----


async def _one(client, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: send time, (arrival time, token count) per chunk with
    tokens, the token ids, finish reason and usage."""
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    chunks, ids, finish, usage = [], [], None, None
    async for chunk in stream:
        t = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            new = getattr(c, "token_ids", None) or []
            if new:
                chunks.append((t, len(new)))
                ids.extend(new)
            finish = c.finish_reason or finish
    t_end = time.perf_counter()
    return dict(
        t0=t0, t_end=t_end, chunks=chunks, ids=ids, ntok=len(ids), finish=finish, usage=usage
    )


async def _load(url: str, prompts: list[str], clients: int, max_tokens: int) -> tuple:
    """``clients`` concurrent clients over ``prompts`` (client j sends prompts j, j + N,
    ... one after another); (wall seconds, results in prompt order)."""
    import httpx  # optional: bench_serve skips (or exits) without it
    import openai  # optional, as httpx

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0)) as http:
        client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http
        )
        results: list = [None] * len(prompts)

        async def worker(j: int):
            for i in range(j, len(prompts), clients):
                results[i] = await _one(client, prompts[i], max_tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(j) for j in range(min(clients, len(prompts)))))
        return time.perf_counter() - t0, results


def run_load(url: str, prompts: list[str], clients: int, max_tokens: int) -> tuple:
    return asyncio.run(_load(url, prompts, clients, max_tokens))
