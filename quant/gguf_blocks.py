"""GGUF's Q4_0, Q4_1 and Q8_0 blocks, repacked into the layers of quant/linear.py without a float copy.

Block layouts (ggml, 32 weights a block, little-endian, one row = K/32 consecutive blocks):
- Q4_0, 18 bytes: d (fp16), 16 bytes of codes;                 w = d * (q - 8)
- Q4_1, 20 bytes: d (fp16), m (fp16), 16 bytes of codes;        w = d * q + m
- Q8_0, 34 bytes: d (fp16), 32 int8 codes;                      w = d * q
In the 4-bit blocks byte j holds weight j in its low nibble and weight j + 16 in its high nibble.

The 4-bit codes carry over exactly into Int4Linear (w = (q - 8) * scale + zero, group 32):
Q4_0 is scale = d, zero = 0 and Q4_1 is scale = d, zero = m + 8d. The scales are rounded from fp16 to
bf16, the type torch's CPU kernel takes. Q8_0's per-block scales do not fit the int8 kernel's one scale per
row, so Q8_0 is requantized per row (int8 codes against the row's largest weight): close, not exact.
"""
from __future__ import annotations

import numpy as np
import torch

from .linear import SCALE_DTYPE, Int4Linear, Int8Linear, quantize_int8

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # ggml type ids
BLOCK = 32
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
SUPPORTED = tuple(BLOCK_BYTES)


def _blocks(raw: np.ndarray, rows: int, cols: int, qtype: int) -> np.ndarray:
    """The raw bytes as [rows, cols/32, block bytes]."""
    if cols % BLOCK:
        raise ValueError(f"row length {cols} is not a multiple of {BLOCK}")
    nbytes = BLOCK_BYTES[qtype]
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.size != rows * cols // BLOCK * nbytes:
        raise ValueError(f"{raw.size} bytes for a [{rows}, {cols}] tensor of type {qtype}")
    return raw.reshape(rows, cols // BLOCK, nbytes)


def _fp16(blocks: np.ndarray, at: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32))


def _codes(nibbles: np.ndarray) -> torch.Tensor:
    """ggml's 16 code bytes per block -> the codes [N, K] (0..15) in weight order."""
    q = np.concatenate((nibbles & 0xF, nibbles >> 4), axis=-1)  # weights 0..15, then 16..31
    return torch.from_numpy(q.reshape(nibbles.shape[0], -1))


def to_int4(raw: np.ndarray, rows: int, cols: int, qtype: int) -> Int4Linear:
    b = _blocks(raw, rows, cols, qtype)
    d = _fp16(b, 0)
    if qtype == Q4_0:
        zeros, nibbles = torch.zeros_like(d), b[..., 2:]
    elif qtype == Q4_1:
        zeros, nibbles = _fp16(b, 2) + 8 * d, b[..., 4:]
    else:
        raise ValueError(f"ggml type {qtype} is not a 4-bit type")
    return Int4Linear.from_codes(_codes(nibbles), d.to(SCALE_DTYPE), zeros.to(SCALE_DTYPE), BLOCK)


def dequantize(raw: np.ndarray, rows: int, cols: int, qtype: int) -> torch.Tensor:
    """Float32 [rows, cols] weights of a Q4_0/Q4_1/Q8_0 tensor (the reference for the repacking)."""
    b = _blocks(raw, rows, cols, qtype)
    d = _fp16(b, 0)[..., None]
    if qtype == Q8_0:
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.float32))
        return (d * q).reshape(rows, cols)
    codes = b[..., 2:] if qtype == Q4_0 else b[..., 4:]
    q = torch.from_numpy(np.concatenate((codes & 0xF, codes >> 4), axis=-1).astype(np.float32))
    w = d * (q - 8) if qtype == Q4_0 else d * q + _fp16(b, 2)[..., None]
    return w.reshape(rows, cols)


def to_layer(raw: np.ndarray, rows: int, cols: int, qtype: int):
    """The quantized layer for one GGUF weight: Int4Linear for Q4_0/Q4_1, Int8Linear for Q8_0."""
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
