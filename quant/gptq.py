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
    group_size: int  # -1: one group over all of K
    sym: bool
    dequantized: torch.Tensor  # [N, K] float32
    error: float  # ||(W - Q) X||^2 / ||W X||^2 on the calibration inputs (nan without any)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The layer's tensors in the GPTQ checkpoint layout, keyed by suffix
        ("qweight", "qzeros", "scales", "g_idx"); prefix them with the layer name."""
        from .gptq_format import pack_layer

        return pack_layer(self.q, self.zeros, self.scales, self.g_idx, self.bits)


class GPTQ:
    def __init__(self, weight: torch.Tensor):
        """weight: the layer's [N, K] weight (out_features, in_features); it is not modified."""
        raise NotImplementedError

    def add_batch(self, x: torch.Tensor) -> None:
        """Accumulate the Hessian H = 2/n sum x x^T over calibration inputs x [..., K]."""
        raise NotImplementedError

    def quantize(self, bits: int = 4, group_size: int = 128, sym: bool = True, act_order: bool = False,
                 damp: float = 0.01, block_size: int = 128) -> GPTQResult:
        """Run GPTQ. group_size -1 means one group per row; act_order quantizes columns in order of
        decreasing Hessian diagonal (g_idx then records each column's group); damp is added to the
        Hessian's diagonal as a fraction of its mean; block_size is the lazy-update block width."""
        raise NotImplementedError


def rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True) -> GPTQResult:
    """Round-to-nearest with GPTQ's grid (min/max per group): the baseline GPTQ should beat."""
    raise NotImplementedError
