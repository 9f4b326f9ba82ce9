"""A GGUF weight kept in the file's own blocks (gguf_types.NATIVE: the types the native kernels read), multiplied
by brisk's native kernels on the CPU: no float copy, memory-mapped from the file where its rows need
no reordering and no interleaving (most types' rows are interleaved 8 at a time at load: the
same bytes, moved, gguf_interleave.py). The block layouts are in kernels/gguf_types.h."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from . import gguf_interleave, gguf_types, native
from .lazy_native_weight import LazyNativeWeight
from .linear import QuantLinear


class GGUFLinear(LazyNativeWeight, QuantLinear):
    def __init__(self, blocks: torch.Tensor, qtype: int, out_features: int, in_features: int,
                 bias: torch.Tensor | None = None, layout: int = 0):
        """blocks: uint8 [N, bytes per row], the rows' blocks as the file stores them (layout 0) or
        interleaved (native.X8: gguf_interleave.pack's)."""
        super().__init__(in_features, out_features, bias)
        self.qtype, self.layout = qtype, layout
        self.register_buffer("blocks", blocks)
        self.use_kernel = True

    @property
    def native(self) -> bool:
        return self.blocks.device.type == "cpu" and native.available()

    @property
    def type_name(self) -> str:
        return gguf_types.BY_ID[self.qtype].name

    @classmethod
    def concat(cls, layers, bias):
        if not all(m.native for m in layers):
            return None
        return JoinedGGUF(layers, bias)

    def _build_native(self) -> native.NativeWeight:
        return native.NativeWeight(self.qtype, self.out_features, self.in_features, self.blocks, layout=self.layout)

    def _matmul(self, x):
        if x.device.type == "cpu" and native.available():
            return self._native().matmul(x)
        return None

    def rows(self, ids, dtype=torch.float32):
        if self.blocks.device.type == "cpu" and native.available():
            return self._native().rows(ids.cpu()).to(device=ids.device, dtype=dtype)
        return super().rows(ids, dtype)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        if self.blocks.device.type == "cpu" and native.available():
            return self._native().dequantize().to(dtype)
        import gguf  # the reference implementation, where the kernels cannot run

        w = gguf.quants.dequantize(self.file_blocks().cpu().numpy(), gguf.GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(w)).to(device=self.blocks.device, dtype=dtype)

    def file_blocks(self) -> torch.Tensor:
        """The blocks in the file's layout."""
        return gguf_interleave.unpack(self.blocks, self.qtype) if self.layout else self.blocks

    def extra_repr(self) -> str:
        return super().extra_repr() + f", type={self.type_name}" + (", rows interleaved" if self.layout else "")


class JoinedGGUF(nn.Module):
    """GGUF layers on the same input (q/k/v, gate/up) computed in one native call, outputs side by
    side. The layers keep their blocks: joining by copying them would hold those weights twice in
    memory (the copy and the file's mapped pages it was read from)."""

    def __init__(self, layers: list[GGUFLinear], bias: torch.Tensor | None):
        super().__init__()
        object.__setattr__(self, "parts", layers)  # not submodules: the model owns them
        self.bias = bias
        self.in_features, self.out_features = layers[0].in_features, sum(m.out_features for m in layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = self.__dict__.get("_joined")
        if joined is None or any(nw is not m._native() for nw, m in zip(joined.weights, self.parts)):
            joined = self.__dict__["_joined"] = native.JoinedWeights([m._native() for m in self.parts])
        y = joined.matmul(x.reshape(-1, self.in_features)).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)
