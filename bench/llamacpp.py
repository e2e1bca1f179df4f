"""llama.cpp beside osd: its binaries, a ``llama-server`` per decoding mode, and ``llama-bench``.

The binaries are built from the llama.cpp sources vendored in the ``llama-cpp-python``
sdist by ``scripts/build_llamacpp.sh`` (``make llamacpp``; ``make bench`` runs it first) and
cached in ``${OSD_CACHE:-~/.cache/osd}/llama.cpp/<version>/bin``. :func:`find_binaries`
looks there (or in ``OSD_LLAMACPP_BIN``) and builds them when asked to
(``OSD_BUILD_LLAMACPP=1``, or ``build=True``).

    >>> from bench import llamacpp
    >>> bins = llamacpp.find_binaries()                  # None when not built
    >>> with llamacpp.Server(bins, "model.gguf", threads=2, mode="ngram-mod") as srv:
    ...     out = srv.complete([1, 2, 3], n_predict=128)  # token ids in, token ids out
    >>> out.tokens, out.timings["predicted_ms"], out.wall_s
    >>> llamacpp.llama_bench(bins, "model.gguf", threads=2)   # {"tg": tok/s, "pp": tok/s}

A request is greedy (``temperature`` 0, ``top_k`` 1, only those two samplers) with a fixed
number of new tokens (``ignore_eos``), the prompt given as token ids (the server adds no
BOS to an all-ids prompt) and ``cache_prompt: false`` (the whole prompt is prefilled every
time, as osd does without its prefix cache). The server runs one slot (``-np 1``) with
``--poll 0`` (its threads sleep between requests instead of spinning: the machine is
shared with the osd process being compared).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import osd

VERSION = os.environ.get("LLAMACPP_PY_VERSION", "0.3.36")
BINARIES = ("llama-server", "llama-bench", "llama-quantize")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_SCRIPT = os.path.join(ROOT, "scripts", "build_llamacpp.sh")

# Decoding modes of llama-server: name -> extra command-line arguments. The n-gram modes
# (common/speculative.cpp of the vendored sources) need no draft model:
# - ngram-simple: the last n tokens looked up earlier in the prompt + output, the m that
#   followed them drafted (defaults n 12, m 48); ``ngram-simple-short`` looks up 3-token
#   matches and drafts up to 8, closer to osd's prompt lookup;
# - ngram-map-k: the same through a per-request map of n-grams (defaults n 12, m 48);
# - ngram-mod: a hashed table of 24-grams shared by all requests of the server (it keeps
#   what earlier requests generated), drafting 48 to 64 tokens.
# ``draft`` (the draft-model mode, ``-md``) is added by :class:`Server` when given a draft
# GGUF.
MODES: dict[str, list[str]] = {
    "plain": [],
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-simple-short": [
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        "3",
        "--spec-ngram-simple-size-m",
        "8",
    ],
    "ngram-map-k": ["--spec-type", "ngram-map-k"],
    "ngram-mod": ["--spec-type", "ngram-mod"],
}


def cache_dir() -> str:
    """``${OSD_CACHE:-~/.cache/osd}/llama.cpp/<VERSION>``, as the build script uses it."""
    base = os.environ.get("OSD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "osd")
    return os.path.join(os.path.abspath(base), "llama.cpp", VERSION)


def bin_dir() -> str:
    """Where the binaries are looked for: ``OSD_LLAMACPP_BIN`` when set, else
    ``cache_dir()/bin``."""
    return os.environ.get("OSD_LLAMACPP_BIN") or os.path.join(cache_dir(), "bin")


def build() -> None:
    """Run ``scripts/build_llamacpp.sh`` (returns at once when the binaries are cached;
    its progress goes to this process's output). Raises RuntimeError when it fails."""
    rc = subprocess.run(
        ["bash", BUILD_SCRIPT], env={**os.environ, "LLAMACPP_PY_VERSION": VERSION}
    ).returncode
    if rc != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed (exit status {rc}); its output is above")


def find_binaries(build_missing: bool | None = None) -> dict[str, str] | None:
    """``{name: path}`` of :data:`BINARIES` in :func:`bin_dir`, or None when one is missing.

    ``build_missing``: build them first when missing (None: when ``OSD_BUILD_LLAMACPP=1``)."""
    if build_missing is None:
        build_missing = os.environ.get("OSD_BUILD_LLAMACPP", "0") == "1"
    paths = {name: os.path.join(bin_dir(), name) for name in BINARIES}
    if not all(os.access(p, os.X_OK) for p in paths.values()):
        if not build_missing:
            return None
        build()
        paths = {name: os.path.join(bin_dir(), name) for name in BINARIES}
        if not all(os.access(p, os.X_OK) for p in paths.values()):
            return None
    return paths


def missing_reason() -> str:
    """Why :func:`find_binaries` returned None, with how to build the binaries."""
    return (
        f"llama.cpp binaries not found in {bin_dir()}: build them with "
        f"`make llamacpp` (scripts/build_llamacpp.sh, 8-15 minutes on 2 cores) or set "
        f"OSD_BUILD_LLAMACPP=1"
    )


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Completion:
    """One ``/completion`` answer: the generated ``tokens``, the server's ``timings``
    (``prompt_n``, ``prompt_ms``, ``predicted_n``, ``predicted_ms``, and ``draft_n``,
    ``draft_n_accepted`` in the speculative modes) and ``wall_s``, the request's wall time
    seen by the client (HTTP included)."""

    tokens: list[int]
    timings: dict = field(default_factory=dict)
    wall_s: float = 0.0
    stop_type: str | None = None


class Server:
    """A ``llama-server`` on a free loopback port, one slot, for the lifetime of the object
    (a context manager; :meth:`close` stops it).

    Args:
        binaries: :func:`find_binaries`'s dict (or the path of ``llama-server``).
        model: the GGUF file.
        threads: ``-t`` (and ``-tb``: prefill uses as many).
        ctx: the context size ``-c``.
        mode: a key of :data:`MODES`, or ``"draft"`` with ``draft`` set.
        draft: a draft model GGUF for the draft-model mode (``-md``; its type is read from
            the file); ``draft_max`` tokens drafted per step (``--spec-draft-n-max``).
        extra: more arguments for the command line.
        timeout_s: how long to wait for ``/health`` to answer 200.
    """

    def __init__(
        self,
        binaries,
        model: str,
        *,
        threads: int = 2,
        ctx: int = 2048,
        mode: str = "plain",
        draft: str | None = None,
        draft_max: int | None = None,
        extra=(),
        timeout_s: float = 120.0,
    ):
        exe = binaries if isinstance(binaries, str) else binaries["llama-server"]
        if mode == "draft" and draft is None:
            raise ValueError("mode 'draft' needs a draft GGUF (draft=...)")
        if mode != "draft" and mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {sorted(MODES)} or 'draft'")
        self.mode, self.model, self.threads = mode, model, threads
        self.port = free_port()
        cmd = [
            exe,
            "-m",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--poll",
            "0",
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            str(ctx),
            "-np",
            "1",
            "--no-webui",
        ]
        if mode == "draft":
            cmd += ["-md", draft, "-td", str(threads), "-tbd", str(threads)]
            if draft_max is not None:
                cmd += ["--spec-draft-n-max", str(draft_max)]
        else:
            cmd += MODES[mode]
        cmd += list(extra)
        self.cmd = cmd
        self._log = tempfile.NamedTemporaryFile(
            prefix=f"llama-server-{mode}-", suffix=".log", delete=False
        )
        # llama.cpp as a user's shell starts it: without the libgomp setting `import osd`
        # put in this process's environment
        env = {k: v for k, v in os.environ.items() if k not in osd._openmp.SET}
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        self._conn: http.client.HTTPConnection | None = None
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.close()
            raise

    # -- process ---------------------------------------------------------------------------
    def log_tail(self, n: int = 30) -> str:
        """The last ``n`` lines of the server's output."""
        try:
            with open(self._log.name, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited with status {self.proc.returncode}:"
                    f" {' '.join(self.cmd)}\n{self.log_tail()}"
                )
            try:
                status, _ = self._request("GET", "/health", None, timeout=5)
                if status == 200:
                    return
            except (OSError, http.client.HTTPException):
                self._drop_conn()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"llama-server did not become healthy in {timeout_s:.0f} s:"
                    f" {' '.join(self.cmd)}\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and remove its log."""
        self._drop_conn()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- HTTP ------------------------------------------------------------------------------
    def _drop_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _request(self, method: str, path: str, body: dict | None, timeout: float = 600):
        """One request on a kept-alive connection: ``(status, parsed JSON or None)``."""
        if self._conn is None:
            self._conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        self._conn.timeout = timeout
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        self._conn.request(method, path, body=data, headers=headers)
        resp = self._conn.getresponse()
        raw = resp.read()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        return resp.status, parsed

    def complete(
        self, prompt: list[int], n_predict: int, *, ignore_eos: bool = True, **fields
    ) -> Completion:
        """Greedy completion of the token ids ``prompt``: ``n_predict`` new tokens (fewer only
        at EOS when ``ignore_eos`` is False). ``fields`` add to or override the request's
        JSON. Raises RuntimeError on an error answer."""
        body = {
            "prompt": [int(t) for t in prompt],
            "n_predict": int(n_predict),
            "cache_prompt": False,
            "temperature": 0.0,
            "top_k": 1,
            "samplers": ["top_k", "temperature"],
            "ignore_eos": bool(ignore_eos),
            "return_tokens": True,
            "stream": False,
            "seed": 0,
        }
        body.update(fields)
        t0 = time.perf_counter()
        try:
            status, out = self._request("POST", "/completion", body)
        except (OSError, http.client.HTTPException):
            self._drop_conn()  # a dropped keep-alive connection: retry once, afresh
            t0 = time.perf_counter()
            status, out = self._request("POST", "/completion", body)
        wall = time.perf_counter() - t0
        if status != 200 or not isinstance(out, dict):
            raise RuntimeError(
                f"llama-server /completion answered {status}: {out}\n{self.log_tail()}"
            )
        return Completion(
            tokens=list(out.get("tokens") or []),
            timings=out.get("timings", {}),
            wall_s=wall,
            stop_type=out.get("stop_type"),
        )


def llama_bench(
    binaries,
    model: str,
    *,
    threads: int = 2,
    n_prompt: int = 128,
    n_gen: int = 128,
    repetitions: int = 3,
    timeout_s: float = 600,
) -> dict:
    """``llama-bench`` on ``model`` (``--poll 0``, ``threads`` threads, ``repetitions`` runs
    of each test): ``{"tg": decode tokens/s over n_gen tokens, "pp": prefill tokens/s of an
    n_prompt-token prompt, each the best repetition (the machine may be shared), "tg_avg",
    "pp_avg": llama-bench's means, "raw": its JSON}``. Raises RuntimeError when it fails."""
    exe = binaries if isinstance(binaries, str) else binaries["llama-bench"]
    cmd = [exe, "-m", model, "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
           "-r", str(repetitions), "--poll", "0", "-o", "json"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(
            f"llama-bench failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr[-2000:]}"
        )
    rows = json.loads(res.stdout)
    out = {"raw": rows}
    for r in rows:
        key = "pp" if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0 else "tg"
        out[key + "_avg"] = float(r["avg_ts"])
        out[key] = max([float(x) for x in r.get("samples_ts") or []] or [float(r["avg_ts"])])
    return out


__all__ = [
    "BINARIES",
    "MODES",
    "VERSION",
    "Completion",
    "Server",
    "bin_dir",
    "build",
    "cache_dir",
    "find_binaries",
    "free_port",
    "llama_bench",
    "missing_reason",
]
