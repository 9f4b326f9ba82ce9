"""Paged KV cache: fixed-size blocks from one preallocated pool, a block table per sequence.

A sequence's K/V live in whichever blocks its table lists, so sequences of any length share one
pool with at most one partly filled block each, and a finished sequence's blocks go straight
back to the pool.

Prefix sharing: a full block is named by a hash of its tokens and of every token before it
(a hash chain), so sequences that begin with the same tokens (a shared system prompt) can point
at the same blocks; blocks are refcounted. Shared blocks are always full and never written
again (a sequence writes only past its shared prefix), so no copy-on-write is needed. A block
whose last user has finished keeps its contents and name until the space is needed (least
recently used first): a prompt prefix that comes back later is found again.

PagedStep describes one batched model call: which tokens, at which positions, written to which
slots, attending over which blocks. The model's paged attention (model.py) reads it.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK_SIZE = 8  # tokens per block: the unfilled end of a last block is the waste (measured: 8 is as fast as 16)


def block_hash(parent: bytes | None, tokens) -> bytes:
    """The name of a full block: its tokens and (through the parent's name) all before them."""
    return hashlib.blake2b((parent or b"") + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockPool:
    """K/V storage for n_blocks blocks of block_size tokens, per layer [n_blocks, block_size, kv_heads,
    head_dim] (token-major, so a gathered block table is a [tokens, kv_heads, head_dim] run)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str):
        shape = (n_layers, n_blocks, block_size, n_kv_heads, head_dim)
        # empty, not zeros: on the CPU, pages never touched cost no memory
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.n_blocks, self.block_size = n_blocks, block_size
        self.refs = [0] * n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # a stack: low ids (touched pages) reused first
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced blocks with a name, LRU first
        self._name: dict[int, bytes] = {}  # block -> hash
        self._block: dict[bytes, int] = {}  # hash -> block
        self._ready: set[int] = set()  # named blocks whose K/V are computed
        # Attention reads a block's unused slots (masked out) too, and 0 * NaN is NaN: each block
        # is zeroed on first use, since empty memory may hold anything.
        self._fresh = [True] * n_blocks
        self._zero(0)  # the padding block of decode block tables

    # ---------------------------------------------------------------- accounting
    @property
    def n_free(self) -> int:
        """Blocks that can be handed out: never used, or holding only a reusable prefix."""
        return len(self._free) + len(self._cached)

    @property
    def n_used(self) -> int:
        return self.n_blocks - self.n_free

    @property
    def block_bytes(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    @property
    def nbytes(self) -> int:
        return self.n_blocks * self.block_bytes

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    # ---------------------------------------------------------------- allocation
    def allocate(self, n: int) -> list[int]:
        if n > self.n_free:
            raise RuntimeError(f"KV pool exhausted: {n} blocks wanted, {self.n_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # reuse the least recently used cached prefix block
                b, _ = self._cached.popitem(last=False)
                self._forget(b)
            self.refs[b] = 1
            if self._fresh[b]:
                self._zero(b)
            out.append(b)
        return out

    def _zero(self, b: int) -> None:
        self.k[:, b].zero_()
        self.v[:, b].zero_()
        self._fresh[b] = False

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unreferenced ones return to the pool."""
        for b in blocks:
            self.refs[b] -= 1
            assert self.refs[b] >= 0, f"block {b} released twice"
            if self.refs[b] == 0:
                if b in self._ready:
                    self._cached[b] = None  # keeps its prefix until the space is needed
                else:
                    self._forget(b)
                    self._free.append(b)

    def _forget(self, b: int) -> None:
        name = self._name.pop(b, None)
        if name is not None:
            del self._block[name]
        self._ready.discard(b)

    # ---------------------------------------------------------------- prefix sharing
    def lookup(self, names: list[bytes]) -> tuple[list[int], bool]:
        """The blocks holding the longest run of these named blocks, and whether one of them is
        still being computed (the caller should wait for it rather than compute it again)."""
        found = []
        for name in names:
            b = self._block.get(name)
            if b is None:
                break
            if b not in self._ready:
                return found, True
            found.append(b)
        return found, False

    def share(self, blocks: list[int]) -> None:
        """Take a reference to blocks found by lookup()."""
        for b in blocks:
            if self.refs[b] == 0:
                del self._cached[b]
            self.refs[b] += 1

    def name(self, block: int, name: bytes, ready: bool) -> None:
        """Publish a full block under its hash (unless another block already holds that prefix)."""
        if name in self._block or block in self._name:
            return
        self._name[block], self._block[name] = name, block
        if ready:
            self._ready.add(block)

    def mark_ready(self, block: int) -> None:
        if block in self._name:
            self._ready.add(block)

    def check(self) -> None:
        """Invariants, for tests: every block is referenced, free or cached, exactly once."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free) and not free & cached
        for b in range(self.n_blocks):
            assert (self.refs[b] > 0) + (b in free) + (b in cached) == 1, f"block {b} lost"
        assert all(b in self._name for b in self._ready)
        assert all(self._block[n] == b for b, n in self._name.items())


@dataclass
class Row:
    """One sequence's part of a step: `tokens` fed at positions start.., its block table."""
    tokens: list[int]
    start: int
    blocks: list[int]
    want_logits: bool = True


@dataclass
class PagedStep:
    """One batched forward over a pool: the tokens of all rows flattened into one [N] run, decode
    rows (one token) first so their attention is one batched call."""
    pool: BlockPool
    tokens: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N] where each token's K/V is written: block * block_size + offset
    n_decode: int
    decode_blocks: torch.Tensor | None  # [n_decode, max_blocks], padded with block 0
    decode_lens: torch.Tensor | None  # [n_decode] keys each decode row attends over
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (flat offset, T, start position, blocks)
    logit_rows: torch.Tensor  # [M] flat indices whose logits are wanted, in the rows' order
    _masks: dict = field(default_factory=dict)  # masks and gather buffers, made once per step

    @classmethod
    def build(cls, pool: BlockPool, rows: list[Row], device) -> "PagedStep":
        bs = pool.block_size
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].tokens) != 1)  # decode rows first
        tokens, positions, slots, offsets = [], [], [], {}
        for i in order:
            r = rows[i]
            offsets[i] = len(tokens)
            tokens += r.tokens
            for p in range(r.start, r.start + len(r.tokens)):
                positions.append(p)
                slots.append(r.blocks[p // bs] * bs + p % bs)
        n_decode = sum(1 for r in rows if len(r.tokens) == 1)
        dec_blocks = dec_lens = None
        if n_decode:
            dec = [rows[i] for i in order[:n_decode]]
            width = max(pool.blocks_for(r.start + 1) for r in dec)
            dec_blocks = torch.tensor([r.blocks[:width] + [0] * (width - len(r.blocks[:width])) for r in dec],
                                      device=device)
            dec_lens = torch.tensor([r.start + 1 for r in dec], device=device)
        prefills = []
        for i in order[n_decode:]:
            r = rows[i]
            end = r.start + len(r.tokens)
            prefills.append((offsets[i], len(r.tokens), r.start,
                             torch.tensor(r.blocks[:pool.blocks_for(end)], device=device)))
        logit_rows = [offsets[i] + len(rows[i].tokens) - 1 for i in range(len(rows)) if rows[i].want_logits]
        as_t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return cls(pool, as_t(tokens), as_t(positions), as_t(slots), n_decode, dec_blocks, dec_lens,
                   prefills, as_t(logit_rows))

    def gather(self, cache: torch.Tensor, second: bool = False) -> torch.Tensor:
        """The decode rows' blocks of one layer's K (or V, second=True) as [rows, keys, KV, D].

        index_select into a buffer reused by every layer of the step: a fresh multi-MB tensor
        per layer costs page faults, and advanced indexing is ~4x slower on the CPU."""
        nd, width = self.decode_blocks.shape
        key = ("buf", second)
        if key not in self._masks:
            self._masks[key] = cache.new_empty((nd * width,) + cache.shape[1:])
        out = torch.index_select(cache, 0, self.decode_blocks.view(-1), out=self._masks[key])
        return out.view(nd, width * cache.shape[1], *cache.shape[2:])

    def decode_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive [n_decode, 1, keys] mask: 0 where a decode row may look, -inf elsewhere."""
        key = ("decode", window, dtype)
        if key not in self._masks:
            L = self.decode_blocks.shape[1] * self.pool.block_size
            k = torch.arange(L, device=self.decode_lens.device)[None, :]
            ok = k < self.decode_lens[:, None]
            if window:
                ok &= k >= self.decode_lens[:, None] - window
            self._masks[key] = torch.zeros(ok.shape, dtype=dtype, device=ok.device) \
                .masked_fill_(~ok, float("-inf"))[:, None, :]
        return self._masks[key]

    def prefill_mask(self, i: int, window: int | None) -> torch.Tensor:
        """Boolean [T, keys] causal (and sliding-window) mask for prefill row i."""
        key = ("prefill", i, window)
        if key not in self._masks:
            _, T, start, blocks = self.prefills[i]
            q = torch.arange(start, start + T, device=blocks.device)[:, None]
            k = torch.arange(len(blocks) * self.pool.block_size, device=blocks.device)[None, :]
            ok = k <= q
            if window:
                ok &= k > q - window
            self._masks[key] = ok
        return self._masks[key]
