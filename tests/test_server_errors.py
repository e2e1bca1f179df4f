"""``osd serve`` refuses bad requests with OpenAI-style errors (status, type, a message
naming the field) and keeps serving: the built-in pair in-process on a free port, a
256-token context.
"""

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import osd  # noqa: E402
from osd.server import build_app  # noqa: E402
from tests.server_harness import MAX_SEQ_LEN, MODEL, Server, spec_engine  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    ae = osd.AsyncEngine(spec_engine(4))
    server = Server(build_app(ae, MODEL))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield dict(server=server, client=client)
    server.stop()
    ae.close()


BAD = [
    ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens must be an integer"),
    ({"prompt": list(range(5, 5 + MAX_SEQ_LEN)), "max_tokens": 1}, 400, "maximum context"),
    ({"prompt": [1, 2, 3], "max_tokens": MAX_SEQ_LEN}, 400, "maximum context"),
    ({"prompt": [1, 2, 10**6]}, 400, "vocabulary"),
    ({"prompt": ""}, 400, "prompt is empty"),
    ({"max_tokens": 3}, 400, "prompt is required"),
    ({"prompt": ["a"] * 65}, 400, "at most 64 prompts"),
    ({"prompt": ["a", ""]}, 400, "prompt is empty"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 17}, 400, "n must be an integer in [1, 16]"),
    ({"prompt": "x", "n": 0}, 400, "n must be an integer in [1, 16]"),
    ({"prompt": "x", "stop": [3]}, 400, "stop must be"),
    ({"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs must be in [0, 20]"),
    ({"prompt": "x", "logprobs": True}, 400, "logprobs must be an integer"),
    ({"prompt": "x", "top_logprobs": 2}, 400, "top_logprobs is a chat field"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs needs logprobs: true",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": 3},
        400,
        "logprobs must be a boolean",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "echo": True},
        400,
        "echo must be a boolean, and only for completions",
    ),
    ({"prompt": "x", "max_tokens": 0}, 400, "0 only with echo"),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty must be in [-2, 2]"),
    ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty must be > 0"),
    ({"prompt": "x", "frequency_penalty": "a"}, 400, "frequency_penalty must be a finite"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias keys must be token ids"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens must be in"),
    ({"prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos must be a boolean"),
    ({"prompt": "x", "logit_bias": {"5": 200}}, 400, "must be in [-100, 100]"),
    ({"prompt": "x", "logit_bias": {"1000000": 1}}, 400, "outside the vocabulary"),
    ({"prompt": "x", "stream": True, "temperature": -1}, 400, "temperature"),
    ("[1, 2", 400, "not valid JSON"),
    ("[1, 2]", 400, "JSON object"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"messages": []}, 400, "messages is required"),
    ({"prompt": "x", "draft": 7}, 400, "unknown draft 7"),
    ({"prompt": "x", "draft": "big"}, 400, "draft must be an integer"),
]


@pytest.mark.parametrize("body,status,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_requests_are_openai_errors(setup, body, status, match):
    url = setup["server"].url
    path = (
        "/v1/chat/completions"
        if isinstance(body, dict) and "messages" in body
        else "/v1/completions"
    )
    if isinstance(body, dict):
        body = {"model": MODEL, **body} if "model" not in body else body
        r = httpx.post(url + path, json=body, timeout=30)
    else:
        r = httpx.post(
            url + path, content=body, headers={"content-type": "application/json"}, timeout=30
        )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert match in err["message"], err
    assert err["type"] == "invalid_request_error" and set(err) == {
        "message",
        "type",
        "param",
        "code",
    }
    # The server keeps serving.
    ok = httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30
    )
    assert ok.status_code == 200


def test_bad_request_through_the_client(setup):
    with pytest.raises(openai.BadRequestError) as exc:
        setup["client"].completions.create(model=MODEL, prompt="x", max_tokens=2, n=30)
    assert exc.value.status_code == 400 and "n must be an integer" in exc.value.message
    with pytest.raises(openai.NotFoundError):
        setup["client"].completions.create(model="nope", prompt="x", max_tokens=2)
