"""The n-gram drafter (--draft ngram): prompt lookup, no model at all."""
from __future__ import annotations

from .drafter import Drafter


class NgramDrafter(Drafter):
    """Prompt lookup decoding: the longest n-gram (n <= max_n) that ends the text and occurred
    before predicts that what followed it then follows again. Strong where the answer copies
    its input (rewrites, summaries, code edits); no extra model, almost no time."""

    name = "ngram"

    def __init__(self, max_n: int = 4):
        self.max_n = max_n
        self.index: list[dict[tuple, int]] = [{} for _ in range(max_n + 1)]  # n-gram -> end of its latest occurrence
        self.ids: list[int] = []  # the text indexed so far
        self.indexed = 0  # n-grams ending at positions < indexed are in the index
        self._match: tuple[int, int] = (0, 0)  # (n, end) found by the last bucket() call

    def _sync(self, ctx: list[int]) -> None:
        n = self.indexed
        if len(ctx) < n or ctx[:n] != self.ids[:n]:  # a new text, not a continuation: start over
            self.index = [{} for _ in range(self.max_n + 1)]
            self.indexed = n = 0
        self.ids = ctx
        # Index every n-gram ending before the last position: each then has a continuation,
        # and the text's own final n-gram is not found as a match of itself.
        for end in range(max(n, 1), len(ctx)):
            for size in range(1, min(self.max_n, end) + 1):
                self.index[size][tuple(ctx[end - size:end])] = end
        self.indexed = max(n, len(ctx))

    def bucket(self, ctx):
        """The length of the longest match: longer matches are likelier to be right."""
        self._sync(ctx)
        for size in range(min(self.max_n, len(ctx)), 0, -1):
            end = self.index[size].get(tuple(ctx[-size:]))
            if end is not None:
                self._match = (size, end)
                return size
        self._match = (0, 0)
        return None

    def propose(self, ctx, k, params, gen, seen):
        size, end = self._match
        return (list(ctx[end:end + k]) if size else []), None
