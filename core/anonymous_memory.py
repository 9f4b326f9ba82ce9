"""Tensors in private anonymous memory: the kernel hands out a zero-filled page on its first write,
so bytes never written cost no resident memory (a KV cache sized for the whole context), and the
mapping can be aligned for Linux's transparent huge pages (weights the kernels stream)."""
from __future__ import annotations

import contextlib
import mmap

import torch

PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 << 20  # x86-64's and most arm64 kernels' transparent huge page


def anonymous_bytes(nbytes: int, huge_pages: bool = False) -> torch.Tensor:
    """A zero-filled uint8 tensor of nbytes in a mapping of its own, touched only where written (the
    tensor keeps the mapping alive). huge_pages: start on a 2 MB boundary and ask Linux (THP in its
    usual madvise mode) to back the whole 2 MB pages with huge ones; elsewhere 4 KB pages."""
    huge = huge_pages and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}  # not shared with a fork
    m = mmap.mmap(-1, max(nbytes + (HUGE_PAGE if huge else 0), PAGE), **private)
    t = torch.frombuffer(m, dtype=torch.uint8)  # holds m as long as any view of it lives
    if not huge:
        return t[:nbytes]
    at = -t.data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError, ValueError):  # THP off or unsupported: 4 KB pages
        # whole 2 MB pages only: a huge page under the partial tail would hold up to 2 MB of nothing
        m.madvise(mmap.MADV_HUGEPAGE, at, nbytes // HUGE_PAGE * HUGE_PAGE)
    return t[at:at + nbytes]
