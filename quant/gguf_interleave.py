"""Q4_K, Q8_0, Q4_0 and Q4_1 rows interleaved 8 at a time: the layouts brisk's fastest kernels for
them read (kernels/q4k_x8.h, q8_x8.h have the layouts and why). Same bytes as the file, moved: a
group of 8 rows holds 8 rows' bytes, so the packed matrix has the file's size and rows past the last
whole group stay where they were."""
from __future__ import annotations

import torch

ROWS = 8
BLOCK = 144  # Q4_K: bytes per super-block of 256 weights
Q4_0, Q4_1, Q8_0, Q4_K = 2, 3, 8, 12
# The 32-weight types, per block: (bytes, fp16 fields at its start, code bytes after them). Interleaved,
# a group's block holds its code bytes in vectors of 8 bytes of rows 0..7 (64 bytes each), then each
# fp16 field of rows 0..7 in turn.
SMALL = {Q8_0: (34, 1, 32), Q4_0: (18, 1, 16), Q4_1: (20, 2, 16)}


def packable(qtype: int, rows: int, cols: int) -> bool:
    return rows >= ROWS and (qtype == Q4_K and cols % 256 == 0 or qtype in SMALL and cols % 32 == 0)


def pack(blocks: torch.Tensor, qtype: int = Q4_K) -> torch.Tensor:
    """blocks: uint8 [N, bytes per row] in the file's layout -> the same shape, interleaved."""
    if qtype in SMALL:
        return _small(blocks, qtype, pack=True)
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
    if qtype in SMALL:
        return _small(packed, qtype, pack=False)
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


def _small(src: torch.Tensor, qtype: int, pack: bool) -> torch.Tensor:
    """pack/unpack of the 32-weight types (SMALL): per group and block, vector c = code bytes 8c..8c+7 of
    rows 0..7, then the fp16 fields (d; Q4_1 also m) of rows 0..7."""
    bb, fields, nc = SMALL[qtype]
    N, row_bytes = src.shape
    G, nb, head = N // ROWS, row_bytes // bb, 2 * fields
    out = torch.empty_like(src, memory_format=torch.contiguous_format)
    file_side = (out if not pack else src)[:G * ROWS].reshape(G, ROWS, nb, bb).transpose(1, 2)  # [group, block, row, byte]
    x8 = (out if pack else src)[:G * ROWS].view(G, nb, ROWS * bb)
    codes = x8[..., :ROWS * nc].view(G, nb, nc // 8, ROWS, 8)  # [group, block, vector, row, byte]
    if pack:
        codes.copy_(file_side[..., head:].reshape(G, nb, ROWS, nc // 8, 8).transpose(2, 3))
    else:
        file_side[..., head:].copy_(codes.transpose(2, 3).reshape(G, nb, ROWS, nc))
    for f in range(fields):
        at = x8[..., ROWS * (nc + 2 * f):ROWS * (nc + 2 * f + 2)].view(G, nb, ROWS, 2)
        (at.copy_(file_side[..., 2 * f:2 * f + 2]) if pack else file_side[..., 2 * f:2 * f + 2].copy_(at))
    out[G * ROWS:] = src[G * ROWS:]
    return out
