"""GPTQ (Frantar et al., 2022): quantize a linear layer's weight column by column, spreading each
column's rounding error over the columns not yet quantized, weighted by the inverse Hessian of the
layer's calibration inputs. Not round-to-nearest: the error it minimizes is the layer's *output*
error on the calibration data, ||W X - Q X||^2.

Use, layer by layer (the caller feeds the layer's inputs, e.g. from a forward hook):

    g = GPTQ(linear.weight)                 # [N, K]
    for x in calibration_inputs:            # [..., K], any leading shape
        g.add_batch(x)                      # H += 2/n X X^T, in float32
    res = g.quantize(bits=4, group_size=128, sym=True, act_order=False, damp=0.01)
    res.dequantized                         # [N, K] float32: what the checkpoint stands for
    res.tensors()                           # {"qweight", "qzeros", "scales", "g_idx"}: GPTQ layout
    res.error                               # relative output error on the calibration Hessian

Each group's grid (scale, zero) is chosen when GPTQ reaches the group, from its weights as updated
by then: by default the range with the least Hessian-weighted rounding error (search), not min/max.

rtn(weight, bits, group_size, sym) is the round-to-nearest baseline with the same result type.

The column loop is GPTQ.run(grid, group_size, ...), for any grid (see "grids" below): quantize is
run on GPTQ's integer grid; bitsandbytes' NF4/FP4 codebook and int8 rows run it on a CodebookGrid
(nf4.gptq_blockwise_4bit, bnb_format.quantize_int8).

Codes: w = (q - z) * s per group, q and z integers in 0..2^bits-1 (z = 2^(bits-1) when sym).
The on-disk layout (packing, the v1 zero convention) is in gptq_format.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GPTQResult:
    q: torch.Tensor  # [N, K] int32 codes in 0..2^bits-1
    scales: torch.Tensor  # [G, N] float32, G = number of groups
    zeros: torch.Tensor  # [G, N] int32 zero points (the code that stands for 0.0)
    g_idx: torch.Tensor  # [K] int32: the group of each input column (sorted unless act_order)
    bits: int
    group_size: int  # -1: one group over all of K; a K it does not divide gets a short last group
    sym: bool
    dequantized: torch.Tensor  # [N, K] float32
    error: float  # ||(W - Q) X||^2 / ||W X||^2 on the calibration inputs (nan without any)

    def tensors(self, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
        """The layer's tensors in the GPTQ checkpoint layout, keyed by suffix
        ("qweight", "qzeros", "scales", "g_idx"); prefix them with the layer name.
        checkpoint_format: "gptq" (v1, zeros stored minus one) or "gptq_v2"."""
        from .gptq_format import pack_layer

        return pack_layer(self.q, self.zeros, self.scales, self.g_idx, self.bits, v1=checkpoint_format == "gptq")


def _grid(w: torch.Tensor, bits: int, sym: bool, search: bool = False,
          importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's grid for the rows of w [N, n]: (scale [N] float32, zero [N] float32 integer).

    Min/max: the range always includes 0. Scales are rounded to float16 first, as the checkpoint
    stores them, so the codes chosen here are the ones the stored scales decode. With sym the zero
    is the middle code; otherwise it is kept >= 1, because the GPTQ (v1) layout stores zero - 1.
    search: the range shrunk by each of SHRINK instead, per row the one whose rounding error
    (each column's squared error times its `importance` [n], e.g. the Hessian's diagonal) is least.
    """
    maxq = 2 ** bits - 1
    lo, hi = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = torch.where(lo < 0, -hi, lo)
    flat = (lo == 0) & (hi == 0)
    lo, hi = torch.where(flat, -1.0, lo), torch.where(flat, 1.0, hi)
    if not search:
        return _scale_zero(lo, hi, maxq, sym)
    return _least_error(w, importance, [_scale_zero(lo * f, hi * f, maxq, sym) for f in SHRINK],
                        lambda w, params: UniformGrid(bits, sym).round(w, params)[1])


def _least_error(w: torch.Tensor, importance: torch.Tensor | None, candidates, decode) -> tuple[torch.Tensor, ...]:
    """Per row of w [N, n], the candidate grid parameters (tuples of [N] tensors) whose rounding
    error, each column's squared error times its importance [n] (uniform if None), is least; the
    first candidate wins ties. decode(w, params) -> the values w rounds to, for params [C, N, 1]
    (C candidates at once: w broadcasts to [C, N, n]). Each candidate's error is the same
    [N, n] @ [n] product as when they were rounded one at a time, so the choice is too."""
    imp = torch.ones(w.shape[1], device=w.device) if importance is None else importance.float()
    stacked = tuple(torch.stack(p) for p in zip(*candidates))  # each [C, N]
    errs = []
    step = max(1, _BATCH // max(1, w.numel()))  # candidates per batch: bounded memory on large rows
    for c0 in range(0, len(stacked[0]), step):
        values = decode(w, tuple(p[c0:c0 + step, :, None] for p in stacked))
        errs += [e @ imp for e in (values - w) ** 2]
    best, best_err = torch.zeros_like(errs[0], dtype=torch.long), errs[0]
    for c, err in enumerate(errs[1:], 1):
        better = err < best_err
        best, best_err = torch.where(better, c, best), torch.minimum(err, best_err)
    return tuple(p.gather(0, best[None])[0] for p in stacked)


_BATCH = 1 << 22  # values _least_error rounds at once (candidates x rows x columns)


class _Nearest:
    """For sorted boundaries `mids` [M] (the midpoints of a sorted codebook), the number of
    boundaries below each value, as int32: torch.bucketize(x, mids), the index of the nearest
    entry with ties to the lower one, bit for bit, and on large tensors (a grid search's candidates)
    2-3x faster than bucketize's binary search, whose speed it keeps on small ones.

    A table over the value's bin (of a fixed range beyond the boundaries, values clamped into it;
    bins at most a quarter of the least gap between boundaries) gives the count below a point at
    most 3 bins under x: at most one boundary lies between that point and x, and one exact
    comparison with it finishes the count. make() gives None where the boundaries are too close
    for a small table."""

    SMALL = 8192  # fewer values than this: bucketize (a binary search costs less than the table's ops)

    def __init__(self, mids: torch.Tensor, bins: int):
        self.mids = mids.float()
        lo, hi = float(self.mids[0]) - 1, float(self.mids[-1]) + 1  # any value beyond keeps its count
        self.k, self.bins = bins / (hi - lo), bins
        self.c = -lo * self.k  # bin position = c + k * x
        # table[b]: the boundaries below the left edge of bin b - 1 (float64 edges, exact enough)
        edges = lo + (torch.arange(bins + 2, dtype=torch.float64) - 1) / self.k
        self.table = (self.mids.double()[None, :] < edges[:, None]).sum(1).int()
        self.after = torch.cat((self.mids, self.mids.new_tensor([float("inf")])))  # the first boundary not counted

    @classmethod
    def make(cls, mids: torch.Tensor, max_bins: int = 1 << 14) -> "_Nearest | None":
        if len(mids) < 2:
            return None
        gap, span = float(mids.diff().min()), float(mids[-1] - mids[0]) + 2
        if not gap > 0 or span / (gap / 4) > max_bins:
            return None
        return cls(mids, int(span / (gap / 4)) + 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < self.SMALL:
            return torch.bucketize(x, self.mids, out_int32=True)
        # int32 and index_select: on a few 100k values, half the time of int64 and indexing
        b = torch.add(self.c, x, alpha=self.k).clamp_(0, self.bins).int()  # truncation: the bin, give or take one
        g = _take(self.table, b)
        return g + (x > _take(self.after, g))


def _take(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for a 1-d table, through index_select (faster than indexing on CPU)."""
    return table.index_select(0, index.reshape(-1)).view(index.shape)


# The range factors the grid search tries: min/max first (ties keep it), down to 0.55 of the range.
# Below about 0.6 no SmolLM2 group was better off (issue 15).
SHRINK = tuple(1 - i / 40 for i in range(19))


def _scale_zero(lo: torch.Tensor, hi: torch.Tensor, maxq: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scale = ((hi - lo) / maxq).half().float().clamp(min=torch.finfo(torch.float16).tiny)
    if sym:
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        zero = torch.round(-lo / scale).clamp(1, maxq)
    return scale, zero


def _codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """The nearest grid codes of w for scale and zero (floats) broadcast against it."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def _check(bits: int, group_size: int, K: int) -> int:
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"GPTQ bits must be 2, 3, 4 or 8, got {bits}")
    return _group_width(group_size, K)


def _group_width(group_size: int, K: int) -> int:
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"group size must be -1 or positive, got {group_size}")
    return K if group_size == -1 else group_size  # K need not be a multiple: the last group is short


# ---------------------------------------------------------------- grids
# A grid is what GPTQ rounds each column to: fit(w [N, n], importance [n], group) -> params (a
# tuple of [N] tensors, one set per group, chosen when GPTQ reaches the group), and
# round(w, params) -> (codes, values): the codes stored and the values the checkpoint decodes them
# to, exactly (the error GPTQ spreads is the one the loaded model will have). A grid with
# `positional = True` takes round(w, params, i), i the column's place in its group.

class UniformGrid:
    """GPTQ's own: w = (q - zero) * scale, q in 0..2^bits-1, params (scale, zero) (see _grid)."""

    def __init__(self, bits: int, sym: bool, search: bool = True):
        self.bits, self.sym, self.search, self.maxq = bits, sym, search, 2 ** bits - 1

    def fit(self, w, importance, group):
        return _grid(w, self.bits, self.sym, self.search, importance)

    def round(self, w, params):
        s, z = params
        q = _codes(w, s, z, self.maxq)
        return q, (q - z) * s


class CodebookGrid:
    """w = code[q] * scale, one scale per row per group, any value (bitsandbytes' NF4/FP4 block
    absmax, its int8 row scale): values beyond scale * the end codes clip to them.

    stored(scale [N], group) -> (value, *extra): the scale as the checkpoint will hold it (e.g.
    rounded to bf16, or through double quantization), so that the codes are chosen for, and GPTQ
    compensates, the scale the model will run; extra tensors (e.g. the scale's own code) ride along
    in the params. fit: the largest |w| onto the end code, shrunk by each of `shrink`, per row the
    one with least rounding error weighted by the importance (the Hessian's diagonal), as _grid."""

    def __init__(self, code: torch.Tensor, stored=lambda s, group: (s,), shrink: tuple[float, ...] | None = None):
        self.code = code.float()
        order = torch.argsort(self.code)
        self._order, self._sorted = order, self.code[order]
        self._mids = (self._sorted[:-1] + self._sorted[1:]) / 2
        self._reach = float(self.code.abs().max())
        self.stored, self.shrink = stored, SHRINK if shrink is None else shrink
        # evenly spaced codes (int8's 255 levels) in order: round instead of bucketize, 5x faster
        steps = self._sorted.diff()
        self._even = bool(torch.equal(order, torch.arange(len(order)))) and bool((steps == steps[0]).all())
        self._nearest = None if self._even else _Nearest.make(self._mids)

    def fit(self, w, importance, group):
        amax = w.abs().amax(dim=1) / self._reach
        amax = torch.where(amax == 0, 1.0, amax)
        return _least_error(w, importance, [self.stored(amax * f, group) for f in self.shrink],
                            lambda w, params: self._rank(w, params)[1])

    def round(self, w, params):
        rank, values = self._rank(w, params)
        return (rank if self._even else _take(self._order, rank)), values

    def _rank(self, w, params):
        """(the index of w's nearest code in sorted order, the value it decodes to)."""
        s = params[0]
        # w / s, as nf4's reference does not: these codes are chosen, not reproduced; a scale of 0
        # (double quantization can store one) decodes every code to 0, so any code will do
        scaled = w / torch.where(s == 0, 1.0, s)
        if self._even:
            c0, step = self.code[0], self.code[1] - self.code[0]
            rank = torch.round((scaled - c0) / step).clamp_(0, len(self.code) - 1).long()
        elif self._nearest is not None:
            rank = self._nearest(scaled)  # torch.bucketize(scaled, self._mids), bit for bit
        else:
            rank = torch.bucketize(scaled, self._mids, out_int32=True)
        return rank, _take(self._sorted, rank) * s


@dataclass
class Compensated:
    """GPTQ run on any grid: the codes, each group's params and what they decode to."""
    q: torch.Tensor  # [N, K] int64 codes, the input columns in their original order
    params: tuple[torch.Tensor, ...]  # each [G, N]: group g's params (groups in column order)
    g_idx: torch.Tensor  # [K] int64: the group of each input column
    dequantized: torch.Tensor  # [N, K] float32
    error: float  # ||(W - Q) X||^2 / ||W X||^2 on the calibration inputs


class GPTQ:
    def __init__(self, weight: torch.Tensor):
        """weight: the layer's [N, K] weight (out_features, in_features); it is not modified."""
        self.weight = weight.detach()
        K = weight.shape[1]
        self.H = torch.zeros(K, K, dtype=torch.float32, device=weight.device)
        self.n = 0

    @classmethod
    def with_hessian(cls, weight: torch.Tensor, H: torch.Tensor, n: int = 1) -> "GPTQ":
        """A GPTQ for `weight` on a Hessian accumulated elsewhere (another linear that reads the same
        inputs, a caller's own hooks): H is shared, not copied (quantize and run copy it before use);
        n is the number of input rows it averages."""
        g = cls(weight)
        g.H, g.n = H, n
        return g

    def add_batch(self, x: torch.Tensor) -> None:
        """Accumulate the Hessian H = 2/n sum x x^T over calibration inputs x [..., K]."""
        x = x.detach().reshape(-1, self.H.shape[0]).to(self.H.device, torch.float32)
        m = x.shape[0]
        # A running mean, so that H is the same whatever the batching.
        self.H *= self.n / (self.n + m)
        self.n += m
        x = x * (2 / self.n) ** 0.5
        self.H.addmm_(x.T, x)

    def quantize(self, bits: int = 4, group_size: int = 128, sym: bool = True, act_order: bool = False,
                 damp: float = 0.01, block_size: int = 128, search: bool = True,
                 group_order: bool = False) -> GPTQResult:
        """Run GPTQ. group_size -1 means one group per row; act_order quantizes columns in order of
        decreasing Hessian diagonal (g_idx then records each column's group); damp is added to the
        Hessian's diagonal as a fraction of its mean; block_size is the lazy-update block width;
        search (the default) picks each group's range by least rounding error, weighted by the
        Hessian's diagonal (see _grid), instead of min/max: the columns GPTQ has updated carry the
        earlier columns' errors, and their min/max range is often much wider than their bulk
        (issue 15: KL to float on SmolLM2-135M 0.163 -> 0.093, 4-bit g32 asym); group_order (without act_order) quantizes the groups in
        order of their largest Hessian diagonal and each group's columns by decreasing diagonal,
        but keeps the groups contiguous (g_idx stays k // group_size, which fast kernels need)."""
        _check(bits, group_size, self.weight.shape[1])
        c = self.run(UniformGrid(bits, sym, search), group_size, act_order, group_order, damp, block_size)
        scales, zeros = c.params
        return _result(c.q, scales, zeros, c.g_idx, bits, group_size, sym, c.dequantized, c.error)

    def run(self, grid, group_size: int, act_order: bool = False, group_order: bool = True, damp: float = 0.01,
            block_size: int = 128) -> Compensated:
        """GPTQ's column loop on `grid` (UniformGrid, CodebookGrid): the arguments as quantize's."""
        N, K = self.weight.shape
        gs = _group_width(group_size, K)
        # a grid whose round() takes the column's place in its group (sub-block scales: gguf_grid.py)
        # needs the columns in place and in order
        positional = getattr(grid, "positional", False)
        if positional and (act_order or group_order):
            raise ValueError("a positional grid takes the columns in order (no act_order or group_order)")
        if self.n == 0:
            raise ValueError("GPTQ: no calibration inputs (call add_batch first)")
        W = self.weight.float().clone()
        H = self.H.clone()
        dead = H.diagonal() == 0  # inputs that were always zero: their weights cannot matter
        H[dead, dead] = 1
        W[:, dead] = 0
        perm = _order(H.diagonal(), gs, act_order, group_order)
        W, H = W[:, perm], H[perm][:, perm]
        Hinv = _inverse_factor(H, damp)

        G = -(-K // gs)
        Q, V = torch.zeros(N, K, dtype=torch.long, device=W.device), torch.zeros_like(W)
        params = [None] * G
        for b0 in range(0, K, block_size):
            b1 = min(b0 + block_size, K)
            W1, Err1, Hinv1 = W[:, b0:b1].clone(), torch.zeros(N, b1 - b0, device=W.device), Hinv[b0:b1, b0:b1]
            for i in range(b1 - b0):
                col = b0 + i
                if col % gs == 0:  # a new group: its grid from the weights as updated so far
                    # act_order: groups are slots of the permuted columns; else slot j holds the
                    # contiguous group perm[j * gs] // gs (group_order moves groups, not columns)
                    g = col // gs if act_order else int(perm[col]) // gs
                    ahead = torch.cat((W1[:, i:], W[:, b1:]), dim=1)[:, :gs]
                    params[g] = grid.fit(ahead, H.diagonal()[col:col + gs], g)
                w, d = W1[:, i], Hinv1[i, i]
                q, v = grid.round(w, params[g], col % gs) if positional else grid.round(w, params[g])
                Q[:, col], V[:, col] = q, v
                err = (w - v) / d
                W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
                Err1[:, i] = err
            W[:, b1:] -= Err1 @ Hinv[b0:b1, b1:]  # the lazy update of all later columns at once

        inv = torch.argsort(perm)
        g_idx = torch.arange(K, device=W.device) // gs
        if act_order:
            g_idx = g_idx[inv]  # the slot each original column was quantized in
        stacked = tuple(torch.stack(p) for p in zip(*params))
        deq = V[:, inv]
        return Compensated(Q[:, inv], stacked, g_idx, deq, output_error(deq, self.weight, self.H))


def _order(diag: torch.Tensor, gs: int, act_order: bool, group_order: bool) -> torch.Tensor:
    """The order in which GPTQ quantizes the columns (a permutation of 0..K-1). Columns with large
    inputs go first while many columns are left to absorb their error; group_order does that
    within each group of gs contiguous columns, and over the groups (a short last group stays
    last, so that every group still fills one slot of gs columns)."""
    K = diag.numel()
    if act_order:
        return torch.argsort(diag, descending=True)
    if not group_order:
        return torch.arange(K, device=diag.device)
    cols = torch.arange(K, device=diag.device)
    full = K // gs * gs
    within = torch.argsort(diag[:full].reshape(-1, gs), dim=1, descending=True) + cols[:full:gs, None]
    rank = torch.argsort(diag[:full].reshape(-1, gs).amax(dim=1), descending=True)
    tail = cols[full:][torch.argsort(diag[full:], descending=True)]
    return torch.cat((within[rank].reshape(-1), tail))


def _inverse_factor(H: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of (H + damp * mean(diag H) I)^-1: row i holds the weights with
    which column i's rounding error is spread over the later columns. A Hessian that is not
    positive definite (too few calibration tokens) gets more damping, up to 10x."""
    mean = H.diagonal().mean()
    for factor in (1, 2, 4, 10):
        Hd = H.clone()
        Hd.diagonal().add_(damp * factor * mean)
        L, info = torch.linalg.cholesky_ex(Hd)
        if info == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    raise ValueError("GPTQ: the calibration Hessian is not positive definite even with 10x damping")


def output_error(deq: torch.Tensor, weight: torch.Tensor, H: torch.Tensor | None) -> float:
    """||(W - Q) X||^2 / ||W X||^2 through the calibration Hessian H (nan without one)."""
    if H is None:
        return float("nan")
    d, w = deq - weight.float(), weight.float()
    return float(((d @ H) * d).sum() / ((w @ H) * w).sum())


def _result(q, scales, zeros, g_idx, bits, group_size, sym, deq, error) -> GPTQResult:
    return GPTQResult(q.to(torch.int32), scales, zeros.to(torch.int32), g_idx.to(torch.int32), bits,
                      group_size, sym, deq, error)


def rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
        H: torch.Tensor | None = None, search: bool = False) -> GPTQResult:
    """Round-to-nearest with GPTQ's grid (min/max per group, or searched: see _grid): the baseline
    GPTQ should beat. H (e.g. GPTQ(weight) after add_batch, its .H) serves to measure .error, and
    with search weighs each column's rounding error by its diagonal (uniform without H)."""
    N, K = weight.shape
    gs = _check(bits, group_size, K)
    w = weight.detach().float()
    g_idx = torch.arange(K, device=w.device) // gs
    imp = None if H is None else H.diagonal()
    grids = [_grid(w[:, g0:g0 + gs], bits, sym, search, None if imp is None else imp[g0:g0 + gs])
             for g0 in range(0, K, gs)]
    scales, zeros = torch.stack([s for s, _ in grids]), torch.stack([z for _, z in grids])  # [G, N]
    q = _codes(w, scales.T[:, g_idx], zeros.T[:, g_idx], 2 ** bits - 1)
    deq = (q - zeros.T[:, g_idx]) * scales.T[:, g_idx]
    return _result(q, scales, zeros, g_idx, bits, group_size, sym, deq, output_error(deq, weight, H))
