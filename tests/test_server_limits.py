"""``osd serve``'s limits against hostile clients, on loopback, each check bounded in
time: the API key, JSON-only bodies, CORS, admission (429 past the queue), slow and idle
connections closed at their timeouts, connections past the limit closed at once, and
accept errors logged at a bounded rate.

The server runs in-process (the built-in pair, k = 3, 4 rows, 256-token context) under
:func:`osd.server.limits.uvicorn_config` with short limits
(``tests.server_harness.LIMITS``), so that timeouts take a second or two.
"""

import asyncio
import json
import logging
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from osd.server import RateLimitFilter, limit_logs  # noqa: E402
from tests.server_harness import HOSTILE_PROMPTS as PROMPTS  # noqa: E402
from tests.server_harness import (  # noqa: E402
    AUTH,
    KEY,
    LIMITS,
    MODEL,
    ROWS,
    expect_error,
    hostile_setup,
    post,
    raw_socket,
    read_until_closed,
    still_serves,
)


@pytest.fixture(scope="module")
def setup():
    yield from hostile_setup()


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
        err = expect_error(r, 401)
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
        r = post(setup, body, headers={"content-type": ctype})
        assert expect_error(r, 415)["code"] == "unsupported_media_type"
    r = httpx.post(
        setup["url"] + "/v1/completions", content=body.encode(), headers=AUTH, timeout=10
    )
    expect_error(r, 415)  # no content-type at all
    r = post(setup, body, headers={"content-type": "application/json; charset=utf-8"})
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
                post(
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
    r = post(setup, {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    err = expect_error(r, 429)
    assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
    assert r.headers["retry-after"] == "1"
    slow.clear()
    for t in threads:
        t.join(120)
    assert [x.status_code for x in results] == [200] * capacity
    r = post(setup, {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": capacity + 1})
    expect_error(r, 400, "n", "generations")  # could never fit: not worth retrying
    still_serves(setup)


# ---- Connections and logs ----


def test_idle_and_slow_header_connections_are_closed(setup):
    idle = raw_socket(setup)
    data, took = read_until_closed(idle, 8)
    idle.close()
    assert took < LIMITS.header_timeout + 3 and data.startswith(b"HTTP/1.1 408"), (took, data)
    # Headers trickled at one byte a second: closed at the header timeout, while other
    # clients are served as usual.
    slow = raw_socket(setup)
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
    still_serves(setup)
    assert httpx.get(setup["url"] + "/health", timeout=5).status_code == 200
    assert time.time() - t0 < 10
    data, took = read_until_closed(slow, 10)
    slow.close()
    t.join(15)
    assert took < LIMITS.header_timeout + 3 and data.startswith(b"HTTP/1.1 408"), (took, data)


def test_a_slow_body_gets_408_and_the_connection_closes(setup):
    s = raw_socket(setup)
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
    still_serves(setup)
    data, took = read_until_closed(s, 10)
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
            socks.append(raw_socket(setup))
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
