"""Verification: which drafts the target keeps, and its own next token after them.

Greedy: a draft is kept when it is the target's argmax, so the output is plain greedy decoding's.
Sampling: standard speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023):
keep d with probability min(1, p(d)/q(d)), else sample from max(0, p - q) renormalized. The
output is then distributed exactly as the target's. p and q are both `probabilities()` of their
logits (temperature, top-k/p, min-p, repetition penalty applied alike); the n-gram drafter's q is
a point mass on its guess. verify checks a chain, verify_tree a tree of point-mass candidates.
"""
from __future__ import annotations

import torch

from ..sampling import SamplingParams, Seen, apply_penalties, draw, extend_seen, probabilities


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
        return i, draw(residual, gen)
    return k, draw(p[k], gen)


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
                return path, draw(residual, gen)
        path.append(nxt)
        node = nxt
