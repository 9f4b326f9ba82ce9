"""The batching engine's decode-only steps with fixed shapes, replayed as CUDA graphs.

A step in which every row is one decode token is the engine's common case. Eagerly it launches
the same ~400 small kernels as a batch-1 step whatever the batch, so on a fast GPU a small batch
is bound by launches, not by the weights. Captured once per shape as a CUDA graph it is one launch.

A graph replays fixed shapes and addresses, so the step's rows are padded: the batch to a power
of two (1, 2, 4, ... the engine's largest batch), each row's block table to a key bucket (256,
512, ... keys, as cuda_graph.key_bucket). One graph per (batch, keys) pair, captured on first use,
all sharing one memory pool. A padding row is token 0 at position 0 in a scratch block that the
pool never hands out: it writes only there and attends over that one slot.

The step's inputs (tokens, positions, slots, lengths, block tables) are one packed long tensor per
shape, refreshed by one host-to-device copy before each replay. With graphs off (the CPU, where
the tests check it) the same fixed shapes run eagerly.
"""
from __future__ import annotations

import numpy as np
import torch

from ..cuda_graph import capture, key_bucket
from ..kv.paged import PagedKV, PagedStep, Row


def batch_bucket(n: int) -> int:
    """Rows a fixed-shape step of n decode rows runs: the next power of two."""
    return 1 << (n - 1).bit_length()


class DecodeGraphs:
    """Runs decode-only steps (every row one token, its logits wanted) at fixed shapes; calling
    it with the rows returns their logits [rows, V], a view of a buffer the next call overwrites."""

    def __init__(self, model, kv: PagedKV, scratch_block: int, max_keys: int, graphs: bool):
        self.model, self.kv, self.scratch = model, kv, scratch_block
        self.max_keys, self.graphs_on = max_keys, graphs
        self.device = kv.k.device
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # per (batch, width): the packed inputs
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @staticmethod
    def takes(rows: list[Row]) -> bool:
        return all(len(r.tokens) == 1 and r.n_logits == 1 for r in rows)

    def __call__(self, rows: list[Row]) -> torch.Tensor:
        bs = self.kv.block_size
        B = batch_bucket(len(rows))
        width = key_bucket(max(r.start + 1 for r in rows), self.max_keys) // bs
        width = max(width, max(-(-(r.start + 1) // bs) for r in rows))  # max_keys not a multiple of bs
        tokens = np.zeros(B, np.int64)
        positions = np.zeros(B, np.int64)
        slots = np.full(B, self.scratch * bs, np.int64)
        lens = np.ones(B, np.int64)
        tables = np.full((B, width), self.scratch, np.int64)
        for i, r in enumerate(rows):
            p = r.start
            tokens[i], positions[i], lens[i] = r.tokens[0], p, p + 1
            slots[i] = r.blocks[p // bs] * bs + p % bs
            used = r.blocks[:-(-(p + 1) // bs)]
            tables[i, :len(used)] = used
        key = (B, width)
        inp = self.inputs.get(key)
        if inp is None:
            inp = self.inputs[key] = torch.zeros(4 * B + B * width, dtype=torch.long, device=self.device)
        inp.copy_(torch.from_numpy(np.concatenate([tokens, positions, slots, lens, tables.ravel()])))
        if not self.graphs_on:
            return self._step(inp, B, width)[:len(rows)]
        if key not in self.graphs:
            graph, out = capture(lambda: self._step(inp, B, width), self.pool)
            self.pool = graph.pool()
            self.graphs[key] = graph, out
        graph, out = self.graphs[key]
        graph.replay()
        return out[:len(rows)]

    def _step(self, inp: torch.Tensor, B: int, width: int) -> torch.Tensor:
        tokens, positions, slots, lens = (inp[i * B:(i + 1) * B] for i in range(4))
        tables = inp[4 * B:].view(B, width)
        step = PagedStep(self.kv, tokens, positions, slots, B, tables, lens, [], None)
        return self.model(tokens[None], positions, step)[0]  # [B, V]: every row's logits
