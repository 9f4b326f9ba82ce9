"""Speculator: what the decode loop (generate.Session) asks each round: drafts, the verdict on
them, and the bookkeeping (the policies learn, the counters add up)."""
from __future__ import annotations

import time

import torch

from ..errors import InvalidValue
from ..sampling import Seen
from .chain_policy import KPolicy
from .drafter import Draft, Drafter
from .options import K_RULE
from .tree_policy import TreePolicy
from .verify import verify, verify_tree


class Speculator:
    """The generation loop (generate.Session) asks it, each step: propose() drafts after the
    context; the loop runs the pending token and the drafts in one target pass; verify() says
    which drafts stand and the target's next token; accept() records the round; observe() shows
    the drafter the pass.

    k: for chain drafters the drafts per round, a number or "auto" (KPolicy); for tree drafters
    "auto" (the TreePolicy picks an option or a plain step by measured speed) or "fixed" (always
    the drafter's first option)."""

    def __init__(self, drafter: Drafter, k: int | str = "auto"):
        if drafter.tree:
            if k not in ("auto", "fixed"):
                raise InvalidValue("draft_k", k, "", template=f"{{option}} {k}: {drafter.name} drafts trees, "
                                   "whose size it chooses itself (auto), not K tokens")
        elif k != "auto" and (not isinstance(k, int) or k < 1):
            raise InvalidValue("draft_k", k, K_RULE)
        self.drafter, self.k = drafter, k
        self.policy = KPolicy(k if not drafter.tree else "auto")  # kept across generations: costs carry over
        self.trees = TreePolicy(drafter.tree_options(), k == "auto", self.policy.pass_cost,
                                getattr(drafter, "expected_tokens", None)) if drafter.tree else None
        self.stats: dict = self.new_stats()

    @property
    def setting(self) -> int | str:
        """K for chains; for trees "auto" or the fixed option (lookahead: "W,N,G")."""
        if self.trees is None or self.trees.adaptive:
            return self.k
        return str(self.trees.options[0])

    def describe(self) -> str:
        """The drafter and its setting, e.g. "ngram K=auto", "lookahead 5,3,2"."""
        return f"{self.drafter.name} {'' if self.drafter.tree else 'K='}{self.setting}"

    @property
    def needs_hidden(self) -> bool:
        return self.drafter.needs_hidden

    def new_stats(self) -> dict:
        """Counters for one generation (the loop attaches them to its result). rounds: passes that
        verified drafts; drafted: the candidate tokens they held; accepted: those kept; passes:
        every target pass of the decode loop, plain steps included."""
        self.stats = {"drafter": self.drafter.name, "k": self.setting, "rounds": 0, "drafted": 0, "accepted": 0,
                      "acceptance_rate": 0.0, "mean_accepted": 0.0, "passes": 0}
        if self.drafter.tree:
            self.stats["options"] = {}  # option -> rounds run with it ("plain": plain steps)
        return self.stats

    def start(self, ids: list[int], kv) -> None:
        """The target's cache `kv` holds the prompt `ids`; drafting begins."""
        if self.trees is not None:
            self.trees.discard()
        self.drafter.start(ids, kv)

    def propose(self, ctx: list[int], room: int, sampler, seen: Seen | None,
                slots: int | None = None) -> Draft:
        """Drafts to follow ctx (the context and the pending token): at most `room` tokens accepted
        (the budget) and `slots` drafted (the cache; default room)."""
        slots = room if slots is None else min(slots, self.drafter.capacity() - len(ctx) - 1)
        if self.drafter.tree:
            return self._propose_tree(ctx, room, slots, sampler, seen)
        bucket = self.drafter.bucket(ctx)
        k = self.policy.choose(bucket, min(room, slots, self.drafter.capacity() - len(ctx) - 1)) \
            if bucket is not None else 0
        t0 = time.perf_counter()
        tokens, q = self.drafter.propose(ctx, k, sampler.params, sampler.generator, seen) if k > 0 else ([], None)
        t1 = time.perf_counter()
        return Draft(tokens, q, bucket, t1 - t0, t1)

    def _propose_tree(self, ctx, room, slots, sampler, seen) -> Draft:
        t0 = time.perf_counter()
        self.trees.closed(t0)  # the round before ends here: its time includes everything it took
        option = self.trees.choose() if room > 0 and slots > 0 else None
        draft = None
        if option is not None:
            draft = self.drafter.propose_tree(ctx, option, room, slots, sampler.params, sampler.generator, seen)
        if draft is None or not draft.tokens:
            draft, option = Draft([]), None
        elif draft.parents is None or len(draft.parents) != len(draft.tokens):
            raise ValueError(f"{self.drafter.name}: a tree draft needs one parent per token")
        self.trees.opened(option, t0, len(draft.tokens) + 1, 1 + _deepest(draft))
        t1 = time.perf_counter()
        draft.option, draft.seconds, draft.done_at = option, t1 - t0, t1
        key = "plain" if option is None else str(option)
        self.stats["options"][key] = self.stats["options"].get(key, 0) + 1
        return draft

    def verify(self, draft: Draft, logits: torch.Tensor, sampler, seen: Seen | None) -> tuple[list[int], int]:
        """logits [len(draft)+1, V] from the target pass; (the accepted drafts' indices in order,
        the target's next token)."""
        if draft.parents is not None:
            return verify_tree(logits, draft.tokens, draft.parents, draft.candidate, sampler.params,
                               sampler.generator, seen)
        n, token = verify(logits, draft.tokens, draft.q, sampler.params, sampler.generator, seen)
        return list(range(n)), token

    def accept(self, draft: Draft, path: list[int]) -> None:
        """Record a round: the policies learn acceptance and costs, the counters add up."""
        n = len(path)
        pass_s = time.perf_counter() - draft.done_at
        if self.trees is not None:
            self.policy.time_pass(len(draft.tokens) + 1, pass_s)
            self.trees.emitted(n + 1)
        else:
            self.policy.record(draft.bucket, len(draft.tokens), n, draft.seconds, pass_s)
        st = self.stats
        st["passes"] += 1
        drafted = draft.n_candidates
        if drafted:
            st["rounds"] += 1
            st["drafted"] += drafted
            st["accepted"] += n
            st["acceptance_rate"] = round(st["accepted"] / st["drafted"], 4)
            st["mean_accepted"] = round(st["accepted"] / st["rounds"], 3)

    def observe(self, draft: Draft, logits: torch.Tensor, hidden: torch.Tensor | None, path: list[int]) -> None:
        """Show the drafter the pass (Drafter.observe)."""
        self.drafter.observe(draft, logits, hidden, path)

    def observe_prefill(self, logits: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Show the drafter the prefill's last row (logits [V], hidden [dim] or None): the one that
        chose the first pending token."""
        self.drafter.observe(Draft([]), logits[None], None if hidden is None else hidden[None], [])


def _deepest(draft: Draft) -> int:
    """The depth of a draft's deepest candidate node (0: none)."""
    if draft.parents is None:
        return len(draft.tokens)
    depth: list[int] = []
    for i, parent in enumerate(draft.parents):
        depth.append(1 + (depth[parent] if parent >= 0 else 0))
    return max((d for d, c in zip(depth, draft.candidate or [True] * len(depth)) if c), default=0)
