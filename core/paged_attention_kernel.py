"""Paged-attention decode as a Triton kernel: one query token per row attends over that row's
blocks of the pool directly, without gathering them into a new tensor (the torch path in
model.paged_attention copies every decode row's whole cache once per layer per step).

One program per (row, kv head, split): it loads the G = H/KV query heads that share this kv head
as one [G, D] tile, so each K/V block is read once per group, and walks the row's keys in tiles
of BLOCK_N keys (several blocks, looked up in the block table key by key) with an online softmax
in float32 (flash-decoding). The grid depends only on shapes, never on `lengths`, and nothing
syncs with the host, so a call can be captured in a CUDA graph.

Split-K: with few rows, R * KV programs leave most of the GPU idle, so each row's keys can be
cut into `splits` chunks whose partial results (normalized output and log-sum-exp) a second small
kernel merges.

Triton is optional: this module imports without it; available() says whether it can be used.
"""
from __future__ import annotations

import functools

import torch

from ..quant.triton_runtime import load_triton

triton = load_triton()  # None on a CPU-only install or run: callers use the torch path
tl = None
if triton is not None:
    import triton.language as tl


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _decode_kernel(Q, K, V, BT, LENS, O, LSE, SINKS,
                       s_qr, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_bt,
                       s_or, s_oh, s_os, s_lr, s_lh,
                       qk_scale, window, n_splits, len_add,
                       G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                       PARTIAL: tl.constexpr, PREC: tl.constexpr, F32_DOT: tl.constexpr,
                       HAS_SINKS: tl.constexpr):
        r, g, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        gi = tl.arange(0, G_PAD)  # query heads of this group (padded: tl.dot wants >= 16 rows)
        d = tl.arange(0, D_PAD)
        dm = d < D
        hm = (gi < G)[:, None] & dm[None, :]
        heads = g * G + gi
        q = tl.load(Q + r * s_qr + heads[:, None] * s_qh + d[None, :], mask=hm, other=0.0)
        if F32_DOT:  # the interpreter's tl.dot multiplies bf16 as raw uint16 bits
            q = q.to(tl.float32)

        # The keys this row sees: [lo, length). Tiles are aligned to BLOCK_N, so every tile in
        # [t_lo, t_hi) holds at least one visible key and the running max never stays -inf.
        length = tl.load(LENS + r).to(tl.int32) + len_add
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(length - window, 0)
        t_lo = lo // BLOCK_N
        t_hi = tl.cdiv(length, BLOCK_N)
        per = tl.cdiv(t_hi - t_lo, n_splits)
        t_start = t_lo + s * per
        t_end = tl.minimum(t_start + per, t_hi)

        m = tl.full([G_PAD], float("-inf"), tl.float32)  # running max (base 2)
        l = tl.zeros([G_PAD], tl.float32)  # running sum of exp2
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        if HAS_SINKS:
            # Each head's sink, a key of logit sinks[h] (not scaled) and value 0, as if seen first:
            # max = sink, sum = 1. In split 0 only, so the combine counts it once.
            sink = tl.load(SINKS + heads, mask=gi < G, other=0.0).to(tl.float32) * 1.4426950408889634
            m = tl.where(s == 0, sink, m)
            l = tl.where(s == 0, 1.0, l)
        n = tl.arange(0, BLOCK_N)
        for t in range(t_start, t_end):
            p = t * BLOCK_N + n  # key positions of this tile
            ok = (p >= lo) & (p < length)
            # Block id per key: masked keys read nothing (not even the table), and their K/V
            # load as 0, so garbage (NaN) in unused slots can't reach the result.
            blk = tl.load(BT + r * s_bt + p // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
            off = p % BLOCK_SIZE
            km = ok[:, None] & dm[None, :]
            k = tl.load(K + blk[:, None] * s_kb + off[:, None] * s_ks + g * s_kh + d[None, :],
                        mask=km, other=0.0)
            if F32_DOT:
                k = k.to(tl.float32)
            sc = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [G_PAD, BLOCK_N]
            sc = tl.where(ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            alpha = tl.exp2(m - m_new)
            pr = tl.exp2(sc - m_new[:, None])  # 0 at masked keys
            l = l * alpha + tl.sum(pr, 1)
            v = tl.load(V + blk[:, None] * s_vb + off[:, None] * s_vs + g * s_vh + d[None, :],
                        mask=km, other=0.0)
            pv = pr.to(v.dtype)  # bf16/fp16 probabilities: the tensor-core P @ V
            if F32_DOT:
                pv, v = pv.to(tl.float32), v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PREC)
            m = m_new

        # l == 0 only for an empty split or a length-0 (padding) row: write 0, not NaN (with
        # sinks, such a row's split 0 holds the sink alone: 0 too).
        o = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        o_ptr = O + r * s_or + heads[:, None] * s_oh + s * s_os + d[None, :]
        if PARTIAL:
            tl.store(o_ptr, o, mask=hm)
            tl.store(LSE + r * s_lr + heads * s_lh + s, m + tl.log2(l), mask=gi < G)
        else:
            tl.store(o_ptr, o.to(O.dtype.element_ty), mask=hm)

    @triton.jit
    def _combine_kernel(OP, LSE, O, n_splits, s_pr, s_ph, s_ps, s_lr, s_lh, s_or, s_oh,
                        D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
        # Merge the splits of one (row, head): weights 2^(lse_s - max lse); an empty split has
        # lse = -inf and weight 0.
        r, h = tl.program_id(0), tl.program_id(1)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        sm = s < n_splits
        lse = tl.load(LSE + r * s_lr + h * s_lh + s, mask=sm, other=float("-inf"))
        mx = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx))
        o = tl.load(OP + r * s_pr + h * s_ph + s[:, None] * s_ps + d[None, :],
                    mask=sm[:, None] & (d < D)[None, :], other=0.0)
        den = tl.sum(w, 0)
        out = tl.sum(w[:, None] * o, 0) / tl.where(den == 0.0, 1.0, den)
        tl.store(O + r * s_or + h * s_oh + d, out.to(O.dtype.element_ty), mask=d < D)


@functools.cache
def _n_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _auto_splits(rows: int, kv: int, max_keys: int, device: torch.device) -> int:
    """Splits enough to give every SM two programs, but at least 256 keys per split; a power of
    two, so few combine-kernel variants get compiled. Depends on shapes only."""
    sms = _n_sms(device)
    splits = 1
    while splits < 64 and rows * kv * splits < 2 * sms and max_keys // (2 * splits) >= 256:
        splits *= 2
    return splits


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, scale: float,
                           window: int | None = None, out: torch.Tensor | None = None,
                           splits: int | None = None, lengths_add: int = 0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over a paged pool.

    q [R, H, D]; k_pool, v_pool [n_blocks, block_size, KV, D] (one layer, q's dtype);
    block_tables [R, max_blocks] int32/int64; lengths [R] (keys 0..length-1 are visible);
    window: attend only to positions > length - 1 - window. Returns out [R, H, D] in q's dtype.
    splits: chunks per row's keys (None: chosen from the shapes; 1: no combine pass).
    lengths_add: added to every length (pass positions as lengths with 1: no extra kernel for +1).
    sinks: None, or [H] logits (gpt-oss): each head's softmax also spans a key of logit sinks[h]
    (not scaled) whose value is zero.
    """
    if triton is None:
        raise RuntimeError("paged_decode_attention needs triton (pip install triton)")
    R, H, D = q.shape
    _, block_size, KV, Dk = k_pool.shape
    assert Dk == D and v_pool.shape == k_pool.shape and H % KV == 0, (q.shape, k_pool.shape)
    assert k_pool.dtype == v_pool.dtype == q.dtype, (q.dtype, k_pool.dtype)
    # the kernels index the last dimension with stride 1
    assert q.stride(2) == k_pool.stride(3) == v_pool.stride(3) == block_tables.stride(1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    assert sinks is None or (sinks.shape == (H,) and sinks.stride(0) == 1), (None if sinks is None else sinks.shape)
    if R == 0:
        return out
    G = H // KV
    G_PAD = max(16, triton.next_power_of_2(G))
    D_PAD = max(16, triton.next_power_of_2(D))
    BLOCK_N = 64 if D_PAD <= 128 else 32  # keys per tile: several blocks per load
    if splits is None:
        splits = _auto_splits(R, KV, block_tables.shape[1] * block_size, q.device)
    meta = dict(G=G, G_PAD=G_PAD, D=D, D_PAD=D_PAD, BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
                HAS_WINDOW=window is not None and window > 0, HAS_SINKS=sinks is not None,
                PREC="ieee" if q.dtype == torch.float32 else "tf32",  # fp32: no tf32 rounding
                F32_DOT=q.device.type == "cpu",  # CPU tensors: TRITON_INTERPRET=1
                num_warps=4, num_stages=2)
    qk_scale = scale * 1.4426950408889634  # exp2 in the kernel: fold in log2(e)
    sink_ptr = q if sinks is None else sinks  # never read without sinks
    strides = (q.stride(0), q.stride(1), *k_pool.stride()[:3], *v_pool.stride()[:3], block_tables.stride(0))
    if splits == 1:
        _decode_kernel[(R, KV, 1)](q, k_pool, v_pool, block_tables, lengths, out, out, sink_ptr, *strides,
                                   out.stride(0), out.stride(1), 0, 0, 0,
                                   qk_scale, window or 0, 1, lengths_add, PARTIAL=False, **meta)
        return out
    part = torch.empty((R, H, splits, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((R, H, splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(R, KV, splits)](q, k_pool, v_pool, block_tables, lengths, part, lse, sink_ptr, *strides,
                                    part.stride(0), part.stride(1), part.stride(2),
                                    lse.stride(0), lse.stride(1),
                                    qk_scale, window or 0, splits, lengths_add, PARTIAL=True, **meta)
    _combine_kernel[(R, H)](part, lse, out, splits, part.stride(0), part.stride(1), part.stride(2),
                            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
                            D=D, D_PAD=D_PAD, S_PAD=max(2, triton.next_power_of_2(splits)))
    return out
