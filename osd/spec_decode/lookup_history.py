"""Prompt lookup across requests: the n-grams of the engine's finished requests.

Prompt lookup proposes what followed the latest earlier occurrence of the context's
suffix. Within one request that finds text copied from the prompt; served traffic also
repeats *across* requests (the same task asked again, a template answered many times),
and a suffix that has no match in the request's own text may have one in an earlier
answer. :class:`LookupHistory` keeps the newest ``capacity`` tokens of finished requests
(each one's output, after the last ``ngram_max`` tokens of its prompt, so that an answer's
first tokens can match too) with an index from every n-gram (``ngram_min`` to
``ngram_max`` tokens) to the position after its latest occurrence. A lookup is a dict
probe per n-gram length; adding a request costs one probe per token and length. When the
tokens pass ``capacity``, the oldest half is dropped and the index rebuilt from the rest.

Drafts proposed from the history are verified like any others, so outputs never change.
"""

from __future__ import annotations

SEPARATOR = -1  # between requests: a continuation never crosses it


class LookupHistory:
    """The newest ``capacity`` tokens of finished requests, indexed by n-gram.

    Args:
        capacity: most tokens kept (> 0).
        ngram_min, ngram_max: the n-gram lengths indexed.
    """

    def __init__(self, capacity: int, ngram_min: int, ngram_max: int):
        if capacity < 1:
            raise ValueError(f"LookupHistory capacity must be >= 1, got {capacity}")
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(
                f"LookupHistory needs 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}"
            )
        self.capacity = capacity
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._tokens: list[int] = []
        self._base = 0  # absolute position of self._tokens[0]
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> absolute position after it
        self.requests = 0  # requests added

    def __len__(self) -> int:
        return len(self._tokens)

    def clear(self) -> None:
        """Forget every request (a benchmark that serves a prompt again starts clean)."""
        self._tokens, self._base, self._index, self.requests = [], 0, {}, 0

    def add(self, prompt: list[int], output: list[int]) -> None:
        """Remember a finished request: its prompt's last ``ngram_max`` tokens, then its
        ``output``."""
        if not output:
            return
        seq = list(prompt[-self.ngram_max :]) + list(output) + [SEPARATOR]
        start = self._base + len(self._tokens)
        self._tokens += seq
        self._index_range(start, start + len(seq))
        self.requests += 1
        if len(self._tokens) > self.capacity:
            self._evict()

    def lookup(self, suffix: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest occurrence of ``suffix`` (whose
        length is one of the indexed n-gram lengths); [] when there is none."""
        pos = self._index.get(tuple(suffix))
        if pos is None or k < 1:
            return []
        out = []
        for t in self._tokens[pos - self._base : pos - self._base + k]:
            if t == SEPARATOR:
                break
            out.append(t)
        return out

    def _index_range(self, lo: int, hi: int) -> None:
        """Index the n-grams that end before absolute positions ``lo + 1 .. hi - 1`` and
        are followed by a token (not a separator), none crossing a separator."""
        toks, base = self._tokens, self._base
        for end in range(lo + 1, hi):
            if toks[end - base] == SEPARATOR or toks[end - 1 - base] == SEPARATOR:
                continue
            for n in range(self.ngram_min, self.ngram_max + 1):
                begin = end - n
                if begin < base:
                    break
                gram = tuple(toks[begin - base : end - base])
                if SEPARATOR in gram:
                    break
                self._index[gram] = end

    def _evict(self) -> None:
        drop = len(self._tokens) - self.capacity // 2
        self._tokens = self._tokens[drop:]
        self._base += drop
        self._index = {}
        self._index_range(self._base, self._base + len(self._tokens))
