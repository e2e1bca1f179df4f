"""Each request's n-grams, indexed as its text grows, for prompt lookup.

Prompt lookup proposes what followed the latest earlier occurrence of the context's
suffix. Searching the whole context for it every step costs time linear in the context
(tens of microseconds a step at a few hundred tokens, more at thousands, and once per row
of the batch). :class:`NGramIndex` keeps, for every n-gram length from ``ngram_min`` to
``ngram_max``, a dict from each n-gram of the request's text to the start of its latest
occurrence, and indexes only the windows that appeared since the last step: a lookup is
then a dict probe per length. It answers what the linear search answers: the latest
occurrence that ends before the context's last token.
"""

from __future__ import annotations


class NGramIndex:
    """The n-grams (``ngram_min`` to ``ngram_max`` tokens) of one growing token list.

    The list it is used with must only grow (a request's prompt then its generated
    tokens); :meth:`match` re-indexes from scratch when it sees a shorter or changed one.
    """

    __slots__ = ("ngram_min", "ngram_max", "_maps", "_size", "_last")

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._maps: dict[int, dict[tuple[int, ...], int]] = {}
        self._size = 0  # the windows inside hist[: _size] are indexed
        self._last = None  # hist[_size - 1] then, to notice a changed list

    def _index(self, hist: list[int], upto: int) -> None:
        if upto < self._size or (self._size and hist[self._size - 1] != self._last):
            self._maps, self._size = {}, 0
        for n in range(self.ngram_min, self.ngram_max + 1):
            m = self._maps.setdefault(n, {})
            for s in range(max(0, self._size - n + 1), upto - n + 1):
                m[tuple(hist[s : s + n])] = s  # later starts overwrite earlier ones
        self._size = upto
        self._last = hist[upto - 1] if upto else None

    def start(self, hist: list[int], n: int) -> int | None:
        """The start of the latest occurrence of ``hist``'s last ``n`` tokens that ends
        before its last token (None: none). Indexes ``hist``'s new windows first."""
        L = len(hist)
        if L - 1 != self._size or (self._size and hist[self._size - 1] != self._last):
            self._index(hist, L - 1)
        if L <= n:
            return None
        return self._maps.get(n, {}).get(tuple(hist[L - n :]))
