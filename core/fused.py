"""Fused Triton kernels for the small ops of a decode step on CUDA: RMSNorm, rotary embedding,
the gated activation.

Measured on an H100 (bench/RESULTS.md): an 8B-shaped bf16 decode step replayed from a CUDA graph
spent ~2.9 ms of its ~9 ms outside the matmuls, in ~47 kernels per layer of a few microseconds
each; eager RMSNorm alone is 8 kernels (cast, square, sum, scale, add, rsqrt, multiply, cast back),
rope 4 per tensor. Each function here is one kernel with the eager code's arithmetic in float32.
The model calls them for CUDA tensors (usable()); the CPU keeps the eager ops. They also run under
TRITON_INTERPRET=1 on CPU tensors, which is how the tests check them.
"""
from __future__ import annotations

import torch

from ..quant.triton_runtime import load_triton

triton = load_triton()
if triton is not None:
    import triton.language as tl


def usable(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


if triton is not None:
    @triton.jit
    def _rms_norm(X, W, Y, D, stride_x, eps, offset,
                  BLOCK: tl.constexpr, CAST_FIRST: tl.constexpr):
        row = tl.program_id(0)
        d = tl.arange(0, BLOCK)
        m = d < D
        x = tl.load(X + row * stride_x + d, mask=m, other=0.0)
        xf = x.to(tl.float32)
        y = xf * tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
        w = tl.load(W + d, mask=m, other=0.0).to(tl.float32)
        if CAST_FIRST:  # Llama: round to the activation dtype, then scale
            y = y.to(x.dtype).to(tl.float32) * w
        else:  # Gemma: scale by (offset + w) in float32
            y = y * (offset + w)
        tl.store(Y + row * D + d, y.to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _rope(X, COS, SIN, Y, H, T, sxb, sxh, sxt, D: tl.constexpr):
        # one (b, h, t) row: y = x * cos + roll(x, D/2) * signed_sin, as model.apply_rope
        pid = tl.program_id(0)
        t = pid % T
        h = (pid // T) % H
        b = pid // (T * H)
        d = tl.arange(0, D)
        base = X + b * sxb + h * sxh + t * sxt
        x = tl.load(base + d).to(tl.float32)
        xr = tl.load(base + (d + D // 2) % D).to(tl.float32)
        c = tl.load(COS + t * D + d).to(tl.float32)
        s = tl.load(SIN + t * D + d).to(tl.float32)
        tl.store(Y + pid * D + d, (x * c + xr * s).to(Y.dtype.element_ty))

    @triton.jit
    def _act(g, GELU: tl.constexpr):
        if GELU:  # tanh approximation: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            return 0.5 * g * (1 + (2 * tl.sigmoid(2 * z) - 1))
        return g * tl.sigmoid(g)

    @triton.jit
    def _gated(G, U, Y, n, g_row, u_row, GELU: tl.constexpr, BLOCK: tl.constexpr):
        # act(g) * u, the activation rounded to Y's dtype first as the eager code does. Rows of n:
        # g and u in separate tensors (row strides n) or side by side in one (row strides 2n).
        row = tl.program_id(0)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        g = tl.load(G + row * g_row + i, mask=m, other=0.0).to(tl.float32)
        u = tl.load(U + row * u_row + i, mask=m, other=0.0).to(tl.float32)
        a = _act(g, GELU)
        tl.store(Y + row * n + i, (a.to(Y.dtype.element_ty).to(tl.float32) * u).to(Y.dtype.element_ty), mask=m)


def gated_halves(gu: torch.Tensor, gelu: bool) -> torch.Tensor:
    """gated() on the output of a joined gate/up matmul: [..., 2F] -> act(gu[..., :F]) * gu[..., F:]."""
    F2 = gu.shape[-1]
    g2 = gu.reshape(-1, F2).contiguous()
    F = F2 // 2
    y = torch.empty(g2.shape[0], F, dtype=gu.dtype, device=gu.device)
    _gated[(g2.shape[0], triton.cdiv(F, 1024))](g2, g2[:, F:], y, F, F2, F2, GELU=gelu, BLOCK=1024, num_warps=4)
    return y.view(*gu.shape[:-1], F)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """model.RMSNorm's forward in one kernel: offset 0 (Llama) casts before scaling by weight and
    returns weight's result dtype; otherwise (Gemma) scales by offset + weight in float32."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype) if offset == 0.0 else x.dtype
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    BLOCK = triton.next_power_of_2(D)
    _rms_norm[(x2.shape[0],)](x2, weight, y, D, x2.stride(0), eps, offset, BLOCK=BLOCK, CAST_FIRST=offset == 0.0,
                              num_warps=4 if BLOCK <= 1024 else 8)
    return y.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """model.apply_rope for x [B, H, T, D] (any strides, D contiguous), cos/sin [T, D] contiguous;
    returns a contiguous [B, H, T, D]."""
    B, H, T, D = x.shape
    y = torch.empty((B, H, T, D), dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    _rope[(B * H * T,)](x, cos.contiguous(), signed_sin.contiguous(), y, H, T,
                        x.stride(0), x.stride(1), x.stride(2), D=D, num_warps=1)
    return y


def gated(g: torch.Tensor, u: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(g) * u (SiLU, or GELU-tanh), rounding act(g) to the dtype first as the eager code does."""
    g, u = g.contiguous(), u.contiguous()
    n = g.shape[-1]
    y = torch.empty_like(g)
    rows = g.numel() // n
    _gated[(rows, triton.cdiv(n, 1024))](g, u, y, n, n, n, GELU=gelu, BLOCK=1024, num_warps=4)
    return y
