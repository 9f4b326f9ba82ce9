"""The KV cache behind a small interface: allocate, write, view, roll back.

Speculative decoding rolls the cache back after rejected draft tokens; a paged, batched cache
can later replace this one as long as it offers the same four operations.
"""
from __future__ import annotations

import torch


class KVCache:
    """Preallocated per-layer K/V tensors of shape [batch, kv_heads, max_len, head_dim]."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str, batch: int = 1):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len
        # each sequence's cache as one block of a paged pool (the CUDA decode-attention kernel)
        self.block_table = torch.arange(batch, dtype=torch.int32, device=device)[:, None]
        self.length = 0  # tokens whose K/V are valid, the same for every layer

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store K/V for positions start..start+T and return views of positions 0..start+T."""
        end = start + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def write_at(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """write() with the positions as a tensor [T] and a fixed number of keys returned (0..keys),
        so the shapes do not depend on the position: what a captured CUDA graph needs."""
        self.k[layer].index_copy_(2, positions, k)
        self.v[layer].index_copy_(2, positions, v)
        return self.k[layer][:, :, :keys], self.v[layer][:, :, :keys]

    def truncate(self, length: int) -> None:
        """Forget everything from `length` on (rejected draft tokens, a rewritten chat turn)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
