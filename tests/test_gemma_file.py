"""Gemma 3 270M, the real Q4_K_M file (``osd.zoo.gemma``; skipped unless it was fetched):
a base model of another family, sliding windows, a 262,144-token vocabulary."""

import os

import pytest

import osd
from osd.chat_template import encode_chat
from osd.zoo import gemma
from osd.zoo.workloads import evaluation_set

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target():
    path = gemma.cached_target()
    if path is None or not os.path.isfile(path):
        pytest.skip(
            "needs the 242 MB Gemma 3 270M file, not downloaded by the test suite: run "
            "python -c 'from osd.zoo import gemma; gemma.fetch_target()' once to include it"
        )
    return path


def test_speculation_past_the_window_equals_plain_greedy(target):
    """A summarise prompt of 428 tokens and 128 new ones: past the 512-token window the
    verified queries must attend as decoded ones do, or int8 activations part the outputs
    (they did, at position 539, when a verify block ran a masked SDPA)."""
    plain = osd.Engine.from_pretrained(target, max_batch_size=1)
    spec = osd.Engine.from_pretrained(
        target, spec=osd.SpecConfig(drafter="ngram", num_draft_tokens=6), max_batch_size=1
    )
    w = next(w for w in evaluation_set(n=4) if w.name == "summarise")
    prompt = encode_chat(plain.tokenizer, [list(w.prompts[3])])[0]
    assert plain.tokenizer.decode(prompt[:3]).startswith("<bos>Question:")
    params = osd.SamplingParams(128)
    a = plain.generate([prompt], params)[0].token_ids
    b = spec.generate([prompt], params)[0].token_ids
    assert len(prompt) + len(a) > 512 + 32 and a == b
    plain.close()
    spec.close()
