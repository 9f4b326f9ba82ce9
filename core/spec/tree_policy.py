"""Which tree a tree drafter drafts each round, or a plain step: TreePolicy, by measured tokens per
second."""
from __future__ import annotations


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
    more than a step, those tries cost heads auto a measurable share of its speed)."""

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
