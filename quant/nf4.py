"""4-bit blockwise quantization with a 16-entry codebook (NF4, FP4), as bitsandbytes defines it,
and NF4Linear, the layer that runs it.

A weight [N, K] is flattened row-major and cut into blocks of `blocksize` values; each block keeps
its absmax (float32) and each value the index of the nearest codebook entry to value / absmax.
Codes are packed two per byte, the first value in the high nibble.
"""
from __future__ import annotations

import torch
from torch import nn

from .linear import QuantLinear


class NF4Linear(QuantLinear):
    """A linear layer with bitsandbytes-4-bit weights (NF4 or FP4), kept packed in memory.

    weight: uint8 packed codes ([N*K/2, 1] as bnb stores them, or any shape with N*K/2 bytes);
    absmax: float32 [N*K/blocksize] (double quantization already undone); code: float32 [16].
    On CUDA with bitsandbytes importable it runs bnb's 4-bit matmul; elsewhere it dequantizes per call.
    """

    def __init__(self, weight: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, shape: tuple[int, int],
                 blocksize: int = 64, quant_type: str = "nf4", bias: torch.Tensor | None = None):
        super().__init__(shape[1], shape[0], bias)
        raise NotImplementedError

    @classmethod
    def from_float(cls, linear: nn.Linear, quant_type: str = "nf4", blocksize: int = 64,
                   double_quant: bool = False) -> "NF4Linear":
        """Quantize a float layer (`--quantize nf4` at load). double_quant rounds the absmax through
        bnb's nested 8-bit code as a checkpoint with double quantization would (same numbers as
        loading such a checkpoint); memory in brisk is the same either way."""
        raise NotImplementedError

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        raise NotImplementedError
