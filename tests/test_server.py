"""``osd serve``: the OpenAI-compatible server, in-process on a free port with the built-in
pair, driven by the official ``openai`` client (and raw ``httpx`` where it helps).

Greedy outputs served to 8 concurrent clients equal ``osd.Engine.generate`` token for
token; completions, chat, logprobs, ``n``, batched prompts, ``echo``, penalties and stop
strings are the engine's; a stream closed mid-way is aborted in the engine; ``/metrics``
parses as Prometheus text. Bad requests are ``tests/test_server_errors.py``, the command
line ``tests/test_server_cli.py``, hostile clients ``tests/test_server_hostile.py`` and
``tests/test_server_limits.py``.
"""

import math
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import osd  # noqa: E402
from osd import zoo  # noqa: E402
from osd.chat_template import apply_chat_template  # noqa: E402
from osd.server import build_app  # noqa: E402
from tests.server_harness import (  # noqa: E402
    MAX_SEQ_LEN,
    MODEL,
    NEW,
    PROMPTS,
    TEMPLATE,
    Server,
    metrics,
    spec_engine,
)


@pytest.fixture(scope="module")
def setup():
    target, draft = zoo.default_pair()
    # The reference: plain decoding (greedy speculation must equal it token for token).
    ref_engine = osd.Engine.from_pretrained(target, max_batch_size=8, max_seq_len=MAX_SEQ_LEN)
    tok = ref_engine.tokenizer
    tok.chat_template = TEMPLATE
    chat_ids = apply_chat_template(tok, [[{"role": "user", "content": p}] for p in PROMPTS[:2]])
    reference = ref_engine.generate(PROMPTS, osd.SamplingParams(NEW))
    chat_reference = ref_engine.generate(chat_ids, osd.SamplingParams(NEW))
    long_ref = ref_engine.generate([PROMPTS[0]], osd.SamplingParams(64))[0]

    # The prefix cache on: the greedy outputs below must still equal plain decoding's.
    engine = spec_engine(4, prefix_cache=4096)
    ae = osd.AsyncEngine(engine)
    server = Server(build_app(ae, MODEL))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield dict(
        server=server,
        client=client,
        ae=ae,
        engine=engine,
        tok=tok,
        ref_engine=ref_engine,
        reference=reference,
        chat_reference=chat_reference,
        long_ref=long_ref,
    )
    server.stop()
    ae.close()


def _metrics(setup) -> dict:
    return metrics(setup["server"].url)


def test_models_and_health(setup):
    models = setup["client"].models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert setup["client"].models.retrieve(MODEL).id == MODEL
    assert httpx.get(setup["server"].url + "/health").json() == {"status": "ok"}


def test_completion_plain_and_streamed(setup):
    client, ref = setup["client"], setup["reference"][0]
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=NEW,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    c = r.choices[0]
    assert r.object == "text_completion" and r.model == MODEL
    assert c.token_ids == ref.token_ids and c.text == ref.text
    assert c.finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == len(setup["tok"].encode(PROMPTS[0]))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(ch.object == "text_completion" for ch in chunks)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == ref.finish_reason and set(finals[:-1]) <= {None}
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)

    # A token-id prompt gets the same continuation.
    ids = setup["tok"].encode(PROMPTS[0])
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=NEW, temperature=0)
    assert r.choices[0].text == ref.text


def test_chat_plain_and_streamed(setup):
    client, ref = setup["client"], setup["chat_reference"][1]
    messages = [{"role": "user", "content": PROMPTS[1]}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=NEW, temperature=0
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=NEW, temperature=0, stream=True
        )
    )
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_logprobs(setup):
    """Completions' and chat's logprobs are the engine's (``SamplingParams.logprobs``),
    streamed or not."""
    client, tok = setup["client"], setup["tok"]
    want = setup["ref_engine"].generate([PROMPTS[0]], osd.SamplingParams(NEW, logprobs=3))[0]
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=NEW, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([e.token_id]) for e in want.logprobs]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert [len(t) for t in lp.top_logprobs] == [3] * len(want.logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=NEW, temperature=0, logprobs=3, stream=True
        )
    )
    streamed = [
        t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    offsets = [
        o for ch in chunks if ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset
    ]
    assert offsets == lp.text_offset

    messages = [{"role": "user", "content": PROMPTS[1]}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=NEW, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert all(
        len(c.top_logprobs) == 2
        and c.top_logprobs[0].token == c.token
        and c.bytes == list(c.token.encode())
        for c in content
    )
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


def test_n_choices(setup):
    """``n``: one engine request per choice, choice ``i`` sampled as a one-choice request
    with seed + i; streamed chunks carry their choice's index."""
    client = setup["client"]
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=NEW, temperature=0.9)
    r = client.completions.create(n=3, seed=5, **kw, extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):
        alone = client.completions.create(seed=5 + i, **kw).choices[0]
        assert c.text == alone.text
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
    texts = ["", "", ""]
    for ch in client.completions.create(n=3, seed=5, stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=2, temperature=0
    )
    assert len(r.choices) == 2 and r.choices[0].message.content == r.choices[1].message.content


def test_batched_prompts(setup):
    """A list of prompts: ``n`` choices of each, choice ``k`` of prompt ``k // n``, equal to
    the prompts sent one by one (greedy)."""
    client, ref = setup["client"], setup["reference"]
    ids = setup["tok"].encode(PROMPTS[2])
    for prompt in ([PROMPTS[0], PROMPTS[1]], [setup["tok"].encode(PROMPTS[0]), ids]):
        r = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=NEW,
            temperature=0,
            n=2,
            extra_body={"return_token_ids": True},
        )
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        want = [ref[0].token_ids] * 2 + [
            ref[1].token_ids if isinstance(prompt[1], str) else ref[2].token_ids
        ] * 2
        assert [c.token_ids for c in r.choices] == want
        assert r.usage.completion_tokens == sum(len(t) for t in want)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=NEW, temperature=0, stream=True
        )
    )
    texts = ["", ""]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == [ref[0].text, ref[1].text]


def test_echo_and_prompt_logprobs(setup):
    """``echo``: the prompt leads the text, and with ``logprobs`` its tokens' scores
    (``Engine.score``; the first is null) lead the lists; ``max_tokens: 0`` scores only."""
    client, tok = setup["client"], setup["tok"]
    ids = tok.encode(PROMPTS[0])
    want = setup["ref_engine"].score([ids], logprobs=2)[0]
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=2
    )
    c = r.choices[0]
    assert c.text == tok.decode(ids) and r.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx([e.logprob for e in want[1:]], abs=1e-4)
    ref = setup["reference"][0]
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=NEW, temperature=0, echo=True, logprobs=1
    )
    c = r.choices[0]
    assert c.text == tok.decode(ids) + ref.text
    assert len(c.logprobs.tokens) == len(ids) + len(ref.token_ids)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=NEW,
            temperature=0,
            echo=True,
            logprobs=1,
            stream=True,
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert [
        o for ch in chunks for o in ch.choices[0].logprobs.text_offset
    ] == c.logprobs.text_offset


def test_penalties_are_the_engines(setup):
    client = setup["client"]
    p = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5)
    want = setup["ref_engine"].generate([PROMPTS[2]], osd.SamplingParams(NEW, **p))[0]
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        max_tokens=NEW,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.3, "return_token_ids": True},
    )
    assert r.choices[0].token_ids == want.token_ids
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        max_tokens=4,
        temperature=0,
        logit_bias={"42": 100},
        extra_body={"return_token_ids": True},
    )
    assert r.choices[0].token_ids == [42] * 4
    eos = setup["tok"].eos_token_id  # forced by the bias, then ignored
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        max_tokens=5,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert r.choices[0].token_ids == [eos] * 5 and r.choices[0].finish_reason == "length"
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        max_tokens=5,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"return_token_ids": True, "min_tokens": 3},
    )
    assert len(r.choices[0].token_ids) == 4 and r.choices[0].token_ids[-1] == eos


def test_chat_without_template_is_a_400(setup):
    tok = setup["engine"].tokenizer
    saved, tok.chat_template = tok.chat_template, None
    try:
        with pytest.raises(openai.BadRequestError) as exc:
            setup["client"].chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
    finally:
        tok.chat_template = saved
    assert "chat template" in exc.value.message


def test_eight_concurrent_clients_get_engine_generate(setup):
    client = setup["client"]
    results, errors = {}, []

    def worker(i):
        try:
            stream = i % 2 == 1
            kw = dict(
                model=MODEL,
                prompt=PROMPTS[i],
                max_tokens=NEW,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            if stream:
                ids, text = [], ""
                for ch in client.completions.create(stream=True, **kw):
                    ids += ch.choices[0].token_ids
                    text += ch.choices[0].text
                results[i] = (ids, text)
            else:
                c = client.completions.create(**kw).choices[0]
                results[i] = (c.token_ids, c.text)
        except Exception as exc:  # reported below, with the thread's index
            errors.append((i, repr(exc)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for i, ref in enumerate(setup["reference"]):
        assert results[i] == (ref.token_ids, ref.text), i


def test_stop_strings_and_stop_token_ids(setup):
    client, ref = setup["client"], setup["long_ref"]
    text = ref.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.find(stop)]
    assert stop.strip() and expected
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=64,
        temperature=0,
        stop=[stop, "\x00never"],
        extra_body={"return_token_ids": True},
    )
    c = r.choices[0]
    assert (c.text, c.finish_reason) == (expected, "stop")
    # Token ids end at the token that completed the stop string.
    tok = setup["tok"]
    assert stop in tok.decode(c.token_ids) and stop not in tok.decode(c.token_ids[:-1])
    assert r.usage.completion_tokens == len(c.token_ids)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=64, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"

    # A stop token id ends the output (its token is kept in token_ids, not in the text).
    sid = ref.token_ids[5]
    cut = ref.token_ids[: ref.token_ids.index(sid) + 1]
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=64,
        temperature=0,
        extra_body={"stop_token_ids": [sid], "return_token_ids": True},
    )
    c = r.choices[0]
    assert (c.token_ids, c.finish_reason) == (cut, "stop")
    assert c.text == tok.decode(cut[:-1], skip_special_tokens=True)
    m = _metrics(setup)
    assert m["osd:request_stop_string_total"] >= 2
    assert m["osd:num_requests_running"] == 0


def test_closed_stream_is_aborted(setup):
    client, url = setup["client"], setup["server"].url
    before = _metrics(setup)['osd:request_aborted_total{reason="client_disconnect"}']
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], temperature=0, max_tokens=MAX_SEQ_LEN - 40, stream=True
    )
    it = iter(stream)
    next(it), next(it)
    stream.close()
    deadline = time.time() + 20
    while True:
        m = _metrics(setup)
        if (
            m["osd:num_requests_running"] == 0
            and m['osd:request_aborted_total{reason="client_disconnect"}'] == before + 1
        ):
            break
        assert time.time() < deadline, m
        time.sleep(0.1)
    # Nothing keeps running in the engine: no target forward happens while idle.
    forwards = m["osd:target_forwards_total"]
    time.sleep(0.5)
    assert _metrics(setup)["osd:target_forwards_total"] == forwards
    r = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == setup["reference"][0].text


def test_metrics(setup):
    m = _metrics(setup)
    for name in (
        "osd:spec_decode_num_drafts_total",
        "osd:spec_decode_num_draft_tokens_total",
        "osd:spec_decode_num_accepted_tokens_total",
        "osd:num_requests_running",
        "osd:online_updates_applied_total",
        "osd:online_updates_rejected_total",
        "osd:online_learners_busy",
        "osd:generation_tokens_total",
        "osd:prompt_tokens_total",
        "osd:prefix_cache_hits_total",
        "osd:prefix_cache_tokens",
    ):
        assert name in m, name
    assert m["osd:prefix_cache_queries_total"] > 0
    assert 0 <= m["osd:prefix_cache_hits_total"] <= m["osd:prefix_cache_queries_total"]
    assert m["osd:spec_decode_num_drafts_total"] > 0
    drafted = m["osd:spec_decode_num_draft_tokens_total"]
    accepted = m["osd:spec_decode_num_accepted_tokens_total"]
    per_pos = [
        m[f'osd:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(3)
    ]
    assert sum(per_pos) == accepted and 0 < accepted <= drafted
    assert per_pos == sorted(per_pos, reverse=True)  # a chain: later positions need earlier
    assert math.isclose(m["osd:spec_decode_acceptance_rate"], accepted / drafted)
    assert m['osd:request_success_total{finished_reason="length"}'] > 0
    assert m['osd:api_errors_total{status="400",type="invalid_request_error"}'] > 0


def test_bench_chat_client_reads_the_stream(setup):
    """``bench.chat_load``'s lean streaming client (the serving benchmarks' clients) reads
    what the OpenAI client reads, through chunked transfer coding, from concurrent
    clients; a refused request raises with the status."""
    from bench import chat_load  # the benchmark's helper, not part of the package

    client = setup["client"]
    messages = [{"role": "user", "content": PROMPTS[1]}]
    want = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=NEW,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    wall, results, cpu = chat_load.run_load(setup["server"].url, [messages] * 3, 2, NEW)
    assert wall > 0 and cpu >= 0
    for r in results:
        assert r["text"] == want.choices[0].message.content and r["finish"] == "length"
        assert r["completion_tokens"] == NEW == want.usage.completion_tokens
        assert r["prompt_tokens"] == want.usage.prompt_tokens
        assert r["t0"] <= r["t_first"] <= r["t_end"] and r["chunks"] >= 1
    with pytest.raises(RuntimeError, match="status 400"):
        chat_load.run_load(setup["server"].url, [[]], 1, NEW)
