"""The servers and clients of ``bench/bench_serve_llamacpp.py``: ``osd serve`` and
``llama-server`` on the chat target, and streaming chat clients that load them.

- :class:`OsdServe` runs ``osd serve`` as a user does (no ``--target``: the chat pair,
  its GGUF cached) with extra flags (``--no-draft``), on a free port;
- :class:`InProcess` drives an ``osd.Engine`` in a worker process of its own
  (``bench/inprocess_worker.py``), one conversation at a time;
- :func:`llama_server` runs ``llama-server`` on the same GGUF with ``-np`` slots of
  ``slot_ctx`` tokens each (``bench.llamacpp.Server``: ``--poll 0``, ``-t``/``-tb``
  threads), with or without ``OMP_WAIT_POLICY`` in its environment;
- :func:`llama_prompt_ids` asks a ``llama-server`` for the token ids its chat endpoint
  builds from a conversation (``/apply-template`` then ``/tokenize``), to check that both
  servers prefill the same ids;
- :func:`run_load` runs N concurrent streaming clients over a list of conversations
  against ``/v1/chat/completions`` and returns the wall time and, per request, when it
  was sent, when its first text arrived, when it ended, its text and the usage counts.
  Each request is plain HTTP/1.1 on a connection of its own, read with asyncio's
  streams: the clients run on the cores the servers use, and a general HTTP client
  (httpx) costs 2-4x the client CPU per token (0.16-0.26 ms against 0.07 on the 2-core
  Intel VM, ``osd serve`` at one client).

The request body is the same for both servers (neither sends ``model``: ``osd serve``
takes a missing model, ``llama-server`` ignores it). ``ignore_eos`` and ``cache_prompt``
are extensions: ``osd serve`` reads ``ignore_eos`` and ignores ``cache_prompt``;
``llama-server`` reads both (``cache_prompt: false``: every request prefills its whole
prompt, as ``osd serve`` does without ``--prefix-cache``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlsplit

import httpx

from bench import llamacpp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "OSDBENCH "  # marks the protocol lines of bench/inprocess_worker.py


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its threads (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _wait_health(url: str, proc: subprocess.Popen, what: str, log, timeout: float) -> None:
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}:\n{log()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise RuntimeError(f"{what} not up after {timeout:.0f} s:\n{log()}")
        time.sleep(0.2)


class OsdServe:
    """``osd serve --threads THREADS [flags]`` as a child process on a free port. Without
    ``--target`` it serves the chat pair when the chat GGUF is cached (the caller checks)."""

    def __init__(self, flags=(), threads: int = 2, timeout: float = 300.0):
        self.port = llamacpp.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "osd.cli", "serve", "--port", str(self.port),
                    "--threads", str(threads), "--log-level", "warning", *flags]  # fmt: skip
        self.log = tempfile.NamedTemporaryFile("w+", prefix="osd_serve_", suffix=".log")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT
        )
        try:
            _wait_health(self.url, self.proc, "osd serve", self.output, timeout)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def engine_wall_s(self) -> float | None:
        """Wall seconds the engine has spent in its steps so far (``/metrics``: generated
        tokens over tokens per second of step time)."""
        vals = {}
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("osd:generation_tokens_total", "osd:engine_tokens_per_second"):
                try:
                    vals[name] = float(value)
                except ValueError:
                    return None
        tps = vals.get("osd:engine_tokens_per_second")
        return vals.get("osd:generation_tokens_total", 0.0) / tps if tps else 0.0

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-4000:]

    def close(self) -> None:
        """Ctrl-C (uvicorn's clean shutdown), then kill after 20 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


class InProcess:
    """An ``osd.Engine`` answering one conversation at a time in a worker process of its
    own (``bench/inprocess_worker.py``: ``import osd`` first, as a user's script)."""

    def __init__(self, target: str, draft: str | None, threads: int, timeout: float = 300.0):
        self.cmd = [sys.executable, "-m", "bench.inprocess_worker", target, draft or "-",
                    str(threads)]  # fmt: skip
        self.log = tempfile.NamedTemporaryFile("w+", prefix="osd_inprocess_", suffix=".log")
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            text=True, cwd=ROOT,
        )  # fmt: skip
        self.pid = self.proc.pid
        try:
            self._engine_wall = self._read()["engine_wall_s"]
        except BaseException:
            self.close()
            raise

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.log.flush()
                with open(self.log.name, errors="replace") as f:
                    tail = f.read()[-4000:]
                raise RuntimeError(f"the in-process worker ended ({self.proc.poll()}):\n{tail}")
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX) :])

    def run(self, convs: list, max_tokens: int) -> tuple:
        """``(wall seconds, results)`` as :func:`bench.chat_load.run_load` gives them."""
        self.proc.stdin.write(json.dumps({"convs": convs, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        self._engine_wall = out["engine_wall_s"]
        return out["wall_s"], out["results"]

    def engine_wall_s(self) -> float:
        """The engine's step time so far (as of the last answer)."""
        return self._engine_wall

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def llama_server(
    bins, model: str, slots: int, threads: int, slot_ctx: int, omp_wait_policy: str | None = None
) -> llamacpp.Server:
    """``llama-server -np SLOTS -c SLOTS*SLOT_CTX --poll 0 -t THREADS -tb THREADS`` on
    ``model``; checks through ``/props`` that it runs ``slots`` slots.

    This llama.cpp is built with OpenMP (``GGML_OPENMP``): its threads meet at
    ``#pragma omp barrier`` after every graph node, so libgomp's wait policy decides
    whether they spin or sleep there. ``omp_wait_policy`` None starts the server without
    ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` (libgomp's default, what a user's shell
    gives it; ``import osd`` has set both in this process), ``"spin=N"`` with
    ``OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=N`` (what ``import osd`` gives osd with N =
    1000), else with ``OMP_WAIT_POLICY`` set to this value."""
    names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    saved = {k: os.environ.get(k) for k in names}
    for k in names:
        os.environ.pop(k, None)
    if omp_wait_policy is not None and omp_wait_policy.startswith("spin="):
        os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
        os.environ["GOMP_SPINCOUNT"] = omp_wait_policy.split("=", 1)[1]
    elif omp_wait_policy is not None:
        os.environ["OMP_WAIT_POLICY"] = omp_wait_policy
    try:  # the child takes this process's environment when it starts
        srv = llamacpp.Server(
            bins, model, threads=threads, ctx=slots * slot_ctx, extra=["-np", str(slots)]
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    srv.url = f"http://127.0.0.1:{srv.port}"
    srv.pid = srv.proc.pid
    srv.omp_wait_policy = omp_wait_policy
    got = httpx.get(srv.url + "/props", timeout=10).json().get("total_slots")
    if got != slots:
        srv.close()
        raise RuntimeError(f"llama-server runs {got} slots, not {slots}: {' '.join(srv.cmd)}")
    return srv


def llama_prompt_ids(url: str, messages: list[dict]) -> list[int]:
    """The token ids ``llama-server`` at ``url`` prefills for ``messages`` on its chat
    endpoint: its chat template's text, tokenized with special tokens parsed."""
    text = httpx.post(url + "/apply-template", json={"messages": messages}, timeout=30).json()
    body = {"content": text["prompt"], "add_special": True, "parse_special": True}
    return httpx.post(url + "/tokenize", json=body, timeout=30).json()["tokens"]


def chat_body(messages: list[dict], max_tokens: int) -> dict:
    """The request both servers get: greedy, ``max_tokens`` new tokens with EOS ignored,
    streamed with a final usage chunk, no prompt caching."""
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "cache_prompt": False,
    }


async def _read_body(reader: asyncio.StreamReader, headers: dict):
    """The response body's pieces as they arrive: chunked transfer coding decoded, else
    up to ``Content-Length`` bytes or the end of the connection."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                return
            data = await reader.readexactly(size + 2)  # the piece and its CRLF
            yield data[:-2]
    left = int(headers["content-length"]) if "content-length" in headers else None
    while left is None or left > 0:
        data = await reader.read(65536 if left is None else min(left, 65536))
        if not data:
            return
        if left is not None:
            left -= len(data)
        yield data


async def _one(url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: send time, first-text time, end time, text, the
    number of chunks with text, finish reason, usage, and (``llama-server``) the
    server's own prefill + decode seconds.

    HTTP/1.1 over a connection of its own (``Connection: close``), read with asyncio's
    streams: the clients share this machine's cores with the server they measure, and a
    general HTTP client (httpx: its HTTP parser and event dispatch in Python) spends
    several times the CPU per streamed token, which on two cores the server loses."""
    u = urlsplit(url)
    body = json.dumps(chat_body(messages, max_tokens)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    t0 = time.perf_counter()
    t_first, parts, finish, usage, chunks, timings = None, [], None, None, 0, None
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        writer.write(head + body)
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != 200:
            got = b"".join([piece async for piece in _read_body(reader, headers)])
            raise RuntimeError(f"{url}: status {status}: {got[:500]!r}")
        buf, done = b"", False
        async for piece in _read_body(reader, headers):
            *lines, buf = (buf + piece).split(b"\n")
            for line in lines:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(f"{url}: error event {obj['error']}")
                if obj.get("usage"):
                    usage = obj["usage"]
                if obj.get("timings"):  # llama-server's own prefill and decode times
                    timings = obj["timings"]
                for c in obj.get("choices") or ():
                    text = (c.get("delta") or {}).get("content")
                    if text:
                        if t_first is None:
                            t_first = time.perf_counter()
                        parts.append(text)
                        chunks += 1
                    finish = c.get("finish_reason") or finish
            if done:
                break
    finally:
        writer.close()
    return dict(
        t0=t0,
        t_first=t_first,
        t_end=time.perf_counter(),
        text="".join(parts),
        chunks=chunks,
        finish=finish,
        completion_tokens=(usage or {}).get("completion_tokens"),
        prompt_tokens=(usage or {}).get("prompt_tokens"),
        server_s=None
        if timings is None
        else (timings.get("prompt_ms", 0.0) + timings.get("predicted_ms", 0.0)) / 1e3,
    )


async def _load(url: str, convs: list, clients: int, max_tokens: int) -> tuple:
    results: list = [None] * len(convs)

    async def worker(j: int):
        for i in range(j, len(convs), clients):
            results[i] = await asyncio.wait_for(_one(url, convs[i], max_tokens), 600.0)

    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(j) for j in range(min(clients, len(convs)))))
    return time.perf_counter() - t0, results, time.process_time() - cpu0


def run_load(url: str, convs: list, clients: int, max_tokens: int) -> tuple:
    """``clients`` concurrent streaming clients over the conversations ``convs`` (client
    j sends conversations j, j + N, ... one after another); ``(wall seconds, results in
    conversation order, CPU seconds of this process meanwhile)``."""
    return asyncio.run(_load(url, convs, clients, max_tokens))
