"""Q4_K rows interleaved 8 at a time: the layout brisk's fastest Q4_K kernel reads (kernels/q4k_x8.h
has the layout and why). Same bytes as the file, moved: a group of 8 rows holds 8 rows' bytes, so the
packed matrix has the file's size and rows past the last whole group stay where they were."""
from __future__ import annotations

import torch

ROWS = 8
BLOCK = 144  # Q4_K: bytes per super-block of 256 weights


def packable(qtype: int, rows: int, cols: int) -> bool:
    return qtype == 12 and cols % 256 == 0 and rows >= ROWS


def pack(blocks: torch.Tensor) -> torch.Tensor:
    """blocks: uint8 [N, bytes per row] in the file's layout -> the same shape, interleaved."""
    N, row_bytes = blocks.shape
    G, ns = N // ROWS, row_bytes // BLOCK
    out = torch.empty_like(blocks, memory_format=torch.contiguous_format)
    # [group, row, super-block, byte] -> [group, super-block, row, byte]
    b = blocks[:G * ROWS].reshape(G, ROWS, ns, BLOCK).transpose(1, 2)
    o = out[:G * ROWS].view(G, ns, ROWS * BLOCK)
    o[..., :1024].view(G, ns, 16, ROWS, 8).copy_(b[..., 16:].reshape(G, ns, ROWS, 16, 8).transpose(2, 3))
    o[..., 1024:1040].view(G, ns, ROWS, 2).copy_(b[..., 0:2])
    o[..., 1040:1056].view(G, ns, ROWS, 2).copy_(b[..., 2:4])
    o[..., 1041:1056:2] ^= 0x80  # -dmin: the fp16's sign bit (the kernel adds the minimum term)
    o[..., 1056:].view(G, ns, 3, ROWS, 4).copy_(b[..., 4:16].reshape(G, ns, ROWS, 3, 4).transpose(2, 3))
    out[G * ROWS:] = blocks[G * ROWS:]
    return out


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack: the file's layout again (paths without the native kernels)."""
    N, row_bytes = packed.shape
    G, ns = N // ROWS, row_bytes // BLOCK
    out = torch.empty_like(packed, memory_format=torch.contiguous_format)
    o = packed[:G * ROWS].view(G, ns, ROWS * BLOCK)
    b = out[:G * ROWS].view(G, ROWS, ns, BLOCK).transpose(1, 2)  # [group, super-block, row, byte]
    b[..., 16:].copy_(o[..., :1024].reshape(G, ns, 16, ROWS, 8).transpose(2, 3).reshape(G, ns, ROWS, 128))
    b[..., 0:2].copy_(o[..., 1024:1040].reshape(G, ns, ROWS, 2))
    m = o[..., 1040:1056].clone()
    m[..., 1::2] ^= 0x80
    b[..., 2:4].copy_(m.reshape(G, ns, ROWS, 2))
    b[..., 4:16].copy_(o[..., 1056:].reshape(G, ns, 3, ROWS, 4).transpose(2, 3).reshape(G, ns, ROWS, 12))
    out[G * ROWS:] = packed[G * ROWS:]
    return out
