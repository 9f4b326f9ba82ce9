"""Fused dequantize-matmul kernels (Triton) for the quantized layers of quant/linear.py on a GPU.

Layouts (the layers' own buffers, nothing repacked):
- int4: codes two per byte along K, [N, K/2] uint8, even column in the low nibble; per group of G
  input columns a scale and a zero, [N, K/G]: w = (q - 8) * scale + zero.
- int8: codes [N, K] int8, one scale per output row: w = q * scale.
- int4 "planes" (Int4Linear's opt-in CUDA layout, packed at load): int32 words [N, K/8], each
  block of 128 columns as 16 words whose nibble j holds columns 16j..16j+15, so that a nibble
  plane is a ready [BLOCK_N, 16] operand for the tensor cores; scales and zeros [K/G, N, 2].

Decode multiplies one activation row by each weight, so its time is the time to read the weight
once: the GEMV kernels stream the codes in wide tiles, do the per-group arithmetic on partial sums
(sum q*x and sum x per group, then one scale and zero per group instead of per weight) and never
write a dequantized copy. More rows (speculative verification, batched decode, prefill) go through
a tiled kernel that dequantizes each weight tile in registers and feeds the tensor cores. The
planes kernel reads each weight once for up to 64 rows: its time is flat from 1 to 16 rows, where
torch's tinygemm grows with them (at 1 row tinygemm is ~2x faster: bench/RESULTS.md).

The kernels run under TRITON_INTERPRET=1 on CPU tensors too: that is how CI checks them.
"""
from __future__ import annotations

import functools

import torch

from .triton_runtime import load_triton

triton = load_triton()  # None without triton or a GPU: layers fall back to dequantize + F.linear
if triton is not None:
    import triton.language as tl


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


    @triton.jit
    def _int4_planes(x_ptr, w_ptr, sz_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sg, stride_ys, stride_ym,
                     G: tl.constexpr, BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     IEEE: tl.constexpr):
        # Program (n tile, m tile, k split) computes out.T = W @ x.T: the weights are the tensor
        # cores' left operand, unpacked in registers (nibble plane j of a block's 16 words is its
        # 16 columns 16j..16j+15, so no reshuffle), the few activation rows the right one. Each
        # word is read once for all BLOCK_M rows; per group, one scale and zero on the float32
        # partial sums (the codes 0..15 are exact in bf16).
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        nmask, mmask = n < N, m < M
        n_blocks = tl.cdiv(K, 128)
        per = tl.cdiv(tl.cdiv(n_blocks, tl.num_programs(2)), BLOCKS) * BLOCKS
        b_lo = tl.program_id(2) * per
        b_hi = tl.minimum(b_lo + per, n_blocks)
        c = tl.arange(0, 16)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for b0 in range(b_lo, b_hi, BLOCKS):
            for i in tl.static_range(BLOCKS):
                b = b0 + i
                live = b < b_hi
                words = tl.load(w_ptr + n[:, None] * stride_wn + (b * 16 + c)[None, :], mask=nmask[:, None] & live,
                                other=0)
                part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                xsum = tl.zeros([BLOCK_M], dtype=tl.float32)
                for j in tl.static_range(8):
                    k = b * 128 + 16 * j + c
                    xt = tl.load(x_ptr + m[None, :] * stride_xm + k[:, None],
                                 mask=(k < K)[:, None] & mmask[None, :] & live, other=0)
                    q = (words >> (4 * j)) & 0xF
                    if IEEE:
                        part += tl.dot(q.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
                    else:
                        part += tl.dot(q.to(xt.dtype), xt)
                    xsum += tl.sum(xt.to(tl.float32), axis=0)
                    if (16 * (j + 1)) % G == 0 or j == 7:  # a group (or this block's share of one) ends
                        g = (b * 128 + 16 * j) // G
                        gmask = nmask & live & (g < K // G)
                        s = tl.load(sz_ptr + g * stride_sg + n * 2, mask=gmask, other=0).to(tl.float32)
                        z = tl.load(sz_ptr + g * stride_sg + n * 2 + 1, mask=gmask, other=0).to(tl.float32)
                        acc += part * s[:, None] + (z - 8 * s)[:, None] * xsum[None, :]
                        part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                        xsum = tl.zeros([BLOCK_M], dtype=tl.float32)
        ymask = nmask[:, None] & mmask[None, :]
        tl.store(y_ptr + tl.program_id(2) * stride_ys + m[None, :] * stride_ym + n[:, None],
                 acc.to(y_ptr.dtype.element_ty), mask=ymask)


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


def pack_int4_planes(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) as int32 words [N, 16 * ceil(K/128)]: in each block of 128 columns,
    word c holds columns 16j + c in bits 4j..4j+3 (j = 0..7). K is padded with code 0 to whole
    blocks (the kernel masks those columns' activations, so they add nothing)."""
    N, K = q.shape
    blocks = -(-K // 128)
    planes = torch.zeros(N, blocks * 128, dtype=torch.int32, device=q.device)
    planes[:, :K] = q
    planes = planes.view(N, blocks, 8, 16)
    words = planes[:, :, 0]
    for j in range(1, 8):  # disjoint bit fields; the top nibble wraps into int32's sign bit
        words = words | (planes[:, :, j] << (4 * j))
    return words.reshape(N, blocks * 16).contiguous()


def unpack_int4_planes(words: torch.Tensor, K: int) -> torch.Tensor:
    """pack_int4_planes' inverse: codes [N, K] uint8."""
    N = words.shape[0]
    shifts = 4 * torch.arange(8, device=words.device, dtype=torch.int32)
    planes = (words.view(N, -1, 1, 16) >> shifts[None, None, :, None]) & 0xF
    return planes.reshape(N, -1)[:, :K].to(torch.uint8).contiguous()


# Launch shapes of the planes kernel by rows (up to 16, more): the best summed time over Llama-3-8B's
# four matrix shapes in `bench/gpu.py --sections planes --sweep` on an H100 (bench/RESULTS.md).
PLANES = {16: dict(BLOCK_N=128, BLOCKS=1, WAVES=4, num_warps=4, num_stages=2),
          64: dict(BLOCK_N=128, BLOCKS=1, WAVES=4, num_warps=4, num_stages=4)}


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count if torch.cuda.is_available() else 1


def int4_planes_matmul(x: torch.Tensor, words: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                       cfg: dict | None = None) -> torch.Tensor:
    """x [M, K] @ w.T for codes in pack_int4_planes' words and scales_zeros [K/G, N, 2]
    (w = (q - 8) * scale + zero); returns [M, N] in x's dtype. Each weight word is read once for
    up to 64 rows; the K range is split across programs when the N tiles alone would leave the
    GPU's multiprocessors idle, the split partial sums then added in a fixed order."""
    N, G = words.shape[0], group_size
    K = x.shape[-1]
    if words.shape[1] != 16 * -(-K // 128):
        raise ValueError(f"activation has {K} columns, the weight {words.shape[1] // 16 * 128} (padded)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    M = x.shape[0]
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    c = dict(cfg or PLANES[16 if M <= 16 else 64])
    block_n, waves, blocks = c.pop("BLOCK_N"), c.pop("WAVES"), c.pop("BLOCKS")
    n_blocks = words.shape[1] // 16
    split = c.pop("SPLIT", None)  # given: tests force a split on the CPU
    if split is None:
        split = 1
        if x.is_cuda and waves:  # enough programs for `waves` per multiprocessor, no split left empty
            tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
            want = min(triton.cdiv(waves * _sm_count(x.device.index or 0), tiles), n_blocks // blocks)
            split = triton.cdiv(n_blocks, triton.cdiv(triton.cdiv(n_blocks, max(want, 1)), blocks) * blocks)
    if words.stride(1) != 1 or scales_zeros.stride(1) != 2 or scales_zeros.stride(2) != 1:
        raise ValueError("planes: words must be contiguous along K, scales and zeros along N")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if split == 1 else \
        torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m), split)
    _int4_planes[grid](x, words, scales_zeros, out, M, N, K, x.stride(0), words.stride(0), scales_zeros.stride(0),
                       out.stride(0) if split > 1 else 0, out.stride(-2), G=G, BLOCKS=blocks, BLOCK_M=block_m,
                       BLOCK_N=block_n, IEEE=x.dtype == torch.float32, **c)
    return out if split == 1 else out.sum(0).to(x.dtype)


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
