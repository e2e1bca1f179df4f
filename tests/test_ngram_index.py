"""NGramIndex (each request's n-grams for prompt lookup) answers what the linear search of
the context answers, step by step as the text grows, with and without the engine's
history of finished requests; a changed or shorter text is re-indexed."""

import random

import pytest

from osd.spec_decode.lookup_drafter import NGramDrafter
from osd.spec_decode.lookup_history import LookupHistory
from osd.spec_decode.ngram_index import NGramIndex


@pytest.mark.parametrize("lengths", [(1, 3), (2, 4), (3, 3)])
@pytest.mark.parametrize("with_history", [False, True])
def test_index_matches_the_search(lengths, with_history):
    rng = random.Random(sum(lengths) + with_history)
    lo, hi = lengths
    history = None
    if with_history:
        history = LookupHistory(200, lo, hi)
        for _ in range(4):
            history.add([rng.randrange(6) for _ in range(5)], [rng.randrange(6) for _ in range(30)])
    drafter = NGramDrafter(lo, hi, history=history)
    for trial in range(20):
        vocab = rng.choice([3, 6, 40])  # few symbols: many repeats; many: few matches
        hist = [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]
        index = NGramIndex(lo, hi)
        for _ in range(60):
            k = rng.randrange(1, 7)
            assert drafter.lookup_match(hist, k, index) == drafter.lookup_match(hist, k)
            hist += [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]  # accepted


def test_changed_text_is_reindexed():
    drafter = NGramDrafter(1, 2)
    index = NGramIndex(1, 2)
    a = [1, 2, 3, 1, 2, 5, 1, 2]
    assert drafter.lookup_match(a, 3, index) == drafter.lookup_match(a, 3) == (2, [5, 1, 2])
    b = [7, 8, 9, 7, 8]  # another text, shorter
    assert drafter.lookup_match(b, 3, index) == drafter.lookup_match(b, 3) == (2, [9, 7, 8])
    c = [7, 8, 4, 4, 7, 8]  # same length as b plus one, another last-but-one token
    assert drafter.lookup_match(c, 2, index) == drafter.lookup_match(c, 2) == (2, [4, 4])
