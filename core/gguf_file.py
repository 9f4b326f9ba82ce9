"""Reading GGUF files: metadata as plain Python values, tensors dequantized to torch.

The header is parsed here, with NumPy for the big arrays (vocabularies, scores): gguf.GGUFReader
reads every array element in Python, 15 s for Gemma 3's 262k-token vocabulary against 0.3 s here.
The `gguf` package still does the dequantization, on memory-mapped slices of the file.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import FileError, UnsupportedFormat
from ..quant import gguf_types

# GGUF value types: (numpy dtype or struct code) for the scalar types.
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order (rows first); GGUF lists dims fastest-first
    qtype: int
    offset: int  # absolute, in the file
    nbytes: int


class GGUFFile:
    def __init__(self, path: str | Path):
        from .files import regular_file

        self.path = regular_file(Path(path))  # a FIFO or a device would block or never end
        try:
            self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise FileError(f"cannot read ({e})", path) from None
        self.pos = 0
        self._key = None  # the metadata key being read, for messages
        try:
            self._parse()
        except _Corrupt as e:
            raise FileError(f"corrupt or truncated GGUF header: {e}", path) from None
        except UnicodeDecodeError as e:
            raise FileError(f"corrupt or truncated GGUF header: {self._where()}text that is not UTF-8 (byte {self.pos})",
                            path) from None
        except (IndexError, ValueError, struct.error, OverflowError, TypeError) as e:
            raise FileError(f"corrupt or truncated GGUF header: {self._where()}{e}", path) from None

    def _where(self) -> str:
        return f"key {self._key}: " if self._key else ""

    # -- low-level readers; each checks bounds, so a corrupt count fails instead of allocating
    def _take(self, n: int) -> np.ndarray:
        if n < 0 or self.pos + n > len(self.data):
            raise _Corrupt(f"{self._where()}needs {n} bytes at offset {self.pos}, the file has {len(self.data)} "
                           "(truncated, or a corrupt length)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def _scalar(self, fmt: str):
        dt = np.dtype(fmt)
        return self._take(dt.itemsize).view(dt)[0].item()

    def _string(self) -> str:
        return bytes(self._take(self._scalar("<u8"))).decode("utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._scalar("<u4"), self._scalar("<u8")
            # every element takes at least this many bytes: a count the rest of the file cannot hold
            # is refused before anything is allocated for it
            least = np.dtype(_SCALARS[etype]).itemsize if etype in _SCALARS else 8 if etype == _STRING else 12
            if count * least > len(self.data) - self.pos:
                raise _Corrupt(f"{self._where()}an array of {count} elements cannot fit in the "
                               f"{len(self.data) - self.pos} bytes left in the file")
            if etype == _STRING:
                return [self._string() for _ in range(count)]
            if etype in _SCALARS:
                dt = np.dtype(_SCALARS[etype])
                arr = self._take(count * dt.itemsize).view(dt)
                return [bool(x) for x in arr] if etype == _BOOL else arr.tolist()
            if etype == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            raise _Corrupt(f"{self._where()}unknown array element type {etype}")
        if vtype in _SCALARS:
            v = self._scalar(_SCALARS[vtype])
            return bool(v) if vtype == _BOOL else v
        raise _Corrupt(f"{self._where()}unknown value type {vtype}")

    def _parse(self) -> None:
        if bytes(self._take(4)) != b"GGUF":
            raise _Corrupt("bad magic (not a GGUF file)")
        version = self._scalar("<u4")
        if version not in (2, 3):
            raise UnsupportedFormat(f"GGUF version {version} is not supported (brisk reads 2 and 3)", self.path)
        n_tensors, n_kv = self._scalar("<u8"), self._scalar("<u8")
        # a key takes at least 12 bytes, a tensor's info at least 24: counts the file cannot hold are corrupt
        if n_kv * 12 + n_tensors * 24 > len(self.data) - self.pos:
            raise _Corrupt(f"implausible counts ({n_tensors} tensors, {n_kv} keys) for a file of {len(self.data)} bytes")
        self.metadata: dict[str, Any] = {}
        self.kv_spans: dict[str, tuple[int, int]] = {}  # each key's record in the file (copied as-is by gguf_writer.py)
        for _ in range(n_kv):
            self._key = None
            start = self.pos
            key = self._string()
            self._key = key
            self.metadata[key] = self._value(self._scalar("<u4"))
            self.kv_spans[key] = (start, self.pos)
        self._key = None
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<u4")
            if not 1 <= n_dims <= 4:
                raise _Corrupt(f"tensor {name} has {n_dims} dimensions (GGUF tensors have 1 to 4)")
            dims = [self._scalar("<u8") for _ in range(n_dims)]
            qtype, offset = self._scalar("<u4"), self._scalar("<u8")
            infos.append((name, dims, qtype, offset))
        align = self.metadata.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or not 1 <= align <= 1 << 16 or align & (align - 1):
            raise _Corrupt(f"general.alignment must be a power of two up to 65536, got {align!r:.40}")
        start = -(-self.pos // align) * align
        self.tensors: list[TensorInfo] = []
        for name, dims, qtype, offset in infos:
            block, size, type_name = _block_layout(qtype, name)
            # Python integers: no overflow, and every check before anything is allocated
            if any(d < 1 for d in dims):
                raise _Corrupt(f"tensor {name} has a zero dimension {dims}")
            if dims[0] % block:
                raise _Corrupt(f"tensor {name}: its rows of {dims[0]} do not split into {type_name} blocks of {block}")
            nbytes = math.prod(dims) // block * size
            if offset % align or start + offset + nbytes > len(self.data):
                what = "is not aligned" if offset % align else \
                    f"needs {nbytes} bytes at offset {start + offset}, past the end of the file ({len(self.data)} bytes)"
                raise _Corrupt(f"tensor {name} ({type_name}, shape {list(reversed(dims))}) {what}")
            self.tensors.append(TensorInfo(name, tuple(reversed(dims)), qtype, start + offset, nbytes))

    def load(self, t: TensorInfo) -> torch.Tensor:
        """One tensor as float32 torch."""
        return dequantize_tensor(self.data, t)

    def raw(self, t: TensorInfo) -> np.ndarray:
        """A tensor's bytes as stored (a view of the memory map)."""
        return self.data[t.offset:t.offset + t.nbytes]


def _block_layout(qtype: int, name: str) -> tuple[int, int, str]:
    """(weights, bytes per block, type name) of a tensor's type: brisk's table first, so a header of
    the types brisk runs is read without the gguf package (imported only for the others)."""
    t = gguf_types.BY_ID.get(qtype)
    if t is not None:
        return t.block_weights, t.block_bytes, t.name
    import gguf

    try:
        qt = gguf.GGMLQuantizationType(qtype)
        return (*gguf.GGML_QUANT_SIZES[qt], qt.name)
    except (ValueError, KeyError):
        raise _Corrupt(f"tensor {name}: unknown type {qtype}") from None


class _Corrupt(ValueError):
    """A header field that cannot be right; its message says which and why."""


def dequantize_tensor(data: np.ndarray, t: TensorInfo) -> torch.Tensor:
    """One tensor of a memory-mapped GGUF file as float32 torch."""
    raw = data[t.offset:t.offset + t.nbytes]
    if t.qtype == gguf_types.F32:
        arr = raw.view(np.float32).copy()
    elif t.qtype == gguf_types.F16:
        arr = raw.view(np.float16).astype(np.float32)
    elif t.qtype == gguf_types.BF16:
        return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).float().reshape(t.shape)
    else:
        import gguf  # its dequantizers (the gguf package's import is slow: not for the float types)

        qtype = gguf.GGMLQuantizationType(t.qtype)
        try:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            arr = gguf.quants.dequantize(raw.reshape(-1, t.shape[-1] // block * size), qtype)
        except NotImplementedError:
            raise UnsupportedFormat(f"GGUF tensor {t.name}: type {qtype.name} is not supported") from None
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(t.shape)


def open_gguf(path: str | Path) -> GGUFFile:
    return GGUFFile(path)


def read_metadata(f: GGUFFile) -> dict[str, Any]:
    return f.metadata
