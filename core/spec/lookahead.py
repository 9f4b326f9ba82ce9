"""Lookahead decoding (Fu et al. 2024, "Break the sequential dependency of LLM inference using
lookahead decoding"): speculation without a draft model or training.

Each round is one target pass over a tree (drafter.Draft with parents) of two branches:

- the lookahead branch: a window of W future positions iterated in parallel, Jacobi style. It
  keeps N-1 levels of guesses; level l holds W tokens for the positions l+1 .. l+W past the
  pending token, and node (l, j) (column j of level l) continues the sequence
      pending, level0[0..j], level1[j], ..., level_l[j]
  i.e. its parent is level l-1's column j (for l >= 1) or level 0's column j-1 (the pending token
  for column 0). So every column's diagonal level0[j], level1[j], ..., level_L[j] is a path. The
  target's argmax at each node of the top level is the next level (one Jacobi step), and each
  diagonal plus that argmax is an n-gram of N tokens that goes to the pool, keyed by its first
  token. The oldest level then drops out and the window moves on with the text.
- the verification branch: up to G n-grams of the pool whose first token is the pending token,
  merged into a trie under it. They are the round's candidates; verify_tree keeps the longest
  agreeing path (greedy: exactly plain greedy's tokens).

The window's nodes are not candidates: they only feed the pool. The pool is also seeded with the
prompt's n-grams and gets those of the text as it is generated (as prompt lookup does).

On a CPU a pass over T tokens costs far more than one token (bench/RESULTS.md has the figures per
T), so the tree is small and "auto" (the TreePolicy) runs it only while it measures faster than
plain decoding.
"""
from __future__ import annotations

import random

from .drafter import Draft, Drafter
from .options import Shape  # noqa: F401  (also imported from here)

POOL_PER_KEY = 16  # n-grams kept per first token, the most recent


# What "auto" chooses among, cheapest first (the TreePolicy also runs plain steps): on a CPU a pass
# over a few tokens costs well over one token's (bench/RESULTS.md), so trees are small. W = 0: the
# verification branch alone, its pool fed by the text and by the window's n-grams from the rounds
# that ran it.
AUTO_SHAPES = [Shape(0, 3, 1), Shape(2, 3, 2)]


class LookaheadDrafter(Drafter):
    """Tree drafts of a Jacobi window and n-gram guesses (see the module's docstring).

    shapes: the options the TreePolicy chooses among (one n-gram size for all); prompt_ngrams,
    text_ngrams: put the prompt's, the answer's own n-grams into the pool too (measured: the
    prompt's matter on input-grounded prompts, the answer's on open-ended ones)."""

    name = "lookahead"
    tree = True

    def __init__(self, shapes: list[Shape] | None = None, prompt_ngrams: bool = True, text_ngrams: bool = True,
                 seed: int = 0):
        self.shapes = list(shapes or AUTO_SHAPES)
        if len({s.ngram for s in self.shapes}) != 1:
            raise ValueError("lookahead shapes must share one n-gram size")
        self.n = self.shapes[0].ngram
        self.prompt_ngrams, self.text_ngrams = prompt_ngrams, text_ngrams
        self.prompt_len = 0
        self.rng = random.Random(seed)
        self.pool: dict[int, dict[tuple, None]] = {}
        self.ids: list[int] = []  # the text whose n-grams are in the pool
        self.levels: list[list[int]] = []  # N-1 levels of W guesses, relative to `frame`
        self.frame = 0  # the pending token's position the window is laid out from
        self.fresh = 0  # Jacobi steps since the window was filled at random
        self._window: tuple[int, int] | None = None  # (index of the top level's first node, W) of the last draft

    def tree_options(self) -> list[Shape]:
        return self.shapes

    # ------------------------------------------------------------ the pool

    def _add(self, ngram) -> None:
        conts = self.pool.setdefault(ngram[0], {})
        cont = tuple(ngram[1:])
        conts.pop(cont, None)  # seen again: now the most recent
        conts[cont] = None
        if len(conts) > POOL_PER_KEY:
            del conts[next(iter(conts))]

    def _sync_text(self, ctx: list[int]) -> None:
        """Add the n-grams of the text that end at each token not seen yet (the prompt's with
        prompt_ngrams, the answer's with text_ngrams)."""
        n = self.n
        for end in range(max(len(self.ids), n - 1), len(ctx)):
            if self.text_ngrams if end >= self.prompt_len else self.prompt_ngrams:
                self._add(ctx[end - n + 1:end + 1])
        self.ids = ctx

    # ------------------------------------------------------------ the window

    def _fill(self, W: int, ctx: list[int]) -> None:
        """A fresh window: N-1 levels of tokens picked at random from the text (as the paper does:
        any start converges, the text's own tokens a little sooner)."""
        self.levels = [[self.rng.choice(ctx) for _ in range(W)] for _ in range(self.n - 1)]
        self.fresh = 0

    def _guess(self, depth: int, above: int) -> int | None:
        """The freshest guess for the position `depth` past the frame from the levels above `above`."""
        for m in range(len(self.levels) - 1, above, -1):
            j = depth - (m + 1)
            if 0 <= j < len(self.levels[m]):
                return self.levels[m][j]
        return None

    def _move(self, s: int, W: int) -> None:
        """Lay the window out from s tokens further on (and W wide): each level drops the columns
        now behind the pending token and gets new ones at its end, the freshest guess for that
        position where a level above has one, else the level's last token."""
        out = []
        for l, level in enumerate(self.levels):
            kept = level[s:W + s]
            for j in range(len(kept), W):
                g = self._guess(l + 1 + j + s, l)
                kept.append(g if g is not None else kept[-1] if kept else self.rng.choice(self.ids))
            out.append(kept)
        self.levels = out
        self.frame += s

    # ------------------------------------------------------------ a round

    def start(self, ids, kv):
        self.pool, self.ids, self.prompt_len = {}, [], len(ids)
        self._sync_text(list(ids))  # the prompt's n-grams seed the pool
        self._fill(max(s.window for s in self.shapes), ids)
        self.frame = len(ids)  # the first pending token's position
        self._window = None

    def propose_tree(self, ctx, option, depth, size, params, gen, seen):
        self._sync_text(ctx)
        L = self.n - 2
        W = option.window or len(self.levels[0])  # a round without the window leaves it as it is
        if len(ctx) - 1 < self.frame:  # not a continuation (cannot happen within a generation)
            self._fill(W, ctx)
            self.frame = len(ctx) - 1
        self._move(len(ctx) - 1 - self.frame, W)
        tokens: list[int] = []
        parents: list[int] = []
        # the verification branch first: its first n-gram, the likeliest, then sits in the slots
        # a chain would use, and keep_path has nothing to move when it is accepted
        trie: dict[tuple[int, int], int] = {}
        for cont in self._candidates(ctx[-1], option.guesses):
            node = -1
            for tok in cont[:depth]:
                nxt = trie.get((node, tok))
                if nxt is None:
                    if len(tokens) >= size:
                        break
                    nxt = trie[node, tok] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                node = nxt
        n_cand = len(tokens)
        self._window = None
        if option.window and len(tokens) + (L + 1) * W <= size:  # the lookahead branch, level by level
            first = len(tokens)
            for l, level in enumerate(self.levels):
                for j, tok in enumerate(level):
                    if l == 0:
                        parents.append(first + j - 1 if j else -1)
                    else:
                        parents.append(first + (l - 1) * W + j)
                    tokens.append(tok)
            self._window = (first + L * W, W)
        if not tokens:
            return None
        return Draft(tokens, parents=parents, candidate=[i < n_cand for i in range(len(tokens))])

    def _candidates(self, token: int, g: int) -> list[tuple]:
        conts = self.pool.get(token)
        return list(reversed(conts))[:g] if conts else []

    def observe(self, draft, logits, hidden, path):
        """The Jacobi step: the target's argmax at each node of the top level is the next level;
        each column's diagonal and it make an n-gram for the pool."""
        if self._window is None or draft.parents is None:
            return
        top, W = self._window
        self._window = None
        new = logits[1 + top:1 + top + W].argmax(dim=-1).tolist()
        if self.fresh >= len(self.levels) - 1:  # every level below comes from Jacobi steps
            for j in range(W):
                self._add([level[j] for level in self.levels] + [new[j]])
        self.levels = self.levels[1:] + [new]
        self.frame += 1  # the levels moved up one: each now starts one position later
        self.fresh += 1

