"""GGUF rows interleaved 8 at a time, for the types gguf_types.py gives a layout (its `interleave`): the
layouts brisk's fastest kernels for them read (kernels/q4k_x8.h, q3k_x8.h, q8_x8.h have the layouts and why). Same bytes as the file, moved: a
group of 8 rows holds 8 rows' bytes, so the packed matrix has the file's size and rows past the last
whole group stay where they were."""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch

from . import gguf_types
from .gguf_types import MXFP4, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0

ROWS = 8
BLOCK = gguf_types.BY_ID[Q4_K].block_bytes  # Q4_K: bytes per super-block of 256 weights
Q5_BLOCK = gguf_types.BY_ID[Q5_K].block_bytes  # Q5_K's
Q6_BLOCK = gguf_types.BY_ID[Q6_K].block_bytes  # Q6_K's
# The 32-weight types (layout "small"), per block: (bytes, fp16 fields at its start, code bytes after
# them). Interleaved, a group's block holds its codes in vectors of 64 bytes (_small), Q5_0/Q5_1 then
# their fifth bits as 8 lane masks (_q5_masks), then each fp16 field of rows 0..7.
_FIELDS = {Q8_0: (1, 32), Q4_0: (1, 16), Q4_1: (2, 16), Q5_0: (1, 16), Q5_1: (2, 16)}
SMALL = {q: (gguf_types.BY_ID[q].block_bytes, *f) for q, f in _FIELDS.items()}
FIFTH = (Q5_0, Q5_1)  # their file blocks: the fp16 fields, qh (4 bytes: bit w, weight w's fifth bit), codes


def _moved(block: int, parts: list[tuple[int, int]]) -> list[int]:
    """The byte order of a layout that only moves whole bytes (kernels/q3k_x8.h): parts (file offset,
    bytes) in order, each of rows 0..7 in turn. Returns, per byte of a group's super-block, its place
    in the group's 8 file blocks (row r's byte b: r * block + b)."""
    order = []
    for off, n in parts:
        order += [r * block + off + i for r in range(ROWS) for i in range(n)]
    assert sorted(order) == list(range(ROWS * block))
    return order


# Q3_K: 4 chunks (qs bytes 8p.., qs bytes 32 + 8p.., hmask bytes 8p..), the scale bytes as Q4_K's, d.
# Q2_K: 4 chunks (qs bytes 8p.., 32 + 8p..), the 16 scale bytes 4 at a time, d, dmin.
_PARTS = {Q3_K: [(o, 8) for p in range(4) for o in (32 + 8 * p, 64 + 8 * p, 8 * p)] + [(96, 4), (100, 4), (104, 4), (108, 2)],
          Q2_K: [(o, 8) for p in range(4) for o in (16 + 8 * p, 48 + 8 * p)] + [(0, 4), (4, 4), (8, 4), (12, 4), (80, 2), (82, 2)]}
MOVED = {q: (gguf_types.BY_ID[q].block_bytes, _moved(gguf_types.BY_ID[q].block_bytes, parts)) for q, parts in _PARTS.items()}
TYPES = tuple(t.id for t in gguf_types.INTERLEAVED)  # the types with an interleaved layout (native.X8)


packable = gguf_types.interleavable


NATIVE_LAYOUTS = (Q4_K, Q6_K, Q8_0, Q4_0, Q4_1)  # the kernels' bk_pack_x8 packs these directly
CHUNK = 4096  # rows packed at a time: the temporaries (a strided view's reshape copies) stay small


def pack(blocks: torch.Tensor, qtype: int = Q4_K, out: torch.Tensor | None = None,
         done: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """blocks: uint8 [N, bytes per row] in the file's layout -> the same shape, interleaved (into `out`
    where given). done(a, b), where given, is told each span of source rows as soon as it is read
    (a loader hands their pages back)."""
    out = torch.empty_like(blocks, memory_format=torch.contiguous_format) if out is None else out
    N = blocks.shape[0]
    whole = N // ROWS * ROWS
    fast = _native_packer(blocks, out, qtype)
    for a in range(0, whole, CHUNK):
        b = min(a + CHUNK, whole)
        if fast is not None:
            fast(a, b)
        else:
            out[a:b] = _pack_groups(blocks[a:b], qtype)
        if done is not None:
            done(a, b)
    out[whole:] = blocks[whole:]
    if done is not None and whole < N:
        done(whole, N)
    return out


def _pack_groups(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    return _LAYOUTS[gguf_types.BY_ID[qtype].interleave](blocks, qtype, True)


# The native packer's program (kernels' bk_pack_term): out[dst] ^= (in[row, byte] & mask) << shift, out
# starting as the bits the layout flips
TERM = np.dtype([("src", "<i4"), ("dst", "<u2"), ("shift", "i1"), ("mask", "u1"), ("run", "<u2"), ("pad", "<u2")])


@functools.cache
def bit_moves(qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """qtype's layout as bit moves, for the native packer: (source byte [terms] as row * block bytes +
    byte, the TERM rows without their final offsets, the bits flipped [8 * block bytes]). Derived from
    the reference implementation above by packing one group of probes: the zero block gives the flipped
    bits, and probe k (each input bit set to bit k of its own index) gives bit k of every output bit's
    source. Checked on random blocks; None where the layout is not a permutation of bits."""
    bb = gguf_types.BY_ID[qtype].block_bytes
    n = ROWS * bb * 8

    def run(bits: np.ndarray) -> np.ndarray:  # input bits (little-endian within bytes) -> output bits
        x = torch.from_numpy(np.packbits(bits.reshape(-1, 8), axis=1, bitorder="little").reshape(ROWS, bb))
        y = _pack_groups(x, qtype).numpy().reshape(-1, 1)
        return np.unpackbits(y, axis=1, bitorder="little").reshape(-1)

    idx = np.arange(n)
    flips = run(np.zeros(n, np.uint8))
    src = np.zeros(n, np.int64)
    for k in range(int(n - 1).bit_length()):
        src |= (run((idx >> k & 1).astype(np.uint8)) ^ flips).astype(np.int64) << k
    if src.max() >= n:
        return None
    shift = idx % 8 - src % 8
    key = (idx // 8 * (n // 8) + src // 8) * 16 + shift + 8  # (output byte, input byte, shift)
    uniq, which = np.unique(key, return_inverse=True)
    mask = np.zeros(len(uniq), np.uint8)
    np.bitwise_or.at(mask, which, (1 << (src % 8)).astype(np.uint8))
    dst, shift, source = uniq // 16 // (n // 8), uniq % 16 - 8, uniq // 16 % (n // 8)
    # whole bytes moved to consecutive places from consecutive places: one run each
    whole = (mask == 255) & (shift == 0)
    joins = np.zeros(len(uniq), bool)
    joins[1:] = whole[1:] & whole[:-1] & (dst[1:] == dst[:-1] + 1) & (source[1:] == source[:-1] + 1)
    starts = np.flatnonzero(~joins)
    terms = np.zeros(len(starts), TERM)
    terms["dst"], terms["shift"], terms["mask"] = dst[starts], shift[starts], mask[starts]
    terms["run"] = np.diff(np.append(starts, len(uniq)))
    source = source[starts]
    flip_bytes = np.packbits(flips.reshape(-1, 8), axis=1, bitorder="little").reshape(-1)
    # the program against the reference, on random blocks (runs expanded to their bytes)
    run = terms["run"].astype(np.int64)
    step = np.arange(int(run.sum())) - np.repeat(np.cumsum(run) - run, run)
    at, to = np.repeat(source, run) + step, np.repeat(terms["dst"].astype(np.int64), run) + step
    m, sh = np.repeat(terms["mask"].astype(np.int64), run), np.repeat(terms["shift"].astype(np.int64), run)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.integers(0, 256, (ROWS, bb), dtype=np.uint8)
        v = x.reshape(-1)[at].astype(np.int64) & m
        got = flip_bytes.copy()
        np.bitwise_xor.at(got, to, (np.where(sh >= 0, v << np.maximum(sh, 0), v >> np.maximum(-sh, 0)) & 255).astype(np.uint8))
        if not np.array_equal(got, _pack_groups(torch.from_numpy(x), qtype).numpy().reshape(-1)):
            return None
    return source, terms, flip_bytes


def _native_packer(blocks: torch.Tensor, out: torch.Tensor, qtype: int) -> Callable[[int, int], None] | None:
    """pack's rows a..b (whole groups) by the native kernels' threads, or None (no kernels, a layout
    that is not a bit permutation, a strided source)."""
    from . import native

    if not (native.available() and blocks.is_contiguous() and out.is_contiguous()):
        return None
    lib = native.library()
    if qtype in NATIVE_LAYOUTS:  # written out by hand in the kernels: no program to derive
        def by_hand(a: int, b: int) -> None:
            lib.bk_pack_x8(blocks[a].data_ptr(), out[a].data_ptr(), (b - a) // ROWS, blocks.shape[1], qtype)
        return by_hand
    moves = bit_moves(qtype)
    if moves is None:
        return None
    source, terms, flips = moves
    bb, row_bytes = gguf_types.BY_ID[qtype].block_bytes, blocks.shape[1]
    terms = terms.copy()
    terms["src"] = source // bb * row_bytes + source % bb

    def run(a: int, b: int) -> None:
        lib.bk_pack_groups(blocks[a].data_ptr(), out[a].data_ptr(), (b - a) // ROWS, row_bytes, bb,
                           terms.ctypes.data, len(terms), flips.ctypes.data)
    return run


def unpack(packed: torch.Tensor, qtype: int = Q4_K) -> torch.Tensor:
    """The inverse of pack: the file's layout again (paths without the native kernels)."""
    return _LAYOUTS[gguf_types.BY_ID[qtype].interleave](packed, qtype, False)


def _k_groups(src: torch.Tensor, qtype: int, pack: bool) -> torch.Tensor:
    """pack/unpack of Q4_K and Q5_K (kernels/q4k_x8.h has the layouts): per group and super-block the
    codes (Q5_K: with a vector of fifth bits after every 4), then the 8 d's, -dmin's and scale bytes."""
    bb = BLOCK if qtype == Q4_K else Q5_BLOCK
    N, row_bytes = src.shape
    G, ns = N // ROWS, row_bytes // bb
    out = torch.empty_like(src, memory_format=torch.contiguous_format)
    file_side = (out if not pack else src)[:G * ROWS].reshape(G, ROWS, ns, bb).transpose(1, 2)  # [group, super-block, row, byte]
    x8 = (out if pack else src)[:G * ROWS].view(G, ns, ROWS * bb)
    codes = 1024 if qtype == Q4_K else 1280  # where the head (d, -dmin, scales) starts
    if qtype == Q4_K:  # vector u, row r: the row's code bytes 8u..8u+7
        vec, qs = x8[..., :1024].view(G, ns, 16, ROWS, 8), file_side[..., 16:]
        if pack:
            vec.copy_(qs.reshape(G, ns, ROWS, 16, 8).transpose(2, 3))
        else:
            qs.copy_(vec.transpose(2, 3).reshape(G, ns, ROWS, 128))
    else:  # chunk c: vectors 4c..4c+3 as Q4_K's, then chunk c's fifth bits (_q5_high)
        chunks = x8[..., :1280].view(G, ns, 4, 5, ROWS, 8)  # [c, slot, r, i]
        qs, qh = file_side[..., 48:], file_side[..., 16:48]
        if pack:
            chunks[..., :4, :, :].copy_(qs.reshape(G, ns, ROWS, 4, 4, 8).permute(0, 1, 3, 4, 2, 5))
            chunks[..., 4, :, :].copy_(_q5_high(qh.reshape(G, ns, ROWS, 4, 8)).transpose(2, 3))
        else:
            qs.copy_(chunks[..., :4, :, :].permute(0, 1, 4, 2, 3, 5).reshape(G, ns, ROWS, 128))
            qh.copy_(_q5_file_high(chunks[..., 4, :, :].transpose(2, 3)).reshape(G, ns, ROWS, 32))
    head = x8[..., codes:]
    if pack:
        head[..., 0:16].view(G, ns, ROWS, 2).copy_(file_side[..., 0:2])
        head[..., 16:32].view(G, ns, ROWS, 2).copy_(file_side[..., 2:4])
        head[..., 17:32:2] ^= 0x80  # -dmin: the fp16's sign bit (the kernel adds the minimum term)
        head[..., 32:].view(G, ns, 3, ROWS, 4).copy_(file_side[..., 4:16].reshape(G, ns, ROWS, 3, 4).transpose(2, 3))
    else:
        file_side[..., 0:2].copy_(head[..., 0:16].reshape(G, ns, ROWS, 2))
        m = head[..., 16:32].clone()
        m[..., 1::2] ^= 0x80
        file_side[..., 2:4].copy_(m.reshape(G, ns, ROWS, 2))
        file_side[..., 4:16].copy_(head[..., 32:].reshape(G, ns, 3, ROWS, 4).transpose(2, 3).reshape(G, ns, ROWS, 12))
    out[G * ROWS:] = src[G * ROWS:]
    return out


def _moved_bytes(src: torch.Tensor, qtype: int, pack: bool) -> torch.Tensor:
    """pack/unpack of the layouts that only move bytes (MOVED): one gather per group's super-block."""
    bb, order = MOVED[qtype]
    N, row_bytes = src.shape
    G, ns = N // ROWS, row_bytes // bb
    idx = torch.tensor(order)
    out = torch.empty_like(src, memory_format=torch.contiguous_format)
    file_side = (src if pack else out)[:G * ROWS].reshape(G, ROWS, ns, bb).transpose(1, 2)  # [group, super-block, row, byte]
    x8 = (out if pack else src)[:G * ROWS].reshape(G, ns, ROWS * bb)
    if pack:
        x8.copy_(file_side.reshape(G, ns, ROWS * bb)[..., idx])
    else:
        file_side.copy_(x8[..., torch.argsort(idx)].view(G, ns, ROWS, bb))
    out[G * ROWS:] = src[G * ROWS:]
    return out


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """Q5_K's qh bytes [..., t, i] (byte 8t + i: bit 2c, 2c + 1 = the fifth bits of weights 64c + 8t + i,
    64c + 32 + 8t + i) -> [..., c, i]: byte i of chunk c holds in bit t and 4 + t those of code vector
    4c + t's low and high nibbles (so that one shift of the chunk's vector and a mask give each)."""
    out = []
    for c in range(4):
        b = torch.zeros_like(qh[..., 0, :])
        for t in range(4):
            b |= (qh[..., t, :] >> 2 * c & 1) << t | (qh[..., t, :] >> 2 * c + 1 & 1) << 4 + t
        out.append(b)
    return torch.stack(out, -2)


def _q5_file_high(hb: torch.Tensor) -> torch.Tensor:
    """The inverse of _q5_high: [..., c, i] -> [..., t, i]."""
    out = []
    for t in range(4):
        b = torch.zeros_like(hb[..., 0, :])
        for c in range(4):
            b |= (hb[..., c, :] >> t & 1) << 2 * c | (hb[..., c, :] >> 4 + t & 1) << 2 * c + 1
        out.append(b)
    return torch.stack(out, -2)


def _small(src: torch.Tensor, qtype: int, pack: bool) -> torch.Tensor:
    """pack/unpack of the 32-weight types (SMALL): per group and block, the codes in 16-bit lanes (Q8_0:
    2 to a lane, Q4_0/Q4_1: 4, _q4_lanes), then the fp16 fields (d; Q4_1 also m) of rows 0..7."""
    bb, fields, nc = SMALL[qtype]
    N, row_bytes = src.shape
    fifth = 4 if qtype in FIFTH else 0  # qh's bytes, between the fields and the codes
    G, nb, head = N // ROWS, row_bytes // bb, 2 * fields + fifth
    out = torch.empty_like(src, memory_format=torch.contiguous_format)
    file_side = (out if not pack else src)[:G * ROWS].reshape(G, ROWS, nb, bb).transpose(1, 2)  # [group, block, row, byte]
    x8 = (out if pack else src)[:G * ROWS].view(G, nb, ROWS * bb)
    if fifth:
        masks = x8[..., ROWS * nc:ROWS * (nc + fifth)]
        qh = file_side[..., head - fifth:head]
        (masks.copy_(_q5_masks(qh)) if pack else qh.copy_(_q5_qh(masks)))
    if nc == 16:  # 4-bit codes: in 16-bit lanes (_q4_lanes)
        lanes = x8[..., :ROWS * nc]
        if pack:
            lanes.copy_(_q4_lanes(file_side[..., head:]))
        else:
            file_side[..., head:].copy_(_q4_bytes(lanes))
    else:  # Q8_0: vector c, lane 8r + i = weight 8c + i of rows r (low byte) and 4 + r (high byte)
        codes = x8[..., :ROWS * nc].view(G, nb, 4, 4, 8, 2)  # [group, block, c, r, i, h]
        rows = file_side[..., head:].reshape(G, nb, 2, 4, 4, 8)  # [group, block, h, r, c, i]
        if pack:
            codes.copy_(rows.permute(0, 1, 4, 3, 5, 2))
        else:
            rows.copy_(codes.permute(0, 1, 5, 3, 2, 4))
    for f in range(fields):
        at = x8[..., ROWS * (nc + fifth + 2 * f):ROWS * (nc + fifth + 2 * f + 2)].view(G, nb, ROWS, 2)
        (at.copy_(file_side[..., 2 * f:2 * f + 2]) if pack else file_side[..., 2 * f:2 * f + 2].copy_(at))
    out[G * ROWS:] = src[G * ROWS:]
    return out


def _mxfp4(src: torch.Tensor, qtype: int, pack: bool) -> torch.Tensor:
    """pack/unpack of MXFP4 (17-byte blocks: e, then 16 code bytes): per group and block, the codes in
    two 64-byte vectors whose nibbles, looked up, are Q8_0's interleaved int8 vectors (kernels/q8_x8.h),
    then e of rows 0..7."""
    N, row_bytes = src.shape
    G, nb = N // ROWS, row_bytes // 17
    out = torch.empty_like(src, memory_format=torch.contiguous_format)
    file_side = (out if not pack else src)[:G * ROWS].reshape(G, ROWS, nb, 17).transpose(1, 2)  # [group, block, row, byte]
    x8 = (out if pack else src)[:G * ROWS].view(G, nb, ROWS * 17)
    if pack:  # weight 8c + i of row 4h + r -> vector c // 2, byte 2 (8r + i) + h, nibble c % 2
        codes = torch.cat([file_side[..., 1:] & 15, file_side[..., 1:] >> 4], -1).view(G, nb, 2, 4, 2, 2, 8)  # [h, r, V, t, i]
        nib = codes.permute(0, 1, 4, 3, 6, 2, 5)  # [V, r, i, h, t]
        x8[..., :128].view(G, nb, 2, 4, 8, 2).copy_(nib[..., 0] | nib[..., 1] << 4)
        x8[..., 128:].copy_(file_side[..., 0])
    else:
        b = x8[..., :128].reshape(G, nb, 2, 4, 8, 2)  # [V, r, i, h]
        nib = torch.stack([b & 15, b >> 4], -1).permute(0, 1, 5, 3, 2, 6, 4).reshape(G, nb, ROWS, 32)  # [h, r, V, t, i]
        file_side[..., 1:].copy_(nib[..., :16] | nib[..., 16:] << 4)
        file_side[..., 0].copy_(x8[..., 128:])
    out[G * ROWS:] = src[G * ROWS:]
    return out


def _q4_lanes(file_codes: torch.Tensor) -> torch.Tensor:
    """A group's Q4_0/Q4_1 code bytes [G, blocks, 8 rows, 16] (byte i: weight i low, i + 16 high) -> [G,
    blocks, 128]: two vectors of 32 little-endian uint16 lanes, 4 codes per lane, so that (vector j // 4
    >> 4 (j % 4)) & 15 is the kernel's code vector j = 2c + h without a byte widening: lane 8r + i holds
    weight 8c + i of row 4h + r (kernels/q8_x8.h)."""
    G, nb = file_codes.shape[:2]
    codes = torch.cat([file_codes & 15, file_codes >> 4], -1).view(G, nb, 2, 4, 4, 8)  # [h, r, c, i]
    codes = codes.permute(0, 1, 4, 2, 3, 5).reshape(G, nb, 2, 2, 2, 4, 8)  # [V, c % 2, h, r, i]
    # nibble k = 2 (c % 2) + h: the lane's low byte holds k = 0, 1, its high byte k = 2, 3 (uint8 all along)
    low, high = (codes[:, :, :, cb, 0] | codes[:, :, :, cb, 1] << 4 for cb in (0, 1))
    return torch.stack([low, high], -1).reshape(G, nb, 128)


def _q5_masks(qh: torch.Tensor) -> torch.Tensor:
    """A group's Q5_0/Q5_1 qh bytes [G, blocks, 8 rows, 4] -> [G, blocks, 32]: for each of the kernel's 8
    code vectors j = 2c + h (as _q4_lanes), a little-endian uint32 whose bit 8r + i is the fifth bit of
    weight 8c + i of row 4h + r (kernels/q8_x8.h adds 16 under it)."""
    G, nb = qh.shape[:2]
    bits = torch.stack([qh >> k & 1 for k in range(8)], -1).view(G, nb, 2, 4, 4, 8)  # [h, r, c, i]: row 4h + r, weight 8c + i
    lanes = bits.permute(0, 1, 4, 2, 3, 5).reshape(G, nb, 8, 4, 8)  # [j = 2c + h, byte r, bit i]
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (lanes * weights).sum(-1, dtype=torch.uint8).reshape(G, nb, 32)


def _q5_qh(masks: torch.Tensor) -> torch.Tensor:
    """The inverse of _q5_masks."""
    G, nb = masks.shape[:2]
    bits = torch.stack([masks.view(G, nb, 8, 4) >> i & 1 for i in range(8)], -1)  # [j, r, i]
    bits = bits.view(G, nb, 4, 2, 4, 8).permute(0, 1, 3, 4, 2, 5).reshape(G, nb, 8, 4, 8)  # [row, byte w // 8, bit]
    weights = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8)
    return (bits * weights).sum(-1, dtype=torch.uint8)


def _q4_bytes(lanes: torch.Tensor) -> torch.Tensor:
    """The inverse of _q4_lanes."""
    G, nb = lanes.shape[:2]
    b = lanes.reshape(G, nb, 2, 4, 8, 2)  # [V, r, i, byte]: byte cb holds nibbles h = 0, 1 of c % 2 = cb
    codes = torch.stack([torch.stack([b[..., cb] & 15, b[..., cb] >> 4], 3) for cb in (0, 1)], 3)
    codes = codes.reshape(G, nb, 4, 2, 4, 8).permute(0, 1, 3, 4, 2, 5).reshape(G, nb, 8, 32)
    return codes[..., :16] | codes[..., 16:] << 4


def _q6_codes(b: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks [..., 210] -> their 256 six-bit codes in weight order [..., 256] (uint8)."""
    out = []
    for h in (0, 1):  # weights 128h..128h+127: ql bytes 64h.., qh bytes 128 + 32h..
        ql, qh = b[..., 64 * h:64 * h + 64], b[..., 128 + 32 * h:160 + 32 * h]
        low = torch.cat([ql & 15, ql >> 4], -1)  # weights 128h + 0..63, then + 64..127
        out.append(low | torch.cat([(qh >> 2 * k & 3) << 4 for k in range(4)], -1))
    return torch.cat(out, -1)


def _q6_blocks(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of _q6_codes (ql and qh; the scales and d are added by the caller): [..., 192]."""
    parts_ql, parts_qh = [], []
    for h in (0, 1):
        c = codes[..., 128 * h:128 * h + 128]
        parts_ql.append((c[..., :64] & 15) | (c[..., 64:] & 15) << 4)
        hi = c >> 4
        parts_qh.append(hi[..., :32] | hi[..., 32:64] << 2 | hi[..., 64:96] << 4 | hi[..., 96:] << 6)
    return torch.cat(parts_ql + parts_qh, -1)


def _pack_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K, per group and super-block 1680 bytes (kernels/q4k_x8.h has the layout): 8 chunks of two
    vectors of low code nibbles and one of high bit pairs, the scales in 4 vectors, the 8 d's."""
    N, row_bytes = blocks.shape
    G, ns = N // ROWS, row_bytes // Q6_BLOCK
    out = torch.empty_like(blocks, memory_format=torch.contiguous_format)
    b = blocks[:G * ROWS].reshape(G, ROWS, ns, Q6_BLOCK).transpose(1, 2)  # [group, super-block, row, byte]
    codes = _q6_codes(b)  # [G, ns, 8, 256]
    o = out[:G * ROWS].view(G, ns, ROWS * Q6_BLOCK)
    lo = codes & 15
    # vector u, row r, byte i: weight 8u + i (low nibble), 128 + 8u + i (high nibble)
    ql = lo[..., :128].reshape(G, ns, ROWS, 16, 8) | lo[..., 128:].reshape(G, ns, ROWS, 16, 8) << 4
    chunks = o[..., :1536].view(G, ns, 8, 3, ROWS, 8)  # per p: ql vectors 2p, 2p + 1, qh vector p
    chunks[..., :2, :, :].copy_(ql.transpose(2, 3).reshape(G, ns, 8, 2, ROWS, 8))
    # vector p, row r, byte i: the top bit pairs of weights 16p + i, 128 + 16p + i, 16p + 8 + i, 136 + 16p + i
    hi = (codes >> 4).reshape(G, ns, ROWS, 2, 8, 2, 8)  # [.., half, p, second 8, i]
    qh = hi[..., 0, :, 0, :] | hi[..., 1, :, 0, :] << 2 | hi[..., 0, :, 1, :] << 4 | hi[..., 1, :, 1, :] << 6
    chunks[..., 2, :, :].copy_(qh.transpose(2, 3))
    # scales: vector q, byte 4r + t = row r's scale 4q + t
    o[..., 1536:1664].view(G, ns, 4, ROWS, 4).copy_(b[..., 192:208].reshape(G, ns, ROWS, 4, 4).transpose(2, 3))
    o[..., 1664:].view(G, ns, ROWS, 2).copy_(b[..., 208:210])
    out[G * ROWS:] = blocks[G * ROWS:]
    return out


def _unpack_q6_k(packed: torch.Tensor) -> torch.Tensor:
    N, row_bytes = packed.shape
    G, ns = N // ROWS, row_bytes // Q6_BLOCK
    out = torch.empty_like(packed, memory_format=torch.contiguous_format)
    o = packed[:G * ROWS].view(G, ns, ROWS * Q6_BLOCK)
    chunks = o[..., :1536].reshape(G, ns, 8, 3, ROWS, 8)
    ql = chunks[..., :2, :, :].reshape(G, ns, 16, ROWS, 8).transpose(2, 3)  # [.., row, u, i]
    qh = chunks[..., 2, :, :].transpose(2, 3)  # [.., row, p, i]
    hi = torch.stack([torch.stack([qh & 3, qh >> 4 & 3], -2), torch.stack([qh >> 2 & 3, qh >> 6], -2)], 3)
    codes = torch.cat([(ql & 15).reshape(G, ns, ROWS, 128), (ql >> 4).reshape(G, ns, ROWS, 128)], -1)
    codes = codes | hi.reshape(G, ns, ROWS, 256) << 4
    b = out[:G * ROWS].view(G, ROWS, ns, Q6_BLOCK).transpose(1, 2)
    b[..., :192].copy_(_q6_blocks(codes))
    b[..., 192:208].copy_(o[..., 1536:1664].reshape(G, ns, 4, ROWS, 4).transpose(2, 3).reshape(G, ns, ROWS, 16))
    b[..., 208:].copy_(o[..., 1664:].reshape(G, ns, ROWS, 2))
    out[G * ROWS:] = packed[G * ROWS:]
    return out


def _q6_k(src: torch.Tensor, qtype: int, pack: bool) -> torch.Tensor:
    return _pack_q6_k(src) if pack else _unpack_q6_k(src)


# gguf_types.py's interleave names -> pack/unpack(src, qtype, pack)
_LAYOUTS = {"k_groups": _k_groups, "q6_k": _q6_k, "moved": _moved_bytes, "small": _small, "mxfp4": _mxfp4}
