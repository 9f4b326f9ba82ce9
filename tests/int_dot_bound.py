"""How far quantized activations may move a product: each input is rounded to its block's grid of
max|x| / 32767 steps (16-bit, quant/kernels/int_dot.h) or max|x| / 127 (8-bit, the K-quants,
int8_dot.h), so it moves by at most half a step. Blocks are 32 inputs, 256 for the types on the
super-block grid (Q4_K, Q5_K, Q6_K)."""
import torch

from brisk.quant import native


def activation_bound(x: torch.Tensor, w: torch.Tensor, kind: int) -> torch.Tensor:
    """[M, N] bound on |x @ w.T - (x rounded) @ w.T| for a weight of this kind (0 where the kind
    takes float32 activations)."""
    if kind not in native.INT_DOT_TYPES or not native.INT_DOT:
        return torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    M, K = x.shape
    B = 256 if kind in native.SUPER_TYPES else 32
    steps = 127 if kind in native.ACT8_TYPES and native.ACT8 else 32767  # 8-bit ones: int8_dot.h
    amax = x.double().abs().view(M, K // B, B).amax(-1)
    half_step = (amax / steps / 2).repeat_interleave(B, dim=1)
    return half_step @ w.double().abs().T
