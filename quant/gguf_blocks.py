"""GGUF's Q4_0, Q4_1, Q8_0 and Q4_K blocks, repacked into the layers of quant/linear.py without a float copy.

Block layouts (ggml, little-endian, one row = consecutive blocks):
- Q4_0, 32 weights, 18 bytes: d (fp16), 16 bytes of codes;           w = d * (q - 8)
- Q4_1, 32 weights, 20 bytes: d (fp16), m (fp16), 16 bytes of codes;  w = d * q + m
- Q8_0, 32 weights, 34 bytes: d (fp16), 32 int8 codes;                w = d * q
- Q4_K, 256 weights, 144 bytes: d, dmin (fp16), 12 bytes of 6-bit scales sc[8] and mins m[8], one per
  sub-block of 32 weights, 128 bytes of codes;                       w = d * sc[j] * q - dmin * m[j]
In Q4_0/Q4_1 byte j holds weight j in its low nibble and weight j + 16 in its high nibble. Q4_K's codes
are 4 chunks of 32 bytes: chunk c holds weights 64c + i (low nibble) and 64c + 32 + i (high nibble).

The 4-bit codes carry over exactly into Int4Linear (w = (q - 8) * scale + zero, group 32):
Q4_0 is scale = d, zero = 0; Q4_1 is scale = d, zero = m + 8d; Q4_K is scale = d * sc[j],
zero = 8 * scale - dmin * m[j]. Scales and zeros are rounded to bf16, the type torch's CPU kernel takes.
Q8_0's per-block scales do not fit the int8 kernel's one scale per row, so Q8_0 is requantized per row
(int8 codes against the row's largest weight): close, not exact.
"""
from __future__ import annotations

import numpy as np
import torch

from . import gguf_types
from .gguf_types import Q4_0, Q4_1, Q4_K, Q8_0
from .linear import SCALE_DTYPE, Int4Linear, Int8Linear, quantize_int8

BLOCK = 32  # the group size of every layer built here (Q4_K's sub-block)
# the types repacked here (gguf_types.py's INT4 and INT8 fallbacks): (weights, bytes) per block
BLOCK_SHAPE = {t.id: (t.block_weights, t.block_bytes) for t in gguf_types.REPACKED}
SUPPORTED = tuple(BLOCK_SHAPE)


def fits(qtype: int, cols: int) -> bool:
    """Whether rows of `cols` weights of this type can be repacked (whole blocks per row)."""
    return qtype in BLOCK_SHAPE and cols % BLOCK_SHAPE[qtype][0] == 0


def _blocks(raw: np.ndarray, rows: int, cols: int, qtype: int) -> np.ndarray:
    """The raw bytes as [rows, blocks per row, block bytes]."""
    if not fits(qtype, cols):
        raise ValueError(f"row length {cols} is not a whole number of type {qtype} blocks")
    n, nbytes = BLOCK_SHAPE[qtype]
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.size != rows * cols // n * nbytes:
        raise ValueError(f"{raw.size} bytes for a [{rows}, {cols}] tensor of type {qtype}")
    return raw.reshape(rows, cols // n, nbytes)


def q8_0_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] and float16 scales [N, K / 32] -> GGUF Q8_0 rows, uint8 [N, K / 32 * 34]: each
    block its scale, then its 32 codes."""
    N, K = codes.shape
    blocks = torch.empty(N, K // 32, 34, dtype=torch.uint8)
    blocks[..., :2] = scales.to(torch.float16).contiguous().view(torch.uint8).view(N, K // 32, 2)
    blocks[..., 2:] = codes.to(torch.int8).contiguous().view(torch.uint8).view(N, K // 32, 32)
    return blocks.view(N, -1)


def q8_0_codes(rows: torch.Tensor) -> torch.Tensor:
    """The int8 codes [N, K] of Q8_0 rows (the inverse of q8_0_rows' first half)."""
    N = rows.shape[0]
    return rows.view(N, -1, 34)[..., 2:].contiguous().view(torch.int8).view(N, -1)


def _fp16(blocks: np.ndarray, at: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32))


def _codes(nibbles: np.ndarray) -> torch.Tensor:
    """ggml's 16 code bytes per block -> the codes [N, K] (0..15) in weight order."""
    q = np.concatenate((nibbles & 0xF, nibbles >> 4), axis=-1)  # weights 0..15, then 16..31
    return torch.from_numpy(q.reshape(nibbles.shape[0], -1))


def _q4_k(b: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks [rows, n, 144] -> codes [rows, n * 256] (0..15) in weight order, and per sub-block
    of 32 weights d * sc and dmin * m ([rows, n * 8], float32: fp16 times a 6-bit integer is exact)."""
    d, dmin = _fp16(b, 0)[..., None], _fp16(b, 2)[..., None]
    lo, hi, mix = b[..., 4:8], b[..., 8:12], b[..., 12:16]
    # sub-blocks 0..3 keep 6 bits in lo (scales) and hi (mins); 4..7 take 4 bits from mix and their top 2
    # bits from the spare top bits of lo and hi
    sc = np.concatenate((lo & 63, (mix & 15) | (lo >> 6 << 4)), axis=-1)
    m = np.concatenate((hi & 63, (mix >> 4) | (hi >> 6 << 4)), axis=-1)
    qs = b[..., 16:].reshape(*b.shape[:2], 4, 1, 32)
    q = np.concatenate((qs & 0xF, qs >> 4), axis=-2)  # [rows, n, chunk, low/high, 32]: weight order
    scale = d * torch.from_numpy(sc.astype(np.float32))
    mins = dmin * torch.from_numpy(m.astype(np.float32))
    return torch.from_numpy(q.reshape(b.shape[0], -1)), scale.flatten(1), mins.flatten(1)


def to_int4(raw: np.ndarray, rows: int, cols: int, qtype: int) -> Int4Linear:
    b = _blocks(raw, rows, cols, qtype)
    if qtype == Q4_K:
        q, scale, mins = _q4_k(b)
        # float32 first, then one bf16 rounding each, as Q4_1's m + 8d
        return Int4Linear.from_codes(q, scale.to(SCALE_DTYPE), (8 * scale - mins).to(SCALE_DTYPE), BLOCK)
    d = _fp16(b, 0)
    if qtype == Q4_0:
        zeros, nibbles = torch.zeros_like(d), b[..., 2:]
    elif qtype == Q4_1:
        zeros, nibbles = _fp16(b, 2) + 8 * d, b[..., 4:]
    else:
        raise ValueError(f"ggml type {qtype} is not a 4-bit type")
    return Int4Linear.from_codes(_codes(nibbles), d.to(SCALE_DTYPE), zeros.to(SCALE_DTYPE), BLOCK)


def dequantize(raw: np.ndarray, rows: int, cols: int, qtype: int) -> torch.Tensor:
    """Float32 [rows, cols] weights of a supported tensor (the reference for the repacking)."""
    b = _blocks(raw, rows, cols, qtype)
    if qtype == Q4_K:  # ggml's own order of operations: d * sc * q - dmin * m
        q, scale, mins = _q4_k(b)
        w = scale[..., None] * q.float().view(rows, -1, BLOCK) - mins[..., None]
        return w.reshape(rows, cols)
    d = _fp16(b, 0)[..., None]
    if qtype == Q8_0:
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.float32))
        return (d * q).reshape(rows, cols)
    codes = b[..., 2:] if qtype == Q4_0 else b[..., 4:]
    q = torch.from_numpy(np.concatenate((codes & 0xF, codes >> 4), axis=-1).astype(np.float32))
    w = d * (q - 8) if qtype == Q4_0 else d * q + _fp16(b, 2)[..., None]
    return w.reshape(rows, cols)


def to_layer(raw: np.ndarray, rows: int, cols: int, qtype: int):
    """The quantized layer for one GGUF weight: Int4Linear for Q4_0/Q4_1/Q4_K, Int8Linear for Q8_0."""
    if qtype == Q8_0:
        return Int8Linear(*quantize_int8(dequantize(raw, rows, cols, qtype)))
    return to_int4(raw, rows, cols, qtype)


def permute_rows(raw: np.ndarray, rows: int, order: torch.Tensor) -> np.ndarray:
    """Reorder whole rows of a quantized tensor (blocks never straddle rows, so this is exact)."""
    return np.asarray(raw, dtype=np.uint8).reshape(rows, -1)[order.numpy()]


# ---------------------------------------------------------------- a load cache for repacked layers
# Repacking 200 layers into the kernel's layout costs seconds; the result is saved once (per torch
# version: the kernel layout is torch's own) and memory-mapped on later loads.

def layer_state(name: str, layer) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and a JSON-able description from which restore_layer rebuilds `layer`."""
    if isinstance(layer, Int8Linear):
        return {f"{name}.weight": layer.weight, f"{name}.scales": layer.scales}, {"kind": "int8"}
    kernel = layer.kernel_data()
    data = {f"{name}.scales": layer.scales, f"{name}.zeros": layer.zeros,
            f"{name}.codes": layer.weight if kernel is None else kernel}
    return data, {"kind": "int4", "group": layer.group_size, "kernel": kernel is not None,
                  "shape": [layer.out_features, layer.in_features]}


def restore_layer(name: str, tensors: dict[str, torch.Tensor], desc: dict):
    if desc["kind"] == "int8":
        return Int8Linear(tensors[f"{name}.weight"], tensors[f"{name}.scales"])
    codes, scales, zeros = (tensors[f"{name}.{k}"] for k in ("codes", "scales", "zeros"))
    if desc["kernel"]:
        return Int4Linear(None, scales, zeros, desc["group"], kernel_data=codes, shape=tuple(desc["shape"]))
    return Int4Linear(codes, scales, zeros, desc["group"])
