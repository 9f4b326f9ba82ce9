"""Device kernels put into a loaded Transformer from outside, as gpt-fast applies quantization:
the model (model.py) stays plain torch, and one walk over its modules swaps in, per device,

- CPU, float32 weights: brisk's native kernels read them in place (NativeLinear); without the
  kernels, single-row matmuls through NumPy's OpenBLAS (blas.py says why);
- CPU, every product on brisk's native kernels: all blocks of a pass in one native call
  (native_decoder.py), and q/k/v and gate/up joined for the passes it does not take;
- CUDA with Triton: fused RMSNorm, rope and gated activation (fused.py), and q/k/v and gate/up
  joined into one matmul each (quant.linear.concat_linears), saving kernel launches.

Swapped modules are subclasses that change `forward` (or a hook of it) only: parameters, names
and state dicts stay those of the model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import blas, fused
from .device import torch_gets_the_threads
from .model import MLP, Attention, RMSNorm, Router, Transformer
from .native_decoder import NativeDecoder
from ..quant import native
from ..quant.gguf_linear import GGUFLinear
from ..quant.lazy_native_weight import LazyNativeWeight
from ..quant.linear import concat_linears


class BlasLinear(nn.Linear):
    """nn.Linear that sends single-row fp32 CPU inputs to NumPy's BLAS."""

    _np = (None, None)  # (weight, its NumPy view), made on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if blas.usable(self.weight) and not x.requires_grad and x.numel() == x.shape[-1]:
            if self._np[0] is not self.weight:  # object.__setattr__: not a registered parameter
                object.__setattr__(self, "_np", (self.weight, self.weight.detach().numpy()))
            y = blas.gemv(x, self._np[1])
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class NativeLinear(LazyNativeWeight, BlasLinear):
    """nn.Linear whose float32 CPU products run on brisk's native kernels, the weight read where it
    lies: one kernel for any number of rows, so a row's bits do not depend on its batch (MKL's
    sgemv and sgemm round differently), and a float model's blocks can run in one native call
    (NativeDecoder). Elsewhere (more than native.F32_MAX_ROWS rows, autograd, other dtypes, no
    kernels) BlasLinear's path."""

    @property
    def native(self) -> bool:
        w = self.weight
        return w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous() and native.usable(w.shape[1])

    def _build_native(self) -> native.NativeWeight:
        return native.NativeWeight(native.F32, self.out_features, self.in_features, self.weight)

    def _native_stale(self, nw: native.NativeWeight) -> bool:
        # a weight assigned anew (concat_linears' views of a joined one) or given other storage (`.data =`)
        return nw.tensors[0] is not self.weight or nw.desc.data != self.weight.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if grad or x.device.type != "cpu" or not self.native:
            return super().forward(x)
        if x.numel() > native.F32_MAX_ROWS * x.shape[-1]:
            with torch_gets_the_threads():
                return super().forward(x)
        y = self._native().matmul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class NativeRouter(Router, NativeLinear):
    """An MoE router on NativeLinear's kernels: a token's routing never depends on its batch."""


class FusedRMSNorm(RMSNorm):
    def forward(self, x):
        return fused.rms_norm(x, self.weight, self.eps, self.offset)


class FusedMLP(MLP):
    def forward(self, x):
        if self.act not in ("silu", "gelu_tanh"):  # gpt-oss's clamped SwiGLU has no fused kernel
            return JoinedMLP.forward(self, x)
        gelu = self.act == "gelu_tanh"
        joined = self.__dict__.get("_gate_up")
        if joined is not None and joined[1] == (self.gate_proj, self.up_proj):
            return self.down_proj(fused.gated_halves(joined[0](x), gelu))
        return self.down_proj(fused.gated(self.gate_proj(x), self.up_proj(x), gelu))


class JoinedAttention(Attention):
    """q/k/v in one matmul where join_projections() could join them (the joined layer is held
    outside the module tree, used while the originals are unchanged)."""

    def project(self, x):
        joined = self.__dict__.get("_qkv")
        if joined is not None and joined[1] == (self.q_proj, self.k_proj, self.v_proj):
            return joined[0](x).split(joined[2], dim=-1)
        return super().project(x)


class FusedAttention(JoinedAttention):
    """Rope in one kernel, q/k/v joined."""

    def rotate(self, x, cos, sin):
        return fused.rope(x, cos, sin)


class JoinedMLP(MLP):
    def forward(self, x):
        joined = self.__dict__.get("_gate_up")
        if joined is None or joined[1] != (self.gate_proj, self.up_proj):
            return MLP.forward(self, x)  # not super(): FusedMLP calls this on itself, no JoinedMLP
        return self.down_proj(self.activate(*joined[0](x).chunk(2, dim=-1)))


class NativeBlocksTransformer(Transformer):
    """A Transformer whose blocks run in one native call where the pass allows (NativeDecoder)."""

    def native_collectives(self):
        """What a tensor-parallel shard's native blocks sum their outputs with (tp_shm.Segment),
        None for a whole model, False where a shard's blocks cannot run natively."""
        return None

    def blocks(self, x, start, kv, tree):
        rope, made = self.__dict__.get("_native_decoder", (None, None))
        if rope is not self.rope:  # described once per set of rope tables (setup_rope makes them)
            tp = self.native_collectives()
            made = NativeDecoder(self, tp) if tp is not False and NativeDecoder.takes(self) else None
            self.__dict__["_native_decoder"] = self.rope, made
        y = None if made is None else made.run(x, start, kv, tree)
        if y is not None:
            return y
        if made is None or made.max_rows is None:  # quantized: the native kernels keep the threads
            return super().blocks(x, start, kv, tree)
        with torch_gets_the_threads():  # a float model's long passes: torch's sgemm, all threads
            return super().blocks(x, start, kv, tree)


def apply_device_kernels(net: nn.Module, device: torch.device) -> None:
    """Swap in the kernels for `device`; call once the layers have their final kinds (after any
    quantization at load)."""
    if device.type == "cpu":
        _swap(net, {nn.Linear: NativeLinear, Router: NativeRouter})
        if any(isinstance(m, GGUFLinear) for m in net.modules()):
            _swap(net, {Attention: JoinedAttention, MLP: JoinedMLP})
            join_projections(net, only=GGUFLinear)
        if type(net) is Transformer and NativeDecoder.takes(net, need_rope=False):
            net.__class__ = NativeBlocksTransformer
    elif device.type == "cuda" and fused.triton is not None:
        use_fused_kernels(net)


def use_fused_kernels(net: nn.Module) -> None:
    """The Triton kernels for norms, rope and the activation, and joined projections (CUDA; on
    CPU tensors too under TRITON_INTERPRET=1, which is how the tests run them)."""
    _swap(net, {RMSNorm: FusedRMSNorm, Attention: FusedAttention, MLP: FusedMLP})
    join_projections(net)


def _swap(net: nn.Module, classes: dict) -> None:
    for m in net.modules():
        if type(m) in classes:
            m.__class__ = classes[type(m)]  # a subclass adding no state: nothing else to move


def join_projections(net: nn.Module, only: type = nn.Module) -> None:
    """Join q/k/v and gate/up into one matmul each where their kinds allow (concat_linears), for
    layers of kind `only`."""
    for block in net.model.layers:
        a, m = block.self_attn, block.mlp
        parts = (a.q_proj, a.k_proj, a.v_proj)
        if isinstance(a.q_proj, only) and (j := concat_linears(list(parts))) is not None:
            a.__dict__["_qkv"] = (j, parts, [p.out_features for p in parts])
        # an MoE layer's experts only where joining shares the weights (GGUF layers, JoinedGGUF):
        # other kinds join by copying, which would hold every expert twice
        for mlp in [m] if isinstance(m, MLP) else list(m.experts) if only is GGUFLinear else []:
            parts = (mlp.gate_proj, mlp.up_proj)
            if isinstance(mlp.gate_proj, only) and (j := concat_linears(list(parts))) is not None:
                mlp.__dict__["_gate_up"] = (j, parts)
