"""The token embedding table stored as 8-bit codes with a scale per 32: brisk's own addition to a
quantized folder (`brisk quantize --embedding int8`).

Why: a small model's table is a large share of its bytes (SmolLM2-135M: 57 MB of a 116 MB 4-bit
folder at 16 bits; Gemma 3 270M: 62% of the model), and GPTQ, AWQ and bitsandbytes folders keep it
16-bit, so they lose on size to llama.cpp's files, whose table is Q8_0 or Q6_K. The grid is GGUF
Q8_0's (a float16 scale per 32 weights, codes -127..127): brisk loads the table as Q8_0 blocks, so a
tied output layer runs on the Q8_0 kernels and lookups read single rows. One scale per row, or one
per 64 weights, cost measurably more KL (bench/RESULTS.md). transformers and
vLLM cannot read such a folder (no format of theirs quantizes embeddings): config.json says so under
CONFIG_KEY, and brisk refuses a folder that names the key without the tensors.

Tensors: QWEIGHT int8 [vocab, dim], SCALES float16 [vocab, dim / 32]; weight j of row v is
QWEIGHT[v, j] * SCALES[v, j // 32].
"""
from __future__ import annotations

import numpy as np
import torch

from . import gguf_blocks
from .gguf_types import Q8_0

CONFIG_KEY = "brisk_embedding"
QWEIGHT, SCALES = "model.embed_tokens.qweight", "model.embed_tokens.scales"
GROUP = 32  # Q8_0's block


def quantize_table(table: torch.Tensor) -> dict[str, torch.Tensor]:
    """[vocab, dim] float -> {QWEIGHT, SCALES}, as GGUF's reference Q8_0 quantizer: d = the block's
    absmax / 127, codes x / d rounded half away from zero, d stored as float16."""
    w = table.detach().float().reshape(table.shape[0], -1, GROUP)
    d = w.abs().amax(dim=-1, keepdim=True) / 127
    x = w * torch.where(d == 0, 0.0, 1 / d)
    q = (x.sign() * (x.abs() + 0.5).floor()).to(torch.int8)
    return {QWEIGHT: q.reshape(table.shape), SCALES: d.squeeze(-1).half()}


def decoded(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 table those tensors hold (calibration runs on these values)."""
    q = tensors[QWEIGHT].float()
    return (q.reshape(q.shape[0], -1, GROUP) * tensors[SCALES].float()[..., None]).reshape(q.shape)


def config_entry() -> dict:
    return {"format": "q8_0_rows", "weight": QWEIGHT, "scales": SCALES, "group_size": GROUP,
            "note": "brisk's 8-bit token embedding (and tied output layer); transformers cannot load this folder"}


class EmbeddingFormatError(ValueError):
    pass


def q8_0_blocks(tensors: dict[str, torch.Tensor], entry, vocab: int, dim: int) -> np.ndarray:
    """The table (popped from tensors) as GGUF Q8_0 rows: uint8 [vocab, dim / 32 * 34], each block
    its float16 scale, then its 32 codes."""
    if not isinstance(entry, dict) or entry.get("format") != "q8_0_rows":
        raise EmbeddingFormatError(f"{CONFIG_KEY} must be {{\"format\": \"q8_0_rows\", ...}}, got {entry!r}"[:200])
    q, s = tensors.pop(QWEIGHT, None), tensors.pop(SCALES, None)
    if q is None or s is None:
        raise EmbeddingFormatError(f"config.json names an 8-bit embedding but {QWEIGHT if q is None else SCALES} is missing")
    if dim % GROUP or q.dtype != torch.int8 or tuple(q.shape) != (vocab, dim):
        raise EmbeddingFormatError(f"{QWEIGHT} must be int8 [{vocab}, {dim}], got {str(q.dtype).removeprefix('torch.')} {list(q.shape)}")
    if s.dtype != torch.float16 or tuple(s.shape) != (vocab, dim // GROUP):
        raise EmbeddingFormatError(f"{SCALES} must be float16 [{vocab}, {dim // GROUP}], got "
                                   f"{str(s.dtype).removeprefix('torch.')} {list(s.shape)}")
    if "model.embed_tokens.weight" in tensors:
        raise EmbeddingFormatError("the folder holds both a 16-bit and an 8-bit embedding table")
    return gguf_blocks.q8_0_rows(q, s).numpy()
