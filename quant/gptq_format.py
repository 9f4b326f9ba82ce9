"""The GPTQ checkpoint layout, as GPTQModel, AutoGPTQ and transformers write it and vLLM reads it.

Per quantized linear layer `prefix` (N = out_features, K = in_features, G groups, b bits):
    prefix.qweight  int32 [K*b/32, N]  codes packed along K (packing.py's bit stream)
    prefix.qzeros   int32 [G, N*b/32]  zero points packed along N, stored MINUS ONE (the "v1"
                                       format, checkpoint_format "gptq"); "gptq_v2" stores them as is
    prefix.scales   fp16  [G, N]
    prefix.g_idx    int32 [K]          the group of each input column: k // group_size, or any
                                       order with act-order (desc_act); G = ceil(K / group_size),
                                       the last group short when group_size does not divide K
    w[n, k] = (q[n, k] - z[g_idx[k], n]) * scales[g_idx[k], n]
config.json carries quantization_config = {"quant_method": "gptq", "bits", "group_size" (-1: one
group per row), "desc_act", "sym", "checkpoint_format", ...}, and optionally GPTQModel's "dynamic":
{regex: overrides} for layers that differ (e.g. {".*mlp\\.down_proj": {"bits": 8}}), the first regex
that matches a layer's name from its start applies, one prefixed "-:" leaves the layer float (vLLM
reads it the same way).
"""
from __future__ import annotations

import regex  # re with a time bound
import torch

from . import packing
from .errors import FormatError
from .zero_point_linear import ZeroPointLinear

REGEX_SECONDS = 1.0  # a layer name is short: a sane pattern matches it in microseconds

FORMATS = ("gptq", "gptq_v2")  # checkpoint_format values with this layout


def quantization_config(bits: int = 4, group_size: int = 128, sym: bool = True, desc_act: bool = False,
                        damp: float = 0.01, checkpoint_format: str = "gptq",
                        dynamic: dict[str, dict] | None = None) -> dict:
    """The quantization_config that GPTQModel/transformers write in config.json for this layout.

    checkpoint_format "gptq" (v1) is what every reader takes (vLLM reads "gptq_v2" as v1); but
    GPTQModel refuses asymmetric v1 checkpoints unless GPTQModel wrote them (old AutoGPTQ ones
    were broken), so asymmetric checkpoints meant for GPTQModel should be "gptq_v2"."""
    if checkpoint_format not in FORMATS:
        raise ValueError(f"checkpoint_format must be one of {FORMATS}, got {checkpoint_format!r}")
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "damp_percent": damp, "true_sequential": True, "static_groups": False, "lm_head": False,
            "checkpoint_format": checkpoint_format, "format": checkpoint_format, "pack_dtype": "int32",
            "meta": {"quantizer": ["brisk"]}, **({"dynamic": dynamic} if dynamic else {})}


OVERRIDABLE = ("bits", "group_size", "sym", "desc_act")


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def layer_config(qcfg: dict, name: str) -> dict | None:
    """The settings of layer `name` (bits, group_size, sym, desc_act): the config's, with the first
    matching "dynamic" entry's overrides; None for a layer a "-:" entry leaves float."""
    base = {"bits": qcfg.get("bits", 4), "group_size": qcfg.get("group_size", -1), "sym": qcfg.get("sym", True),
            "desc_act": qcfg.get("desc_act", False)}
    dynamic = qcfg.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise FormatError(f"GPTQ dynamic must map regexes to settings, got {type(dynamic).__name__}")
    for pattern, over in dynamic.items():
        negative = pattern.startswith("-:")
        try:  # a model file's regex: the time bound stops one that backtracks for ever
            hit = regex.match(pattern[2:] if negative else pattern.removeprefix("+:"), name, timeout=REGEX_SECONDS)
        except regex.error as e:
            raise FormatError(f"GPTQ dynamic pattern {pattern!r} is not a regex: {e}") from None
        except TimeoutError:
            raise FormatError(f"GPTQ dynamic pattern {pattern!r} backtracks without end on {name!r}") from None
        if hit and negative:
            return None
        if hit:
            if not isinstance(over, dict):
                raise FormatError(f"GPTQ dynamic {pattern!r} must map to settings, got {over!r}")
            return {**base, **{k: v for k, v in over.items() if k in OVERRIDABLE}}
    return base


def pack_layer(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
               bits: int, v1: bool = True) -> dict[str, torch.Tensor]:
    """Codes q [N, K], zeros [G, N] (integers; 1..2^bits-1 for v1), scales [G, N] and g_idx [K]
    -> {"qweight", "qzeros", "scales", "g_idx"} in the v1 layout, or v2 (zeros as they are)."""
    if v1 and int(zeros.min()) < 1:
        raise ValueError("a zero point of 0 cannot be stored in the GPTQ v1 layout (it stores zero - 1)")
    return {"qweight": packing.pack(q, bits).T.contiguous(),  # packed along K, stored [K*b/32, N]
            "qzeros": packing.pack(zeros.to(torch.int64) - int(v1), bits),
            "scales": scales.to(torch.float16).contiguous(),
            "g_idx": g_idx.to(torch.int32).contiguous()}


def unpack_layer(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                 bits: int, v1: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of pack_layer: (q [N, K] int32, zeros [G, N] int32, scales [G, N] float32, g_idx [K] int64)."""
    return unpack_qweight(qweight, bits), unpack_qzeros(qzeros, bits, v1), scales.float(), g_idx.long()


def unpack_qweight(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    return packing.unpack(qweight.T.contiguous(), bits)


def unpack_qzeros(qzeros: torch.Tensor, bits: int, v1: bool = True) -> torch.Tensor:
    return packing.unpack(qzeros, bits) + int(v1)  # v1 readers add one without wrapping


def detect(qcfg: dict) -> bool:
    return str(qcfg.get("quant_method", qcfg.get("method", ""))).lower() == "gptq"


def load_linear(tensors: dict[str, torch.Tensor], prefix: str, qcfg: dict,
                bias: torch.Tensor | None) -> "GPTQLinear | None":
    if f"{prefix}.qweight" not in tensors:
        return None
    fmt = str(qcfg.get("checkpoint_format", qcfg.get("format", "gptq"))).lower()
    if fmt not in FORMATS:
        raise FormatError(f"GPTQ checkpoint_format {fmt!r} is not supported (brisk reads {', '.join(FORMATS)})")
    layer = layer_config(qcfg, prefix)
    if layer is None:
        raise FormatError(f"{prefix} is stored quantized, but the config's dynamic leaves it float")
    bits, gs = layer["bits"], layer["group_size"]
    if not _whole(bits) or bits not in packing.BITS or not _whole(gs) or not (gs == -1 or gs > 0):
        raise FormatError(f"{prefix}: {bits!r}-bit GPTQ in groups of {gs!r} is not supported (brisk reads "
                          f"{', '.join(map(str, packing.BITS))} bits, groups of -1 or a positive integer)")
    qweight = tensors.pop(f"{prefix}.qweight")
    try:
        qzeros, scales = tensors.pop(f"{prefix}.qzeros"), tensors.pop(f"{prefix}.scales")
    except KeyError as e:
        raise FormatError(f"{prefix}: GPTQ checkpoint lacks {e.args[0]}") from None
    g_idx = tensors.pop(f"{prefix}.g_idx", None)
    matrices = qweight.dim() == qzeros.dim() == scales.dim() == 2
    K, N = (qweight.shape[0] * 32 // bits, qweight.shape[1]) if matrices else (0, 0)
    G = scales.shape[0] if matrices else 0
    gs = K if gs == -1 else gs
    if not matrices or not K or qweight.dtype != torch.int32 or qzeros.shape != (G, N * bits // 32) \
            or scales.shape[1] != N or G != -(-K // gs):
        raise FormatError(f"{prefix}: GPTQ tensors of inconsistent shapes (qweight {tuple(qweight.shape)}, "
                          f"qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)}, group_size {gs})")
    # the bytes of another type would be read as codes or scales without a word
    if qzeros.dtype != torch.int32 or not scales.is_floating_point() \
            or (g_idx is not None and g_idx.dtype not in (torch.int16, torch.int32, torch.int64)):
        raise FormatError(f"{prefix}: GPTQ tensors of the wrong types (qzeros {qzeros.dtype}, scales {scales.dtype}"
                          + (f", g_idx {g_idx.dtype})" if g_idx is not None else ")"))
    if g_idx is None and layer["desc_act"] is True:  # act-order: the column order is only in g_idx
        raise FormatError(f"{prefix}: desc_act checkpoint without its g_idx")
    if g_idx is None:  # some writers leave it out when it is just k // group_size
        g_idx = torch.arange(K, dtype=torch.int32) // gs
    if g_idx.shape != (K,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= G:
        raise FormatError(f"{prefix}: g_idx does not match the {G} groups of {K} input columns")
    return GPTQLinear(qweight, qzeros, scales, g_idx, bits, bias, v1=fmt == "gptq")


class GPTQLinear(ZeroPointLinear):
    """A GPTQ layer; its buffers are the checkpoint's tensors (qweight dropped on the kernel path)."""

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                 bits: int, bias: torch.Tensor | None = None, v1: bool = True):
        super().__init__(qweight.shape[0] * 32 // bits, qweight.shape[1], bits, bias)
        self.v1 = v1
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        self.register_buffer("g_idx", g_idx.to(torch.int32))
        self._build_kernel()

    def _pack_codes(self, q):
        return packing.pack(q, self.bits).T.contiguous()

    def codes(self):
        q = self._kernel_codes() if self.qweight is None else unpack_qweight(self.qweight, self.bits)
        return q, unpack_qzeros(self.qzeros, self.bits, self.v1), self.scales.float(), self.g_idx.long()
