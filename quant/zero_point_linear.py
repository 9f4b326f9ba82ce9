"""The layer GPTQ and AWQ checkpoints load into: integer codes with a per-group scale and integer
zero point, w[n, k] = (q[n, k] - z[g(k), n]) * s[g(k), n], g(k) the group of input column k.

Subclasses keep the checkpoint's tensors as buffers and say how to decode them (`codes`).

On the CPU, 4-bit layers run brisk's native kernels on Int4Linear's layout (int4 groups, bf16 scale
and zero), or without them torch's packed int4 kernel; both compute (q - 8) * scale + zero per
group of columns, and GPTQ/AWQ weights map onto that as scale = s, zero = (8 - z) * s. The native
kernels make a row's result independent of its batch (speculative and batched greedy decoding keep
plain greedy's tokens) and run decode several times faster than torch's kernel (bench/RESULTS.md).
Their groups are fixed-size and contiguous, so
- act-order checkpoints (g_idx not sorted) permute the weight's columns by argsort(g_idx) at load
  and gather the activations' columns the same way at run time;
- one group per row (group_size -1), groups over 256 columns or a short last group repeat their
  scale over kernel-sized groups.
The kernel's copy of the codes replaces the checkpoint's `qweight` (holding both would double the
memory); `codes` reads them back from the kernel's layout when asked.

Either kernel takes bfloat16 scales: the fp16 scales lose 3 bits (on the zero term at most 1/64 of
a quantization step), the rounding Int4Linear has too. Torch's kernel takes float32 scales exactly
(ZeroPointLinear.exact = True before loading), but that path is not vectorized: measured 2x slower
for one token, 20-35x slower for a 16-128 token prefill.

On CUDA the same codes, scales and zeros (bf16) run through the Triton int4 kernel
(triton_matmul.py) in Int4Linear's layout, act-order permutation included.

8-bit layers on a symmetric grid (every zero point 128: GPTQ's sym) in groups of a multiple of 32
are GGUF Q8_0 blocks exactly: code q - 128 as int8, the group's fp16 scale repeated per 32. On the
CPU they run the native Q8_0 kernels (rows interleaved by 8), so a GPTQ checkpoint mixing 4 and 8
bits (GPTQModel's dynamic) keeps every layer on the native path.

Anything else (other bit widths, no triton, shapes the kernels reject) dequantizes and runs
F.linear (QuantLinear's fallback, with its one-time warning): slower, the checkpoint's weights exactly.
"""
from __future__ import annotations

import torch

from . import gguf_blocks, gguf_interleave, native, triton_matmul
from .gguf_types import Q8_0
from .lazy_native_weight import LazyNativeWeight
from .linear import QuantLinear, pack_int4, unpack_int4, unpack_int4_kernel

KERNEL_GROUPS = (256, 128, 64, 32)  # the group sizes torch's CPU int4 kernel takes, largest first


class ZeroPointLinear(LazyNativeWeight, QuantLinear):
    exact = False  # float32 kernel inputs: bit-exact to the checkpoint, much slower (see above)

    def __init__(self, in_features: int, out_features: int, bits: int, bias: torch.Tensor | None):
        super().__init__(in_features, out_features, bias)
        self.bits = bits

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, K] int32, zeros [G, N] int32, scales [G, N] float32, g_idx [K] int64)."""
        raise NotImplementedError

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        q, z, s, g = self.codes()
        return ((q - z.T[:, g]) * s.T[:, g]).to(dtype)

    def _build_kernel(self) -> None:
        """Derive an int4 kernel's data from the codes when a kernel can run this layer: torch's
        packed CPU kernel for a layer on the CPU, the Triton kernel (triton_matmul) on CUDA."""
        self.use_kernel = False
        if self.bits == 8:
            return self._build_q8()
        if self.bits != 4 or self.out_features % 16:
            return
        q, z, s, g = self.codes()
        perm = None
        if not bool((g[1:] >= g[:-1]).all()):
            perm = torch.argsort(g, stable=True)
            g = g[perm]
        counts = torch.bincount(g, minlength=s.shape[0])
        # the largest kernel group that tiles every checkpoint group (a short last group included)
        kg = next((k for k in KERNEL_GROUPS if bool((counts % k == 0).all())), None)
        if kg is None:
            return
        if perm is not None:
            q = q[:, perm]
            self.register_buffer("_perm", perm, persistent=False)
        first = g[::kg]  # the checkpoint group of each kernel group
        s, z = s[first], z[first].float()
        self.kernel_group = kg
        self.use_kernel = True
        self.qweight = None
        if self.scales.device.type == "cpu" and native.usable(self.in_features, kg) and not self.exact:
            self._int4_layout(q, s.T.contiguous(), ((8 - z) * s).T.contiguous())  # read in place by the kernels
        elif self.scales.device.type == "cpu":
            self.register_buffer("_packed", torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1),
                                 persistent=False)
            dtype = torch.float32 if self.exact else torch.bfloat16
            self.register_buffer("_scales_zeros", torch.stack((s, (8 - z) * s), dim=-1).to(dtype).contiguous(),
                                 persistent=False)  # [K / kg, N, 2]
        else:
            self._int4_layout(q, s.T.contiguous(), ((8 - z) * s).T.contiguous())

    def _build_q8(self) -> None:
        """Symmetric 8-bit groups as Q8_0 blocks for the native kernels (see the module's docstring)."""
        if self.scales.device.type != "cpu" or self.exact or not native.available() or self.in_features % 32:
            return
        q, z, s, g = self.codes()
        if not bool((z == 128).all()) or not bool((g[1:] >= g[:-1]).all()):
            return  # asymmetric codes leave int8; act-order would need the activations permuted
        if bool((torch.bincount(g, minlength=s.shape[0]) % 32 != 0).any()):
            return
        N, K = self.out_features, self.in_features
        blocks = gguf_blocks.q8_0_rows(q - 128, s[g[::32]].T)
        self._q8_layout = native.X8 if gguf_interleave.packable(Q8_0, N, K) else 0
        self.register_buffer("_q8", gguf_interleave.pack(blocks, Q8_0) if self._q8_layout else blocks, persistent=False)
        self.use_kernel = True
        self.qweight = None

    def _int4_layout(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """Int4Linear's layout (pack_int4 codes [N, K/2], scales and zeros [N, K/kg]): the native
        kernels' on the CPU, the Triton kernel's on CUDA."""
        self._packed = self._scales_zeros = None
        self.register_buffer("_q4", pack_int4(q), persistent=False)
        self.register_buffer("_s4", scales.to(torch.bfloat16), persistent=False)
        self.register_buffer("_z4", zeros.to(torch.bfloat16), persistent=False)

    @property
    def native(self) -> bool:
        """Whether the native kernels run this layer as it is (no act-order column permutation, which
        only _matmul applies): what NativeDecoder and the thread-pool choice look for."""
        if getattr(self, "_q8", None) is not None:
            return self._q8.device.type == "cpu" and native.available()
        return (getattr(self, "_q4", None) is not None and self._q4.device.type == "cpu"
                and getattr(self, "_perm", None) is None and native.usable(self.in_features, self.kernel_group))

    def _build_native(self) -> native.NativeWeight:
        q8 = getattr(self, "_q8", None)
        if q8 is None:
            return native.NativeWeight(native.I4G, self.out_features, self.in_features, self._q4, self._s4, self._z4,
                                       self.kernel_group)
        return native.NativeWeight(Q8_0, self.out_features, self.in_features, q8, layout=self._q8_layout)

    def _native_stale(self, nw: native.NativeWeight) -> bool:
        q8 = getattr(self, "_q8", None)  # the kernel data is rebuilt by assignment (_int4_layout, a Q8_0 layout)
        return nw.tensors[0] is not (self._q4 if q8 is None else q8)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)  # LazyNativeWeight's: drops the descriptor first
        if self.use_kernel and getattr(self, "_packed", None) is not None and self._packed.device.type != "cpu":
            # moved off the CPU: rebuild the kernel data in the GPU kernel's layout
            q = unpack_int4_kernel(self._packed, self.out_features, self.in_features)
            sz = self._scales_zeros.float()
            self._int4_layout(q, sz[..., 0].T.contiguous(), sz[..., 1].T.contiguous())
        if getattr(self, "_q8", None) is not None and self._q8.device.type != "cpu":
            # no 8-bit kernel off the CPU: the checkpoint's packing again, for the fallback
            device, self.use_kernel = self._q8.device, False
            q = self._kernel_codes().cpu()
            self._q8 = None
            self.qweight = self._pack_codes(q).to(device)
        return out

    def _pack_codes(self, q: torch.Tensor) -> torch.Tensor:
        """Codes [N, K] in the checkpoint's `qweight` packing (the subclass's format)."""
        raise NotImplementedError

    def _kernel_codes(self) -> torch.Tensor:
        """The codes q [N, K] (input columns in the checkpoint's order), from the kernel's copy."""
        if getattr(self, "_q8", None) is not None:  # Q8_0 blocks: the codes are bytes 2..33 of each, minus 128
            blocks = self._q8.cpu()
            blocks = gguf_interleave.unpack(blocks, Q8_0) if self._q8_layout else blocks
            return (gguf_blocks.q8_0_codes(blocks).to(torch.int32) + 128).to(self.scales.device)
        if getattr(self, "_packed", None) is not None:
            q = unpack_int4_kernel(self._packed, self.out_features, self.in_features).cpu().to(torch.int32)
        else:
            q = unpack_int4(self._q4).cpu().to(torch.int32)
        if getattr(self, "_perm", None) is not None:
            q = torch.empty_like(q).index_copy_(1, self._perm.cpu(), q)  # undo the column permutation
        return q.to(self.scales.device)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        # The CPU kernel's bf16 output is not refined (refine_top): with no rows() of its own, a
        # head would dequantize its whole weight per call for it.
        if not self.use_kernel:
            return None
        if getattr(self, "_q8", None) is not None:
            return self._native().matmul(x) if x.device.type == "cpu" and native.available() else None
        if getattr(self, "_perm", None) is not None:
            x = x.index_select(1, self._perm)  # the act-order permutation of the kernel's columns
        if x.device.type == "cpu" and getattr(self, "_q4", None) is not None and native.usable(self.in_features, self.kernel_group):
            return self._native().matmul(x.float())
        if x.device.type == "cpu" and self._packed is not None:
            return torch._weight_int4pack_mm_for_cpu(x.to(self._scales_zeros.dtype), self._packed, self.kernel_group,
                                                     self._scales_zeros)
        if getattr(self, "_q4", None) is not None and triton_matmul.usable(x):
            return triton_matmul.int4_matmul(x, self._q4, self._s4, self._z4, self.kernel_group)
        return None

    def extra_repr(self) -> str:
        return super().extra_repr() + f", bits={self.bits}, kernel={self.use_kernel}"
