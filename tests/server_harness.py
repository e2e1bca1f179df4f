"""What the tests of ``osd serve`` (``tests/test_server*.py``) share: uvicorn in a
background thread on a free loopback port, the built-in pair behind it, ``/metrics``
parsed, and the raw-HTTP helpers of the hostile-client checks.

Not a test module: the test modules import it after ``pytest.importorskip`` of fastapi,
uvicorn, openai and httpx, which it needs.
"""

import re
import socket
import threading
import time

import httpx
import openai
import uvicorn

import osd
from osd import zoo
from osd.server import Limits, build_app, uvicorn_config

MODEL = "osd-zoo"
MAX_SEQ_LEN = 256
# The built-in tokenizer ships no chat template; the chat tests install this one.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPTS = [
    "def __init__(self, name):\n    self.name = name\n",
    "import os\nimport sys\n\n",
    "    for i in range(len(items)):\n",
    "class Error(Exception):\n",
    "    return self._data[key]\n",
    "if __name__ == '__main__':\n",
    '    def close(self):\n        """Close the file.',
    "    # Return the number of bytes",
]
NEW = 16


def free_socket() -> socket.socket:
    """A TCP socket bound to a free loopback port (not listening yet)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class Server:
    """uvicorn in a background thread serving ``app`` on 127.0.0.1:port; within
    ``limits`` (through :func:`osd.server.uvicorn_config`) when given."""

    def __init__(self, app, limits: Limits | None = None):
        sock = free_socket()
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = (
            uvicorn.Config(app, log_level="warning")
            if limits is None
            else uvicorn_config(app, limits, log_level="warning")
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.time() + 30
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the server did not come up"
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def spec_engine(max_batch_size: int, **kwargs) -> osd.Engine:
    """The built-in pair speculating with a chain of 3 in a 256-token context, with the
    chat template installed."""
    target, draft = zoo.default_pair()
    engine = osd.Engine.from_pretrained(
        target,
        draft=draft,
        max_batch_size=max_batch_size,
        max_seq_len=MAX_SEQ_LEN,
        spec=osd.SpecConfig(num_draft_tokens=3),
        **kwargs,
    )
    engine.tokenizer.chat_template = TEMPLATE
    return engine


def metrics(url: str) -> dict:
    """``/metrics`` as {sample name with labels: value}; parsed by prometheus_client when
    installed, else by a line regex."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    try:
        # optional: the strict parser when installed (the dev extra), else a line regex
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        line = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")
        for raw in text.splitlines():
            if raw.startswith("#") or not raw:
                continue
            m = line.match(raw)
            assert m, f"not a Prometheus sample line: {raw!r}"
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out
    for fam in text_string_to_metric_families(text):
        assert fam.type in ("counter", "gauge"), (fam.name, fam.type)
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


# ---- Hostile clients (tests/test_server_hostile.py, tests/test_server_limits.py) ----

KEY = "sekrit-key"
ROWS = 4
LIMITS = Limits(
    api_key=KEY,
    allowed_origins=("http://ok.example",),
    max_body_bytes=96 << 10,
    max_waiting=2,
    keep_alive_timeout=1.0,
    header_timeout=1.5,
    body_timeout=1.5,
    max_connections=24,
)
AUTH = {"Authorization": f"Bearer {KEY}"}
HOSTILE_PROMPTS = [
    "def __init__(self, name):\n",
    "import os\nimport sys\n\n",
    "    for i in range(len(items)):\n",
    "class Error(Exception):\n",
    "    return self._data[key]\n",
]


def hostile_setup():
    """The server of the hostile-client checks (``ROWS`` rows, within ``LIMITS``) and
    plain decoding's 24 greedy tokens of each of ``HOSTILE_PROMPTS``; a module fixture's
    body (``yield from``)."""
    target, _ = zoo.default_pair()
    ref_engine = osd.Engine.from_pretrained(target, max_batch_size=ROWS, max_seq_len=MAX_SEQ_LEN)
    reference = ref_engine.generate(HOSTILE_PROMPTS, osd.SamplingParams(24))
    engine = spec_engine(ROWS)
    ae = osd.AsyncEngine(engine)
    app = build_app(ae, MODEL, LIMITS)
    server = Server(app, LIMITS)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield dict(
        server=server,
        url=server.url,
        client=client,
        engine=engine,
        ae=ae,
        app=app,
        tok=engine.tokenizer,
        reference=reference,
    )
    server.stop()
    ae.close()


def post(setup, body, path="/v1/completions", headers=None, timeout=30, **kw):
    """POST ``body`` (JSON, or raw bytes / text sent as JSON) with the API key."""
    h = {**AUTH, **(headers or {})}
    if isinstance(body, (bytes, str)):
        h.setdefault("content-type", "application/json")
        return httpx.post(setup["url"] + path, content=body, headers=h, timeout=timeout, **kw)
    return httpx.post(setup["url"] + path, json=body, headers=h, timeout=timeout, **kw)


def expect_error(r, status, param=None, contains=""):
    """The OpenAI-style error body of ``r``, checked for its status, param and message."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param and contains in err["message"], err
    return err


def raw_socket(setup, timeout=5.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", setup["server"].port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_until_closed(s: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (or ``limit`` seconds pass)."""
    t0, data = time.time(), b""
    s.settimeout(0.2)
    while time.time() - t0 < limit:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.time() - t0


def still_serves(setup):
    """A greedy completion still equals plain decoding's."""
    r = post(
        setup, {"model": MODEL, "prompt": HOSTILE_PROMPTS[0], "max_tokens": 24, "temperature": 0}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == setup["reference"][0].text
