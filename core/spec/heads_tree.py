"""The draft heads' static tree (Medusa's sparse trees): a node is a path of ranks (r0, r1, ...),
meaning head 0's r0-th choice, then head 1's r1-th choice, ...; it is kept when the target's own
token agrees at every step of the path. Nodes are added greedily in order of their estimated
acceptance probability, the product of the per-head top-r accuracies measured on held-out text,
so any prefix of the stored node list is the best tree of that size under that estimate.
"""
from __future__ import annotations

import heapq


def build_tree(accuracy: list[list[float]], budget: int) -> tuple[list[tuple[int, ...]], list[float]]:
    """Medusa's greedy sparse tree: up to `budget` nodes, each a path of ranks (r0, r1, ...), added
    in decreasing order of estimated acceptance, the product of accuracy[d][r_d] along the path
    (accuracy[k][r]: how often head k's r-th choice is the model's token). A node is only a
    candidate once its parent and its next-better sibling are in, so every prefix of the returned
    list is a valid tree (parents before children). Returns (nodes, their estimated probabilities)."""
    depth, ranks = len(accuracy), len(accuracy[0]) if accuracy else 0
    nodes, probs = [], []
    # entries: (-probability, path, the parent's probability); ties go to the smaller path
    heap = [(-accuracy[0][0], (0,), 1.0)] if depth and ranks else []
    while heap and len(nodes) < budget:
        neg, path, parent_p = heapq.heappop(heap)
        nodes.append(path)
        probs.append(-neg)
        d = len(path) - 1
        if path[-1] + 1 < ranks:  # the next sibling
            heapq.heappush(heap, (-parent_p * accuracy[d][path[-1] + 1], path[:-1] + (path[-1] + 1,), parent_p))
        if d + 1 < depth:  # the first child
            heapq.heappush(heap, (neg * accuracy[d + 1][0], path + (0,), -neg))
    return nodes, probs


def tree_parents(nodes: list[tuple[int, ...]]) -> list[int]:
    """parents[i]: the index of node i's parent in `nodes`, -1 for the root (the pending token)."""
    index = {p: i for i, p in enumerate(nodes)}
    return [index[p[:-1]] if len(p) > 1 else -1 for p in nodes]


def expected_length(probs: list[float]) -> float:
    """Tokens per verifying pass the estimate predicts: the target's own token plus each node's
    chance to be on the accepted path (nodes of one depth exclude each other)."""
    return 1.0 + sum(probs)
