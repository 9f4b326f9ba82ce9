"""Where a layer's keys and values live, and how its attention runs over them.

The model computes q, k, v for a step's tokens and hands them to a KV object, which stores k/v
and returns the attention output; the model never knows which kind it has. A step is announced
once with `begin(start, T, tree)` (positions, masks), then `attend` runs per layer:

- ContiguousKV: one preallocated [batch, kv_heads, max_len, head_dim] run per layer; batch-1
  generation and speculative verification (the CPU fast path). FixedKeys (decode steps) and
  FixedTree (verifying steps) wrap it for steps of fixed shapes (CUDA graphs).
- PagedKV / PagedStep: blocks of a shared pool, a block table per sequence; continuous batching
  and prefix sharing.
- NoKV: stores nothing; calibration runs whole sequences once.

A tree of candidate tokens (tree speculation) is one step: its T tokens take the T slots after
`start`, each at position start + its depth, and `tree` [T, T] says which earlier ones each may
see (its ancestors and itself). Without a tree the tokens are a causal run.
"""
from .base import KV, attention_masks, tree_positions
from .contiguous import ContiguousKV, FixedKeys, FixedTree
from .none import NoKV
from .paged import PagedKV, PagedStep, Row

__all__ = ["KV", "ContiguousKV", "FixedKeys", "FixedTree", "NoKV", "PagedKV", "PagedStep", "Row", "attention_masks",
           "tree_positions"]
