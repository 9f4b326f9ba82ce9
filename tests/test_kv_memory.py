"""A CPU cache costs memory only where positions are written (core/kv/memory.py): creating one for
a long context leaves the process's resident memory where it was, and writing positions grows it
by about their bytes; never-written slots read as zeros."""
from __future__ import annotations

import torch

from brisk.core.kv import ContiguousKV

PAGE_BYTES = 4096


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


def test_a_big_cache_costs_nothing_until_written():
    layers, heads, max_len, D = 8, 4, 8192, 64  # 256 MB of float32 K and V
    before = resident_bytes()
    kv = ContiguousKV(layers, heads, D, max_len, torch.float32, "cpu")
    assert kv.nbytes == 2 * layers * heads * max_len * D * 4
    assert resident_bytes() - before < 4 << 20
    written = 1024  # positions: 2 * layers * heads * 1024 * D * 4 = 16 MB
    for t in kv.k + kv.v:
        t[:, :, :written] = 1.0
    grown = resident_bytes() - before
    expected = 2 * layers * heads * written * D * 4
    assert expected <= grown < expected + (8 << 20)
    # slots never written read as zeros (masked attention relies on it)
    assert all(not t[:, :, written::97].any() for t in kv.k + kv.v)
