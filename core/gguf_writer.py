"""Writing a GGUF file (version 3): metadata records copied byte for byte from a source file (so every
key keeps its value type: the tokenizer, chat template and architecture keys as the source has them),
a few keys set anew, the tensors' infos, then their data, each at the file's alignment.

Written to a temporary sibling (OUT.partial) and renamed into place at the end: OUT is the whole file
or absent, never a truncated one.
"""
from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

_U32, _I32, _F32, _BOOL, _STRING, _ARRAY = 4, 5, 6, 7, 8, 9  # GGUF value types
_SCALAR = {_U32: "<I", _I32: "<i", _F32: "<f"}
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # PyTorch order (rows first)
    qtype: int
    nbytes: int


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def u32_record(key: str, value: int) -> bytes:
    """One metadata record holding a uint32."""
    return _string(key) + struct.pack("<II", _U32, value)


def f32_record(key: str, value: float) -> bytes:
    """One metadata record holding a float32."""
    return _string(key) + struct.pack("<If", _F32, value)


def string_record(key: str, value: str) -> bytes:
    """One metadata record holding a string."""
    return _string(key) + struct.pack("<I", _STRING) + _string(value)


def bool_record(key: str, value: bool) -> bytes:
    """One metadata record holding a bool."""
    return _string(key) + struct.pack("<I?", _BOOL, value)


def array_record(key: str, item: str, values: list) -> bytes:
    """One metadata record holding an array; item: "u32", "i32", "f32" or "str"."""
    kind = {"u32": _U32, "i32": _I32, "f32": _F32, "str": _STRING}[item]
    head = _string(key) + struct.pack("<IIQ", _ARRAY, kind, len(values))
    if kind == _STRING:
        return head + b"".join(_string(v) for v in values)
    return head + np.asarray(values, dtype=_SCALAR[kind]).tobytes()


def _padding(n: int, align: int) -> bytes:
    return b"\0" * (-n % align)


def header(records: list[bytes], tensors: list[TensorEntry], align: int) -> bytes:
    """Everything before the tensor data, padded to the alignment; offsets from the data's start."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(records)), *records]
    offset = 0
    for t in tensors:
        dims = tuple(reversed(t.shape))  # GGUF lists the fastest dimension first
        out.append(_string(t.name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                   + struct.pack("<IQ", t.qtype, offset))
        offset += t.nbytes + len(_padding(t.nbytes, align))
    head = b"".join(out)
    return head + _padding(len(head), align)


def write(path: Path, records: list[bytes], tensors: list[TensorEntry], data: Iterable[np.ndarray | bytes],
          align: int = DEFAULT_ALIGNMENT) -> int:
    """The file at `path`, atomically: `data` yields each tensor's bytes in the order of `tensors`.
    Returns the file's size. A tensor whose bytes are not its entry's size is a ValueError (nothing written)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb") as f:
            f.write(header(records, tensors, align))
            for t, blob in zip(tensors, data, strict=True):
                blob = memoryview(np.ascontiguousarray(blob) if isinstance(blob, np.ndarray) else blob).cast("B")
                if blob.nbytes != t.nbytes:
                    raise ValueError(f"tensor {t.name}: {blob.nbytes} bytes, its type and shape take {t.nbytes}")
                f.write(blob)
                f.write(_padding(t.nbytes, align))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path.stat().st_size
