"""What a drafter is to the decode loop: the Drafter interface and the Draft it proposes.

Every drafter module (model_drafter, ngram, lookahead, heads) and the decode loop import only
this, not each other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import SamplingParams, Seen
from .options import MAX_TREE  # noqa: F401  (also imported from here)


@dataclass
class Draft:
    """A round's guesses: the tokens, the distributions they were drawn from (None: point masses
    or greedy), the K policy's bucket, and when drafting ended (to time the verifying pass).

    A tree (parents not None): parents[i] is the index in `tokens` of node i's parent, -1 for the
    pending token, and a parent always comes before its children; candidate[i] says whether node i
    may be accepted (None: all), the others only feed the drafter (lookahead's window). A tree's
    candidates are point masses: q is None. option: the TreePolicy option it was drafted with."""
    tokens: list[int]
    q: torch.Tensor | None = None
    bucket: int | None = None
    seconds: float = 0.0
    done_at: float = 0.0
    parents: list[int] | None = None
    candidate: list[bool] | None = None
    option: object = None

    @property
    def n_candidates(self) -> int:
        if self.parents is None or self.candidate is None:
            return len(self.tokens)
        return sum(self.candidate)


class Drafter:
    """Guesses continuations. `bucket` names the kind of guess available now (the K policy keeps
    acceptance statistics per bucket; None: no guess at all), `propose` makes up to k guesses.

    Tree drafters (tree = True) implement tree_options() and propose_tree() instead: the loop asks
    the Speculator's TreePolicy for an option (or a plain step) each round and the drafter for a
    tree of that option.

    After every step of the decode loop (a chain round, a tree round or a plain step) the loop
    calls observe() with the target's output for that pass; before the first step it calls it once
    for the prompt's prefill (see observe). A drafter with needs_hidden = True also gets the
    final-norm hidden states there (every pass of the loop then computes them: no CUDA graph)."""

    name = "drafter"
    tree = False  # True: drafts trees (tree_options, propose_tree), not chains (bucket, propose)
    needs_hidden = False  # True: observe() gets the target's final-norm hidden states

    def start(self, ids: list[int], kv) -> None:
        """A generation begins: the target's cache `kv` holds `ids` (the prompt). Catch up with
        it, outside the timed rounds (it is not a per-token cost)."""

    def bucket(self, ctx: list[int]) -> int | None:
        return 0

    def propose(self, ctx: list[int], k: int, params: SamplingParams, gen: torch.Generator,
                seen: Seen | None) -> tuple[list[int], torch.Tensor | None]:
        """Up to k tokens to follow ctx, and the distributions they were drawn from ([n, V], or
        None for point masses). seen: the ids the penalties look at (sampling.Seen)."""
        raise NotImplementedError

    def capacity(self) -> int:
        return 1 << 62

    def tree_options(self) -> list:
        """Tree drafters: the tree shapes it can draft (hashable; e.g. node budgets), cheapest
        first. The TreePolicy keeps each one's tokens per second and picks the fastest, or a plain
        step; a Speculator built with k="fixed" always uses the first."""
        return []

    def propose_tree(self, ctx: list[int], option, depth: int, size: int, params: SamplingParams,
                     gen: torch.Generator, seen: Seen | None) -> "Draft | None":
        """A tree to follow ctx (ctx[-1] is the pending token): Draft(tokens, parents=...,
        candidate=...) of at most `size` nodes whose candidate nodes lie at most `depth` deep
        (depth 1: children of the pending token), or None for a plain step this round."""
        raise NotImplementedError

    def observe(self, draft: "Draft", logits: torch.Tensor, hidden: torch.Tensor | None, path: list[int]) -> None:
        """A pass of the decode loop is done. logits [1 + len(draft.tokens), V]: the target's
        output after the pending token (row 0) and after each drafted node (row 1 + i); hidden: the
        final norm's output for the same rows [1 + len, dim] (None unless needs_hidden); path: the
        accepted nodes' indices into draft.tokens, in order (chains: 0..n-1). The next pending
        token was chosen from the row of the last accepted node (row 0 when path is empty), so that
        row's hidden state is the one that produced it. A plain step has draft.tokens == [] and
        one row.

        Before the first step it is called once for the prefill: draft = Draft([]), the rows of the
        prompt's last token (whose logits chose the first pending token), path = []."""
