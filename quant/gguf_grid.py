"""GGUF's block types as grids for GPTQ (quant/gptq.py's GPTQ.run): each column is rounded onto the
block's scales, and the result is the type's exact block bytes.

A block's scales (the 32-weight types: an fp16 d, and Q5_1 an fp16 m; Q4_K/Q5_K: d, dmin and 6-bit
scales and mins per 32 of a 256-weight super-block; Q6_K, Q3_K, Q2_K: per 16 of 256) are chosen when GPTQ reaches the
block: its weights as updated by then go through llama.cpp's own rounding (native.quantize_rows, which
runs llama.cpp's scale searches), and for Q4_0, Q5_0 and Q4_K..Q6_K through a search weighted by the
Hessian's diagonal too (gguf_weighted_fit.py); per row, the scales that round the block with less
weighted error are read back from those bytes. Every column of the
block is then rounded to the nearest code against those fixed scales, and GPTQ spreads the rest of the
error over the later columns. encode() writes the chosen codes into the bytes of the fitted blocks.

Every type here decodes as  w = scale * (q - zero) - offset  per weight, q an unsigned stored code in
lo..hi, with the float operations in ggml's own order (so decode() is bit for bit ggml's dequantization):
- Q8_0: scale = d, zero 0, q signed int8 (kept to -127..127, llama.cpp's own range)
- Q4_0 / Q5_0: scale = d, zero 8 / 16, q 0..15 / 0..31;  Q5_1: scale = d, offset = -m, q 0..31
- Q4_K / Q5_K: scale = d * sc[j], offset = dmin * m[j] (sub-block j of 32), q 0..15 / 0..31
- Q6_K: scale = d * sc[j] (int8, sub-block j of 16), zero 32, q 0..63
- Q3_K: scale = d * (sc[j] - 32) (6-bit sc, sub-block j of 16), zero 4, q 0..7 (its top bit in hmask)
- Q2_K: scale = d * (sc[j] & 15), offset = dmin * (sc[j] >> 4) (sub-block j of 16), q 0..3
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import gguf_types, gguf_weighted_fit
from .gguf_types import Q2_K, Q3_K, Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block [N, bytes], as float32 [N, 1]."""
    return np.ascontiguousarray(b[:, at:at + 2]).view(np.float16).astype(np.float32)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes [N, 12] -> the 6-bit scales and mins [N, 8] (ggml's get_scale_min_k4)."""
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate((lo & 63, (mix & 15) | (lo >> 6 << 4)), axis=1)
    m = np.concatenate((hi & 63, (mix >> 4) | (hi >> 6 << 4)), axis=1)
    return sc.astype(np.float32), m.astype(np.float32)


def _k3_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes [N, 12] -> its 16 6-bit scales [N, 16] (low 4 bits in bytes 0..7, two
    nibbles each; the top 2 bits in bytes 8..11, four per byte)."""
    lo, top = s[:, 0:8], s[:, 8:12]
    return np.concatenate([(lo[:, 0:4] & 15) | (top & 3) << 4, (lo[:, 4:8] & 15) | (top >> 2 & 3) << 4,
                           lo[:, 0:4] >> 4 | (top >> 4 & 3) << 4, lo[:, 4:8] >> 4 | (top >> 6) << 4], axis=1)


def _two_bits(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's 64 code bytes [N, 64] -> the low 2 bits of weights 0..255: weight 128n + 32j + 16p + l
    sits at bits 2j of byte 32n + 16p + l."""
    b = qs.reshape(-1, 2, 1, 32)  # [N, n, j, 16p + l]
    return ((b >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3).reshape(-1, 256)


def _put_two_bits(q: np.ndarray) -> np.ndarray:
    """The inverse of _two_bits: codes [N, 256] (0..3) -> [N, 64] bytes."""
    shift = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    return ((q.reshape(-1, 2, 4, 32) & 3) << shift).sum(axis=2, dtype=np.uint8).reshape(-1, 64)


def _qh_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes [N, 4] (a little-endian uint32) -> the fifth bit of each of the 32 weights."""
    return np.unpackbits(qh, axis=1, bitorder="little")


@dataclass(frozen=True)
class _Layout:
    qtype: int
    lo: int  # the least and largest stored code
    hi: int
    zero: int

    @property
    def weights(self) -> int:
        return gguf_types.BY_ID[self.qtype].block_weights

    def fields(self, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Blocks [N, bytes] -> (scale, offset), each float32 [N, weights]."""
        t = self.qtype
        if t in (Q8_0, Q4_0, Q5_0):
            d = np.repeat(_f16(b, 0), self.weights, axis=1)
            return d, np.zeros_like(d)
        if t == Q5_1:
            return np.repeat(_f16(b, 0), 32, axis=1), np.repeat(-_f16(b, 2), 32, axis=1)
        if t in (Q4_K, Q5_K):
            sc, m = _k4_scales(b[:, 4:16])
            scale, offset = _f16(b, 0) * sc, _f16(b, 2) * m  # exact: fp16 times a 6-bit integer
            return np.repeat(scale, 32, axis=1), np.repeat(offset, 32, axis=1)
        if t == Q6_K:
            sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
            scale = np.repeat(_f16(b, 208) * sc, 16, axis=1)
            return scale, np.zeros_like(scale)
        if t == Q3_K:
            scale = np.repeat(_f16(b, 108) * (_k3_scales(b[:, 96:108]).astype(np.float32) - 32), 16, axis=1)
            return scale, np.zeros_like(scale)
        if t == Q2_K:
            sc = b[:, :16]
            return (np.repeat(_f16(b, 80) * (sc & 15).astype(np.float32), 16, axis=1),
                    np.repeat(_f16(b, 82) * (sc >> 4).astype(np.float32), 16, axis=1))
        raise ValueError(f"no GPTQ grid for GGUF type {t}")

    def codes(self, b: np.ndarray) -> np.ndarray:
        """Blocks [N, bytes] -> their stored codes [N, weights] in weight order (int32)."""
        t, N = self.qtype, b.shape[0]
        if t == Q8_0:
            return np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.int32)
        if t in (Q4_0, Q5_0, Q5_1):
            q = b[:, -16:]
            q = np.concatenate((q & 15, q >> 4), axis=1).astype(np.int32)
            return q if t == Q4_0 else q | _qh_bits(b[:, -20:-16]).astype(np.int32) << 4
        if t in (Q2_K, Q3_K):
            q = _two_bits(b[:, 16:80] if t == Q2_K else b[:, 32:96]).astype(np.int32)
            if t == Q3_K:  # the top bit of weight 128n + 32j + 16p + l: bit 4n + j of hmask[16p + l]
                hm = np.unpackbits(b[:, :32], axis=1, bitorder="little").reshape(N, 32, 2, 4)  # [N, 16p + l, n, j]
                q |= hm.transpose(0, 2, 3, 1).reshape(N, 256).astype(np.int32) << 2
            return q
        if t in (Q4_K, Q5_K):
            qs = b[:, 16:144] if t == Q4_K else b[:, 48:176]
            qs = qs.reshape(N, 4, 1, 32)  # chunk c of 64: weight 64c + i low nibble, 64c + 32 + i high
            q = np.concatenate((qs & 15, qs >> 4), axis=2).astype(np.int32)
            if t == Q5_K:  # the fifth bit of weight 64c + 32h + i: bit 2c + h of qh[i]
                qh = b[:, 16:48].reshape(N, 1, 1, 32)
                shift = (2 * np.arange(4)[:, None] + np.arange(2)[None, :])[None, :, :, None]
                q |= ((qh >> shift) & 1).astype(np.int32) << 4
            return q.reshape(N, 256)
        if t == Q6_K:
            ql = b[:, :128].reshape(N, 2, 2, 32)  # half n, byte group j: weights 128n + 32j + l (low), +64 (high)
            qh = b[:, 128:192].reshape(N, 2, 1, 32)
            low = np.concatenate((ql & 15, ql >> 4), axis=2)  # [N, half, quarter, 32]
            high = (qh >> (2 * np.arange(4)[None, None, :, None])) & 3
            return (low.astype(np.int32) | high.astype(np.int32) << 4).reshape(N, 256)
        raise ValueError(f"no GPTQ grid for GGUF type {t}")

    def put_codes(self, b: np.ndarray, q: np.ndarray) -> np.ndarray:
        """A copy of blocks [N, bytes] with the codes q [N, weights] (the inverse of codes())."""
        t, N, out = self.qtype, b.shape[0], b.copy()
        if t == Q8_0:
            out[:, 2:] = q.astype(np.int8).view(np.uint8)
            return out
        q = q.astype(np.uint8)
        if t in (Q4_0, Q5_0, Q5_1):
            out[:, -16:] = (q[:, :16] & 15) | (q[:, 16:] & 15) << 4
            if t != Q4_0:
                out[:, -20:-16] = np.packbits(q >> 4 & 1, axis=1, bitorder="little")
        elif t in (Q2_K, Q3_K):
            if t == Q2_K:
                out[:, 16:80] = _put_two_bits(q)
            else:
                out[:, 32:96] = _put_two_bits(q)
                hm = (q >> 2 & 1).reshape(N, 2, 4, 32).transpose(0, 3, 1, 2).reshape(N, 256)
                out[:, :32] = np.packbits(hm, axis=1, bitorder="little")
        elif t in (Q4_K, Q5_K):
            q4 = q.reshape(N, 4, 2, 32)
            nibbles = (q4[:, :, 0] & 15) | (q4[:, :, 1] & 15) << 4
            if t == Q4_K:
                out[:, 16:144] = nibbles.reshape(N, 128)
            else:
                out[:, 48:176] = nibbles.reshape(N, 128)
                shift = (2 * np.arange(4)[:, None] + np.arange(2)[None, :])[None, :, :, None].astype(np.uint8)
                out[:, 16:48] = ((q4 >> 4) << shift).sum(axis=(1, 2), dtype=np.uint8)
        elif t == Q6_K:
            q6 = q.reshape(N, 2, 4, 32)
            out[:, :128] = ((q6[:, :, :2] & 15) | (q6[:, :, 2:] & 15) << 4).reshape(N, 128)
            shift = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
            out[:, 128:192] = ((q6 >> 4) << shift).sum(axis=2, dtype=np.uint8).reshape(N, 64)
        else:
            raise ValueError(f"no GPTQ grid for GGUF type {t}")
        return out


LAYOUTS = {t: _Layout(t, lo, hi, zero) for t, lo, hi, zero in (
    (Q8_0, -127, 127, 0), (Q4_0, 0, 15, 8), (Q5_0, 0, 31, 16), (Q5_1, 0, 31, 0),
    (Q2_K, 0, 3, 0), (Q3_K, 0, 7, 4), (Q4_K, 0, 15, 0), (Q5_K, 0, 31, 0), (Q6_K, 0, 63, 32))}
GRIDS = tuple(LAYOUTS)  # the types GPTQ rounds onto


def decode(qtype: int, raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """brisk's own dequantization of a tensor of one of GRIDS: float32 [rows, cols]."""
    lay = LAYOUTS[qtype]
    b = np.asarray(raw, dtype=np.uint8).reshape(-1, gguf_types.BY_ID[qtype].block_bytes)
    scale, offset = (torch.from_numpy(a) for a in lay.fields(b))
    q = torch.from_numpy(lay.codes(b)).float()
    return (scale * (q - lay.zero) - offset).reshape(rows, cols)


class GGUFGrid:
    """One GGUF type as a grid for GPTQ.run (group_size = the type's block). A K-quant's round() needs
    the column's place in the block (positional): the scales differ per sub-block.
    params per block: (scale [N, B], offset [N, B], the fitted blocks' bytes [N, block bytes])."""

    def __init__(self, qtype: int):
        from . import native

        self.layout, self.qtype, self._quantize = LAYOUTS[qtype], qtype, native.quantize_rows
        self.block = self.layout.weights
        # the 32-weight types have one scale per block: any column order within it rounds the same
        self.positional = self.block > 32

    def fit(self, w: torch.Tensor, importance, group):
        # llama.cpp's own scale search on the updated weights (its rounding has no importance input)
        w = w.detach().float().cpu()
        b = self._quantize(self.qtype, w.numpy())
        if importance is not None and self.qtype in gguf_weighted_fit.WEIGHTED:
            # and the scales searched under the Hessian's diagonal: per row, whichever rounds w with less error
            imp = importance.float().cpu()
            mine = gguf_weighted_fit.fit_blocks(self.qtype, w, imp, b)
            better = self._error(w, imp, mine) < self._error(w, imp, b)
            b = np.where(better.numpy()[:, None], mine, b)
        scale, offset = self.layout.fields(b)
        return torch.from_numpy(scale), torch.from_numpy(offset), torch.from_numpy(b)

    def _error(self, w: torch.Tensor, importance: torch.Tensor, b: np.ndarray) -> torch.Tensor:
        """Per row of w, the importance-weighted squared error of its nearest codes on blocks b's scales."""
        lay = self.layout
        s, o = (torch.from_numpy(a) for a in lay.fields(b))
        q = torch.round((w + o) / torch.where(s == 0, 1.0, s)).add_(lay.zero).clamp_(lay.lo, lay.hi)
        return ((s * (q - lay.zero) - o - w) ** 2) @ importance

    def round(self, w: torch.Tensor, params, pos: int = 0):
        lay = self.layout
        s, o = params[0][:, pos], params[1][:, pos]
        # a scale of 0 decodes every code to -offset: any code will do
        q = torch.round((w + o) / torch.where(s == 0, 1.0, s)).add_(lay.zero).clamp_(lay.lo, lay.hi)
        return q.long(), s * (q - lay.zero) - o

    def encode(self, q: torch.Tensor, blocks: torch.Tensor) -> np.ndarray:
        """GPTQ's codes q [N, K] and its blocks' fitted bytes [G, N, block bytes] -> the rows' bytes [N, G * bytes]."""
        G, N, nb = blocks.shape
        qs = q.numpy().reshape(N, G, self.block).transpose(1, 0, 2)
        out = np.stack([self.layout.put_codes(blocks[g].numpy(), qs[g]) for g in range(G)], axis=1)
        return out.reshape(N, G * nb)
