"""Fused dequantize-matmul kernels (Triton) for the quantized layers of quant/linear.py on a GPU.

Layouts (the layers' own buffers, nothing repacked):
- int4: codes two per byte along K, [N, K/2] uint8, even column in the low nibble; per group of G
  input columns a scale and a zero, [N, K/G]: w = (q - 8) * scale + zero.
- int8: codes [N, K] int8, one scale per output row: w = q * scale.

Decode multiplies one activation row by each weight, so its time is the time to read the weight
once: the GEMV kernels stream the codes in wide tiles, do the per-group arithmetic on partial sums
(sum q*x and sum x per group, then one scale and zero per group instead of per weight) and never
write a dequantized copy. More rows (speculative verification, batched decode, prefill) go through
a tiled kernel that dequantizes each weight tile in registers and feeds the tensor cores.

The kernels run under TRITON_INTERPRET=1 on CPU tensors too: that is how CI checks them.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton (a CPU-only install): layers fall back to dequantize + F.linear
    triton = None


def usable(x: torch.Tensor) -> bool:
    """Whether the layers should run these kernels on x: CUDA with triton. (On the CPU, under
    TRITON_INTERPRET=1, the functions below run too, but only tests call them there.)"""
    return triton is not None and x.is_cuda


# Launch shapes: the best of a sweep over Llama-3-8B's five matrix shapes on an H100 (bench/gpu.py
# --sweep, bench/RESULTS.md); bench may override them.
GEMV = {"int4": dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4), "int8": dict(BLOCK_N=8, BLOCK_K=512, num_warps=8)}
GEMM_ROWS = 1  # up to this many activation rows use the GEMV kernel (once per row), more the tiled one


if triton is not None:
    @triton.jit
    def _int4_gemv(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, N, K,
                   G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        half = tl.arange(0, BLOCK_K // 2)  # byte j of a tile holds columns 2j (low) and 2j+1 (high)
        NG: tl.constexpr = BLOCK_K // G
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = k0 + 2 * half < K
            b = tl.load(w_ptr + n[:, None] * (K // 2) + (k0 // 2 + half)[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0)
            xe = tl.load(x_ptr + k0 + 2 * half, mask=kmask, other=0).to(tl.float32)
            xo = tl.load(x_ptr + k0 + 2 * half + 1, mask=kmask, other=0).to(tl.float32)
            p = (b & 0xF).to(tl.float32) * xe[None, :] + (b >> 4).to(tl.float32) * xo[None, :]
            qx = tl.sum(tl.reshape(p, [BLOCK_N, NG, G // 2]), axis=2)  # per group: sum q * x
            xs = tl.sum(tl.reshape(xe + xo, [NG, G // 2]), axis=1)  # per group: sum x
            g = k0 // G + tl.arange(0, NG)
            gmask = nmask[:, None] & (g < K // G)[None, :]
            s = tl.load(s_ptr + n[:, None] * (K // G) + g[None, :], mask=gmask, other=0).to(tl.float32)
            z = tl.load(z_ptr + n[:, None] * (K // G) + g[None, :], mask=gmask, other=0).to(tl.float32)
            acc += tl.sum(s * qx + (z - 8 * s) * xs[None, :], axis=1)
        tl.store(y_ptr + n, acc.to(y_ptr.dtype.element_ty), mask=nmask)

    @triton.jit
    def _int4_gemm(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                   G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        half = tl.arange(0, BLOCK_K // 2)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = k0 + 2 * half < K
            xmask = (m < M)[:, None] & kmask[None, :]
            xe = tl.load(x_ptr + m[:, None] * stride_xm + (k0 + 2 * half)[None, :], mask=xmask, other=0)
            xo = tl.load(x_ptr + m[:, None] * stride_xm + (k0 + 2 * half + 1)[None, :], mask=xmask, other=0)
            wmask = kmask[:, None] & (n < N)[None, :]
            b = tl.load(w_ptr + n[None, :] * (K // 2) + (k0 // 2 + half)[:, None], mask=wmask, other=0)
            g = (k0 + 2 * half) // G  # [BLOCK_K/2, BLOCK_N] scales: a column pair never straddles a group
            s = tl.load(s_ptr + n[None, :] * (K // G) + g[:, None], mask=wmask, other=0).to(tl.float32)
            z = tl.load(z_ptr + n[None, :] * (K // G) + g[:, None], mask=wmask, other=0).to(tl.float32)
            lo = (((b & 0xF).to(tl.float32) - 8) * s + z).to(xe.dtype)
            hi = (((b >> 4).to(tl.float32) - 8) * s + z).to(xe.dtype)
            acc = tl.dot(xe, lo, acc)
            acc = tl.dot(xo, hi, acc)
        ymask = (m < M)[:, None] & (n < N)[None, :]
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=ymask)

    @triton.jit
    def _int8_gemv(x_ptr, w_ptr, s_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nmask[:, None] & (k < K)[None, :], other=0)
            x = tl.load(x_ptr + k, mask=k < K, other=0).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        s = tl.load(s_ptr + n, mask=nmask, other=0).to(tl.float32)
        tl.store(y_ptr + n, (acc * s).to(y_ptr.dtype.element_ty), mask=nmask)

    @triton.jit
    def _int8_gemm(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0)
            w = tl.load(w_ptr + n[None, :] * K + k[:, None], mask=(k < K)[:, None] & (n < N)[None, :], other=0)
            acc = tl.dot(x, w.to(x.dtype), acc)  # int8 codes are exact in bf16/fp16; the scale comes after
        s = tl.load(s_ptr + n, mask=n < N, other=0).to(tl.float32)
        ymask = (m < M)[:, None] & (n < N)[None, :]
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], (acc * s[None, :]).to(y_ptr.dtype.element_ty),
                 mask=ymask)


def _gemm_blocks(M: int) -> dict:
    """Tile shape for the tiled kernels by the number of rows (tensor-core tiles need >= 16)."""
    if M <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8)


def _check(x: torch.Tensor, K: int) -> torch.Tensor:
    if x.shape[-1] != K:
        raise ValueError(f"activation has {x.shape[-1]} columns, the weight {K}")
    return x if x.stride(-1) == 1 else x.contiguous()


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """x [M, K] @ w.T for the int4 weight above; returns [M, N] in x's dtype."""
    N, K = packed.shape[0], packed.shape[1] * 2
    x = _check(x, K)
    M = x.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M <= GEMM_ROWS:
        cfg = dict(GEMV["int4"])
        cfg["BLOCK_K"] = max(cfg["BLOCK_K"], group_size)
        grid = (triton.cdiv(N, cfg["BLOCK_N"]),)
        for r in range(M):
            _int4_gemv[grid](x[r], packed, scales, zeros, y[r], N, K, G=group_size, **cfg)
        return y
    cfg = _gemm_blocks(M)
    cfg["BLOCK_K"] = max(cfg["BLOCK_K"], group_size)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]))
    _int4_gemm[grid](x, packed, scales, zeros, y, M, N, K, x.stride(0), y.stride(0), G=group_size, **cfg)
    return y


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (q * scales[:, None]).T; returns [M, N] in x's dtype."""
    N, K = q.shape
    x = _check(x, K)
    M = x.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M <= GEMM_ROWS:
        cfg = GEMV["int8"]
        grid = (triton.cdiv(N, cfg["BLOCK_N"]),)
        for r in range(M):
            _int8_gemv[grid](x[r], q, scales, y[r], N, K, **cfg)
        return y
    cfg = _gemm_blocks(M)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]))
    _int8_gemm[grid](x, q, scales, y, M, N, K, x.stride(0), y.stride(0), **cfg)
    return y
