"""Speculative decoding: a cheap drafter proposes K tokens, the model checks them in one pass.

A round: the drafter guesses d1..dK after the pending token t; the target runs [t, d1..dK] in a
single forward pass, which gives its distribution after each prefix; the longest prefix of
drafts the target agrees with is kept, plus one token of the target's own (the correction at the
first rejection, or a bonus after the last draft). Both KV caches roll back past the first
rejected draft, so each round yields 1..K+1 tokens for one target pass.

Greedy: a draft is kept when it is the target's argmax, so the output is plain greedy decoding's.
Sampling: standard speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023):
keep d with probability min(1, p(d)/q(d)), else sample from max(0, p - q) renormalized. The
output is then distributed exactly as the target's. p and q are both `probabilities()` of their
logits (temperature, top-k/p, min-p, repetition penalty applied alike); the n-gram drafter's q is
a point mass on its guess.

Drafters: another checkpoint with the same tokenizer (ModelDrafter), a quantized copy of the
target built at load (`self:int8`, `self:int4`), or prompt lookup (NgramDrafter: continue the
latest earlier occurrence of the text's last few tokens; no model at all). Tree drafters live in
their own modules: lookahead (core/lookahead.py) and draft heads (`heads:PATH`, core/draft_heads.py).

Tree rounds: a drafter may propose a tree instead of a chain (Draft.parents): several
continuations sharing prefixes, plus nodes the target only runs for the drafter to look at
(lookahead's window, core/lookahead.py). The target runs the whole tree in one pass with an
ancestor mask; verify_tree walks it from the pending token, keeping a child while the target
agrees (greedy) or by sequential rejection of point masses (sampling: exact); the cache keeps the
accepted path's K/V in consecutive slots (ContiguousKV.keep_path). A TreePolicy picks the tree's
shape, or a plain step, by measured tokens per second.
"""
from __future__ import annotations

import time
import warnings

import torch

from .cuda_graph import decode_step
from .errors import BriskError, InvalidValue
from .generate import common_prefix, prefill
from .drafting import MAX_TREE, Draft, Drafter  # the interface drafters implement (re-exported)
from .kv import ContiguousKV
from .kv.base import ancestor_mask  # noqa: F401 (tree drafts' mask, re-exported)
from .sampling import SamplingParams, Seen, apply_penalties, extend_seen, probabilities

K_MAX = 12  # most drafts per round for --draft-k auto: beyond it acceptance^K makes drafts worthless


# ---------------------------------------------------------------- drafters

class ModelDrafter(Drafter):
    """A smaller model with its own KV cache, kept in step with the target's accepted tokens.

    share_cache (a quantized copy of the target: same layers and shapes): draft in the target's
    own cache instead. The context's K/V are then the target's, exact, and nothing needs a
    prefill or a catch-up; the draft's K/V for its guesses are overwritten by the verifying pass,
    which writes the same positions before it reads them.
    """

    def __init__(self, model, max_len: int, vocab_size: int, name: str = "model", share_cache: bool = False):
        self.model, self.name, self.share_cache = model, name, share_cache
        self.cache = None if share_cache else ContiguousKV.for_model(model, max_len)
        self.max_len = max_len
        self.ids: list[int] = []  # the tokens whose K/V the draft cache holds
        self.vocab_size = vocab_size  # the target's: draft logits are cut or padded to it
        self.device = model.model.norm.weight.device

    def capacity(self) -> int:
        return self.max_len

    def bucket(self, ctx):
        return 0 if len(ctx) < self.max_len else None  # a draft with a shorter context stops

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        V = self.vocab_size
        if logits.shape[-1] > V:  # padded vocabularies differ in size; the tokenizers agree
            return logits[..., :V]
        if logits.shape[-1] < V:
            return torch.nn.functional.pad(logits, (0, V - logits.shape[-1]), value=float("-inf"))
        return logits

    def sync(self, ctx: list[int]) -> torch.Tensor:
        """Bring the cache to ctx (rolling back what the target rejected, running what is
        missing); returns the logits after ctx's last token."""
        # shared: the target's cache holds ctx[:-1], its accepted tokens
        keep = len(ctx) - 1 if self.share_cache else min(common_prefix(self.ids, ctx), len(ctx) - 1)
        if len(ctx) - keep == 1:  # the steady state: one token, a decode step (a graph on CUDA)
            logits = self._step()(ctx[-1], keep)
        else:
            logits = prefill(self.model, self.cache, ctx, keep, self.device)
        self.ids = list(ctx)
        return logits

    def _step(self):
        """The draft model's one-token step on the cache it drafts in (captured graphs on CUDA)."""
        if getattr(self, "_step_cache", None) is not self.cache:
            self._step_fn, self._step_cache = decode_step(self.model, self.cache), self.cache
        return self._step_fn

    def start(self, ids, kv):
        if self.share_cache:
            self.cache = kv
        elif 0 < len(ids) < self.max_len:
            self.sync(ids)

    def propose(self, ctx, k, params, gen, seen):
        logits = self.sync(ctx)  # one token in steady state (two after a round all accepted)
        out, qs = [], []
        while True:
            logits = self._logits(logits.float())
            if seen is not None:
                logits = apply_penalties(logits, extend_seen(seen, out), params)
            if params.greedy:
                tok = int(logits.argmax())
            else:
                q = probabilities(logits, params)
                tok = int(torch.multinomial(q.cpu(), 1, generator=gen))
                qs.append(q)
            out.append(tok)
            if len(out) == k:
                return out, (torch.stack(qs) if qs else None)
            logits = self._step()(tok, len(self.ids))
            self.ids.append(tok)


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


# ---------------------------------------------------------------- how many tokens to draft

class KPolicy:
    """Drafts per round: fixed, or ("auto") the K that maximizes expected tokens per second.

    Per bucket and draft position i it keeps decayed counts of how often draft i was accepted
    once drafts 1..i-1 were: a_i. A round of K drafts then yields E = 1 + a_1 + a_1 a_2 + ...
    tokens (acceptance comes in runs: a_i grows with i, which a single rate would miss). Its
    cost is K draft steps plus one target pass over K+1 tokens, both timed as generation goes
    (how much more a pass over several tokens costs than over one depends on the device).
    K = 0, plain decoding, wins when drafts are not accepted often enough; while a bucket sits at
    0 its counts fade towards the prior, so it is tried again now and then and can recover.
    """

    # Pseudo-counts added to the first position's (accepted, tried): hopeful (5 in 6), so that a
    # drafter gets tried, and light, so that a few rounds overrule it. Each later position's prior
    # is the estimate for the one before it: a position seldom reached is not assumed better.
    PRIOR = (1.0, 1.2)
    DECAY = 0.95  # per round of the bucket: recent text counts more
    FADE = 0.97  # per round a bucket is not drafted for

    def __init__(self, k: int | str = "auto", k_max: int = K_MAX):
        self.auto = k == "auto"
        self.k_fixed = 0 if self.auto else int(k)
        self.k_max = k_max if self.auto else self.k_fixed
        self.counts: dict[int, list[list[float]]] = {}  # bucket -> per position [accepted, tried]
        self.verify_s: dict[int, float] = {}  # tokens per target pass -> seconds (EMA)
        self.draft_s = 0.0  # seconds per drafted token (EMA)

    def acceptance(self, bucket: int, n: int) -> list[float]:
        """For drafts 0..n-1: the chance each is accepted when the drafts before it were."""
        c = self.counts.get(bucket) or [[0.0, 0.0]] * n
        out, prior = [], self.PRIOR[0] / self.PRIOR[1]
        for acc, tried in c[:n]:
            prior = (acc + prior * self.PRIOR[1]) / (tried + self.PRIOR[1])
            out.append(prior)
        return out

    def pass_cost(self, n: int) -> float | None:
        """Seconds of a target pass over n tokens as measured so far (None before any pass)."""
        return self._verify_cost(n) if 1 in self.verify_s else None

    def _verify_cost(self, n: int) -> float:
        """Seconds of a target pass over n tokens: timed, or interpolated between the nearest
        timed sizes, or (beyond the largest) as much as it. Optimistic on purpose: an untimed
        size gets tried and timed; the cost is not linear in n (on a CPU a pass over 2 tokens
        can cost as much as one over 5), so no slope is assumed."""
        if n in self.verify_s:
            return self.verify_s[n]
        below = max(m for m in self.verify_s if m < n)  # 1 is always timed first
        above = min((m for m in self.verify_s if m > n), default=None)
        if above is None:
            return self.verify_s[below]
        f = (n - below) / (above - below)
        return (1 - f) * self.verify_s[below] + f * self.verify_s[above]

    def choose(self, bucket: int, limit: int) -> int:
        limit = min(limit, self.k_max)
        if not self.auto or limit <= 0:
            return max(0, min(self.k_fixed, limit))
        if 1 not in self.verify_s:
            return 0  # time a plain step first: every choice is measured against it
        if not self.draft_s:
            return min(4, limit)  # a first round, to time the drafter
        best_k, best_rate = 0, 1.0 / self.verify_s[1]
        expected, run = 1.0, 1.0
        for k, a in enumerate(self.acceptance(bucket, limit), start=1):
            run *= a
            expected += run
            rate = expected / (k * self.draft_s + self._verify_cost(k + 1))
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0 and bucket in self.counts:
            self.counts[bucket] = [[a * self.FADE, t * self.FADE] for a, t in self.counts[bucket]]
        return best_k

    def time_pass(self, n: int, seconds: float) -> None:
        """A target pass over n tokens took `seconds` (chains and trees alike)."""
        old = self.verify_s.get(n)
        self.verify_s[n] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def record(self, bucket: int, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        self.time_pass(drafted + 1, verify_s)
        if not drafted:
            return
        per = draft_s / drafted
        self.draft_s = per if self.draft_s == 0 else 0.8 * self.draft_s + 0.2 * per
        c = self.counts.setdefault(bucket, [[0.0, 0.0] for _ in range(max(self.k_max, 1))])
        for i, pos in enumerate(c):
            pos[0] *= self.DECAY
            pos[1] *= self.DECAY
            if i <= accepted and i < drafted:  # tried: the first `accepted` and the one rejected
                pos[1] += 1
                pos[0] += i < accepted


class TreePolicy:
    """Which option a tree drafter drafts with this round, or None for a plain step: the one with
    the most tokens per second lately.

    A round costs the time from its proposal to the next one: the target's pass (on a CPU it grows
    with the tree's size), verifying, the drafter's own work and handing the tokens out; it yields
    the tokens it emitted (accepted + 1). Per choice, both are summed with decay. The choice is
    revised every RUN rounds (a drafter may need a few rounds to warm up: lookahead's window); the
    plain step runs first (every option is judged against it), then each option once in the
    drafter's order. A choice that is not the fastest when its run ends is tried again only after
    a wait that doubles each time it loses (quadruples when it lost badly), so a drafter that does
    not pay on this text or device costs little: the back-off. An option that could not win even if
    every round kept its deepest candidate path (its most tokens per round over the time of a pass
    over its usual tree size, `cost` = seconds per pass over n tokens as measured by the loop, or
    over its rounds' measured time where that is longer, below the best rate) has its run cut short
    and is not retried while that holds. Where the drafter estimates its tokens per round
    (`expected`: trained heads measured theirs), the hope is the larger of that estimate and what
    its rounds emitted, not the deepest path: an option that cannot pay is then dropped after one
    round, not tried for RUN rounds again and again (on a CPU, where a pass over a few tokens costs
    1.3-2x a step, heads auto lost 4-11% to those tries)."""

    RUN = 4  # rounds a choice runs before it is judged
    DECAY = 0.9  # per round of a choice: recent text counts more
    FIRST_WAIT = 32  # rounds before a losing choice is tried again
    BADLY = 0.75  # losing badly: below this fraction of the best rate

    def __init__(self, options: list, adaptive: bool = True, cost=None, expected=None):
        if not options:
            raise ValueError("a tree drafter needs at least one option")
        self.options, self.adaptive, self.cost, self.expected = list(options), adaptive, cost, expected
        self.tokens: dict = {}  # choice -> decayed tokens emitted
        self.seconds: dict = {}  # choice -> decayed seconds spent
        self.rounds: dict = {}  # choice -> decayed rounds run
        self.nodes: dict = {}  # option -> its trees' tokens per pass (pending token included), averaged
        self.most: dict = {}  # option -> the most tokens one of its rounds could emit
        self.wait: dict = {}  # choice -> rounds it waits after its next loss
        self.due: dict = {}  # choice -> the round from which it may run again
        self.current = None if adaptive else self.options[0]
        self.ran = 0  # rounds the current choice has run
        self.round = 0
        self._open: list | None = None  # [choice, tokens, start] of the round in flight

    def rate(self, choice) -> float | None:
        """Tokens per second measured for a choice (None: not yet)."""
        return self.tokens[choice] / self.seconds[choice] if self.seconds.get(choice) else None

    def choose(self):
        """The option for this round (None: a plain step)."""
        self.round += 1
        if not self.adaptive:
            return self.current
        best = self._best()
        if self.ran < self.RUN and not (self.current != best and self._hopeless(self.current, best)):
            self.ran += 1
            return self.current  # (a run is cut short once its first rounds show it cannot win)
        last = self.current
        if last == best:
            self.wait.pop(last, None)
        elif self.rate(last) is not None:  # it ran and lost: wait before the next try
            wait = self.wait.get(last, self.FIRST_WAIT)
            self.due[last] = self.round + wait
            self.wait[last] = wait * (4 if self.rate(last) < self.BADLY * self.rate(best) else 2)
        choices = [None] + self.options
        untried = [c for c in choices if c not in self.seconds and c != last]
        pick = untried[0] if untried else best
        for c in [] if untried else choices:  # a loser whose wait is over, unless it cannot win
            if c in (best, last) or self.due.get(c, 0) > self.round:
                continue
            if not self._hopeless(c, best):
                pick = c
                break
            wait = self.wait.get(c, self.FIRST_WAIT)
            self.due[c], self.wait[c] = self.round + wait, wait * 2
        self.current, self.ran = pick, 1
        return pick

    def _hopeless(self, choice, best) -> bool:
        """Whether `choice` would lose to `best` even at its most hopeful (see the class)."""
        if choice is None or self.cost is None or choice not in self.nodes:
            return False
        seconds = self.cost(round(self.nodes[choice])) or 0.0
        tokens = self.most[choice]
        if self.rounds.get(choice):
            seconds = max(seconds, self.seconds[choice] / self.rounds[choice])
            guess = self.expected(choice) if self.expected is not None else None
            if guess is not None:
                tokens = min(tokens, max(guess, self.tokens[choice] / self.rounds[choice]))
        return bool(seconds) and tokens / seconds < self.rate(best)

    def _best(self):
        rates = {c: self.rate(c) for c in [None] + self.options if self.rate(c) is not None}
        return max(rates, key=rates.get) if rates else None

    def opened(self, choice, start: float, nodes: int = 1, most: int = 1) -> None:
        """A round with `choice` (what ran: None when the drafter had nothing) began at `start`,
        its pass over `nodes` tokens, `most` the tokens it emits if its deepest path is kept."""
        self._open = [choice, 0, start]
        if choice is not None:
            self.nodes[choice] = 0.8 * self.nodes.get(choice, nodes) + 0.2 * nodes
            self.most[choice] = max(self.most.get(choice, 0), most)

    def emitted(self, tokens: int) -> None:
        if self._open is not None:
            self._open[1] = tokens

    def closed(self, end: float) -> None:
        """The next proposal came at `end`: the round in flight is recorded."""
        if self._open is None:
            return
        choice, tokens, start = self._open
        self._open = None
        if tokens:
            self.tokens[choice] = self.tokens.get(choice, 0.0) * self.DECAY + tokens
            self.seconds[choice] = self.seconds.get(choice, 0.0) * self.DECAY + (end - start)
            self.rounds[choice] = self.rounds.get(choice, 0.0) * self.DECAY + 1

    def discard(self) -> None:
        """Forget the round in flight (a new generation: the time since includes its prefill)."""
        self._open = None


# ---------------------------------------------------------------- verification

def acceptance_probability(p_x: float, q_x: float) -> float:
    """Rejection sampling's rule: keep a draft drawn from q with probability min(1, p/q)."""
    return min(1.0, p_x / q_x) if q_x > 0 else 1.0


def verify(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, params: SamplingParams,
           gen: torch.Generator, seen: Seen | None) -> tuple[int, int]:
    """logits [K+1, V]: the target after each prefix of [t, d1..dK]. Returns (how many drafts are
    kept, the target's next token after them)."""
    k = len(drafts)
    if seen is not None:  # each position sees the drafts before it, as plain decoding would
        logits = torch.stack([apply_penalties(logits[i], extend_seen(seen, drafts[:i]), params) for i in range(k + 1)])
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()
        n = 0
        while n < k and best[n] == drafts[n]:
            n += 1
        return n, best[n]
    p = probabilities(logits, params).cpu()
    u = torch.rand(k, generator=gen).tolist()
    for i, x in enumerate(drafts):
        qi = q[i].cpu() if q is not None else None
        q_x = float(qi[x]) if qi is not None else 1.0
        if u[i] < acceptance_probability(float(p[i, x]), q_x):
            continue
        if qi is not None:
            residual = (p[i] - qi).clamp_(min=0)
        else:  # q is a point mass on x
            residual = p[i].clone()
            residual[x] = 0
        if residual.sum() <= 0:  # p == q up to rounding: rejection was a fluke of float error
            residual = p[i]
        return i, int(torch.multinomial(residual, 1, generator=gen))
    return k, int(torch.multinomial(p[k], 1, generator=gen))


def verify_tree(logits: torch.Tensor, tokens: list[int], parents: list[int], candidate: list[bool] | None,
                params: SamplingParams, gen: torch.Generator, seen: Seen | None) -> tuple[list[int], int]:
    """A tree of deterministic candidates against the target. logits [1 + len(tokens), V]: the
    target after the pending token (row 0) and after node i (row 1 + i); parents[i]: node i's
    parent (-1: the pending token); only nodes with candidate[i] (None: all) may be accepted.
    Returns (the accepted nodes, in path order; the target's next token after them).

    From the root, at each node: greedy, the target's argmax; if a candidate child holds it, the
    walk moves there, else the argmax is the next token. Sampling, with p the target's
    distribution there: the candidate children are tried in order, child c accepted with
    probability p(c) / (the mass not yet rejected), else p(c) is zeroed; if none is accepted the
    next token is drawn from what remains. Each step then draws exactly from p (a point-mass
    draft is accepted with probability p(x), else the residual is p without x), so the output is
    distributed as the target's. The repetition penalty at a node sees the path's tokens."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        if candidate is None or candidate[i]:
            children.setdefault(parent, []).append(i)
    path: list[int] = []
    node = -1
    while True:
        row = logits[node + 1]
        if seen is not None:
            row = apply_penalties(row, extend_seen(seen, [tokens[i] for i in path]), params)
        kids = children.get(node, ())
        if params.greedy:
            best = int(row.argmax())
            nxt = next((c for c in kids if tokens[c] == best), None)
            if nxt is None:
                return path, best
        else:
            p = probabilities(row, params).cpu()
            residual, nxt = p, None
            for c in kids:
                mass = float(residual.sum())
                x = tokens[c]
                if mass <= 0:
                    break
                if float(torch.rand(1, generator=gen)) < float(residual[x]) / mass:
                    nxt = c
                    break
                residual = residual.clone() if residual is p else residual
                residual[x] = 0
            if nxt is None:
                if residual.sum() <= 0:  # rounding left no mass: what was rejected had it all
                    residual = p
                return path, int(torch.multinomial(residual, 1, generator=gen))
        path.append(nxt)
        node = nxt


# ---------------------------------------------------------------- the decode loop

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
            raise InvalidValue("draft_k", k, "must be a positive integer or auto")
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


# ---------------------------------------------------------------- `brisk bench --draft`

BENCH_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def bench_rows(llm, speculator: Speculator, n_gen: int, reps: int) -> list:
    """Greedy generation of up to n_gen tokens from one chat prompt, plain then speculative:
    speculation's speed depends on the text, so both rows decode real text (the tg row of
    `brisk bench` feeds back argmaxes of random context)."""
    import statistics

    from .benchmark import BenchRow, peak_memory
    from .generate import Session
    from .sampling import GREEDY

    ids = llm.prompt_ids(BENCH_PROMPT)
    rows = []
    for sp in (None, speculator):
        s = Session(llm, speculator=sp)
        results = []
        for i in range(reps + 1):  # the first run warms up (and lets --draft-k auto learn the costs)
            list(s.stream(ids, GREEDY, n_gen))
            results.append(s.last)
        results = results[1:]
        speeds = [r.decode_tps for r in results]
        med = statistics.median(speeds)
        test, acc = f"tg{n_gen} text", None
        if sp is not None:
            drafted = sum(r.spec["drafted"] for r in results)
            acc = sum(r.spec["accepted"] for r in results) / drafted if drafted else 0.0
            test = f"tg{n_gen} {sp.describe()}, {acc:.0%} acc."
        rows.append(BenchRow(model=llm.name, device=str(llm.device), dtype=str(llm.dtype).removeprefix("torch."),
                             quant=llm.quantization,
                             test=test, tok_s=med, spread=(max(speeds) - min(speeds)) / 2,
                             ttft_s=statistics.median(r.ttft_s for r in results),
                             model_bytes=llm.load_info.param_bytes, gb_s=llm.load_info.param_bytes * med / 1e9,
                             peak_mem_bytes=peak_memory(llm.device), acceptance=acc))
    return rows


# ---------------------------------------------------------------- building one from a --draft spec

SELF_METHODS = {"self:int8": "int8", "self:int4": "int4"}


def parse_k(value: str | int | None) -> int | str:
    if value is None or value == "auto":
        return "auto"
    try:
        k = int(value)
    except (TypeError, ValueError):
        raise InvalidValue("draft_k", value, "must be a positive integer or auto") from None
    if k < 1:
        raise InvalidValue("draft_k", value, "must be a positive integer or auto")
    return k


HEADS = "heads:"  # --draft heads:PATH, draft heads written by `brisk distill`


def parse_heads(draft: str, k: int | str) -> tuple[str, int | None]:
    """`heads:PATH` and a parsed --draft-k -> (PATH, the tree size to draft: None for auto). A
    number K is a fixed tree of the stored tree's first K nodes (K tokens drafted per round, as K
    means for chains); auto lets the TreePolicy pick among a few sizes, or plain steps."""
    path = draft[len(HEADS):]
    if not path.strip():
        raise InvalidValue("draft", draft, "", template="{option} heads:PATH needs the folder `brisk distill` "
                           "wrote, e.g. heads:smol-heads")
    if k != "auto" and k > MAX_TREE - 1:
        raise InvalidValue("draft_k", k, "", template=f"{{option}} {k}: a heads tree of K nodes runs with the pending "
                           f"token in one pass of at most {MAX_TREE} tokens, so K <= {MAX_TREE - 1}")
    return path, None if k == "auto" else k


def make_speculator(llm, draft: str, k: str | int | None = "auto", lookahead: str | None = None) -> Speculator:
    """`draft`: "ngram", "lookahead", "heads:PATH", "self:int8", "self:int4", or a model brisk can
    load (path, hub id, GGUF). lookahead: "W,N,G" for --draft lookahead (default: auto, which sizes
    the tree by measured speed and falls back to plain decoding where it does not pay). heads:PATH:
    the draft heads `brisk distill` wrote for this model (k: see parse_heads)."""
    k = parse_k(k)
    if lookahead is not None and draft != "lookahead":
        raise BriskError("--lookahead needs --draft lookahead")
    if draft == "lookahead":
        from .lookahead import LookaheadDrafter, parse_lookahead

        if k != "auto":
            raise InvalidValue("draft_k", k, "", template="{option} does not apply to --draft lookahead "
                               "(it drafts trees; --lookahead W,N,G sets their size)")
        shape = parse_lookahead(lookahead)
        return Speculator(LookaheadDrafter([shape] if shape else None), "fixed" if shape else "auto")
    if draft.startswith(HEADS):
        from .draft_heads import HeadsDrafter

        path, size = parse_heads(draft, k)
        drafter = HeadsDrafter(llm, path, None if size is None else [size])
        if size is not None and size > len(drafter.nodes):
            raise InvalidValue("draft_k", k, "", template=f"{{option}} {k}: the tree in {path} has "
                               f"{len(drafter.nodes)} nodes (`brisk distill --tree-nodes` sets it)")
        return Speculator(drafter, "auto" if size is None else "fixed")
    if draft == "ngram":
        return Speculator(NgramDrafter(), k)
    if draft in SELF_METHODS:
        if llm.quantization != "none":
            # Its layers are already int4/int8/4-bit: a copy at the same or more bits drafts no
            # faster than the model verifies, and brisk has no fast kernel below 4 bits.
            raise BriskError(f"--draft {draft}: {llm.name} is already quantized ({llm.quantization}), so a "
                             "quantized copy of it would not be faster; load it with --quantize none for a "
                             "self-draft, or use --draft ngram or a smaller model")
        return Speculator(ModelDrafter(quantized_copy(llm.model, SELF_METHODS[draft], llm.ctx),
                                       llm.ctx, llm.config.vocab_size, name=draft, share_cache=True), k)
    if draft.startswith("self:"):
        raise InvalidValue("draft", draft, "", template=f"{{option}} {draft}: use self:int8 or self:int4")
    from .llm import LLM

    other = LLM.load(draft, device=str(llm.device), dtype=str(llm.dtype).removeprefix("torch."), ctx=llm.ctx)
    check_pair(llm, other)
    return Speculator(ModelDrafter(other.model, other.ctx, llm.config.vocab_size, name=other.name), k)


def check_pair(target, draft) -> None:
    """Refuse a draft whose tokenizer differs from the target's; warn when it is not smaller."""
    diff = target.tokenizer.describe_difference(draft.tokenizer)
    if diff:
        raise BriskError(f"draft {draft.name} cannot draft for {target.name}: their tokenizers differ ({diff})")
    t, d = _n_params(target.model), _n_params(draft.model)
    if d >= t:
        warnings.warn(f"draft {draft.name} ({d / 1e6:.3g}M parameters) is not smaller than {target.name} "
                      f"({t / 1e6:.3g}M): speculative decoding will likely be slower than plain decoding",
                      stacklevel=3)


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def quantized_copy(model, method: str, max_len: int):
    """A second Transformer sharing the target's embeddings and norms, with quantized linears.

    Built on the meta device and handed the target's tensors (no float copy is made); then each
    linear, the output head included (it is a fifth of a small model's bytes), is replaced by its
    quantized version.
    """
    from ..quant.linear import quantize_model
    from .kernel_passes import apply_device_kernels
    from .model import Transformer

    with torch.device("meta"):
        draft = Transformer(model.cfg)
    draft.load_state_dict(model.state_dict(), assign=True)
    draft.rope_factors = model.rope_factors
    draft.setup_rope(max_len, model.model.norm.weight.device)
    quantize_model(draft, method, head=True)
    apply_device_kernels(draft, draft.model.norm.weight.device)
    return draft.eval().requires_grad_(False)
