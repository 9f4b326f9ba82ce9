"""AutoAWQ's GEMM checkpoint layout (what AutoAWQ, GPTQModel, transformers and vLLM read as AWQ).

Per quantized linear layer `prefix` (N = out_features, K = in_features, G = K / group_size):
    prefix.qweight  int32 [K, N/8]  4-bit codes packed along N, eight per word, interleaved:
                                    nibble i of word j holds column 8j + AWQ_ORDER[i]
    prefix.qzeros   int32 [G, N/8]  zero points, packed the same way, stored as they are
    prefix.scales   fp16  [G, N]
    w[n, k] = (q[n, k] - z[k // group_size, n]) * scales[k // group_size, n]
config.json carries quantization_config = {"quant_method": "awq", "bits": 4, "group_size",
"zero_point": true, "version": "gemm"}.
"""
from __future__ import annotations

import torch

from . import packing
from .errors import FormatError
from .zero_point_linear import ZeroPointLinear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of a word holds
_UNDO_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # argsort of AWQ_ORDER
VERSIONS = ("gemm",)


def quantization_config(bits: int = 4, group_size: int = 128, zero_point: bool = True, version: str = "gemm") -> dict:
    """The quantization_config AutoAWQ writes in config.json (transformers' AwqConfig reads it)."""
    return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": zero_point,
            "version": version, "modules_to_not_convert": None}


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, N] 4-bit values -> [R, N/8] int32 in AWQ's interleaved order."""
    R, N = values.shape
    return packing.pack(values.reshape(R, N // 8, 8)[..., list(AWQ_ORDER)].reshape(R, N), 4)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_awq: [R, N/8] int32 -> [R, N] int32."""
    R = packed.shape[0]
    return packing.unpack(packed, 4).reshape(R, -1, 8)[..., list(_UNDO_ORDER)].reshape(R, -1)


def pack_layer(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int = 4) -> dict[str, torch.Tensor]:
    """Codes q [N, K], zeros [G, N] and scales [G, N] -> {"qweight", "qzeros", "scales"}."""
    if bits != 4:
        raise ValueError(f"the AWQ GEMM layout holds 4-bit codes, not {bits}-bit")
    return {"qweight": pack_awq(q.T), "qzeros": pack_awq(zeros),
            "scales": scales.to(torch.float16).contiguous()}


def unpack_layer(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor):
    """Inverse of pack_layer: (q [N, K] int32, zeros [G, N] int32, scales [G, N] float32)."""
    return unpack_awq(qweight).T.contiguous(), unpack_awq(qzeros), scales.float()


def detect(qcfg: dict) -> bool:
    return str(qcfg.get("quant_method", qcfg.get("method", ""))).lower() == "awq"


def load_linear(tensors: dict[str, torch.Tensor], prefix: str, qcfg: dict,
                bias: torch.Tensor | None) -> "AWQLinear | None":
    if f"{prefix}.qweight" not in tensors:
        return None
    version = str(qcfg.get("version", qcfg.get("format", qcfg.get("checkpoint_format", "gemm")))).lower()
    if version not in VERSIONS:
        raise FormatError(f"AWQ version {version!r} is not supported (brisk reads the GEMM layout)")
    bits = qcfg.get("bits", qcfg.get("w_bit", 4))
    if type(bits) is not int or bits != 4 or not qcfg.get("zero_point", True):  # 4.0 or True: not what was written
        raise FormatError(f"AWQ with bits={bits}, zero_point={qcfg.get('zero_point')} is not supported "
                          "(brisk reads 4-bit AWQ with zero points)")
    qweight = tensors.pop(f"{prefix}.qweight")
    try:
        qzeros, scales = tensors.pop(f"{prefix}.qzeros"), tensors.pop(f"{prefix}.scales")
    except KeyError as e:
        raise FormatError(f"{prefix}: AWQ checkpoint lacks {e.args[0]}") from None
    matrices = qweight.dim() == qzeros.dim() == scales.dim() == 2
    K, N = (qweight.shape[0], qweight.shape[1] * 8) if matrices else (0, 0)
    G = scales.shape[0] if matrices else 0
    if not matrices or qweight.dtype != torch.int32 or scales.shape[1] != N or qzeros.shape != (G, N // 8) \
            or not G or K % G:
        raise FormatError(f"{prefix}: AWQ tensors of inconsistent shapes (qweight {tuple(qweight.shape)}, "
                          f"qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)})")
    if qzeros.dtype != torch.int32 or not scales.is_floating_point():  # another type's bytes, read as these
        raise FormatError(f"{prefix}: AWQ tensors of the wrong types (qzeros {qzeros.dtype}, scales {scales.dtype})")
    gs = qcfg.get("group_size", qcfg.get("q_group_size"))
    if gs is not None and not (isinstance(gs, int) and not isinstance(gs, bool) and (gs * G == K or gs == -1 and G == 1)):
        raise FormatError(f"{prefix}: quantization_config group_size {gs!r} does not match the tensors "
                          f"({K} input columns in {G} groups)")
    return AWQLinear(qweight, qzeros, scales, bias)


class AWQLinear(ZeroPointLinear):
    """An AWQ GEMM layer; its buffers are the checkpoint's tensors (qweight dropped on the kernel path)."""

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None):
        super().__init__(qweight.shape[0], qweight.shape[1] * 8, 4, bias)
        self.group_size = self.in_features // scales.shape[0]
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        self._build_kernel()

    def codes(self):
        q = self._kernel_codes() if self.qweight is None else unpack_awq(self.qweight).T.contiguous()
        g_idx = torch.arange(self.in_features, device=q.device) // self.group_size
        return q, unpack_awq(self.qzeros), self.scales.float(), g_idx
