"""AWQ (Lin et al., 2023): activation-aware weight quantization.

Salient input channels (large mean |activation|) get scaled up before quantization, so their
weights lose less to rounding; the scale is folded back into the operation before the layer.
Then each group's clipping range is searched to minimize the output error. All layers that read
the same input (q/k/v; gate/up) share one scale.

Use, per group of layers with a shared input x [n, K] (calibration activations):

    s = search_scales(x, [q.weight, k.weight, v.weight], bits=4, group_size=128)   # [K]
    # the caller multiplies each weight's columns by s and divides the previous op by s
    # (the RMSNorm weight, or the previous linear's output rows), which keeps the float model exact
    clip = search_clip(x, w_scaled, bits=4, group_size=128)                        # [N, G]
    res = quantize(w_scaled, bits=4, group_size=128, clip=clip)
    res.dequantized, res.tensors(), res.error

res.tensors() is the AutoAWQ GEMM layout ({"qweight", "qzeros", "scales"}; see awq_format.py).
Codes: w = (q - z) * s per group, zero point z integer in 0..2^bits-1 (asymmetric, AutoAWQ's default).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AWQResult:
    q: torch.Tensor  # [N, K] int32 codes
    scales: torch.Tensor  # [G, N] float32
    zeros: torch.Tensor  # [G, N] int32
    bits: int
    group_size: int
    dequantized: torch.Tensor  # [N, K] float32 (of the scaled weight)
    error: float  # ||(W - Q) x||^2 / ||W x||^2 on the x given to quantize (nan without one)

    def tensors(self) -> dict[str, torch.Tensor]:
        """{"qweight", "qzeros", "scales"} in AutoAWQ's GEMM layout; prefix with the layer name."""
        from .awq_format import pack_layer

        return pack_layer(self.q, self.zeros, self.scales, self.bits)


def _groups(bits: int, group_size: int, K: int) -> int:
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"AWQ bits must be 2, 3, 4 or 8, got {bits}")
    gs = K if group_size == -1 else group_size
    if gs <= 0 or K % gs:
        raise ValueError(f"in_features {K} is not a multiple of the group size {group_size}")
    return gs


def _grid(wg: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's asymmetric min/max grid for rows of wg [R, gs]: (scale [R], zero [R]) as floats,
    scales rounded to float16 first (the checkpoint's dtype), zeros integers in 0..2^bits-1."""
    maxq = 2 ** bits - 1
    lo, hi = wg.amin(dim=1), wg.amax(dim=1)
    scale = ((hi - lo).clamp(min=1e-5) / maxq).half().float()
    zero = torch.clamp(-torch.round(lo / scale), 0, maxq)
    return scale, zero


def _fake_quant(w: torch.Tensor, bits: int, gs: int) -> torch.Tensor:
    """w [N, K] quantized and dequantized per group of gs columns."""
    N, K = w.shape
    wg = w.reshape(-1, gs)
    s, z = _grid(wg, bits)
    q = torch.clamp(torch.round(wg / s[:, None]) + z[:, None], 0, 2 ** bits - 1)
    return ((q - z[:, None]) * s[:, None]).reshape(N, K)


def search_scales(x: torch.Tensor, weights: list[torch.Tensor], bits: int = 4, group_size: int = 128,
                  n_grid: int = 20, n_tokens: int = 4096, folded=None) -> torch.Tensor:
    """The per-input-channel scale s [K] (float32) that minimizes the output error of the layers
    reading x [n, K] when their weights are quantized as W * s (and the input as x / s); the
    error is measured on at most n_tokens rows of x, evenly spaced (mean |x| uses all of them).

    Candidates are s = mean|x|^a / mean|w|^(1-a) for a in 0, 1/n_grid, .., (n_grid-1)/n_grid
    (mean|w| of weights normalized per group), normalized to a geometric middle of 1; a = 0 with
    the weights' own normalization is close to plain rounding, so the search rarely does worse.

    folded(s), where given: (s as it will be stored, the factor [K] by which the op before the
    layers will scale each input channel once s is folded into it and rounded to the checkpoint's
    dtype); the error is then measured on x times that factor, so scales the checkpoint cannot
    hold lose the search.
    """
    x = x.detach().reshape(-1, x.shape[-1]).float()
    W = torch.cat([w.detach().float() for w in weights])  # layers sharing x: one output space
    N, K = W.shape
    gs = _groups(bits, group_size, K)
    x_mean = x.abs().mean(dim=0)
    wn = W.abs().reshape(N, K // gs, gs)
    w_mean = (wn / wn.amax(dim=-1, keepdim=True).clamp(min=1e-12)).reshape(N, K).mean(dim=0)
    x = x[:: max(1, x.shape[0] // n_tokens)][:n_tokens]
    ref = x @ W.T
    best, best_s = float("inf"), torch.ones(K)
    for i in range(n_grid):
        a = i / n_grid
        s = (x_mean.pow(a) / w_mean.pow(1 - a).clamp(min=1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        xs = x
        if folded is not None:
            s, factor = folded(s)
            xs = x * factor
        wq = _fake_quant(W * s, bits, gs) / s
        err = float((xs @ wq.T - ref).pow(2).mean())
        if err < best:
            best, best_s = err, s
    return best_s


def search_clip(x: torch.Tensor, weight: torch.Tensor, bits: int = 4, group_size: int = 128,
                n_grid: int = 20, max_shrink: float = 0.5, n_tokens: int = 512) -> torch.Tensor:
    """The max |w| per group [N, G] to clip to before quantizing, searched to minimize the
    group's output error on x [n, K] (at most n_tokens of its rows, evenly spaced)."""
    x = x.detach().reshape(-1, x.shape[-1]).float()
    x = x[:: max(1, x.shape[0] // n_tokens)][:n_tokens]
    w = weight.detach().float()
    N, K = w.shape
    gs = _groups(bits, group_size, K)
    G = K // gs
    xg = x.reshape(-1, G, gs).transpose(0, 1)  # [G, n, gs]
    wg = w.reshape(N, G, gs)
    ref = torch.bmm(xg, wg.permute(1, 2, 0))  # [G, n, N]: each group's share of the output
    org_max = wg.abs().amax(dim=-1)  # [N, G]
    best_err = torch.full((N, G), float("inf"))
    best_max = org_max.clone()
    for i in range(int(max_shrink * n_grid)):
        m = org_max * (1 - i / n_grid)
        cw = torch.maximum(torch.minimum(wg, m[..., None]), -m[..., None])
        qw = _fake_quant(cw.reshape(N, K), bits, gs).reshape(N, G, gs)
        err = (torch.bmm(xg, qw.permute(1, 2, 0)) - ref).pow(2).mean(dim=1).T  # [N, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, m, best_max)
    return best_max


def quantize(weight: torch.Tensor, bits: int = 4, group_size: int = 128, clip: torch.Tensor | None = None,
             x: torch.Tensor | None = None) -> AWQResult:
    """Asymmetric min/max quantization per group, the range clipped to [-clip, clip] when given;
    x [n, K] (optional) only measures .error."""
    w = weight.detach().float()
    N, K = w.shape
    gs = _groups(bits, group_size, K)
    G = K // gs
    wg = w.reshape(N, G, gs)
    if clip is not None:
        wg = torch.maximum(torch.minimum(wg, clip[..., None]), -clip[..., None])
    s, z = _grid(wg.reshape(N * G, gs), bits)
    q = torch.clamp(torch.round(wg.reshape(N * G, gs) / s[:, None]) + z[:, None], 0, 2 ** bits - 1)
    deq = ((q - z[:, None]) * s[:, None]).reshape(N, K)
    error = float("nan")
    if x is not None:
        x = x.detach().reshape(-1, K).float()
        error = float((x @ (deq - w).T).pow(2).sum() / (x @ w.T).pow(2).sum())
    return AWQResult(q.reshape(N, K).to(torch.int32), s.reshape(N, G).T.contiguous(),
                     z.reshape(N, G).T.contiguous().to(torch.int32), bits, group_size, deq, error)
