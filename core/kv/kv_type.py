"""The KV cache's element type (--kv-type): how a layer's K and V values are stored.

- f32, f16, bf16: the cache tensors in that dtype; attention reads them back in the activations'
  dtype (decoder.c converts as it reads, the torch paths cast).
- q8_0: GGUF's Q8_0, per (position, head) blocks of 32 values, each an fp16 scale d and 32 int8 q
  (value = d q): a [.., head_dim / 32 * 34] uint8 row where the others have [.., head_dim] values.
  Quantized as gguf-py quantizes Q8_0, so the bytes are those of a GGUF tensor of the same values.

"auto" is the activations' dtype (what the cache always was). CUDA keeps that: its kernels read
the cache in place in the activations' dtype, so another type is refused there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidValue
from ..load_options import KV_TYPE_NAMES, check_kv_type  # noqa: F401  (check_kv_type: also imported from here)

Q8_BLOCK, Q8_BYTES = 32, 34  # values per block, bytes per block (an fp16 scale + 32 int8)


@dataclass(frozen=True)
class KVType:
    name: str  # as --kv-type spells it
    storage: torch.dtype  # the cache tensors' dtype
    native: int  # bk_cache.type (quant/kernels/bk_decoder.h)

    @property
    def quantized(self) -> bool:
        return self.name == "q8_0"

    def row_width(self, head_dim: int) -> int:
        """Stored elements per (position, head)."""
        return head_dim // Q8_BLOCK * Q8_BYTES if self.quantized else head_dim

    def bytes_per_value(self) -> float:
        return Q8_BYTES / Q8_BLOCK if self.quantized else self.storage.itemsize

    def check_head_dim(self, head_dim: int) -> None:
        if self.quantized and head_dim % Q8_BLOCK:
            raise InvalidValue("kv_type", self.name, "", template=f"{{option}} q8_0 needs a head size that is a "
                               f"multiple of {Q8_BLOCK}; this model's is {head_dim}")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Values [..., D] as stored: [..., row_width(D)] of `storage`."""
        if not self.quantized:
            return x.to(self.storage)
        return quantize_q8_0(x)

    def decode(self, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows [..., row_width] back as values [..., D] in dtype (no copy when already so)."""
        if not self.quantized:
            return s.to(dtype)
        return dequantize_q8_0(s).to(dtype)


_STORAGE = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)  # each of KV_TYPE_NAMES' tensors
# a type's position in the names is its bk_cache.type id
TYPES = {name: KVType(name, storage, i) for i, (name, storage) in enumerate(zip(KV_TYPE_NAMES, _STORAGE, strict=True))}
_OF_DTYPE = {t.storage: t for t in TYPES.values() if not t.quantized}


def resolve(value: str, dtype: torch.dtype, device: torch.device) -> KVType:
    """The type a cache of activations in `dtype` on `device` stores: "auto" is the activations'
    dtype; on CUDA nothing else (its attention kernels read the cache in place)."""
    name = check_kv_type(value)
    own = _OF_DTYPE[dtype]
    if name == "auto":
        return own
    if device.type != "cpu" and name != own.name:
        raise InvalidValue("kv_type", value, "", template=f"{{option}} {name}: on {device.type} the cache is kept in "
                           f"the activations' dtype ({own.name}; use auto); other types run on the CPU")
    return TYPES[name]


def of_dtype(dtype: torch.dtype) -> KVType:
    return _OF_DTYPE[dtype]


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D / 32 * 34] uint8, each block d (fp16, little-endian) then 32 int8, computed
    in float32 as gguf-py's Q8_0 quantizer does: d = max |x| / 127, q = x / d rounded half away from 0."""
    blocks = x.float().reshape(*x.shape[:-1], -1, Q8_BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inv
    a = scaled.abs()
    q = torch.sign(scaled) * (a.floor() + (2 * (a - a.floor())).floor())  # round half away from zero
    out = torch.cat([d.half().view(torch.uint8), q.to(torch.int8).view(torch.uint8)], -1)
    return out.reshape(*x.shape[:-1], -1)


def dequantize_q8_0(s: torch.Tensor) -> torch.Tensor:
    """[..., D / 32 * 34] uint8 -> [..., D] float32: d q per block."""
    blocks = s.reshape(*s.shape[:-1], -1, Q8_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (q * d).reshape(*s.shape[:-1], -1)
