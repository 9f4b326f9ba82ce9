"""The interface every KV implementation offers, and the masks they share."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


class KV:
    """begin() once per forward, then attend() for each layer."""

    def begin(self, start: int | torch.Tensor, T: int, tree: torch.Tensor | None = None) -> None:
        """A step of T tokens: at positions start.. (int), or at the positions of a tensor [T];
        `tree` [T, T] bool (with an int start): token i sees new token j iff tree[i, j]."""
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
               scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store this step's k/v for `layer` and attend. q [B, H, T, D], k/v [B, KV, T, D], rotated;
        window: a sliding window's length (None: full attention); sinks: None, or [H] logits on q's
        device (gpt-oss): each head's softmax also spans its sink, a key whose value is zero, so
        the real keys' weights sum to less than 1. Returns [B, T, H, D]."""
        raise NotImplementedError


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The softmax over each row of scores and its sink (sinks broadcasts to scores[..., :1], same
    dtype), the sink's column dropped: its value is zero."""
    full = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], -1)
    return torch.softmax(full, dim=-1)[..., :-1]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
         sinks: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """SDPA (grouped-query when k has fewer heads than q), q [B, H, T, D], k/v [B, KV, S, D];
    mask: None, or bool / additive broadcasting to [B, H, T, S]. With sinks [H]: one more key and
    value, both zero, whose column of an additive mask holds the head's sink logit, so exp(sink)
    joins each row's denominator and nothing its output."""
    gqa = k.shape[1] != q.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)
    B, H, T, D = q.shape
    S = k.shape[2]
    if is_causal:  # SDPA's is_causal: top-left aligned
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    if mask is None:
        bias = q.new_zeros(1, 1, T, S)
    elif mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    else:
        bias = mask.to(q.dtype)
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    lead = (bias.shape[0], H)
    bias = torch.cat([bias.expand(*lead, T, S), sinks.to(q.dtype).view(1, H, 1, 1).expand(*lead, T, 1)], -1)
    zero = k.new_zeros(B, k.shape[1], 1, D)
    return F.scaled_dot_product_attention(q, torch.cat([k, zero], 2), torch.cat([v, zero], 2), attn_mask=bias,
                                          scale=scale, enable_gqa=gqa)


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
