"""Weight-only quantized linear layers: int8 per output channel, int4 per group.

Weights are stored quantized; activations stay floating point. On the CPU torch's packed kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) dequantize on the fly inside the matmul; on
CUDA the Triton kernels of triton_matmul.py do, on the layers' own buffers. Elsewhere (no triton, a
shape a kernel rejects) the layer dequantizes its weight and runs F.linear: slower, the same
numbers up to rounding.

Formats (the stored buffers, i.e. the state dict, are the portable form; kernel layouts are
derived from them at build time and never saved):
- int8: q int8 [N, K] in -127..127, one bf16 scale per output row: w = q * scale.
- int4: q in 0..15 packed two per byte along K (even column in the low nibble), [N, K/2] uint8;
  per group of `group_size` columns a bf16 scale and zero: w = (q - 8) * scale + zero.
  That is the convention of torch's int4 kernel; "zero" is the value q = 8 stands for.
Scales are rounded to bf16 before the weights are quantized against them, so the kernel (which
takes bf16 scales) and the plain-torch fallback compute the same weights.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from . import native, settings, triton_matmul
from .lazy_native_weight import LazyNativeWeight

SCALE_DTYPE = torch.bfloat16  # what the CPU kernels take; also the activations they take
GROUP_SIZES = (32, 64, 128, 256)


# ---------------------------------------------------------------- int8

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: returns (q [N, K] int8, scales [N] bf16)."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-10).to(SCALE_DTYPE)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scales.float()[:, None]).to(dtype)


# ---------------------------------------------------------------- int4

def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of columns: returns (q [N, K] uint8 in 0..15, scales, zeros),
    scales and zeros [N, K // group_size] bf16, with w ~ (q - 8) * scale + zero."""
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"in_features {K} is not a multiple of the group size {group_size}")
    wg = w.float().reshape(N, K // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=1e-10).to(SCALE_DTYPE)
    zeros = (lo + 8 * scales.float()).to(SCALE_DTYPE)  # the middle code: lo + 8 steps
    s, z = scales.float()[..., None], zeros.float()[..., None]
    q = torch.round((wg - z) / s + 8).clamp(0, 15).to(torch.uint8)
    return q.reshape(N, K), scales, zeros


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K/2] uint8, column 2i in the low nibble, 2i+1 in the high."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: [N, K/2] uint8 -> [N, K] uint8."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype=torch.float32) -> torch.Tensor:
    q = unpack_int4(packed).float()
    N, K = q.shape
    w = (q.reshape(N, -1, group_size) - 8) * scales.float()[..., None] + zeros.float()[..., None]
    return w.reshape(N, K).to(dtype)


# ---------------------------------------------------------------- modules

_fallbacks_said: set = set()


def _say_fallback_once(kind: str, device: str) -> None:
    if (kind, device) not in _fallbacks_said:
        _fallbacks_said.add((kind, device))
        warnings.warn(f"{kind} has no fast kernel on {device} for this shape: dequantizing each call (correct, slower)")


class QuantLinear(nn.Module):
    """The one forward of every quantized linear layer: flatten to 2D, run the subclass's kernel
    for the input's device (`_matmul`) or, where it has none, its fallback (`_fallback`), cast
    back, add the bias. Subclasses supply their kernel data, `_matmul` (preparing the input as
    their kernel wants it; a kernel that returns bf16 passes its output through `refine`),
    `dequantize`, and where they have a faster way than dequantizing the whole weight, `rows`
    and `_fallback`."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.use_kernel = False  # set by subclasses once their kernel data is built
        self.refine_top = 0  # see refine()

    @property
    def native(self) -> bool:
        """Whether brisk's native CPU kernels compute this layer's products."""
        return False

    @classmethod
    def concat(cls, layers: list["QuantLinear"], bias: torch.Tensor | None) -> "QuantLinear | None":
        """A layer of this kind computing all `layers` (see concat_linears), or None: where a subclass
        joins its own tensors."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = self._matmul(x2)
        if y is None:
            y = self._fallback(x2)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] times the weight through the layer's kernel for x's device, or None where
        there is none."""
        return None

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] times the weight where no kernel runs: dequantize it, then F.linear."""
        _say_fallback_once(type(self).__name__, x.device.type)
        return F.linear(x, self.dequantize(x.dtype))

    def refine(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The bf16 output y of a kernel, with each row's `refine_top` largest outputs recomputed
        in float32 (y as it is where refine_top is 0).

        The CPU kernels take and return bf16: 8 bits of mantissa, so logits near 25 come out in
        steps of 0.125 and close candidates tie (measured: SmolLM2's first answer token flipped).
        As the output layer, only the top of the distribution decides greedy and top-k/top-p
        sampling, so those few logits are made exact against the stored weights; the rest keep
        bf16 precision, a relative error of ~0.4% on probabilities that are tiny anyway."""
        if not self.refine_top:
            return y
        y = y.float()
        top = y.topk(min(self.refine_top, self.out_features), dim=-1).indices  # [M, k]
        exact = torch.einsum("mk,mjk->mj", x.float(), self.rows(top, torch.float32))
        return y.scatter_(1, top, exact)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """Dequantized rows `ids` of the weight (embedding lookups from a tied output layer)."""
        return F.embedding(ids, self.dequantize(dtype))  # subclasses gather before dequantizing

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(LazyNativeWeight, QuantLinear):
    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        if weight.device.type == "cpu" and weight.data_ptr() % 64:
            # torch's CPU int8 kernel crashes on weights that are not 16-byte aligned, which a
            # memory-mapped safetensors file (8-byte alignment) can hand over
            weight = weight.clone()
        self.register_buffer("weight", weight)  # int8 [N, K]: the kernel takes it as it is
        self.register_buffer("scales", scales)
        self.use_kernel = weight.device.type == "cpu"

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "Int8Linear":
        q, scales = quantize_int8(linear.weight.detach())
        return cls(q, scales, linear.bias)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_int8(self.weight, self.scales, dtype)

    def rows(self, ids, dtype=torch.float32):
        return (self.weight[ids].float() * self.scales[ids].float()[..., None]).to(dtype)

    @property
    def native(self) -> bool:
        return self.use_kernel and self.weight.device.type == "cpu" and native.usable(self.in_features)

    def _build_native(self) -> native.NativeWeight:
        return native.NativeWeight(native.I8R, self.out_features, self.in_features, self.weight, row_scales=self.scales)

    def _matmul(self, x):
        if self.use_kernel and x.device.type == "cpu":
            if native.usable(self.in_features):  # float32 out (no refine needed), batch-invariant
                return self._native().matmul(x)
            return self.refine(x, torch._weight_int8pack_mm(x.to(SCALE_DTYPE), self.weight, self.scales))
        return triton_matmul.int8_matmul(x, self.weight, self.scales) if triton_matmul.usable(x) else None


# ---------------------------------------------------------------- torch's packed int4 kernels
# Both take w = (q - 8) * scale + zero per group, scales and zeros as one [K/group, N, 2] bf16
# tensor; each packs the codes in its own undocumented tiled layout:
# - "cpu":      _convert_weight_to_int4pack_for_cpu / _weight_int4pack_mm_for_cpu (uint8 [N, K/2]);
# - "tinygemm": _convert_weight_to_int4pack / _weight_int4pack_mm, CUDA (int32 words of 8 codes).

def _pack(q: torch.Tensor, layout: str) -> torch.Tensor:
    """Codes [N, K] (0..15) in a kernel's layout, on q's device."""
    if layout == "cpu":
        return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    if layout == "planes":
        return triton_matmul.pack_int4_planes(q)
    q = q.to(torch.uint8)
    pairs = (q[:, 0::2] << 4 | q[:, 1::2]) if _tinygemm_high_first() else (q[:, 0::2] | q[:, 1::2] << 4)
    return torch._convert_weight_to_int4pack(pairs.contiguous(), _inner_k_tiles(q.shape[1]))


def _inner_k_tiles(K: int) -> int:
    return 8 if K % 128 == 0 else 4 if K % 64 == 0 else 2


USE_TINYGEMM = True  # bench/gpu.py turns it off to time the Triton int4 kernel on the same layers
# Int4Linear's layout on CUDA: torch's tinygemm, or the Triton planes kernel, which reads each weight
# once for up to 64 activation rows (speculative verifying passes, batched decode), where tinygemm's
# time grows with the rows (bench/RESULTS.md). BRISK_CUDA_INT4=tinygemm|planes chooses.
CUDA_INT4 = settings.CUDA_INT4.get()


def tinygemm_fits(N: int, K: int, group_size: int) -> bool:
    return USE_TINYGEMM and torch.cuda.is_available() and N % 8 == 0 and K % 32 == 0 and group_size in GROUP_SIZES \
        and _tinygemm_high_first() is not None


@functools.cache
def _tinygemm_high_first() -> bool | None:
    """Which nibble of the uint8 input tinygemm's packer reads as the even column: found once by
    packing known codes both ways (None: the kernel is missing or matched neither)."""
    try:
        q = torch.randint(0, 16, (16, 64), dtype=torch.uint8, device="cuda")
        x = torch.eye(64, dtype=torch.bfloat16, device="cuda")
        sz = torch.stack((torch.ones(2, 16), torch.zeros(2, 16) + 8), dim=-1).to(torch.bfloat16).cuda()
        for high in (True, False):
            pairs = (q[:, 0::2] << 4 | q[:, 1::2]) if high else (q[:, 0::2] | q[:, 1::2] << 4)
            w = torch._weight_int4pack_mm(x, torch._convert_weight_to_int4pack(pairs.contiguous(), 2), 32, sz)
            if torch.equal(w.T.float(), q.float()):  # w = (q - 8) * 1 + 8 = q
                return high
    except (RuntimeError, AttributeError):
        pass
    return None


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Every 4-bit field of a packed tensor, in one fixed order (by shift, then element)."""
    bits = packed.element_size() * 8
    p = packed.reshape(-1).to(torch.int64) & ((1 << bits) - 1)
    return torch.cat([(p >> s) & 0xF for s in range(0, bits, 4)])


@functools.lru_cache(maxsize=32)
def _int4_kernel_layout(N: int, K: int, layout: str = "cpu") -> torch.Tensor:
    """Where a kernel's layout puts each weight: for field i of _nibbles(packed), the flat index
    n * K + k of the weight it holds. Found by packing the bits of every weight's own index,
    four at a time."""
    device = "cpu" if layout == "cpu" else "cuda"
    idx = torch.arange(N * K, dtype=torch.int64)
    src = torch.zeros(N * K, dtype=torch.int64)
    for shift in range(0, max(int(N * K - 1).bit_length(), 1), 4):
        q = ((idx >> shift) & 0xF).to(torch.uint8).view(N, K).to(device)
        src |= _nibbles(_pack(q, layout).cpu()) << shift
    return src.to(torch.int32)


def unpack_int4_kernel(packed: torch.Tensor, N: int, K: int, layout: str = "cpu") -> torch.Tensor:
    """The codes [N, K] (uint8, 0..15) held in a kernel's packed layout, on packed's device."""
    if layout == "planes":  # a documented layout: no probing
        return triton_matmul.unpack_int4_planes(packed, K)
    q = torch.empty(N * K, dtype=torch.uint8)
    q[_int4_kernel_layout(N, K, layout).long()] = _nibbles(packed.cpu()).to(torch.uint8)
    return q.view(N, K).to(packed.device)


class Int4Linear(LazyNativeWeight, QuantLinear):
    """Kept as torch's packed kernel data where a kernel takes the shape ("cpu" layout on the CPU,
    "tinygemm" on CUDA: `layout`), else as pack_int4 codes (`weight`) that the Triton kernel or
    the dequantizing fallback reads. Moving the layer between devices repacks it."""

    def __init__(self, weight: torch.Tensor | None, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None, kernel_data: torch.Tensor | None = None,
                 shape: tuple[int, int] | None = None, keep_codes: bool = False):
        """weight: uint8 [N, K/2] in pack_int4's layout, or None with kernel_data: the CPU kernel's
        packed tensor (from kernel_data() of a layer built before, e.g. a load cache) and shape (N, K).
        keep_codes: keep `weight` beside the kernel's copy (a tied head: embedding lookups read rows
        of it every step, and rebuilding it from the kernel's layout costs seconds for a big vocab)."""
        N, K = shape if weight is None else (weight.shape[0], weight.shape[1] * 2)
        super().__init__(K, N, bias)
        self.group_size = group_size
        self.layout = None
        self.keep_codes = keep_codes
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        if kernel_data is not None:
            if scales.device.type != "cpu" or not self._fits("cpu"):
                raise ValueError("kernel data given for a layer the CPU kernel cannot run")
            self._set_kernel_data(kernel_data, "cpu")
        else:
            self._make_kernel_data(unpack_int4(weight))

    def _fits(self, layout: str) -> bool:
        N, K, G = self.out_features, self.in_features, self.group_size
        if layout == "native":
            return native.usable(K, G)
        if layout == "cpu":
            return G in GROUP_SIZES and N % 32 == 0
        if layout == "planes":
            return triton_matmul.triton is not None and torch.cuda.is_available() and G in GROUP_SIZES
        return tinygemm_fits(N, K, G)

    def _cuda_layout(self) -> str | None:
        """The kernel layout on CUDA: CUDA_INT4's choice where it takes the shape, else the other."""
        order = ("planes", "tinygemm") if CUDA_INT4 == "planes" else ("tinygemm", "planes")
        return next((layout for layout in order if self._fits(layout)), None)

    def _make_kernel_data(self, q: torch.Tensor) -> None:
        """From codes [N, K]: the packed kernel data for the layer's device, where a kernel fits.
        brisk's native kernels read pack_int4's codes as they are (layout "native")."""
        layout = "cpu" if self.scales.device.type == "cpu" else self._cuda_layout() if self.scales.is_cuda else None
        if layout == "cpu" and self._fits("native"):
            self.weight = pack_int4(q) if self.weight is None else self.weight
            self.use_kernel, self.layout = True, "native"
        elif layout and self._fits(layout):
            self._set_kernel_data(_pack(q, layout), layout)
        else:
            self.weight = pack_int4(q)
            self.use_kernel, self.layout = False, None

    def _set_kernel_data(self, packed: torch.Tensor, layout: str) -> None:
        # The kernel's own tiled layout replaces ours: holding both would double the memory.
        self.register_buffer("_packed", packed, persistent=False)
        self.register_buffer("_scales_zeros", torch.stack((self.scales, self.zeros), dim=-1).transpose(0, 1)
                             .to(SCALE_DTYPE).contiguous(), persistent=False)  # [K/group, N, 2]
        self.use_kernel, self.layout = True, layout
        if not self.keep_codes:
            self.weight = None

    @classmethod
    def from_codes(cls, q: torch.Tensor, scales, zeros, group_size: int, bias=None) -> "Int4Linear":
        """From unpacked codes [N, K] (0..15): skips a pack/unpack round trip on the kernel path."""
        N, K = q.shape
        if scales.device.type == "cpu" and group_size in GROUP_SIZES and N % 32 == 0 and not native.usable(K, group_size):
            return cls(None, scales, zeros, group_size, bias, kernel_data=_pack(q, "cpu"), shape=(N, K))
        return cls(pack_int4(q), scales, zeros, group_size, bias)

    def kernel_data(self) -> torch.Tensor | None:
        return self._packed if self.layout == "cpu" else None

    def codes(self) -> torch.Tensor:
        """The packed codes in pack_int4's layout, rebuilt from the kernel's when only that is kept."""
        if self.weight is not None:
            return self.weight
        return pack_int4(unpack_int4_kernel(self._packed, self.out_features, self.in_features, self.layout))

    @property
    def native(self) -> bool:
        return self.layout == "native"

    def _build_native(self) -> native.NativeWeight:
        return native.NativeWeight(native.I4G, self.out_features, self.in_features, self.weight, self.scales,
                                   self.zeros, self.group_size)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)  # LazyNativeWeight's: drops the descriptor first
        device = self.scales.device.type
        if self.layout is not None and (self.layout in ("cpu", "native")) != (device == "cpu"):
            # Moved between the CPU and CUDA: repack for the kernel of the new device.
            q = unpack_int4(self.weight) if self.layout == "native" else \
                unpack_int4_kernel(self._packed, self.out_features, self.in_features, self.layout)
            for name in ("_packed", "_scales_zeros"):  # buffers of the old layout (the native one has none)
                self._buffers.pop(name, None)
            self._make_kernel_data(q)
        elif self.layout is None and self.weight is not None and device == "cuda" and self._cuda_layout():
            self._make_kernel_data(unpack_int4(self.weight))
        return out

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int = 32, keep_codes: bool = False) -> "Int4Linear":
        q, scales, zeros = quantize_int4(linear.weight.detach(), group_size)
        return cls(pack_int4(q), scales, zeros, group_size, linear.bias, keep_codes=keep_codes)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_int4(self.codes(), self.scales, self.zeros, self.group_size, dtype)

    def rows(self, ids, dtype=torch.float32):
        if self.layout == "native" and ids.device.type == "cpu":
            return self._native().rows(ids).to(dtype)
        if self.weight is None:  # an embedding reads rows every step: keep our layout from now on
            self.weight = self.codes()
        flat = ids.reshape(-1)
        w = dequantize_int4(self.weight[flat], self.scales[flat], self.zeros[flat], self.group_size, dtype)
        return w.view(*ids.shape, self.in_features)

    def _matmul(self, x):
        if self.layout == "native" and x.device.type == "cpu":  # float32 out: no refine needed
            return self._native().matmul(x)
        if self.use_kernel and x.device.type == "cpu":
            return self.refine(x, torch._weight_int4pack_mm_for_cpu(x.to(SCALE_DTYPE), self._packed, self.group_size,
                                                                    self._scales_zeros))
        if self.layout == "tinygemm" and x.is_cuda:
            # tinygemm ignores strides: a fused layer's originals hold column slices of its scales
            # (found on an H100); .contiguous() is a no-op for every other layer
            y = torch._weight_int4pack_mm(x.to(SCALE_DTYPE), self._packed, self.group_size,
                                          self._scales_zeros.contiguous())
            # bf16 in and out: a float32 model's output layer gets its top logits exact (refine)
            return self.refine(x, y) if x.dtype == torch.float32 else y
        if self.layout == "planes" and x.is_cuda:
            y = triton_matmul.int4_planes_matmul(x.to(SCALE_DTYPE), self._packed, self._scales_zeros, self.group_size)
            return self.refine(x, y) if x.dtype == torch.float32 else y
        if self.weight is None or not triton_matmul.usable(x) or self.group_size not in GROUP_SIZES:
            return None
        return triton_matmul.int4_matmul(x, self.weight, self.scales, self.zeros, self.group_size)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}, layout={self.layout}"


# ---------------------------------------------------------------- one matmul for several layers

def concat_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing all `layers` on the same input (outputs side by side), or None where
    their kinds differ or no kernel layout allows it. A decode step reads each weight once
    either way, but one launch instead of three (q/k/v) or two (gate/up) saves the per-kernel
    ramp-up, which on a GPU is a few microseconds each (see bench/RESULTS.md).

    The originals keep views into the new layer's tensors, so memory is not doubled and their
    state dicts are unchanged."""
    first = layers[0]
    if len({type(m) for m in layers}) != 1 or (first.bias is None) != all(m.bias is None for m in layers):
        return None
    bias = None if first.bias is None else torch.cat([m.bias for m in layers])
    sizes = [m.out_features for m in layers]
    if isinstance(first, nn.Linear):
        w = torch.cat([m.weight for m in layers])
        fused = nn.Linear(first.in_features, w.shape[0], bias=bias is not None, device="meta")
        fused.weight = nn.Parameter(w, requires_grad=False)
        if bias is not None:
            fused.bias = nn.Parameter(bias, requires_grad=False)
        for m, part in zip(layers, w.split(sizes)):
            m.weight = nn.Parameter(part, requires_grad=False)
        return fused
    if isinstance(first, QuantLinear) and (joined := type(first).concat(layers, bias)) is not None:
        return joined
    if isinstance(first, Int8Linear):
        fused = Int8Linear(torch.cat([m.weight for m in layers]), torch.cat([m.scales for m in layers]), bias)
        for m, w, sc in zip(layers, fused.weight.split(sizes), fused.scales.split(sizes)):
            m.weight, m.scales = w, sc
        return fused
    layout = getattr(first, "layout", None)
    if isinstance(first, Int4Linear) and layout in ("tinygemm", "planes") and all(
            m.layout == layout and m.group_size == first.group_size and m.out_features % 8 == 0 for m in layers):
        # both layouts keep output rows apart (tinygemm tiles them by 8): the packed tensors stack
        # along their first dimension
        parts = [n // 8 for n in sizes] if layout == "tinygemm" else sizes
        fused = Int4Linear.__new__(Int4Linear)
        QuantLinear.__init__(fused, first.in_features, sum(sizes), bias)
        fused.group_size, fused.keep_codes, fused.weight = first.group_size, False, None
        fused.scales = torch.cat([m.scales for m in layers])
        fused.zeros = torch.cat([m.zeros for m in layers])
        fused._set_kernel_data(torch.cat([m._packed for m in layers]), layout)
        for m, pk, sz, sc, zr in zip(layers, fused._packed.split(parts), fused._scales_zeros.split(sizes, 1),
                                     fused.scales.split(sizes), fused.zeros.split(sizes)):
            m._packed, m._scales_zeros, m.scales, m.zeros = pk, sz, sc, zr
        return fused
    return None


class QuantEmbedding(nn.Module):
    """The token embedding of a model whose (tied) output layer is quantized: lookups dequantize
    just the rows they need from that layer, so the table is not held a second time in float."""

    def __init__(self, head: QuantLinear, dtype: torch.dtype, owner: bool = False):
        """owner: the table is this embedding's own (untied), not the output layer's."""
        super().__init__()
        if owner:
            self.head = head
        else:
            object.__setattr__(self, "head", head)  # not a submodule: the head owns (and saves) the weights
        if isinstance(head, Int4Linear):
            head.keep_codes = True  # rows are looked up every step: keep them in our layout
        self.num_embeddings, self.embedding_dim, self.dtype = head.out_features, head.in_features, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.rows(ids, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, from {type(self.head).__name__}"


# ---------------------------------------------------------------- whole models

METHODS = ("int8", "int4")


def quantize_linear(linear: nn.Linear, method: str, group_size: int = 32, keep_codes: bool = False) -> nn.Module:
    """The quantized replacement of one layer (anything with a float `weight` and a `bias`), or the
    layer itself where the method cannot apply. keep_codes: see Int4Linear."""
    if method == "int8":
        return Int8Linear.from_float(linear)
    if method == "int4":
        if linear.weight.shape[1] % group_size:
            return linear  # keep it float rather than pad: only odd-shaped heads hit this
        return Int4Linear.from_float(linear, group_size, keep_codes=keep_codes)
    raise ValueError(f"unknown quantization method {method!r}; use one of {', '.join(METHODS)}")


def quantize_model(model: nn.Module, method: str, group_size: int = 32, head: bool = False,
                   skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Replace the model's nn.Linear layers (in place) by quantized ones; returns the model.

    Layers whose name starts with one of `skip` stay as they are unless `head` is true: the
    output projection is the most sensitive layer, and with tied embeddings quantizing it makes a
    second copy instead of shrinking one. Embeddings and norms are never touched.
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; use one of {', '.join(METHODS)}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group size must be one of {GROUP_SIZES}, got {group_size}")
    return replace_linears(model, lambda linear: quantize_linear(linear, method, group_size), head, skip)


def replace_modules(model: nn.Module, make) -> nn.Module:
    """The one replacement walk: each submodule m named `name` becomes make(name, m) where that is
    not None (quantized layers at load, kernels for a device, a checkpoint's own layers); the
    walk's list is taken first, so replacements are not walked again. Returns the model."""
    for name, m in list(model.named_modules()):
        new = make(name, m) if name else None
        if new is not None and new is not m:
            parent_name, _, attr = name.rpartition(".")
            with torch.no_grad():
                setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
    return model


def replace_linears(model: nn.Module, make, head: bool = False, skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Replace each nn.Linear of `model` (in place) by make(linear), but not those named with a
    `skip` prefix unless `head`; returns the model."""
    return replace_modules(model, lambda name, m: make(m) if isinstance(m, nn.Linear) and
                           (head or not name.startswith(skip)) else None)
