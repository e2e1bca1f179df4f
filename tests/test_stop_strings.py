"""Stop strings (``SamplingParams.stop``): the engine ends a request at the token that
completes one, plain and speculative alike, and cuts its text before it."""

import asyncio

import pytest

import osd
from osd import zoo
from osd.models import load_model
from tests.test_models import tiny_hf_model

PROMPTS = ["def add(a, b):", "The quick brown fox", "import os\nimport sys\n"]
NEW = 48


@pytest.fixture(scope="module")
def pair():
    target, draft = zoo.default_pair()
    plain = osd.Engine.from_pretrained(target, max_batch_size=3, max_seq_len=256)
    spec = osd.Engine.from_pretrained(
        target,
        draft=draft,
        max_batch_size=2,
        max_seq_len=256,
        spec=osd.SpecConfig(num_draft_tokens=4),
    )
    return plain, spec, plain.generate(PROMPTS, osd.SamplingParams(NEW))


def _stop_in(text: str, at: float) -> str:
    """A 3-character stop string from ``text`` near fraction ``at`` (not whitespace)."""
    i = int(len(text) * at)
    while not text[i : i + 3].strip():
        i += 1
    return text[i : i + 3]


def test_plain_and_speculative_stop_at_the_same_token(pair):
    plain, spec, free = pair
    stops = [_stop_in(o.text, 0.5) for o in free]
    tok = plain.tokenizer
    for eng in (plain, spec):
        outs = eng.generate(
            PROMPTS, [osd.SamplingParams(NEW, stop=[s, "\x00never"]) for s in stops]
        )
        for o, ref, s in zip(outs, free, stops):
            assert o.finish_reason == "stop"
            assert o.text == ref.text[: ref.text.find(s)]
            # ids end at the token that completed the stop string, a prefix of the free run
            assert o.token_ids == ref.token_ids[: len(o.token_ids)]
            assert s in tok.decode(o.token_ids) and s not in tok.decode(o.token_ids[:-1])
    # The earliest of several stop strings ends it; a string never generated changes nothing.
    early, late = _stop_in(free[0].text, 0.2), _stop_in(free[0].text, 0.7)
    [o] = spec.generate([PROMPTS[0]], osd.SamplingParams(NEW, stop=[late, early]))
    assert o.text == free[0].text[: free[0].text.find(early)]
    [o] = spec.generate([PROMPTS[0]], osd.SamplingParams(NEW, stop="\x00never"))
    assert (o.token_ids, o.finish_reason) == (free[0].token_ids, free[0].finish_reason)


def test_stream_ends_at_the_stop_string(pair):
    plain, spec, free = pair
    s = _stop_in(free[1].text, 0.6)
    [want] = plain.generate([PROMPTS[1]], osd.SamplingParams(NEW, stop=s))
    chunks = list(spec.stream(PROMPTS[1], osd.SamplingParams(NEW, stop=s)))
    assert [t for c in chunks for t in c] == want.token_ids


def test_bad_stop_strings_raise_and_the_engine_serves_on(pair):
    plain, _, free = pair
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        osd.SamplingParams(8, stop=["a", ""])
    with pytest.raises(TypeError, match="stop must be a string or a sequence of strings"):
        osd.SamplingParams(8, stop=[3])
    with pytest.raises(TypeError, match="stop must be"):
        osd.SamplingParams(8, stop=b"x")
    bare = osd.Engine(load_model(tiny_hf_model("llama", seed=1)), max_batch_size=1, max_seq_len=32)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        bare.generate([[1, 2, 3]], osd.SamplingParams(4, stop="x"))
    assert len(bare.generate([[1, 2, 3]], osd.SamplingParams(4))[0].token_ids) == 4
    assert plain.generate([PROMPTS[0]], osd.SamplingParams(NEW))[0].token_ids == free[0].token_ids


def test_async_snapshots_are_prefixes_of_the_final_text(pair):
    """``AsyncEngine`` snapshots hold back a tail that may still become a stop string, so
    each snapshot's text is a prefix of the final (cut) text."""
    _, spec, free = pair
    s = _stop_in(free[2].text, 0.7)
    ae = osd.AsyncEngine(spec)

    async def run():
        return [out async for out in ae.generate(PROMPTS[2], osd.SamplingParams(NEW, stop=s))]

    try:
        outs = asyncio.run(run())
    finally:
        ae.close()
    final = outs[-1]
    assert final.finish_reason == "stop" and final.text == free[2].text[: free[2].text.find(s)]
    assert all(final.text.startswith(o.text) for o in outs)
    assert len(outs) > 2
