"""The block pool's bookkeeping: which blocks are free, which are in use, which hold a prefix.

Prefix sharing: a full block is named by a hash of its tokens and of every token before it
(a hash chain), so sequences that begin with the same tokens (a shared system prompt) can point
at the same blocks; blocks are refcounted. Shared blocks are always full and never written
again (a sequence writes only past its shared prefix), so no copy-on-write is needed. A block
whose last user has finished keeps its contents and name until the space is needed (least
recently used first): a prompt prefix that comes back later is found again.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from ..kv.paged import blocks_for


def block_hash(parent: bytes | None, tokens) -> bytes:
    """The name of a full block: its tokens and (through the parent's name) all before them."""
    return hashlib.blake2b((parent or b"") + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockPool:
    """Which of n_blocks blocks are in use (refcounted), free, or cached with a prefix's name.
    Metadata only: the K/V tensors are the paged KV's (kv/paged.py)."""

    def __init__(self, n_blocks: int, block_size: int):
        self.n_blocks, self.block_size = n_blocks, block_size
        self.refs = [0] * n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # a stack: low ids (touched pages) reused first
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced blocks with a name, LRU first
        self._name: dict[int, bytes] = {}  # block -> hash
        self._block: dict[bytes, int] = {}  # hash -> block
        self._ready: set[int] = set()  # named blocks whose K/V are computed

    # ---------------------------------------------------------------- accounting
    @property
    def n_free(self) -> int:
        """Blocks that can be handed out: never used, or holding only a reusable prefix."""
        return len(self._free) + len(self._cached)

    @property
    def n_used(self) -> int:
        return self.n_blocks - self.n_free

    def blocks_for(self, n_tokens: int) -> int:
        return blocks_for(n_tokens, self.block_size)

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
            out.append(b)
        return out

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
