"""MXFP4 as Hugging Face's gpt-oss checkpoints store it, repacked into GGUF's MXFP4 blocks (the
layout brisk's kernels read, kernels/gguf_types.h) without changing a value.

Both hold, per group of 32 weights, 32 4-bit e2m1 codes (sign, 2 exponent bits, 1 mantissa bit)
and one E8M0 exponent byte e. Hugging Face: `*_blocks` uint8 [..., rows, groups, 16] with weight
2j in byte j's low nibble and 2j + 1 in its high one, `*_scales` uint8 [..., rows, groups], and
w = e2m1(code) * 2^(e - 127). GGUF: a 17-byte block, e first, then 16 bytes with weight j in byte
j's low nibble and j + 16 in its high one, w = 2 e2m1(code) * 2^(e - 128): the same w for the same
code and e, so only the nibbles move."""
from __future__ import annotations

import torch

from .gguf_types import BY_ID, MXFP4

BLOCK_BYTES = BY_ID[MXFP4].block_bytes


def gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Hugging Face's blocks [..., rows, groups, 16] and scales [..., rows, groups] -> GGUF rows
    uint8 [..., rows, groups * 17]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # [..., 32], weights in order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales[..., None], packed], dim=-1).flatten(-2)


# ---------------------------------------------------------------- the checkpoint format (formats.py)

SUFFIX = ".gguf_mxfp4"  # an expert projection's GGUF rows, as core/arch/gpt_oss.py hands them over


def detect(qcfg: dict) -> bool:
    return str(qcfg.get("quant_method", "")).lower() == "mxfp4"


def load_linear(tensors: dict[str, torch.Tensor], prefix: str, qcfg: dict, bias: torch.Tensor | None):
    """An expert projection kept in MXFP4 (GGUFLinear over its blocks); None for the layers the
    checkpoint keeps in bf16 (attention, routers, embeddings)."""
    from . import gguf_interleave, native
    from .gguf_linear import GGUFLinear

    rows = tensors.pop(prefix + SUFFIX, None)
    if rows is None:
        return None
    N, K = rows.shape[0], rows.shape[1] // BLOCK_BYTES * 32
    if native.available() and native.interleaves(MXFP4, N, K):  # as a GGUF's MXFP4 loads
        return GGUFLinear(gguf_interleave.pack(rows.contiguous(), MXFP4), MXFP4, N, K, bias, layout=native.X8)
    return GGUFLinear(rows.contiguous(), MXFP4, N, K, bias)
