"""Q4_K and Q8_0 rows interleaved 8 at a time: the layouts brisk's fastest kernels for them read
(kernels/q4k_x8.h, q8_x8.h have the layouts and why). Same bytes as the file, moved: a group of 8
rows holds 8 rows' bytes, so the packed matrix has the file's size and rows past the last whole
group stay where they were."""
from __future__ import annotations

import torch

ROWS = 8
BLOCK = 144  # Q4_K: bytes per super-block of 256 weights
Q4_K, Q8_0 = 12, 8


def packable(qtype: int, rows: int, cols: int) -> bool:
    return rows >= ROWS and (qtype == Q4_K and cols % 256 == 0 or qtype == Q8_0 and cols % 32 == 0)


def pack(blocks: torch.Tensor, qtype: int = Q4_K) -> torch.Tensor:
    """blocks: uint8 [N, bytes per row] in the file's layout -> the same shape, interleaved."""
    if qtype == Q8_0:
        return _pack_q8_0(blocks)
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


def unpack(packed: torch.Tensor, qtype: int = Q4_K) -> torch.Tensor:
    """The inverse of pack: the file's layout again (paths without the native kernels)."""
    if qtype == Q8_0:
        return _unpack_q8_0(packed)
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


def _pack_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 (blocks of 34 bytes: d, 32 codes): per group and block, vector c = codes 8c..8c+7 of rows 0..7,
    then the 8 d's."""
    N, row_bytes = blocks.shape
    G, nb = N // ROWS, row_bytes // 34
    out = torch.empty_like(blocks, memory_format=torch.contiguous_format)
    b = blocks[:G * ROWS].reshape(G, ROWS, nb, 34).transpose(1, 2)  # [group, block, row, byte]
    o = out[:G * ROWS].view(G, nb, ROWS * 34)
    o[..., :256].view(G, nb, 4, ROWS, 8).copy_(b[..., 2:].reshape(G, nb, ROWS, 4, 8).transpose(2, 3))
    o[..., 256:].view(G, nb, ROWS, 2).copy_(b[..., :2])
    out[G * ROWS:] = blocks[G * ROWS:]
    return out


def _unpack_q8_0(packed: torch.Tensor) -> torch.Tensor:
    N, row_bytes = packed.shape
    G, nb = N // ROWS, row_bytes // 34
    out = torch.empty_like(packed, memory_format=torch.contiguous_format)
    o = packed[:G * ROWS].view(G, nb, ROWS * 34)
    b = out[:G * ROWS].view(G, ROWS, nb, 34).transpose(1, 2)
    b[..., 2:].copy_(o[..., :256].reshape(G, nb, 4, ROWS, 8).transpose(2, 3).reshape(G, nb, ROWS, 32))
    b[..., :2].copy_(o[..., 256:].reshape(G, nb, ROWS, 2))
    out[G * ROWS:] = packed[G * ROWS:]
    return out
