"""The paged cache: K/V in fixed-size blocks of one preallocated pool, a block table per sequence.

A sequence's K/V live in whichever blocks its table lists, so sequences of any length share one
pool with at most one partly filled block each. Which blocks are free, shared or cached is the
block pool's business (batching/block_pool.py); this module holds the tensors and the attention.

PagedStep is one batched forward: which tokens, at which positions, written to which slots,
attending over which blocks. It is the KV object the model sees for that step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import paged_attention_kernel
from .base import KV, sdpa, softmax_with_sinks
from .kv_type import KVType, of_dtype

BLOCK_SIZE = 8  # tokens per block: the unfilled end of a last block is the waste (measured: 8 is as fast as 16)


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that hold n_tokens."""
    return -(-n_tokens // block_size)


class PagedKV:
    """K/V storage for n_blocks blocks of block_size tokens, per layer [n_blocks, block_size, kv_heads,
    head_dim] (token-major, so a gathered block table is a [tokens, kv_heads, head_dim] run)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str, kv_type: KVType | None = None):
        self.type = kv_type or of_dtype(dtype)  # how values are stored (kv_type.py); dtype: the activations'
        self.type.check_head_dim(head_dim)
        shape = (n_layers, n_blocks, block_size, n_kv_heads, self.type.row_width(head_dim))
        # empty, not zeros: on the CPU, pages never touched cost no memory
        self.k = torch.empty(shape, dtype=self.type.storage, device=device)
        self.v = torch.empty(shape, dtype=self.type.storage, device=device)
        self.n_blocks, self.block_size = n_blocks, block_size
        # Attention reads a block's unused slots (masked out) too, and 0 * NaN is NaN: each block
        # is zeroed on first use, since empty memory may hold anything.
        self._fresh = [True] * n_blocks
        self.first_use([0])  # the padding block of decode block tables

    def first_use(self, blocks: list[int]) -> None:
        """Blocks about to be written: zero those never used before."""
        for b in blocks:
            if self._fresh[b]:
                self.k[:, b].zero_()
                self.v[:, b].zero_()
                self._fresh[b] = False

    @property
    def block_bytes(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    @property
    def nbytes(self) -> int:
        return self.n_blocks * self.block_bytes


@dataclass
class Row:
    """One sequence's part of a step: `tokens` fed at positions start.., its block table, and
    for how many of its last tokens the logits are wanted (1: the next token's; all: echo)."""
    tokens: list[int]
    start: int
    blocks: list[int]
    n_logits: int = 1


@dataclass
class PagedStep(KV):
    """One batched forward over a pool: the tokens of all rows flattened into one [N] run, decode
    rows (one token) first so their attention is one batched call."""
    kv: PagedKV
    tokens: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N] where each token's K/V is written: block * block_size + offset
    n_decode: int
    decode_blocks: torch.Tensor | None  # [n_decode, max_blocks], padded with block 0
    decode_lens: torch.Tensor | None  # [n_decode] keys each decode row attends over
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (flat offset, T, start position, blocks)
    logit_rows: torch.Tensor  # [M] flat indices whose logits are wanted, in the rows' order and positions'
    _masks: dict = field(default_factory=dict)  # masks and gather buffers, made once per step

    @classmethod
    def build(cls, kv: PagedKV, rows: list[Row], device) -> "PagedStep":
        bs = kv.block_size
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
            width = max(blocks_for(r.start + 1, bs) for r in dec)
            dec_blocks = torch.tensor([r.blocks[:width] + [0] * (width - len(r.blocks[:width])) for r in dec],
                                      device=device)
            dec_lens = torch.tensor([r.start + 1 for r in dec], device=device)
        prefills = []
        for i in order[n_decode:]:
            r = rows[i]
            end = r.start + len(r.tokens)
            prefills.append((offsets[i], len(r.tokens), r.start, torch.tensor(r.blocks[:blocks_for(end, bs)], device=device)))
        logit_rows = [offsets[i] + j for i in range(len(rows))
                      for j in range(len(rows[i].tokens) - rows[i].n_logits, len(rows[i].tokens))]
        as_t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return cls(kv, as_t(tokens), as_t(positions), as_t(slots), n_decode, dec_blocks, dec_lens,
                   prefills, as_t(logit_rows))

    def begin(self, start, T, tree=None):
        if tree is not None:
            raise NotImplementedError("tree steps run on a contiguous cache")

    def attend(self, layer, q, k, v, window, scale, sinks=None):
        """q [1, H, N, D], k/v [1, KV, N, D]: the step's tokens, written to their slots first.

        Decode rows (one query each) run the Triton paged-attention kernel on CUDA, which reads the
        blocks in place; elsewhere they gather their block tables into [rows, keys, KV, D] and run
        as one masked bmm per KV head. Prefill chunks run one SDPA each over their gathered blocks.
        """
        q = q[0].transpose(0, 1).contiguous()  # [N, H, D]: batched bmm wants plain strides
        k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [N, KV, D]
        N, H, D = q.shape
        KV = k.shape[1]
        kc, vc = self.kv.k[layer], self.kv.v[layer]  # [blocks, block_size, KV, D as stored]
        kind = self.kv.type
        kc.view(-1, KV, kc.shape[-1]).index_copy_(0, self.slots, kind.encode(k))
        vc.view(-1, KV, vc.shape[-1]).index_copy_(0, self.slots, kind.encode(v))
        out = q.new_empty(N, H, D)
        nd, G = self.n_decode, H // KV
        if nd and q.is_cuda and paged_attention_kernel.available():
            paged_attention_kernel.paged_decode_attention(q[:nd], kc, vc, self.decode_blocks,
                                                          self.decode_lens, scale, window, out=out[:nd], sinks=sinks)
        elif nd:
            keys, values = (kind.decode(self.gather(c, second), q.dtype)  # [rows, keys, KV, D]
                            for c, second in ((kc, False), (vc, True)))
            mask = self.decode_mask(window, q.dtype)
            for h in range(KV):  # a strided [rows, keys, D] slice per KV head: no copy for bmm
                heads = slice(h * G, (h + 1) * G)
                scores = torch.baddbmm(mask, q[:nd, heads], keys[:, :, h].transpose(1, 2), alpha=scale)
                if sinks is None:
                    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
                else:
                    probs = softmax_with_sinks(scores.float(), sinks[heads].float()[:, None]).to(q.dtype)
                out[:nd, heads] = torch.bmm(probs, values[:, :, h])
        for i, (s, T, _, blocks) in enumerate(self.prefills):
            keys, values = (kind.decode(c.index_select(0, blocks), q.dtype).flatten(0, 1).transpose(0, 1)[None]
                            for c in (kc, vc))  # [1, KV, keys, D]
            y = sdpa(q[s:s + T].transpose(0, 1)[None], keys, values, self.prefill_mask(i, window), scale, sinks)
            out[s:s + T] = y[0].transpose(0, 1)
        return out[None]  # [1, N, H, D]

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
            L = self.decode_blocks.shape[1] * self.kv.block_size
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
            k = torch.arange(len(blocks) * self.kv.block_size, device=blocks.device)[None, :]
            ok = k <= q
            if window:
                ok &= k > q - window
            self._masks[key] = ok
        return self._masks[key]
