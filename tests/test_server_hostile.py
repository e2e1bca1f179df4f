"""``osd serve`` against hostile and careless clients, on loopback, each check bounded in
time: one request never fails another, work per request is bounded, keys and admission
limits hold, slow and idle connections are closed, and every refusal is an OpenAI-style
error naming what was wrong.

The server runs in-process (the built-in pair, k = 3, 4 rows, 256-token context) under
:func:`osd.server_limits.uvicorn_config` with short limits, so that timeouts take a
second or two.
"""

import asyncio
import json
import logging
import socket
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import osd  # noqa: E402
from osd import cli, zoo  # noqa: E402
from osd.request import stop_prefix_length  # noqa: E402
from osd.server import build_app  # noqa: E402
from osd.server_limits import Limits, RateLimitFilter, limit_logs, parse_json, uvicorn_config  # noqa: E402
from osd.server_requests import APIError  # noqa: E402
from osd.server_run import limits_from_args  # noqa: E402

MODEL = "osd-zoo"
KEY = "sekrit-key"
MAX_SEQ_LEN = 256
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
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPTS = [
    "def __init__(self, name):\n",
    "import os\nimport sys\n\n",
    "    for i in range(len(items)):\n",
    "class Error(Exception):\n",
    "    return self._data[key]\n",
]


class Server:
    """uvicorn in a background thread serving ``app`` on 127.0.0.1 within ``limits``."""

    def __init__(self, app, limits):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, limits, log_level="warning"))
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


@pytest.fixture(scope="module")
def setup():
    target, draft = zoo.default_pair()
    ref_engine = osd.Engine.from_pretrained(target, max_batch_size=ROWS, max_seq_len=MAX_SEQ_LEN)
    reference = ref_engine.generate(PROMPTS, osd.SamplingParams(24))
    engine = osd.Engine.from_pretrained(
        target,
        draft=draft,
        max_batch_size=ROWS,
        max_seq_len=MAX_SEQ_LEN,
        spec=osd.SpecConfig(num_draft_tokens=3),
    )
    engine.tokenizer.chat_template = TEMPLATE
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


def _post(setup, body, path="/v1/completions", headers=None, timeout=30, **kw):
    h = {**AUTH, **(headers or {})}
    if isinstance(body, (bytes, str)):
        h.setdefault("content-type", "application/json")
        return httpx.post(setup["url"] + path, content=body, headers=h, timeout=timeout, **kw)
    return httpx.post(setup["url"] + path, json=body, headers=h, timeout=timeout, **kw)


def _error(r, status, param=None, contains=""):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param and contains in err["message"], err
    return err


def _raw(setup, timeout=5.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", setup["server"].port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _read_until_closed(s: socket.socket, limit: float) -> tuple[bytes, float]:
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


def _still_serves(setup):
    r = _post(setup, {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == setup["reference"][0].text


# ---- One request never fails another ----


def _poison(monkeypatch, engine, prompt_ids, after):
    """Every engine step that holds the request whose prompt is ``prompt_ids`` raises:
    its admission (``after`` None) or its steps from its ``after``-th token on. Values
    this bad cannot come from a request (they are validated); this hook stands in."""

    def hit(requests):
        return any(
            r.prompt == prompt_ids and (after is None or len(r.generated) >= after)
            for r in requests
        )

    real_prefill = engine.prefill

    def prefill(new, *a, **kw):
        if after is None and hit(new):
            raise RuntimeError("injected admission failure")
        return real_prefill(new, *a, **kw)

    monkeypatch.setattr(engine, "prefill", prefill)
    sp = engine.speculators[0]
    real_step = sp.step

    def step(active, params):
        if after is not None and hit(active):
            raise RuntimeError("injected step failure")
        return real_step(active, params)

    monkeypatch.setattr(sp, "step", step)


@pytest.mark.parametrize("after", [None, 5], ids=["admission", "mid-stream"])
def test_a_poisoned_request_fails_alone_and_the_batch_gets_its_solo_output(
    setup, monkeypatch, after
):
    poisoned = setup["tok"].encode("    # poisoned request\n")
    _poison(monkeypatch, setup["engine"], poisoned, after)
    client, ref = setup["client"], setup["reference"]
    results, errors = {}, {}

    def worker(i):
        try:
            if i == len(PROMPTS) - 1:  # the poisoned one, streamed, among the others
                stream = client.completions.create(
                    model=MODEL, prompt=poisoned, max_tokens=24, temperature=0, stream=True
                )
                results[i] = "".join(ch.choices[0].text for ch in stream)
                return
            kw = dict(model=MODEL, prompt=PROMPTS[i], max_tokens=24, temperature=0)
            if i % 2:
                results[i] = "".join(
                    ch.choices[0].text for ch in client.completions.create(stream=True, **kw)
                )
            else:
                results[i] = client.completions.create(**kw).choices[0].text
        except Exception as exc:
            errors[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(120)
    # A stream that already started gets an error event (the client raises on it); one
    # that had not gets a 500.
    assert set(errors) == {len(PROMPTS) - 1}, errors
    assert isinstance(errors[len(PROMPTS) - 1], openai.APIError)
    for i in range(len(PROMPTS) - 1):
        assert results[i] == ref[i].text, i
    assert setup["ae"].stats["errors"]["step_error"] >= 1


BEYOND_KERNELS = [
    ({"temperature": 1e39}, "temperature"),
    ({"temperature": 1e-39}, "temperature"),
    ({"top_p": 1e-46}, "top_p"),
    ({"top_k": 9223372036854775807}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 10, "max_tokens": 4}, "min_tokens"),
    ({"logit_bias": {"5": 1e300}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"stop": "x" * 257}, "stop"),
    ({"n": 2, "seed": 2**63 - 1}, None),  # accepted: choice seeds wrap within int64
]


@pytest.mark.parametrize(
    "fields,param", BEYOND_KERNELS, ids=[json.dumps(f)[:40] for f, _ in BEYOND_KERNELS]
)
def test_values_the_kernels_cannot_represent_are_400s_naming_the_field(setup, fields, param):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0.5, **fields}
    r = _post(setup, body)
    if param is None:
        assert r.status_code == 200, r.text
    else:
        _error(r, 400, param)
    # NaN and Infinity (which Python's JSON parser takes) are refused the same way.
    r = _post(setup, '{"prompt": "hi", "temperature": NaN}')
    _error(r, 400, "temperature")


# ---- Bounded work per request ----


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_bodies_past_the_limit_are_413_without_being_read(setup):
    before = _rss_mb()
    s = _raw(setup)  # a declared 512 MiB body: refused on the headers
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: 536870912\r\n\r\n"
    )
    data, took = _read_until_closed(s, 5)
    s.close()
    assert data.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in data and took < 4
    s = _raw(setup)  # chunked, no length: refused once past the limit
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + KEY.encode() + b"\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
    got = {}
    # Read while sending: the answer arrives before the reset that the unread rest of
    # the body causes when the server closes.
    reader = threading.Thread(target=lambda: got.setdefault("data", _read_until_closed(s, 10)))
    reader.start()
    try:
        for _ in range(64):  # up to 64 MiB; the server stops reading long before
            s.sendall(chunk)
    except OSError:
        pass
    reader.join(15)
    s.close()
    data = got["data"][0]
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert _rss_mb() - before < 64, (before, _rss_mb())
    _still_serves(setup)


def test_an_overlong_prompt_is_refused_before_tokenizing(setup, monkeypatch):
    tok = setup["tok"]
    calls = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    r = _post(setup, {"model": MODEL, "prompt": "x" * 90_000})
    _error(r, 400, "prompt", "characters")
    r = _post(
        setup,
        {"model": MODEL, "messages": [{"role": "user", "content": "x" * 90_000}]},
        path="/v1/chat/completions",
    )
    _error(r, 400, "messages", "characters")
    assert not calls


def test_prompts_are_tokenized_off_the_event_loop(setup, monkeypatch):
    tok = setup["tok"]
    real = tok.encode

    def slow(*a, **k):
        time.sleep(2.0)
        return real(*a, **k)

    monkeypatch.setattr(tok, "encode", slow)
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault(
            "r", _post(setup, {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2})
        )
    )
    t.start()
    time.sleep(0.3)
    t0 = time.time()
    assert httpx.get(setup["url"] + "/health", timeout=5).status_code == 200
    assert time.time() - t0 < 1.0  # the loop answered while tokenizing
    t.join(30)
    assert result["r"].status_code == 200


def test_stop_strings_are_bounded_and_matched_in_linear_time(setup):
    stops = [("\x01" + "q" * 254 + chr(0x41 + i)) for i in range(16)]  # never matched
    t0 = time.time()
    r = _post(
        setup,
        {
            "model": MODEL,
            "prompt": PROMPTS[1],
            "max_tokens": 24,
            "temperature": 0,
            "stop": stops,
            "stream": True,
        },
    )
    assert r.status_code == 200 and time.time() - t0 < 30
    text = "".join(
        json.loads(line[6:])["choices"][0]["text"]
        for line in r.text.splitlines()
        if line.startswith("data: {")
    )
    assert text == setup["reference"][1].text
    # The hold-back check costs O(len(stop)) per stop string, whatever the text's length.
    long = "q" * 100_000
    t0 = time.perf_counter()
    for _ in range(20):
        stop_prefix_length(long, stops)
    assert (time.perf_counter() - t0) / 20 < 0.05
    assert stop_prefix_length("abc\x01qq", stops) == 3


# ---- Access and admission ----


def test_api_key_is_required_on_v1_in_openai_shape(setup):
    url = setup["url"]
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
    ):
        r = httpx.get(url + "/v1/models", headers=headers, timeout=10)
        err = _error(r, 401)
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert httpx.get(url + "/v1/models", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # open to probes
    head = httpx.head(url + "/health", timeout=10)
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(url + "/metrics", timeout=10).status_code == 200


def test_json_endpoints_take_only_application_json(setup):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        r = _post(setup, body, headers={"content-type": ctype})
        assert _error(r, 415)["code"] == "unsupported_media_type"
    r = httpx.post(
        setup["url"] + "/v1/completions", content=body.encode(), headers=AUTH, timeout=10
    )
    _error(r, 415)  # no content-type at all
    r = _post(setup, body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_cors_only_for_allowed_origins(setup):
    url = setup["url"]
    pre = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    ok = httpx.options(url + "/v1/completions", headers={"Origin": "http://ok.example", **pre})
    assert ok.headers.get("access-control-allow-origin") == "http://ok.example"
    evil = httpx.options(url + "/v1/completions", headers={"Origin": "http://evil.example", **pre})
    assert "access-control-allow-origin" not in evil.headers
    r = httpx.get(url + "/v1/models", headers={"Origin": "http://evil.example", **AUTH})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_a_full_queue_answers_429_with_retry_after(setup, monkeypatch):
    sp = setup["engine"].speculators[0]
    real, slow = sp.step, threading.Event()
    slow.set()

    def step(active, params):  # a busy engine: every step takes a while
        if slow.is_set():
            time.sleep(0.2)
        return real(active, params)

    monkeypatch.setattr(sp, "step", step)
    capacity = ROWS + LIMITS.max_waiting
    results = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(
                _post(
                    setup,
                    {
                        "model": MODEL,
                        "prompt": PROMPTS[i % len(PROMPTS)],
                        "max_tokens": 24,
                        "temperature": 0,
                    },
                    timeout=120,
                )
            )
        )
        for i in range(capacity)
    ]
    for t in threads:
        t.start()
    counters = setup["app"].state.counters
    deadline = time.time() + 20
    while counters.running < capacity:
        assert time.time() < deadline, counters.running
        time.sleep(0.05)
    r = _post(setup, {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    err = _error(r, 429)
    assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
    assert r.headers["retry-after"] == "1"
    slow.clear()
    for t in threads:
        t.join(120)
    assert [x.status_code for x in results] == [200] * capacity
    r = _post(setup, {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": capacity + 1})
    _error(r, 400, "n", "generations")  # could never fit: not worth retrying
    _still_serves(setup)


def test_idle_and_slow_header_connections_are_closed(setup):
    idle = _raw(setup)
    data, took = _read_until_closed(idle, 8)
    idle.close()
    assert took < LIMITS.header_timeout + 3 and data.startswith(b"HTTP/1.1 408"), (took, data)
    # Headers trickled at one byte a second: closed at the header timeout, while other
    # clients are served as usual.
    slow = _raw(setup)
    request = b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 50 + b"\r\n\r\n"
    closed = {}

    def trickle():
        t0 = time.time()
        try:
            for byte in request:
                slow.sendall(bytes([byte]))
                time.sleep(1.0)
        except OSError:
            pass
        closed["after"] = time.time() - t0

    t = threading.Thread(target=trickle)
    t.start()
    t0 = time.time()
    _still_serves(setup)
    assert httpx.get(setup["url"] + "/health", timeout=5).status_code == 200
    assert time.time() - t0 < 10
    data, took = _read_until_closed(slow, 10)
    slow.close()
    t.join(15)
    assert took < LIMITS.header_timeout + 3 and data.startswith(b"HTTP/1.1 408"), (took, data)


def test_a_slow_body_gets_408_and_the_connection_closes(setup):
    s = _raw(setup)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    stop = threading.Event()

    def trickle():
        for byte in body[:-1]:
            if stop.is_set():
                return
            try:
                s.sendall(bytes([byte]))
            except OSError:
                return
            time.sleep(1.0)

    t = threading.Thread(target=trickle)
    t.start()
    _still_serves(setup)
    data, took = _read_until_closed(s, 10)
    stop.set()
    s.close()
    t.join(5)
    assert data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data, data[:300]
    assert took < LIMITS.body_timeout + 3


def test_connections_past_the_limit_are_closed_at_once(setup):
    socks = []
    open_before = len(setup["server"].server.server_state.connections)
    try:
        for _ in range(LIMITS.max_connections + 8):
            socks.append(_raw(setup))
        time.sleep(0.5)  # well within the header timeout
        refused = 0
        for s in socks:
            s.setblocking(False)
            try:
                if s.recv(1) == b"":
                    refused += 1
            except BlockingIOError:  # open, waiting for a request
                pass
            except ConnectionResetError:
                refused += 1
        # Connections still open from earlier checks count too (until they close).
        assert 8 <= refused <= 8 + open_before, (refused, open_before)
    finally:
        for s in socks:
            s.close()
    deadline = time.time() + 10
    while True:  # the server notices the closed sockets
        try:
            if httpx.get(setup["url"] + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.time() < deadline
        time.sleep(0.2)


def test_accept_errors_are_logged_at_a_bounded_rate():
    """asyncio logs every failed ``accept()`` ("Too many open files"); through the filter
    ``osd serve`` installs, a flood becomes a few lines and a count."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    installed = limit_logs(burst=3, window=60.0)
    now = [1000.0]
    installed.clock = lambda: now[0]
    loop = asyncio.new_event_loop()
    try:
        for _ in range(2000):
            loop.call_exception_handler(
                {
                    "message": "socket.accept() out of system resource",
                    "exception": OSError(24, "Too many open files"),
                }
            )
        assert len(records) == 3
        now[0] += 61.0
        loop.call_exception_handler(
            {
                "message": "socket.accept() out of system resource",
                "exception": OSError(24, "Too many open files"),
            }
        )
        assert len(records) == 4 and "1997 more like this" in records[-1]
        other = RateLimitFilter(burst=1, window=10.0, clock=lambda: 0.0)  # kinds apart
        rec = [logging.LogRecord("x", logging.WARNING, "f", 1, m, None, None) for m in "abab"]
        assert [other.filter(r) for r in rec] == [True, True, False, False]
    finally:
        loop.close()
        logger.removeHandler(handler)
        for name in ("asyncio", "uvicorn.error", "osd.server", "osd.engine"):
            logging.getLogger(name).removeFilter(installed)


# ---- Errors ----


def test_malformed_bodies_are_400s(setup):
    _error(_post(setup, b"[" * 60_000), 400, None, "deeper than")
    _error(_post(setup, b'{"prompt": ' + b"[" * 70 + b"]" * 70 + b"}"), 400, None, "deeper than")
    for bad in (b"\xff\xfe{}", b'{"prompt": "hi"', b"", b'{"prompt": 1e99999999999}'):
        r = _post(setup, bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = _post(setup, '{"prompt": "he\\ud800llo", "max_tokens": 2}')
    _error(r, 400, "prompt", "surrogate")
    r = _post(
        setup,
        '{"messages": [{"role": "user", "content": "he\\udfffllo"}]}',
        path="/v1/chat/completions",
    )
    _error(r, 400, "messages", "surrogate")
    r = _post(setup, '{"prompt": "hi", "stop": ["\\ud800"]}')
    _error(r, 400, "stop", "surrogate")
    r = _post(setup, '{"prompt": "hi", "model": "\\ud800"}')  # echoed safely
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with pytest.raises(APIError):
        parse_json(b"[" * 100_000)


@pytest.mark.parametrize(
    "field,value",
    [
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
        ("tool_choice", "auto"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("parallel_tool_calls", True),
    ],
)
def test_unsupported_features_are_400s_naming_them(setup, field, value):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: value}
    r = _post(setup, body, path="/v1/chat/completions")
    _error(r, 400, field, "not supported")


def test_plain_text_response_format_is_accepted(setup):
    r = _post(
        setup,
        {
            "model": MODEL,
            "prompt": "hi",
            "max_tokens": 2,
            "response_format": {"type": "text"},
            "tool_choice": "none",
        },
    )
    assert r.status_code == 200, r.text


def test_text_cut_by_max_tokens_never_ends_in_a_broken_character(setup):
    lead = setup["tok"].convert_tokens_to_ids("â")  # byte 0xE2: opens a 3-byte character
    body = {
        "model": MODEL,
        "prompt": "hi",
        "max_tokens": 2,
        "temperature": 0,
        "logit_bias": {str(lead): 100},
        "return_token_ids": True,
    }
    c = _post(setup, body).json()["choices"][0]
    assert c["token_ids"] == [lead, lead] and c["finish_reason"] == "length"
    assert c["text"] == ""
    r = _post(setup, {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == ""


# ---- Flags ----


def test_serve_flags_and_the_environment_key(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--api-key",
        "--allowed-origins",
        "--max-body-bytes",
        "--max-prompt-chars",
        "--max-waiting",
        "--max-connections",
        "--keep-alive-timeout",
        "--header-timeout",
        "--body-timeout",
    ):
        assert flag in out, flag
    args = cli.build_parser().parse_args(
        ["serve", "--max-waiting", "3", "--allowed-origins", "http://a.example, http://b.example"]
    )
    monkeypatch.setenv("OSD_API_KEY", "from-env")
    limits = limits_from_args(args)
    assert limits.api_key == "from-env" and limits.max_waiting == 3
    assert limits.allowed_origins == ("http://a.example", "http://b.example")
    assert limits.max_body_bytes == Limits().max_body_bytes
    monkeypatch.delenv("OSD_API_KEY")
    assert limits_from_args(args).api_key is None
    with pytest.raises(ValueError):
        Limits(header_timeout=0)
