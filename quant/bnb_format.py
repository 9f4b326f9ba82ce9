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
    P.SCB             float32 [N]     per-row absmax of the float weight (any positive scale:
                                      values beyond it are stored clipped to +-127)
    P.weight_format   uint8 scalar    0 ("row"-major; the only layout bitsandbytes still writes)
    so w = weight * SCB / 127. brisk runs it as quant/linear.py's Int8Linear with
    scales = SCB / 127 rounded to bf16 (the scale dtype torch's CPU int8 kernel takes): the int8
    values are kept as stored, each row's scale is off by at most 2^-9 relative.

config.json's `quantization_config` is what transformers' BitsAndBytesConfig writes
(`quant_method: "bitsandbytes"`, `load_in_4bit` / `load_in_8bit`, `bnb_4bit_quant_type`, ...).
"""
from __future__ import annotations

import json

import torch
from torch import nn

from .errors import FormatError
from .linear import Int8Linear, SCALE_DTYPE
from .nf4 import (NESTED_BLOCKSIZE, NF4Linear, codebook, double_quantize, dynamic_code,  # noqa: F401
                  gptq_blockwise_4bit, quantize_blockwise_4bit, undo_double_quant)

QUANT_TYPES = ("nf4", "fp4")
METHODS = ("nf4", "fp4", "int8")
_FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def detect(qcfg: dict) -> bool:
    """True when `quantization_config` is bitsandbytes' (4-bit or 8-bit)."""
    method = qcfg.get("quant_method")
    if method is None:  # configs from before transformers wrote quant_method
        return bool(qcfg.get("load_in_4bit") or qcfg.get("load_in_8bit"))
    return method == "bitsandbytes"


def quantization_config(method: str, double_quant: bool = True, blocksize: int = 64,
                        compute_dtype: str = "bfloat16", skip_modules: list[str] | None = None) -> dict:
    """The `quantization_config` BitsAndBytesConfig(...).to_dict() writes for `method`
    ("nf4", "fp4" or "int8"). `skip_modules` lists the layers kept float (e.g. ["lm_head"]).
    BitsAndBytesConfig has no blocksize field: each layer's quant_state records it (64 is what
    transformers itself uses), so only 64 is accepted here."""
    if method not in METHODS:
        raise ValueError(f"unknown bitsandbytes method {method!r}; use one of {', '.join(METHODS)}")
    if blocksize != 64:
        raise ValueError("bitsandbytes checkpoints that transformers loads use blocksize 64")
    four = method != "int8"
    return {
        "quant_method": "bitsandbytes",
        "_load_in_8bit": not four,
        "_load_in_4bit": four,
        "llm_int8_threshold": 6.0,
        "llm_int8_skip_modules": skip_modules,
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
        "bnb_4bit_quant_type": method if four else "fp4",  # transformers' default when unused
        "bnb_4bit_use_double_quant": bool(double_quant) and four,
        "bnb_4bit_compute_dtype": compute_dtype if four else "float32",
        "bnb_4bit_quant_storage": "uint8",
        "load_in_4bit": four,
        "load_in_8bit": not four,
    }


def json_tensor(d: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(d).encode("utf-8")), dtype=torch.uint8).clone()


def quantize_4bit(weight: torch.Tensor, quant_type: str = "nf4", blocksize: int = 64,
                  double_quant: bool = True, hessian: torch.Tensor | None = None,
                  damp: float = 0.01) -> dict[str, torch.Tensor]:
    """Quantize one [N, K] weight as bitsandbytes does; returns the tensors transformers saves for a
    Linear4bit, keyed by suffix under the layer prefix: "weight", "weight.absmax", "weight.quant_map",
    ("weight.nested_absmax", "weight.nested_quant_map",) "weight.quant_state.bitsandbytes__<type>".
    The JSON's `dtype` is the weight's dtype (what bnb dequantizes to). The 4-bit codes and the absmax
    equal bitsandbytes' bit for bit; with double quantization the absmax codes are the nearest
    entries of the 8-bit map, where bnb's search is approximate (a code may differ by one step).
    hessian [K, K] (GPTQ's, of the layer's calibration inputs): codes and absmax chosen by GPTQ
    instead (nf4.gptq_blockwise_4bit), the same tensors; a K that blocks straddle is rounded."""
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"unknown 4-bit type {quant_type!r}; use nf4 or fp4")
    if weight.dtype not in _FLOAT_DTYPES.values():
        raise ValueError(f"cannot quantize a {weight.dtype} weight")
    dq = None
    if hessian is not None and weight.dim() == 2 and weight.shape[1] % blocksize == 0:
        packed, absmax, dq = gptq_blockwise_4bit(weight, hessian, quant_type, blocksize, double_quant, damp)
    else:
        packed, absmax = quantize_blockwise_4bit(weight, quant_type, blocksize)
        if double_quant:
            dq = double_quantize(absmax)
    state = {"quant_type": quant_type, "blocksize": blocksize,
             "dtype": str(weight.dtype).removeprefix("torch."), "shape": list(weight.shape)}
    out = {"weight": packed.view(-1, 1), "weight.absmax": absmax, "weight.quant_map": codebook(quant_type)}
    if dq is not None:
        q, nested, offset = dq
        out.update({"weight.absmax": q, "weight.nested_absmax": nested, "weight.nested_quant_map": dynamic_code().clone()})
        state.update({"nested_blocksize": NESTED_BLOCKSIZE, "nested_dtype": "float32", "nested_offset": offset})
    out[f"weight.quant_state.bitsandbytes__{quant_type}"] = json_tensor(state)
    return out


# GPTQ int8's row-scale search: 255 levels leave little to clip, so finer and shallower than 4-bit's.
INT8_SHRINK = tuple(1 - i / 100 for i in range(31))


def quantize_int8(weight: torch.Tensor, hessian: torch.Tensor | None = None,
                  damp: float = 0.01) -> dict[str, torch.Tensor]:
    """Quantize one [N, K] weight as bitsandbytes' Int8Params: {"weight": int8, "SCB": float32 [N],
    "weight_format": uint8 0}: SCB is each row's absmax, weight = round(w * 127 / SCB).
    Like bitsandbytes, the weight is first rounded to float16 (where it fits), so the result is
    bitsandbytes' bit for bit.
    hessian [K, K] (GPTQ's, of the layer's calibration inputs): the codes and each row's scale
    chosen by GPTQ instead, the scale searched (it may clip the row's largest values) and a bf16
    value, so that SCB / 127 is what both bitsandbytes (SCB / 127) and brisk (bf16 row scales)
    decode."""
    w = weight.detach()
    if w.abs().max() <= torch.finfo(torch.float16).max:
        w = w.to(torch.float16)
    w = w.float()
    if hessian is not None:
        from .gptq import GPTQ, CodebookGrid

        grid = CodebookGrid(torch.arange(-127, 128, dtype=torch.float32),
                            lambda s, group: (s.to(SCALE_DTYPE).float(),), INT8_SHRINK)
        c = GPTQ.with_hessian(w, hessian).run(grid, -1, damp=damp)
        # a bf16 scale times 127 is exact in float32, and float32 SCB / 127 gives the scale back
        return {"weight": (c.q - 127).to(torch.int8), "SCB": c.params[0][0] * 127,
                "weight_format": torch.tensor(0, dtype=torch.uint8)}
    scb = w.abs().amax(dim=1)
    q = torch.round(w * (127.0 / scb.clamp(min=1e-30))[:, None]).clamp(-127, 127).to(torch.int8)
    return {"weight": q, "SCB": scb, "weight_format": torch.tensor(0, dtype=torch.uint8)}


def load_linear(tensors: dict[str, torch.Tensor], prefix: str, qcfg: dict,
                bias: torch.Tensor | None) -> nn.Module | None:
    """The layer stored under `prefix`: an NF4Linear (4-bit) or an Int8Linear (8-bit), or None where
    the checkpoint keeps the layer float. Removes the keys it consumed from `tensors`."""
    state_keys = [f"{prefix}.weight.quant_state.bitsandbytes__{t}" for t in QUANT_TYPES]
    found = [k for k in state_keys if k in tensors]
    if found:
        return _load_4bit(tensors, prefix, found[0], bias)
    if f"{prefix}.SCB" in tensors:
        return _load_int8(tensors, prefix, bias)
    w = tensors.get(f"{prefix}.weight")
    if w is not None and w.dtype in (torch.uint8, torch.int8):
        raise FormatError(f"{prefix}: packed bitsandbytes weight without its quant_state / SCB")
    return None


def _pop(tensors: dict, key: str, real: bool | None = None) -> torch.Tensor:
    """tensors[key], removed; real=True: it must hold floating-point numbers (a scale, a code book),
    real=False: integers (codes), as an integer tensor read as scales is another format's bytes."""
    try:
        t = tensors.pop(key)
    except KeyError:
        raise FormatError(f"bitsandbytes checkpoint lacks {key}") from None
    if real is not None and t.is_floating_point() != real:
        raise FormatError(f"{key} is {str(t.dtype).removeprefix('torch.')}, not "
                          + ("a floating-point tensor" if real else "an integer tensor"))
    return t


def _load_4bit(tensors: dict, prefix: str, state_key: str, bias) -> NF4Linear:
    try:
        state = json.loads(bytes(tensors.pop(state_key).to(torch.uint8).cpu().numpy()).decode("utf-8"))
        quant_type, blocksize = state["quant_type"], int(state["blocksize"])
        N, K = (int(d) for d in state["shape"])
    except (ValueError, KeyError, TypeError) as e:
        raise FormatError(f"{state_key}: unreadable quant_state ({e})") from None
    if quant_type not in QUANT_TYPES:
        raise FormatError(f"{prefix}: unknown 4-bit type {quant_type!r}")
    if blocksize <= 0 or N <= 0 or K <= 0:
        raise FormatError(f"{state_key}: quant_state shape [{N}, {K}] or blocksize {blocksize} is not positive")
    packed = _pop(tensors, f"{prefix}.weight")
    if packed.dtype != torch.uint8:  # bnb_4bit_quant_storage other than uint8: the same bytes
        packed = packed.contiguous().view(-1).view(torch.uint8)
    double = f"{prefix}.weight.nested_absmax" in tensors
    # (flattened: a unit dimension more or less is the same vector)
    absmax = _pop(tensors, f"{prefix}.weight.absmax", real=not double).reshape(-1)  # double quantization: 8-bit codes
    if double and absmax.dtype != torch.uint8:  # codes that index the nested code book
        raise FormatError(f"{prefix}.weight.absmax is {str(absmax.dtype).removeprefix('torch.')}, not the uint8 codes "
                          "of double quantization")
    code = _pop(tensors, f"{prefix}.weight.quant_map", real=True).float().reshape(-1)
    if double:
        nested = _pop(tensors, f"{prefix}.weight.nested_absmax", real=True).reshape(-1)
        nested_code = _pop(tensors, f"{prefix}.weight.nested_quant_map", real=True).reshape(-1)
        try:
            offset, nested_blocksize = float(state["nested_offset"]), int(state.get("nested_blocksize", NESTED_BLOCKSIZE))
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{state_key}: double-quantized layer without a valid nested_offset") from None
        if nested_blocksize <= 0 or nested_code.numel() != 256 or nested.numel() != -(-absmax.numel() // nested_blocksize):
            raise FormatError(f"{prefix}: double-quantization tensors do not match the {absmax.numel()} absmax codes "
                              f"and nested blocksize {nested_blocksize}")
        absmax = undo_double_quant(absmax, nested, nested_code, offset, nested_blocksize)
    n = N * K
    if packed.numel() != (n + 1) // 2 or absmax.numel() != -(-n // blocksize) or code.numel() != 16:
        raise FormatError(f"{prefix}: 4-bit tensors do not match the shape [{N}, {K}] and blocksize {blocksize}")
    return NF4Linear(packed, absmax.float(), code, (N, K), blocksize, quant_type, bias)


def _load_int8(tensors: dict, prefix: str, bias) -> Int8Linear:
    weight, scb = _pop(tensors, f"{prefix}.weight"), _pop(tensors, f"{prefix}.SCB", real=True)
    fmt = tensors.pop(f"{prefix}.weight_format", None)
    if fmt is not None and (fmt.numel() != 1 or int(fmt.reshape(-1)[0]) != 0):  # 0 = row-major; the tiled GPU layouts are gone
        raise FormatError(f"{prefix}: int8 weight_format {fmt.reshape(-1).tolist()[:4]} (only row-major 0 is supported)")
    if weight.dtype != torch.int8 or weight.dim() != 2 or scb.shape != (weight.shape[0],):
        raise FormatError(f"{prefix}: int8 weight {tuple(weight.shape)} {weight.dtype} does not match SCB {tuple(scb.shape)}")
    return Int8Linear(weight.contiguous(), (scb.float() / 127).to(SCALE_DTYPE), bias)
