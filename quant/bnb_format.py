"""bitsandbytes checkpoints: 4-bit NF4/FP4 (Linear4bit) and 8-bit LLM.int8 (Linear8bitLt), in the
layout transformers writes with `save_pretrained` after loading with a `BitsAndBytesConfig`.

4-bit, per layer `P` (weight [N, K], blocksize B, default 64):
    P.weight                                uint8 [N*K/2, 1]  codes, two per byte, the first (lower
                                                              flat index) in the high nibble
    P.weight.absmax                         float32 [N*K/B]   per-block absmax (no double quant), or
                                            uint8   [N*K/B]   its 8-bit code (double quant)
    P.weight.quant_map                      float32 [16]      the NF4 / FP4 codebook
    P.weight.nested_absmax                  float32 [ceil(N*K/B/256)]  (double quant only)
    P.weight.nested_quant_map               float32 [256]     bnb's signed dynamic 8-bit map (double quant)
    P.weight.quant_state.bitsandbytes__nf4  uint8 [*] UTF-8 JSON: quant_type, blocksize, dtype, shape
                                            (and nested_blocksize=256, nested_dtype, nested_offset)
    (`__fp4` for FP4.) The weight, flattened row-major, is cut into blocks of B values:
    w = quant_map[code] * absmax[block]; with double quant the absmax itself is
    nested_quant_map[absmax_code] * nested_absmax[absmax_block_of_256] + nested_offset.

8-bit, per layer `P`:
    P.weight          int8 [N, K]     round(w * 127 / SCB[row])
    P.SCB             float32 [N]     per-row absmax of the float weight
    P.weight_format   uint8 scalar    0 ("row"-major; the only layout bitsandbytes still writes)
    so w = weight * SCB / 127. brisk runs it as quant/linear.py's Int8Linear with
    scales = SCB / 127 (see Int8Linear note in `load_linear` on the bf16 rounding of that scale).

config.json's `quantization_config` is what transformers' BitsAndBytesConfig writes
(`quant_method: "bitsandbytes"`, `load_in_4bit` / `load_in_8bit`, `bnb_4bit_quant_type`, ...).
"""
from __future__ import annotations

import torch
from torch import nn

from .nf4 import NF4Linear  # noqa: F401  (the 4-bit layer: quant/nf4.py holds the codebooks and math)

QUANT_TYPES = ("nf4", "fp4")
METHODS = ("nf4", "fp4", "int8")


def detect(qcfg: dict) -> bool:
    """True when `quantization_config` is bitsandbytes' (4-bit or 8-bit)."""
    raise NotImplementedError


def quantization_config(method: str, double_quant: bool = True, blocksize: int = 64,
                        compute_dtype: str = "bfloat16", skip_modules: list[str] | None = None) -> dict:
    """The `quantization_config` BitsAndBytesConfig(...).to_dict() writes for `method`
    ("nf4", "fp4" or "int8"). `skip_modules` lists the layers kept float (e.g. ["lm_head"])."""
    raise NotImplementedError


def quantize_4bit(weight: torch.Tensor, quant_type: str = "nf4", blocksize: int = 64,
                  double_quant: bool = True) -> dict[str, torch.Tensor]:
    """Quantize one [N, K] weight as bitsandbytes does; returns the tensors transformers saves for a
    Linear4bit, keyed by suffix under the layer prefix: "weight", "weight.absmax", "weight.quant_map",
    ("weight.nested_absmax", "weight.nested_quant_map",) "weight.quant_state.bitsandbytes__<type>".
    The JSON's `dtype` is the weight's dtype (what bnb dequantizes to)."""
    raise NotImplementedError


def quantize_int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize one [N, K] weight as bitsandbytes' Int8Params: {"weight": int8, "SCB": float32 [N],
    "weight_format": uint8 0}."""
    raise NotImplementedError


def load_linear(tensors: dict[str, torch.Tensor], prefix: str, qcfg: dict,
                bias: torch.Tensor | None) -> nn.Module | None:
    """The layer stored under `prefix`: an NF4Linear (4-bit) or an Int8Linear (8-bit), or None where
    the checkpoint keeps the layer float. Removes the keys it consumed from `tensors`."""
    raise NotImplementedError
