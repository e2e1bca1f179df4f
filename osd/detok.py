"""A request's output text without decoding all of it again at every snapshot.

``Engine.output`` gives the text of everything a request generated so far, and a server
asks for it after every step that adds tokens: decoding all the ids each time costs a
request of n tokens O(n^2) in all (a 2,000-token answer: about 0.3 ms a snapshot on the
CPU, in the thread that runs the steps).

For a byte-level tokenizer (GPT-2's scheme, used by Llama 3, Qwen, SmolLM and many more)
the fast tokenizer's ``decode`` is the UTF-8 decoding, with replacement, of its tokens'
bytes joined (special tokens skipped contribute nothing). UTF-8 needs no state across a
point where the bytes before it form whole characters, so when ``decode(ids[:n])`` holds
no U+FFFD (no bytes were replaced), ``decode(ids) == decode(ids[:n]) + decode(ids[n:])``
exactly. :func:`output_text` keeps, per request, the longest such prefix it has decoded
(``RequestState.text_done``) and decodes only what follows it; a replaced byte (a
character still being spelled, or invalid bytes) keeps the prefix where it is until the
text after it is whole again. Tokenizers of other kinds (SentencePiece's, or any that
cleans up spaces after decoding) decode everything every time.
"""

from __future__ import annotations


def incremental(tokenizer) -> bool:
    """Whether ``tokenizer.decode`` is the joined bytes of its tokens (see the module
    docstring): a fast tokenizer with a ``ByteLevel`` decoder and no space clean-up."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return (
        decoder is not None
        and type(decoder).__name__ == "ByteLevel"
        and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    )


def output_text(tokenizer, r) -> str:
    """``tokenizer.decode(r.generated, skip_special_tokens=True)``, decoding only the ids
    after ``r``'s longest whole-character prefix decoded so far."""
    ids = r.generated
    if not incremental(tokenizer):
        return tokenizer.decode(ids, skip_special_tokens=True)
    n, head = r.text_done
    if n > len(ids):  # the ids were cut back: start over
        n, head = 0, ""
    tail = tokenizer.decode(ids[n:], skip_special_tokens=True)
    if "\ufffd" not in tail:
        r.text_done = (len(ids), head + tail)
    return head + tail
