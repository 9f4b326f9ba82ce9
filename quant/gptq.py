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

rtn(weight, bits, group_size, sym) is the round-to-nearest baseline with the same result type.

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


def _grid(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's min/max grid for the rows of w [N, n]: (scale [N] float32, zero [N] float32 integer).

    The range always includes 0. Scales are rounded to float16 first, as the checkpoint stores
    them, so the codes chosen here are the ones the stored scales decode. With sym the zero is the
    middle code; otherwise it is kept >= 1, because the GPTQ (v1) layout stores zero - 1 unsigned.
    """
    maxq = 2 ** bits - 1
    lo, hi = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = torch.where(lo < 0, -hi, lo)
    flat = (lo == 0) & (hi == 0)
    lo, hi = torch.where(flat, -1.0, lo), torch.where(flat, 1.0, hi)
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
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"group size must be -1 or positive, got {group_size}")
    return K if group_size == -1 else group_size  # K need not be a multiple: the last group is short


class GPTQ:
    def __init__(self, weight: torch.Tensor):
        """weight: the layer's [N, K] weight (out_features, in_features); it is not modified."""
        self.weight = weight.detach()
        K = weight.shape[1]
        self.H = torch.zeros(K, K, dtype=torch.float32, device=weight.device)
        self.n = 0

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
                 damp: float = 0.01, block_size: int = 128) -> GPTQResult:
        """Run GPTQ. group_size -1 means one group per row; act_order quantizes columns in order of
        decreasing Hessian diagonal (g_idx then records each column's group); damp is added to the
        Hessian's diagonal as a fraction of its mean; block_size is the lazy-update block width."""
        N, K = self.weight.shape
        gs = _check(bits, group_size, K)
        if self.n == 0:
            raise ValueError("GPTQ.quantize: no calibration inputs (call add_batch first)")
        maxq = 2 ** bits - 1
        W = self.weight.float().clone()
        H = self.H.clone()
        dead = H.diagonal() == 0  # inputs that were always zero: their weights cannot matter
        H[dead, dead] = 1
        W[:, dead] = 0
        perm = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(K, device=W.device)
        W, H = W[:, perm], H[perm][:, perm]
        Hinv = _inverse_factor(H, damp)

        G = -(-K // gs)
        Q = torch.zeros_like(W)
        scales = torch.zeros(G, N, device=W.device)
        zeros = torch.zeros(G, N, device=W.device)
        for b0 in range(0, K, block_size):
            b1 = min(b0 + block_size, K)
            W1, Err1, Hinv1 = W[:, b0:b1].clone(), torch.zeros(N, b1 - b0, device=W.device), Hinv[b0:b1, b0:b1]
            for i in range(b1 - b0):
                col = b0 + i
                if col % gs == 0:  # a new group: its grid from the weights as updated so far
                    g = col // gs
                    ahead = torch.cat((W1[:, i:], W[:, b1:]), dim=1)[:, :gs]
                    s, z = _grid(ahead, bits, sym)
                    scales[g], zeros[g] = s, z
                s, z = scales[col // gs], zeros[col // gs]
                w, d = W1[:, i], Hinv1[i, i]
                q = _codes(w, s, z, maxq)
                Q[:, col] = q
                err = (w - (q - z) * s) / d
                W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
                Err1[:, i] = err
            W[:, b1:] -= Err1 @ Hinv[b0:b1, b1:]  # the lazy update of all later columns at once

        inv = torch.argsort(perm)
        g_idx = (torch.arange(K, device=W.device) // gs)[inv]  # the group of each original column
        return _result(Q[:, inv], scales, zeros, g_idx, bits, group_size, sym, self.weight, self.H)


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


def _result(q, scales, zeros, g_idx, bits, group_size, sym, weight, H) -> GPTQResult:
    deq = (q - zeros.T[:, g_idx]) * scales.T[:, g_idx]
    error = float("nan")
    if H is not None:
        d, w = deq - weight.float(), weight.float()
        error = float(((d @ H) * d).sum() / ((w @ H) * w).sum())
    return GPTQResult(q.to(torch.int32), scales, zeros.to(torch.int32), g_idx.to(torch.int32), bits,
                      group_size, sym, deq, error)


def rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
        H: torch.Tensor | None = None) -> GPTQResult:
    """Round-to-nearest with GPTQ's grid (min/max per group): the baseline GPTQ should beat.
    H (e.g. GPTQ(weight) after add_batch, its .H) only serves to measure .error."""
    N, K = weight.shape
    gs = _check(bits, group_size, K)
    w = weight.detach().float()
    g_idx = torch.arange(K, device=w.device) // gs
    grids = [_grid(w[:, g0:g0 + gs], bits, sym) for g0 in range(0, K, gs)]
    scales, zeros = torch.stack([s for s, _ in grids]), torch.stack([z for _, z in grids])  # [G, N]
    q = _codes(w, scales.T[:, g_idx], zeros.T[:, g_idx], 2 ** bits - 1)
    return _result(q, scales, zeros, g_idx, bits, group_size, sym, weight, H)
