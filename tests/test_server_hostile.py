"""``osd serve`` against hostile and careless clients, on loopback, each check bounded in
time: one request never fails another, work per request is bounded, and every malformed
or unsupported request is an OpenAI-style error naming what was wrong. (Keys, admission
and connections: ``tests/test_server_limits.py``.)

The server runs in-process (the built-in pair, k = 3, 4 rows, 256-token context) under
:func:`osd.server.limits.uvicorn_config` with short limits
(``tests.server_harness.LIMITS``), so that timeouts take a second or two.
"""

import json
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from osd.request import stop_prefix_length  # noqa: E402
from osd.server import APIError, parse_json  # noqa: E402
from tests.server_harness import HOSTILE_PROMPTS as PROMPTS  # noqa: E402
from tests.server_harness import (  # noqa: E402
    KEY,
    MODEL,
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
    r = post(setup, body)
    if param is None:
        assert r.status_code == 200, r.text
    else:
        expect_error(r, 400, param)
    # NaN and Infinity (which Python's JSON parser takes) are refused the same way.
    r = post(setup, '{"prompt": "hi", "temperature": NaN}')
    expect_error(r, 400, "temperature")


# ---- Bounded work per request ----


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_bodies_past_the_limit_are_413_without_being_read(setup):
    before = _rss_mb()
    s = raw_socket(setup)  # a declared 512 MiB body: refused on the headers
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: 536870912\r\n\r\n"
    )
    data, took = read_until_closed(s, 5)
    s.close()
    assert data.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in data and took < 4
    s = raw_socket(setup)  # chunked, no length: refused once past the limit
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + KEY.encode() + b"\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
    got = {}
    # Read while sending: the answer arrives before the reset that the unread rest of
    # the body causes when the server closes.
    reader = threading.Thread(target=lambda: got.setdefault("data", read_until_closed(s, 10)))
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
    still_serves(setup)


def test_an_overlong_prompt_is_refused_before_tokenizing(setup, monkeypatch):
    tok = setup["tok"]
    calls = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    r = post(setup, {"model": MODEL, "prompt": "x" * 90_000})
    expect_error(r, 400, "prompt", "characters")
    r = post(
        setup,
        {"model": MODEL, "messages": [{"role": "user", "content": "x" * 90_000}]},
        path="/v1/chat/completions",
    )
    expect_error(r, 400, "messages", "characters")
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
            "r", post(setup, {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2})
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
    r = post(
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


# ---- Errors ----


def test_malformed_bodies_are_400s(setup):
    expect_error(post(setup, b"[" * 60_000), 400, None, "deeper than")
    expect_error(
        post(setup, b'{"prompt": ' + b"[" * 70 + b"]" * 70 + b"}"), 400, None, "deeper than"
    )
    for bad in (b"\xff\xfe{}", b'{"prompt": "hi"', b"", b'{"prompt": 1e99999999999}'):
        r = post(setup, bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(setup, '{"prompt": "he\\ud800llo", "max_tokens": 2}')
    expect_error(r, 400, "prompt", "surrogate")
    r = post(
        setup,
        '{"messages": [{"role": "user", "content": "he\\udfffllo"}]}',
        path="/v1/chat/completions",
    )
    expect_error(r, 400, "messages", "surrogate")
    r = post(setup, '{"prompt": "hi", "stop": ["\\ud800"]}')
    expect_error(r, 400, "stop", "surrogate")
    r = post(setup, '{"prompt": "hi", "model": "\\ud800"}')  # echoed safely
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
    r = post(setup, body, path="/v1/chat/completions")
    expect_error(r, 400, field, "not supported")


def test_plain_text_response_format_is_accepted(setup):
    r = post(
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
    c = post(setup, body).json()["choices"][0]
    assert c["token_ids"] == [lead, lead] and c["finish_reason"] == "length"
    assert c["text"] == ""
    r = post(setup, {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == ""
