"""The interface every KV implementation offers, and the masks they share."""
from __future__ import annotations

import numpy as np
import torch


class KV:
    """begin() once per forward, then attend() for each layer."""

    def begin(self, start: int | torch.Tensor, T: int, tree: torch.Tensor | None = None) -> None:
        """A step of T tokens: at positions start.. (int), or at the positions of a tensor [T];
        `tree` [T, T] bool (with an int start): token i sees new token j iff tree[i, j]."""
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
               scale: float) -> torch.Tensor:
        """Store this step's k/v for `layer` and attend. q [B, H, T, D], k/v [B, KV, T, D], rotated;
        window: a sliding window's length (None: full attention). Returns [B, T, H, D]."""
        raise NotImplementedError


def tree_positions(start: int, tree: torch.Tensor) -> torch.Tensor:
    """Each tree token's position: start plus its depth (its ancestors, itself excluded)."""
    return start + tree.sum(-1) - 1


def ancestor_mask(parents: list[int], device=None) -> torch.Tensor:
    """The [T, T] mask of a tree step over [pending token] + draft nodes (T = 1 + len(parents)):
    mask[i, j] iff node j is node i or one of its ancestors; node 0 is the pending token and
    draft node i (parent parents[i], -1 the pending token) is node i + 1."""
    T = len(parents) + 1
    m = np.zeros((T, T), dtype=bool)
    m[0, 0] = True
    for i, parent in enumerate(parents, start=1):
        if not -1 <= parent < i - 1:
            raise ValueError(f"node {i - 1}'s parent {parent} does not come before it")
        m[i] = m[parent + 1]
        m[i, i] = True
    return torch.from_numpy(m).to(device)


def attention_masks(q_pos: torch.Tensor, keys: int, window: int | None,
                    tree: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean [T, keys] masks (full, sliding) for queries at q_pos over slots 0..keys-1, slot i
    holding position i; with a tree, its tokens hold the last T slots and see only their ancestors.
    (Ancestors have lower positions, so the position rule keeps them; the tree drops the rest.)"""
    k_pos = torch.arange(keys, device=q_pos.device)
    if tree is not None:
        k_pos = torch.cat([k_pos[:keys - len(q_pos)], q_pos])
    q, k = q_pos[:, None], k_pos[None, :]
    full = k <= q
    if tree is not None:
        full[:, keys - len(q_pos):] &= tree
    sliding = full & (k > q - window) if window else full
    return full, sliding
