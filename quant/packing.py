"""Bit packing into int32 words, as GPTQ and AWQ checkpoints store their codes.

Both formats pack small unsigned integers into int32 words as one little-endian bit stream: value j
of a run occupies bits j*bits .. j*bits+bits-1 of the stream, word w holding stream bits 32w..32w+31.
For 2, 4 and 8 bits that is 32/bits whole values per word; for 3 bits, 32 values fill 3 words and
two of them straddle a word boundary (GPTQ's 3-bit layout). AWQ additionally interleaves the 8
values of each word (AWQ_ORDER); see awq_format.py.
"""
from __future__ import annotations

import torch

BITS = (2, 3, 4, 8)


def _check(n: int, bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"{bits}-bit packing is not supported (use one of {BITS})")
    if n * bits % 32:
        raise ValueError(f"{n} values of {bits} bits do not fill whole int32 words")


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] integers in 0..2^bits-1 -> [..., n*bits/32] int32, packed along the last dim."""
    n = values.shape[-1]
    _check(n, bits)
    v = values.to(torch.int64)
    pos = torch.arange(n, device=v.device) * bits
    word, off = pos // 32, pos % 32
    out = torch.zeros(*v.shape[:-1], n * bits // 32, dtype=torch.int64, device=v.device)
    # Bit fields never overlap, so adding them is OR-ing them.
    out.index_add_(-1, word, (v << off) & 0xFFFFFFFF)
    spill = off + bits > 32  # the high bits of a value that straddles two words
    if spill.any():
        out.index_add_(-1, word[spill] + 1, v[..., spill] >> (32 - off[spill]))
    return (out - ((out >> 31) << 32)).to(torch.int32)  # two's complement: bit 31 is the sign


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack: [..., m] int32 -> [..., m*32/bits] int32 values in 0..2^bits-1."""
    n = packed.shape[-1] * 32 // bits
    _check(n, bits)
    if 32 % bits == 0:  # whole values per word: one shift per position, no gather
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
        v = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
        return v.reshape(*packed.shape[:-1], n)
    w = packed.to(torch.int64) & 0xFFFFFFFF
    pos = torch.arange(n, device=w.device) * bits
    word, off = pos // 32, pos % 32
    v = w[..., word] >> off
    spill = off + bits > 32
    if spill.any():
        v[..., spill] |= w[..., word[spill] + 1] << (32 - off[spill])
    return (v & ((1 << bits) - 1)).to(torch.int32)
