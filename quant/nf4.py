"""4-bit blockwise quantization with a 16-entry codebook (NF4, FP4) as bitsandbytes defines it,
the 8-bit blockwise code bitsandbytes uses to double-quantize the block scales, and NF4Linear.

A weight [N, K] is flattened row-major and cut into blocks of `blocksize` values; each block keeps
its absmax (float32) and each value the index of the codebook entry nearest to value / absmax
(ties go to the lower entry). Codes are packed two per byte, the first value in the high nibble.
Double quantization stores the absmax vector the same way with a 256-entry code: minus its mean
(the "offset"), in blocks of 256, one byte per absmax.
"""
from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .linear import QuantLinear

# Index order is the stored code. NF4: quantiles of N(0, 1) scaled to [-1, 1] (QLoRA).
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)
# FP4 (1 sign bit, 2 exponent bits, 1 mantissa bit): bit patterns 0..7 are the magnitudes
# 0, 0.0625, 8, 12, 4, 6, 2, 3, divided by 12 so the largest is 1; patterns 8..15 are negated.
_FP4_MAGNITUDES = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0)
FP4_CODE = tuple(m / 12 for m in _FP4_MAGNITUDES) + tuple(-m / 12 for m in _FP4_MAGNITUDES)
NESTED_BLOCKSIZE = 256  # double quantization's block, fixed in bitsandbytes
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
BLOCKSIZE = 64  # bitsandbytes' default, and --quantize nf4's (core/tensor_parallel.py cuts at its multiples)


def codebook(quant_type: str) -> torch.Tensor:
    if quant_type == "nf4":
        return torch.tensor(NF4_CODE, dtype=torch.float32)
    if quant_type == "fp4":
        return torch.tensor(FP4_CODE, dtype=torch.float32)
    raise ValueError(f"unknown 4-bit type {quant_type!r}; use nf4 or fp4")


@functools.cache
def dynamic_code() -> torch.Tensor:
    """bitsandbytes' signed "dynamic tree" 8-bit code (float32 [256], sorted).

    Exponent e = 0..6 covers |x| in (10^(e-6) * 0.1, 10^(e-6)]: its 2^e values are the midpoints of
    2^e equal steps from 0.1 to 1, times 10^(e-6), with both signs. With 0 and 1 that makes 256.
    The steps are taken in float32, as bitsandbytes does, so the values match it bit for bit."""
    values = [0.0, 1.0]
    for e in range(7):
        edges = torch.linspace(0.1, 1, 2 ** e + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2
        values += (10.0 ** (e - 6) * mids).tolist() + (-(10.0 ** (e - 6)) * mids).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


def _nearest(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index into `code` of the entry nearest each value (ties to the lower value)."""
    code = code.to(scaled.device)
    order = torch.argsort(code)
    sorted_code = code[order]
    q = torch.bucketize(scaled, (sorted_code[:-1] + sorted_code[1:]) / 2)
    return order[q]


def _blocks(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a flat float32 vector into blocks (the last one may be short): (scaled values in
    [-1, 1], absmax per block)."""
    n = flat.numel()
    nblocks = -(-n // blocksize)
    padded = F.pad(flat, (0, nblocks * blocksize - n)).view(nblocks, blocksize)
    absmax = padded.abs().amax(dim=1)
    # multiply by the reciprocal, as bitsandbytes does, so the codes agree at the last bit
    scaled = (padded * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp(-1, 1)
    return scaled.reshape(-1)[:n], absmax


def quantize_blockwise_4bit(w: torch.Tensor, quant_type: str = "nf4",
                            blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Any-shape float tensor -> (packed uint8 [ceil(n/2)], absmax float32 [ceil(n/blocksize)])."""
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {BLOCKSIZES}, got {blocksize}")
    scaled, absmax = _blocks(w.detach().reshape(-1).float(), blocksize)
    if scaled.numel() % 2:
        scaled = F.pad(scaled, (0, 1))  # the spare nibble holds the code of 0
    q = _nearest(scaled, codebook(quant_type)).to(torch.uint8)
    return pack_4bit(q), absmax


def pack_4bit(q: torch.Tensor) -> torch.Tensor:
    """Flat codes (uint8 0..15, an even count) -> bytes, the first of each pair in the high nibble."""
    return (q[0::2] << 4) | q[1::2]


def gptq_blockwise_4bit(weight: torch.Tensor, H: torch.Tensor, quant_type: str = "nf4", blocksize: int = 64,
                        double_quant: bool = False, damp: float = 0.01):
    """GPTQ (quant/gptq.py) on the 4-bit codebook grid: the [N, K] weight's codes and block absmax
    chosen to minimize the output error on the inputs whose Hessian is H, instead of rounded
    independently. K must be a multiple of blocksize, so that a block of the row-major flattening
    is `blocksize` consecutive columns of one row (one GPTQ group).

    Returns (packed uint8 [N*K/2], absmax float32 [N*K/blocksize] as the model will use it,
    double_quant ? (absmax codes uint8, nested absmax, offset) : None): the tensors
    quantize_blockwise_4bit and double_quantize give, with other values. The stored absmax may
    be below the block's largest |w| (those values then take the end codes): each block's is
    searched, weighted by the Hessian's diagonal. With double quantization the nested 8-bit state
    (offset, one nested absmax per 256 blocks) is fixed first, from the round-to-nearest absmax,
    and every candidate absmax goes through it: GPTQ compensates the scale the model will run."""
    from .gptq import GPTQ, CodebookGrid

    N, K = weight.shape
    if K % blocksize:
        raise ValueError(f"GPTQ 4-bit needs in_features ({K}) to be a multiple of the blocksize ({blocksize})")
    w = weight.detach().float()
    nested = None
    stored = lambda s, group: (s,)  # noqa: E731  (float32 absmax: stored as it is)
    if double_quant:
        _, nested_absmax, offset = nested = double_quantize(quantize_blockwise_4bit(w, quant_type, blocksize)[1])
        first_blocks = torch.arange(N, device=w.device) * (K // blocksize)  # block index of (row, group 0)

        def stored(s, group):
            return round_nested(s, first_blocks + group, nested_absmax, offset)

    c = GPTQ.with_hessian(w, H).run(CodebookGrid(codebook(quant_type), stored), blocksize, damp=damp)
    packed = pack_4bit(c.q.reshape(-1).to(torch.uint8))
    absmax = c.params[0].T.reshape(-1)  # [G, N] -> row-major blocks: row * G + group
    if nested is not None:
        nested = (c.params[1].T.reshape(-1).to(torch.uint8), nested_absmax, offset)
    return packed, absmax, nested


def unpack_4bit(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Packed bytes -> the first n codes (uint8 0..15), flat."""
    packed = packed.reshape(-1)
    return torch.stack((packed >> 4, packed & 0xF), dim=-1).reshape(-1)[:n]


def quantize_blockwise_8bit(x: torch.Tensor, blocksize: int = NESTED_BLOCKSIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat float32 -> (uint8 codes into dynamic_code(), absmax float32 per block)."""
    scaled, absmax = _blocks(x.reshape(-1).float(), blocksize)
    return _nearest(scaled, dynamic_code()).to(torch.uint8), absmax


def dequantize_blockwise_8bit(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                              blocksize: int = NESTED_BLOCKSIZE) -> torch.Tensor:
    n = q.numel()
    vals = F.pad(code[q.reshape(-1).long()], (0, absmax.numel() * blocksize - n))
    return (vals.view(-1, blocksize) * absmax[:, None]).reshape(-1)[:n]


def double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """absmax float32 -> (uint8 codes, nested absmax float32, offset)."""
    offset = absmax.mean()
    q, nested = quantize_blockwise_8bit(absmax - offset)
    return q, nested, offset.item()


def round_nested(absmax: torch.Tensor, index: torch.Tensor, nested_absmax: torch.Tensor,
                 offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Absmax values at block indices `index` through double quantization with a given nested
    state: (the value undo_double_quant decodes, bit for bit; its uint8 code)."""
    code = dynamic_code().to(absmax.device)
    scale = nested_absmax[index // NESTED_BLOCKSIZE]
    q = _nearest(((absmax - offset) * (1.0 / scale.clamp(min=1e-38))).clamp(-1, 1), code)
    return code[q] * scale + torch.tensor(offset, dtype=torch.float32), q


def undo_double_quant(q: torch.Tensor, nested_absmax: torch.Tensor, nested_code: torch.Tensor,
                      offset: float, nested_blocksize: int = NESTED_BLOCKSIZE) -> torch.Tensor:
    # offset added in float32 like bitsandbytes (it keeps it as a float32 tensor)
    return dequantize_blockwise_8bit(q, nested_absmax.float(), nested_code.float(), nested_blocksize) \
        + torch.tensor(offset, dtype=torch.float32)


def dequantize_4bit(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, shape: tuple[int, ...],
                    blocksize: int, dtype=torch.float32) -> torch.Tensor:
    """The float tensor: code[q] * absmax[block], computed in float32 like bitsandbytes."""
    n = 1
    for d in shape:
        n *= d
    vals = F.pad(code.float()[unpack_4bit(packed, n).long()], (0, absmax.numel() * blocksize - n))
    return (vals.view(-1, blocksize) * absmax.float()[:, None]).reshape(-1)[:n].view(shape).to(dtype)


# ---------------------------------------------------------------- the layer

def _bnb():
    """bitsandbytes, where importable (it is optional: only used for its CUDA kernels)."""
    try:
        import bitsandbytes
        return bitsandbytes
    except Exception:  # not installed, or installed without a usable native library
        return None


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


class NF4Linear(QuantLinear):
    """A linear layer with bitsandbytes-4-bit weights (NF4 or FP4), kept packed in memory.

    weight: the packed codes (uint8, N*K/2 bytes; bnb stores them as [N*K/2, 1]); absmax: float32
    [ceil(N*K/blocksize)] (double quantization already undone); code: float32 [16].
    On CUDA with bitsandbytes importable it runs bnb's 4-bit matmul on the stored tensors. Elsewhere
    no kernel takes this format: it dequantizes per call, through a 256-entry table that turns each
    byte into its two values at once (F.embedding: one gather per byte, no nibble unpacking), a
    slab of rows at a time so the float copy stays small (`SLAB` weights).
    """

    SLAB = 1 << 19  # weights dequantized at once: 2 MB of float32 (1-4 MB measured best, 1 thread)

    def __init__(self, weight: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, shape: tuple[int, int],
                 blocksize: int = 64, quant_type: str = "nf4", bias: torch.Tensor | None = None):
        N, K = shape
        super().__init__(K, N, bias)
        if weight.numel() * 2 < N * K or absmax.numel() * blocksize < N * K:
            raise ValueError(f"4-bit tensors too small for a [{N}, {K}] weight")
        self.blocksize, self.quant_type = blocksize, quant_type
        self.register_buffer("weight", weight.reshape(-1, 1).contiguous())
        self.register_buffer("absmax", absmax.float().contiguous())
        self.register_buffer("code", code.float().contiguous())
        # byte b -> (code[b >> 4], code[b & 15])
        pairs = torch.stack((code.float().repeat_interleave(16), code.float().repeat(16)), dim=1)
        self.register_buffer("_pairs", pairs.contiguous(), persistent=False)
        # rows per slab: whole blocks and whole bytes in each, so slabs index absmax and weight directly
        step = math.lcm(blocksize, 2) // math.gcd(math.lcm(blocksize, 2), K)
        self._slab_rows = max(step, self.SLAB // K // step * step)

    @classmethod
    def from_float(cls, linear: nn.Linear, quant_type: str = "nf4", blocksize: int = BLOCKSIZE,
                   double_quant: bool = False) -> "NF4Linear":
        """Quantize a float layer (`--quantize nf4` at load). double_quant rounds the absmax through
        bnb's nested 8-bit code as a checkpoint with double quantization would (same numbers as
        loading such a checkpoint); memory in brisk is the same either way."""
        w = linear.weight.detach()
        packed, absmax = quantize_blockwise_4bit(w, quant_type, blocksize)
        if double_quant:
            q, nested, offset = double_quantize(absmax)
            absmax = undo_double_quant(q, nested, dynamic_code(), offset)
        return cls(packed, absmax, codebook(quant_type), tuple(w.shape), blocksize, quant_type, linear.bias)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return self._rows(0, self.out_features).to(dtype)

    def rows(self, ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """Dequantized rows `ids` (embedding lookups from a tied output layer)."""
        K, bs = self.in_features, self.blocksize
        if K % bs:  # blocks straddle rows: no per-row slice
            return F.embedding(ids, self.dequantize(dtype))
        flat = ids.reshape(-1)
        packed = self.weight.view(self.out_features, K // 2)[flat]
        vals = F.embedding(packed.to(torch.int32), self._pairs).view(-1, bs)
        absmax = self.absmax.view(self.out_features, K // bs)[flat].reshape(-1, 1)
        return (vals * absmax).view(*ids.shape, K).to(dtype)

    def _rows(self, r0: int, r1: int) -> torch.Tensor:
        """Float32 weight rows r0..r1 (r0 a multiple of _slab_rows, or 0)."""
        K, bs = self.in_features, self.blocksize
        n = (r1 - r0) * K
        b0 = r0 * K // bs
        packed = self.weight.view(-1)[r0 * K // 2:(r0 * K + n + 1) // 2]
        vals = F.embedding(packed.to(torch.int32), self._pairs).view(-1)[:n]
        absmax = self.absmax[b0:b0 + -(-n // bs)]
        if n % bs:  # a short last block (only where N*K is not a multiple of the blocksize)
            vals = F.pad(vals, (0, absmax.numel() * bs - n))
        return (vals.view(-1, bs) * absmax[:, None]).view(-1)[:n].view(r1 - r0, K)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._fast_path(self.weight.device)  # say so at load (.to(device)), not mid-generation
        return out

    @staticmethod
    def _fast_path(device: torch.device):
        """bitsandbytes where it has a kernel (CUDA), else None after one warning."""
        if device.type == "cuda" and (bnb := _bnb()) is not None:
            return bnb
        _warn_once(f"nf4/fp4 weights on {device.type}: no kernel for this format here, the weights are "
                   "dequantized per call (decoding 10-15x slower than int4)"
                   + (" -- install bitsandbytes for its CUDA kernels" if device.type == "cuda" else ""))
        return None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        if (bnb := self._fast_path(x.device)) is None:
            return None
        return bnb.matmul_4bit(x, self.weight.t(), self._quant_state(x.dtype))

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        """No kernel: the weight dequantized a slab of rows at a time."""
        N, R = self.out_features, self._slab_rows
        if N <= R:
            return F.linear(x, self._rows(0, N).to(x.dtype))
        y = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
        for r in range(0, N, R):
            y[:, r:r + R] = F.linear(x, self._rows(r, min(r + R, N)).to(x.dtype))
        return y

    def _quant_state(self, dtype):
        qs = getattr(self, "_qs", None)
        if qs is None or qs.dtype != dtype or qs.absmax is not self.absmax:  # rebuilt after .to(device)
            from bitsandbytes.functional import QuantState

            qs = QuantState(absmax=self.absmax, shape=torch.Size((self.out_features, self.in_features)),
                            code=self.code, blocksize=self.blocksize, quant_type=self.quant_type, dtype=dtype)
            self._qs = qs
        return qs

    def extra_repr(self) -> str:
        return super().extra_repr() + f", quant_type={self.quant_type}, blocksize={self.blocksize}"
