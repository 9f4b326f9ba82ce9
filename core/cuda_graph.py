"""Batch-1 decode on CUDA as one graph replay per token, and speculative verifying passes as one
graph replay per round.

An eager decode step of a 32-layer model launches ~400 small kernels; on a fast GPU the launches,
not the weights, then set the pace. Captured once in a CUDA graph, the step is one launch. A graph
replays fixed shapes and addresses, so the step is written with fixed shapes: the token and its
position live in device tensors, K/V are written at that position by index, and attention runs
over a fixed number of cache slots, masked past the position. That number is a bucket (256, 512,
1024, ... up to the cache's length), one graph each, captured on first use: a step reads the K/V of
at most twice the slots that hold tokens.

A verifying pass (the pending token and a round's drafts, a chain or a tree) is the same on more
tokens: its T is padded to a power of two (the padding tokens see only themselves and write slots
nobody reads before they are overwritten), its tree mask and positions are inputs, and the masks
over the slots are computed inside the graph (kv.FixedTree).
"""
from __future__ import annotations

import numpy as np
import torch

from .kv import FixedKeys, FixedTree
from .kv.base import ancestor_mask
from ..quant import settings

FIRST_BUCKET = 256


def graphs_enabled(device, model=None) -> bool:
    """Whether steps on `device` (of `model`) replay as CUDA graphs. A model with mixture-of-experts
    layers runs eagerly: its routing reads the chosen experts back to the host, which a capture
    cannot hold; so does a tensor-parallel shard, whose passes start by sending their step to the
    other ranks (graph_safe False)."""
    if torch.device(device).type != "cuda" or not settings.CUDA_GRAPHS.get() or not getattr(model, "graph_safe", True):
        return False
    cfg = getattr(model, "cfg", None)
    return cfg is None or not any(cfg.is_moe_layer(i) for i in range(cfg.n_layers))


def key_bucket(end: int, max_len: int) -> int:
    """The slots a fixed-shape step attends over to see `end` slots: 256, 512, ..., max_len."""
    keys = FIRST_BUCKET
    while keys < end:
        keys *= 2
    return min(keys, max_len)


def capture(fn, pool=None):
    """fn's work as a CUDA graph: (graph, fn's output, which each replay rewrites)."""
    # Warm up on a side stream first (as torch's docs ask): lazy init, Triton compiles and cuBLAS
    # workspaces must happen outside the capture. The warm-up runs the step on the current inputs,
    # which the replay then runs again, writing the same K/V.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def decode_step(model, cache):
    """A function (token, pos) -> logits [V] that runs one decode step on `cache` (a ContiguousKV):
    graph replays on CUDA (unless BRISK_CUDA_GRAPHS=0), the eager model elsewhere."""
    device = cache.k[0].device
    if graphs_enabled(device, model):
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

    def __call__(self, token: int, pos: int) -> torch.Tensor:
        keys = key_bucket(pos + 1, self.cache.max_len)
        self.token.fill_(token)
        self.pos.fill_(pos)
        graph, logits = self.graphs.get(keys) or self._capture(keys)
        graph.replay()
        return logits

    def _step(self, keys: int) -> torch.Tensor:
        return self.model(self.token, self.pos, FixedKeys(self.cache, keys))[0, -1]

    def _capture(self, keys: int):
        graph, logits = capture(lambda: self._step(keys), self.pool)
        self.pool = graph.pool()
        self.graphs[keys] = graph, logits
        return graph, logits


def verify_pass(model, cache, fixed: bool | None = None):
    """A function (tokens, start, parents, hidden) -> (logits [T, V], final-norm hidden [T, dim]
    or None) that runs a verifying pass over tokens (the pending token, then the drafts: a chain,
    or a tree with parents as Draft.parents) at start on `cache`. On CUDA (unless
    BRISK_CUDA_GRAPHS=0) a graph replay per pass; fixed=True runs those fixed shapes eagerly
    (how the CPU tests check them)."""
    device = cache.k[0].device
    if fixed is None:
        fixed = graphs_enabled(device, model)
    if fixed:
        return FixedVerifier(model, cache, graphs=graphs_enabled(device, model))

    def eager(tokens: list[int], start: int, parents: list[int] | None, hidden: bool):
        tree = ancestor_mask(parents, device) if parents is not None else None
        out = model(torch.tensor([tokens], device=device), start, cache, tree=tree, return_hidden=hidden)
        return (out[0][0], out[1][0]) if hidden else (out[0], None)
    return eager


class FixedVerifier:
    """verify_pass's fixed shapes: T padded to a power of two, a graph per (T, key bucket,
    hidden). The outputs are views of buffers that the next call overwrites."""

    def __init__(self, model, cache, graphs: bool):
        self.model, self.cache, self.graphs_on = model, cache, graphs
        self.device = cache.k[0].device
        self.eager = verify_pass(model, cache, fixed=False)  # where padding would run past the cache
        self.inputs: dict[int, torch.Tensor] = {}  # per padded T: [slot0, tokens, positions, tree]
        self.graphs: dict[tuple, tuple] = {}
        self.pool = None

    def __call__(self, tokens: list[int], start: int, parents: list[int] | None, hidden: bool):
        T = len(tokens)
        n = 1 << (T - 1).bit_length()
        if start + n > self.cache.max_len:  # no room to pad: the eager pass
            return self.eager(tokens, start, parents, hidden)
        tree = np.eye(n, dtype=bool)  # padding: each token sees itself only
        tree[:T, :T] = np.tril(np.ones((T, T), dtype=bool)) if parents is None else ancestor_mask(parents).numpy()
        packed = np.concatenate([[start], tokens, [0] * (n - T), start + tree.sum(1) - 1, tree.ravel()])
        inp = self.inputs.get(n)
        if inp is None:
            inp = self.inputs[n] = torch.zeros(1 + 2 * n + n * n, dtype=torch.long, device=self.device)
        inp.copy_(torch.from_numpy(packed.astype(np.int64)))  # one host-to-device copy per pass
        keys = key_bucket(start + n, self.cache.max_len)
        key = (n, keys, hidden)
        if not self.graphs_on:
            out = self._pass(inp, n, keys, hidden)
        else:
            if key not in self.graphs:
                graph, out = capture(lambda: self._pass(inp, n, keys, hidden), self.pool)
                self.pool = graph.pool()
                self.graphs[key] = graph, out
            graph, out = self.graphs[key]
            graph.replay()
        logits, h = out
        return logits[:T], (h[:T] if hidden else None)

    def _pass(self, inp: torch.Tensor, n: int, keys: int, hidden: bool):
        slot0, tokens, pos = inp[:1], inp[1:1 + n], inp[1 + n:1 + 2 * n]
        tree = inp[1 + 2 * n:].view(n, n).bool()
        out = self.model(tokens[None], pos, FixedTree(self.cache, keys, slot0, pos, tree), return_hidden=hidden)
        return (out[0][0], out[1][0]) if hidden else (out[0], None)
