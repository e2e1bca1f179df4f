"""``osd.detok``: a request's text decoded piece by piece equals the whole decode at every
snapshot, for byte-level tokenizers (characters spelled over several tokens, invalid
bytes, special tokens included); other tokenizers decode everything every time."""

import random

import pytest

from osd import zoo
from osd.detok import incremental, output_text
from osd.models.loading import load_tokenizer
from osd.request import RequestState


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(zoo.default_pair()[0])


def _request():
    return RequestState(index=0, prompt=[1], max_new_tokens=10_000, stop_ids=frozenset(), seed=0)


def _stream_ids(tok, rng: random.Random, n: int) -> list[int]:
    """Ids of text with multi-byte characters, random ids (lone bytes of a character,
    invalid sequences) and special tokens."""
    text = "naïve café — 東京 🙂 def f(x): return x ** 2  # ok\n" * 8
    ids = tok.encode(text, add_special_tokens=False)
    special = list(tok.all_special_ids)
    out = []
    while len(out) < n:
        pick = rng.random()
        if pick < 0.6:
            out.extend(ids[rng.randrange(len(ids)) :][: rng.randint(1, 6)])
        elif pick < 0.9:
            out.append(rng.randrange(len(tok)))
        elif special:
            out.append(rng.choice(special))
    return out[:n]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_snapshot_equals_the_whole_decode(tok, seed):
    assert incremental(tok)  # the built-in pair's tokenizer is byte-level
    rng = random.Random(seed)
    ids = _stream_ids(tok, rng, 400)
    r = _request()
    steps = 0
    while len(r.generated) < len(ids):
        r.generated.extend(ids[len(r.generated) : len(r.generated) + rng.randint(1, 5)])
        got = output_text(tok, r)
        assert got == tok.decode(r.generated, skip_special_tokens=True)
        steps += 1
    assert steps > 50 and 0 < r.text_done[0] <= len(ids)


def test_a_character_spelled_over_several_tokens(tok):
    ids = tok.encode("🙂🙂 東京", add_special_tokens=False)
    r = _request()
    for t in ids:
        r.generated.append(t)
        assert output_text(tok, r) == tok.decode(r.generated, skip_special_tokens=True)
    assert r.text_done[0] == len(ids)


def test_ids_cut_back_start_over(tok):
    ids = tok.encode("hello world, hello again", add_special_tokens=False)
    r = _request()
    r.generated.extend(ids)
    output_text(tok, r)
    del r.generated[2:]
    assert output_text(tok, r) == tok.decode(ids[:2], skip_special_tokens=True)


def test_other_tokenizers_decode_everything():
    class Whole:
        clean_up_tokenization_spaces = False

        def decode(self, ids, skip_special_tokens=True):
            return "|".join(map(str, ids))

    r = _request()
    r.generated.extend([3, 4, 5])
    assert not incremental(Whole())
    assert output_text(Whole(), r) == "3|4|5" and r.text_done == (0, "")
