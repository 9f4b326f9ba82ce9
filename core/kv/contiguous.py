"""The contiguous cache: per layer one preallocated [batch, kv_heads, max_len, head_dim] run.

Slot i holds position i (a tree step puts its tokens in the slots after its start). Nothing
records how many slots are valid: a step attends only up to its own positions, so after
rejected drafts or a rewritten chat turn the caller simply writes the next step over them.
"""
from __future__ import annotations

import math
import mmap

import torch

from .. import paged_attention_kernel
from .base import KV, attention_masks, sdpa, softmax_with_sinks, tree_positions


def decode_attention(q, k, v, scale, mask=None, sinks=None):
    """One query token against the cache, grouped-query heads folded into the batch of a bmm.
    mask: None, or bool [1, keys]; sinks: None, or [H]. On the CPU this is about 3x cheaper than
    SDPA for one query."""
    B, H, _, D = q.shape
    KV = k.shape[1]
    qg = q.reshape(B * KV, H // KV, D)  # the query heads that share one KV head
    scores = torch.bmm(qg, k.reshape(B * KV, -1, D).transpose(1, 2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # batch row b * KV + g holds heads g*G..(g+1)*G-1
        probs = softmax_with_sinks(scores, sinks.float().view(1, KV, -1).expand(B, -1, -1).reshape(B * KV, -1, 1))
    y = torch.bmm(probs.to(v.dtype), v.reshape(B * KV, -1, D))
    return y.view(B, 1, H, D)


def _zeros(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros; on the CPU in fresh private anonymous memory, which the OS zeroes page by page
    as it is first written: a cache for the whole context costs nothing at start (torch.zeros
    writes every slot before the first token) and its memory grows with the text."""
    n = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or not n or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: a fork does not share it
    return torch.frombuffer(pages, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


class ContiguousKV(KV):
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str, batch: int = 1):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = [_zeros(shape, dtype, device) for _ in range(n_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(n_layers)]
        self.max_len = max_len
        # each sequence's cache as one block of a paged pool (the CUDA decode-attention kernel)
        self.block_table = torch.arange(batch, dtype=torch.int32, device=device)[:, None]

    @classmethod
    def for_model(cls, model, max_len: int, batch: int = 1) -> "ContiguousKV":
        """A cache for a Transformer, in its activations' dtype and on its device."""
        cfg, w = model.cfg, model.model.norm.weight
        return cls(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_len, w.dtype, w.device, batch)

    def begin(self, start, T, tree=None, keys=None):
        """keys (with a tensor start): attend over a fixed number of slots, masked past each
        token's position, so the shapes do not depend on the position (FixedKeys)."""
        fixed = torch.is_tensor(start)
        self.start, self.T, self.tree, self.keys = start, T, tree, keys if fixed else start + T
        if self.keys > self.max_len:
            raise ValueError(f"sequence of {self.keys} tokens exceeds the cache ({self.max_len})")
        self._masks = {}

    def _mask(self, window: int | None, device) -> torch.Tensor | None:
        """The step's mask for a layer with this window (made once per step and window), or None:
        one query of a causal run sees every slot up to its own (with a window: the last ones,
        sliced), and a prompt from position 0 on a GPU is plain causal (SDPA's flash kernel)."""
        fixed, plain = torch.is_tensor(self.start), self.tree is None
        if plain and not fixed and (self.T == 1 or (self.start == 0 and device.type == "cuda"
                                                    and (window is None or self.T <= window))):
            return None
        if window not in self._masks:
            if fixed:
                pos = self.start
            elif plain:
                pos = torch.arange(self.start, self.start + self.T, device=device)
            else:
                pos = tree_positions(self.start, self.tree)
            self._masks[window] = attention_masks(pos, self.keys, window, self.tree)[window is not None]
        return self._masks[window]

    def attend(self, layer, q, k, v, window, scale, sinks=None):
        B, H, T, D = q.shape
        kc, vc = self.k[layer], self.v[layer]
        fixed = torch.is_tensor(self.start)
        if fixed:
            kc.index_copy_(2, self.start, k)
            vc.index_copy_(2, self.start, v)
        else:
            kc[:, :, self.start:self.keys] = k
            vc[:, :, self.start:self.keys] = v
        if T == 1 and fixed and q.is_cuda and paged_attention_kernel.available():
            return self._paged_kernel(layer, q, window, scale, sinks)
        keys, values = kc[:, :, :self.keys], vc[:, :, :self.keys]
        mask = self._mask(window, q.device)
        if mask is None and window and self.keys > window and T == 1:  # one query: its window is the last keys
            keys, values = keys[:, :, -window:], values[:, :, -window:]
        # one query with sinks: the bmm's extra score column, not SDPA's copy of the cache plus a key
        if T == 1 and (mask is not None or q.device.type == "cpu" or sinks is not None):
            return decode_attention(q, keys, values, scale, mask, sinks)
        return sdpa(q, keys, values, mask, scale, sinks, is_causal=mask is None and T > 1).transpose(1, 2)

    def _paged_kernel(self, layer, q, window, scale, sinks=None):
        """One query per sequence through the paged-attention kernel, each sequence's cache one
        block of max_len slots read up to its position: no mask, no reading past it."""
        B = q.shape[0]
        kc = self.k[layer].transpose(1, 2)  # [B, max_len, KV, D]: a view, no copy
        vc = self.v[layer].transpose(1, 2)
        pos = self.start.expand(B) if self.start.numel() == 1 else self.start
        y = paged_attention_kernel.paged_decode_attention(q[:, :, 0], kc, vc, self.block_table, pos, scale,
                                                          window, lengths_add=1, sinks=sinks)
        return y[:, None]  # [B, 1, H, D]

    def keep_path(self, start: int, slots: list[int]) -> None:
        """After a tree step from `start`: move the K/V of the accepted nodes (their slots, in
        path order) to slots start+1, start+2, ..., where decoding those tokens one by one would
        have put them (the pending token's are at `start` already). A node at depth d was run at
        position start + d, so its K/V are already those of that slot: a copy, no recompute.
        Slots past the path keep stale values, as after rejected chain drafts: the next step
        writes over them before reading."""
        n = len(slots)
        if slots == list(range(start + 1, start + 1 + n)):
            return  # the path is the tree's first branch, already in place
        idx = torch.tensor(slots, device=self.k[0].device)
        for t in self.k + self.v:  # index_select copies before the slice is written
            t[:, :, start + 1:start + 1 + n] = t.index_select(2, idx)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class FixedKeys(KV):
    """A ContiguousKV seen by a step of fixed shapes (a captured CUDA graph): positions come as a
    tensor, and attention spans `keys` slots whatever the position."""

    def __init__(self, kv: ContiguousKV, keys: int):
        self.kv, self.keys = kv, keys

    def begin(self, start, T, tree=None):
        self.kv.begin(start, T, None, keys=self.keys)

    def attend(self, layer, q, k, v, window, scale, sinks=None):
        return self.kv.attend(layer, q, k, v, window, scale, sinks)


class FixedTree(KV):
    """A ContiguousKV seen by a verifying step of fixed shapes (a captured CUDA graph): T tokens
    written to slots slot0.., at positions `pos` [T], token i seeing every slot before slot0 (within
    a sliding window of its position) and the step's token j iff tree[i, j]; attention spans `keys`
    slots whatever slot0 is. slot0 [1], pos [T] and tree [T, T] are tensors the caller refills."""

    def __init__(self, kv: ContiguousKV, keys: int, slot0: torch.Tensor, pos: torch.Tensor, tree: torch.Tensor):
        self.kv, self.keys, self.slot0, self.pos, self.tree = kv, keys, slot0, pos, tree

    def begin(self, start, T, tree=None):
        # Made once per step from the tensors alone (no host values), so a graph replays it.
        dev, n = self.pos.device, self.pos.shape[0]
        slot = torch.arange(self.keys, device=dev)
        rel = slot - self.slot0  # a key's index in the step, negative before it
        inside = (rel >= 0) & (rel < n)
        idx = rel.clamp(0, n - 1)
        self.slots = self.slot0 + torch.arange(n, device=dev)
        self.k_pos = torch.where(inside, self.pos[idx], slot)
        self.full = torch.where(inside[None, :], self.tree[:, idx], (rel < 0)[None, :])
        self._masks = {}

    def _mask(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.full
        if window not in self._masks:
            self._masks[window] = self.full & (self.k_pos[None, :] > self.pos[:, None] - window)
        return self._masks[window]

    def attend(self, layer, q, k, v, window, scale, sinks=None):
        kc, vc = self.kv.k[layer], self.kv.v[layer]
        kc.index_copy_(2, self.slots, k)
        vc.index_copy_(2, self.slots, v)
        return sdpa(q, kc[:, :, :self.keys], vc[:, :, :self.keys], self._mask(window), scale, sinks).transpose(1, 2)
