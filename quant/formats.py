"""Quantized checkpoint formats: which one a config.json names, and the layer each one loads into.

Every format module (gptq_format, awq_format, bnb_format, mxfp4_format) exposes the same two functions:

    detect(qcfg: dict) -> bool
        True when config.json's `quantization_config` is this format's.
    load_linear(tensors: dict[str, Tensor], prefix: str, qcfg: dict, bias: Tensor | None) -> nn.Module | None
        The layer stored under `prefix` (e.g. "model.layers.0.self_attn.q_proj"): a QuantLinear
        built from `tensors[prefix + ".qweight"]` etc., or None when the checkpoint keeps that layer
        float (a plain `prefix + ".weight"`). It removes the keys it consumed from `tensors`.

Formats are imported lazily: loading a float model never imports a quantization module.
"""
from __future__ import annotations

import importlib

import torch
from torch import nn

from .errors import FormatError
from .linear import replace_modules

_MODULES = ("gptq_format", "awq_format", "bnb_format", "mxfp4_format")




def find_format(qcfg: dict):
    """The format module for a `quantization_config`, or a FormatError naming what it says."""
    for name in _MODULES:
        mod = importlib.import_module(f"{__package__}.{name}")
        if mod.detect(qcfg):
            return mod
    method = qcfg.get("quant_method", "?")
    raise FormatError(f"unsupported quantization_config (quant_method={method!r}); "
                      "brisk reads gptq, awq (GEMM), bitsandbytes (nf4, fp4, int8) and mxfp4 (gpt-oss)")


def load_quantized_linears(model: nn.Module, tensors: dict[str, torch.Tensor], qcfg: dict) -> list[str]:
    """Replace each nn.Linear of `model` (built on the meta device) that the checkpoint stores
    quantized by the format's layer; returns the names replaced. Float layers are left for the
    ordinary state-dict load."""
    fmt = find_format(qcfg)
    replaced = []

    def load(name, module):
        if not isinstance(module, nn.Linear) or f"{name}.weight" in tensors and not _is_packed(tensors, name):
            return None
        bias = tensors.pop(f"{name}.bias", None)
        layer = fmt.load_linear(tensors, name, qcfg, bias)
        if layer is None:
            if bias is not None:
                tensors[f"{name}.bias"] = bias
            return None
        replaced.append(name)
        return layer

    replace_modules(model, load)
    return replaced


def _is_packed(tensors: dict[str, torch.Tensor], name: str) -> bool:
    # bitsandbytes keeps the name `weight` for its packed data: uint8/int8, or any dtype with
    # bnb_4bit_quant_storage (e.g. bf16 for FSDP); its quant-state or SCB keys tell it apart.
    if tensors[f"{name}.weight"].dtype in (torch.uint8, torch.int8):
        return True
    return any(f"{name}.{k}" in tensors for k in ("weight.quant_state.bitsandbytes__nf4",
                                                  "weight.quant_state.bitsandbytes__fp4", "SCB"))
