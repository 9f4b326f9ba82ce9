"""Importance-weighted scales for GGUF blocks (Q4_0, Q5_0, Q4_K, Q5_K, Q6_K): what gguf_grid.GGUFGrid.fit
chooses instead of llama.cpp's own rounding where it does better.

llama.cpp's rounding without an imatrix weighs each weight's error by its own magnitude; GPTQ knows
what each input column costs, the Hessian's diagonal (the mean square of that input: what llama.cpp's
imatrix measures too). So per sub-block a search over candidate grids, each with the least-squares
scale (and min) under that importance, then the sub-block scales quantized against the super-block's
fp16 d (and dmin) and each moved by one step either way where that lowers the weighted error with
the codes rounded again. The result is the block's scale bytes; its codes are GPTQ's to choose.

fit_blocks(qtype, w [N, B], importance [B], llama.cpp's blocks) -> the blocks' bytes [N, block bytes]
with these scales (B the block's weights: 32, or 256 for the K-quants), for gguf_grid's layouts to read.
"""
from __future__ import annotations

import numpy as np
import torch

from .gguf_types import Q4_0, Q4_K, Q5_0, Q5_K, Q6_K

WEIGHTED = (Q4_0, Q5_0, Q4_K, Q5_K, Q6_K)
# the candidate grids per sub-block: code range + RMIN + RDELTA * i over the sub-block's range, i in
# 0..STEPS (llama.cpp's imatrix search for Q4_K takes these)
RMIN, RDELTA, STEPS = -0.9, 0.05, 36
SIGNED_STEPS = range(-9, 10)  # Q6_K: the extreme value onto code -32 +- a tenth of a code each


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def _asym_subblocks(x: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sub-blocks x [N, S, n] on codes 0..nmax, w [S, n] each weight's importance: per sub-block
    (scale, neg_min) [N, S] with x ~ scale * q - neg_min, neg_min >= 0, of least weighted error."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    span = x.amax(-1, keepdim=True) - lo
    span = torch.where(span > 0, span, 1.0)
    sw, sx = w.sum(-1), (w * x).sum(-1)
    best_s, best_m = (span / nmax)[..., 0], lo[..., 0]
    q = torch.round((x - lo) / (span / nmax)).clamp_(0, nmax)
    best = (w * (best_s[..., None] * q + best_m[..., None] - x) ** 2).sum(-1)
    for i in range(STEPS + 1):
        q = torch.round((x - lo) * ((nmax + RMIN + RDELTA * i) / span)).clamp_(0, nmax)
        sl, sl2, sxl = (w * q).sum(-1), (w * q * q).sum(-1), (w * q * x).sum(-1)
        D = sw * sl2 - sl * sl
        ok = D > 0
        D = torch.where(ok, D, 1.0)
        s, m = (sw * sxl - sx * sl) / D, (sl2 * sx - sl * sxl) / D
        pos = m > 0  # the min is kept <= 0 (the format stores -min >= 0)
        s, m = torch.where(pos, sxl / torch.where(sl2 > 0, sl2, 1.0), s), torch.where(pos, 0.0, m)
        err = (w * (s[..., None] * q + m[..., None] - x) ** 2).sum(-1)
        better = ok & (err < best) & (s > 0)
        best, best_s, best_m = torch.where(better, err, best), torch.where(better, s, best_s), torch.where(better, m, best_m)
    return best_s, -best_m


def _sym_subblocks(x: torch.Tensor, w: torch.Tensor, nmax: int) -> torch.Tensor:
    """Sub-blocks x [N, S, n] on codes -nmax..nmax-1: per sub-block the signed scale [N, S] (x ~ scale * q)
    of least weighted error, the grids through the extreme value onto -nmax, nudged."""
    ext = x.gather(-1, x.abs().argmax(-1, keepdim=True))
    ext = torch.where(ext != 0, ext, 1.0)
    best, best_s = None, None
    for i in SIGNED_STEPS:
        q = torch.round(x * (-(nmax + 0.1 * i) / ext)).clamp_(-nmax, nmax - 1)
        sl2, sxl = (w * q * q).sum(-1), (w * q * x).sum(-1)
        s = sxl / torch.where(sl2 > 0, sl2, 1.0)
        err = (w * (s[..., None] * q - x) ** 2).sum(-1)
        if best is None:
            best, best_s = err, s
        else:
            better = err < best
            best, best_s = torch.where(better, err, best), torch.where(better, s, best_s)
    return best_s


def _nudge(x, w, scale_of, offset_of, levels: list[torch.Tensor], ranges, lo: int, hi: int):
    """Each sub-block's integer scale levels (one or two tensors [N, S]) moved by -1, 0 or +1 each,
    within `ranges`, to whichever gives the least weighted error with x's codes rounded again (lo..hi)."""
    steps = [(a,) for a in (-1, 0, 1)] if len(levels) == 1 else [(a, b) for a in (-1, 0, 1) for b in (-1, 0, 1)]
    best, out = None, [lv.clone() for lv in levels]
    for step in steps:
        cand = [(lv + a).clamp(r0, r1) for lv, a, (r0, r1) in zip(levels, step, ranges)]
        s, o = scale_of(cand[0])[..., None], offset_of(cand[-1])[..., None] if len(cand) == 2 else 0.0
        q = torch.round((x + o) / torch.where(s == 0, 1.0, s)).clamp_(lo, hi)
        err = (w * (s * q - o - x) ** 2).sum(-1)
        if best is None:
            best = err
            out = cand
            continue
        better = err < best
        best = torch.where(better, err, best)
        out = [torch.where(better, c, b) for c, b in zip(cand, out)]
    return out


def _k4_scale_bytes(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [N, 8] -> Q4_K/Q5_K's 12 scale bytes [N, 12] (gguf_grid._k4_scales' inverse)."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    return np.concatenate((ls[:, :4] | (ls[:, 4:] >> 4) << 6, lm[:, :4] | (lm[:, 4:] >> 4) << 6,
                           (ls[:, 4:] & 15) | (lm[:, 4:] & 15) << 4), axis=1)


def _half_bytes(x: torch.Tensor) -> np.ndarray:
    return x.half().numpy().reshape(-1, 1).view(np.uint8)


def fit_blocks(qtype: int, w: torch.Tensor, importance: torch.Tensor, blocks: np.ndarray) -> np.ndarray:
    """The rows w [N, B] as one block each of `qtype`, scales chosen under `importance` [B]: a copy
    of `blocks` (llama.cpp's own for w, [N, block bytes]) with its scale fields replaced."""
    N = w.shape[0]
    x, out = w.float(), blocks.copy()
    imp = importance.float().clamp(min=0)
    if qtype in (Q4_0, Q5_0):  # one fp16 d per 32, codes -8..7 / -16..15 around the zero code
        d = _fp16(_sym_subblocks(x[:, None], imp[None], 8 if qtype == Q4_0 else 16)[:, 0])
        out[:, 0:2] = _half_bytes(d)
        return out
    if qtype in (Q4_K, Q5_K):
        nmax = 15 if qtype == Q4_K else 31
        xs, ws = x.reshape(N, 8, 32), imp.reshape(8, 32)
        scale, neg_min = _asym_subblocks(xs, ws, nmax)
        d, dmin = _fp16(scale.amax(-1) / 63), _fp16(neg_min.amax(-1) / 63)
        ls = torch.round(scale / torch.where(d > 0, d, 1.0)[:, None]).clamp(0, 63)
        lm = torch.round(neg_min / torch.where(dmin > 0, dmin, 1.0)[:, None]).clamp(0, 63)
        ls, lm = _nudge(xs, ws, lambda v: d[:, None] * v, lambda v: dmin[:, None] * v, [ls, lm],
                        [(0, 63), (0, 63)], 0, nmax)
        out[:, 0:2], out[:, 2:4] = _half_bytes(d), _half_bytes(dmin)
        out[:, 4:16] = _k4_scale_bytes(ls.numpy(), lm.numpy())
        return out
    if qtype == Q6_K:
        xs, ws = x.reshape(N, 16, 16), imp.reshape(16, 16)
        scale = _sym_subblocks(xs, ws, 32)
        ext = scale.gather(-1, scale.abs().argmax(-1, keepdim=True))[:, 0]
        d = _fp16(ext / -128)
        sc = torch.round(scale / torch.where(d != 0, d, 1.0)[:, None]).clamp(-128, 127)
        (sc,) = _nudge(xs, ws, lambda v: d[:, None] * v, None, [sc], [(-128, 127)], -32, 31)
        out[:, 208:210] = _half_bytes(d)
        out[:, 192:208] = sc.to(torch.int8).numpy().view(np.uint8)
        return out
    raise ValueError(f"no weighted fit for GGUF type {qtype}")
