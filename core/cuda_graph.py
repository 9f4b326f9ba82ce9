"""Batch-1 decode on CUDA as one graph replay per token.

An eager decode step of a 32-layer model launches ~400 small kernels; on a fast GPU the launches,
not the weights, then set the pace. Captured once in a CUDA graph, the step is one launch. A graph
replays fixed shapes and addresses, so the step is written with fixed shapes: the token and its
position live in device tensors, K/V are written at that position by index, and attention runs
over a fixed number of cache slots, masked past the position. That number is a bucket (256, 512,
1024, ... up to the cache's length), one graph each, captured on first use: a step reads the K/V of
at most twice the slots that hold tokens.
"""
from __future__ import annotations

import os

import torch

from .kv import FixedKeys

FIRST_BUCKET = 256


def decode_step(model, cache):
    """A function (token, pos) -> logits [V] that runs one decode step on `cache` (a ContiguousKV):
    graph replays on CUDA (unless BRISK_CUDA_GRAPHS=0), the eager model elsewhere."""
    device = cache.k[0].device
    if device.type == "cuda" and os.environ.get("BRISK_CUDA_GRAPHS", "1") != "0":
        return GraphedDecoder(model, cache)

    def eager(token: int, pos: int) -> torch.Tensor:
        return model(torch.tensor([[token]], device=device), pos, cache)[0, -1]
    return eager


class GraphedDecoder:
    """Runs model(token at position pos) on `cache` by graph replay; the result is the logits [V]
    in a buffer that the next call overwrites (read it, or copy it, before calling again)."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        device = cache.k[0].device
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # one memory pool shared by all buckets' graphs

    def bucket(self, pos: int) -> int:
        keys = FIRST_BUCKET
        while keys <= pos:
            keys *= 2
        return min(keys, self.cache.max_len)

    def __call__(self, token: int, pos: int) -> torch.Tensor:
        keys = self.bucket(pos)
        self.token.fill_(token)
        self.pos.fill_(pos)
        graph, logits = self.graphs.get(keys) or self._capture(keys)
        graph.replay()
        return logits

    def _step(self, keys: int) -> torch.Tensor:
        return self.model(self.token, self.pos, FixedKeys(self.cache, keys))[0, -1]

    def _capture(self, keys: int):
        # Warm up on a side stream first (as torch's docs ask): lazy init, Triton compiles and
        # cuBLAS workspaces must happen outside the capture. The warm-up writes K/V at self.pos,
        # which the replay then writes again with the same values.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(keys)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._step(keys)
        self.pool = graph.pool()
        self.graphs[keys] = graph, logits
        return graph, logits
