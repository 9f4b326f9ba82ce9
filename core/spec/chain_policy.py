"""How many tokens a chain drafter drafts per round: KPolicy (--draft-k, a number or auto)."""
from __future__ import annotations

K_MAX = 12  # most drafts per round for --draft-k auto: beyond it acceptance^K makes drafts worthless


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
