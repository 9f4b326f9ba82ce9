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


def search_scales(x: torch.Tensor, weights: list[torch.Tensor], bits: int = 4, group_size: int = 128,
                  n_grid: int = 20) -> torch.Tensor:
    """The per-input-channel scale s [K] (float32) that minimizes the output error of the layers
    reading x [n, K] when their weights are quantized as W * s (and the input as x / s)."""
    raise NotImplementedError


def search_clip(x: torch.Tensor, weight: torch.Tensor, bits: int = 4, group_size: int = 128,
                n_grid: int = 20, max_shrink: float = 0.5) -> torch.Tensor:
    """The max |w| per group [N, G] to clip to before quantizing, searched to minimize the
    group's output error on x [n, K]."""
    raise NotImplementedError


def quantize(weight: torch.Tensor, bits: int = 4, group_size: int = 128, clip: torch.Tensor | None = None,
             x: torch.Tensor | None = None) -> AWQResult:
    """Asymmetric min/max quantization per group, the range clipped to [-clip, clip] when given;
    x [n, K] (optional) only measures .error."""
    raise NotImplementedError
