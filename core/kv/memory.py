"""Cache tensors whose memory costs nothing until a position is written.

A cache sized for the whole context is mostly never written (a short answer in a 4k context).
On the CPU its tensors are views into one anonymous mapping: the kernel hands out a zero-filled
page on its first write, so the process's resident memory grows with the positions written, and a
slot never written still reads as zeros (attention multiplies masked slots' values by 0, and 0 *
NaN garbage would poison it). Elsewhere (CUDA) they are plain zero-filled tensors.
"""
from __future__ import annotations

import math

import torch

from ..anonymous_memory import PAGE, anonymous_bytes


def zeroed_views(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """One zero tensor per shape, in `dtype` on `device`; on the CPU views into one anonymous
    mapping (each starting on a page of its own), touched only where written."""
    if torch.device(device).type != "cpu":
        return [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [item * math.prod(s) for s in shapes]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // PAGE) * PAGE
    raw = anonymous_bytes(total)
    return [raw[o:o + n].view(dtype).view(s) for o, n, s in zip(offsets, sizes, shapes)]

