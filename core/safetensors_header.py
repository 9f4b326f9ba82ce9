"""A safetensors file's header, read without torch or the safetensors package: the 8-byte
little-endian length, then that many bytes of JSON naming each tensor's dtype, shape and byte range.
`brisk info` reads only this; the loader checks it before the safetensors reader maps the file."""
from __future__ import annotations

import json
from pathlib import Path

from .errors import FileError

MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own bound on a header


def _raw_header(path: Path) -> tuple[bytes, int]:
    """The header's JSON bytes and the size of the data after it; a FileError naming the file when
    the length is missing or claims more than the file (or the format) holds."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FileError("not a safetensors file (shorter than its header length)", path)
            n = int.from_bytes(head, "little")
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise FileError(f"corrupt safetensors header (it claims {n} bytes; the file has {size})", path)
            return f.read(n), size - 8 - n
    except OSError as e:
        raise FileError(f"cannot read ({e.strerror or e})", path) from None


def tensor_entries(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """{tensor name: (dtype, shape, bytes)} from the header; the tensor data is never read."""
    raw, data = _raw_header(path)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FileError("corrupt safetensors header (not JSON)", path) from None
    if not isinstance(header, dict):
        raise FileError("corrupt safetensors header (not a JSON object)", path)
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            if not (isinstance(dtype, str) and 0 <= begin <= end <= data and min(shape, default=0) >= 0):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise FileError(f"corrupt safetensors header (entry {name!r})", path) from None
        out[name] = (dtype, shape, int(end - begin))
    return out


def check_unique_names(path: Path) -> None:
    """A FileError where the header names one tensor twice: the safetensors reader keeps one of the
    two without a word. JSON that does not parse is left to the reader's own error."""
    raw, _ = _raw_header(path)
    try:  # pairs at every level, so that the top level's repeats show
        top = json.loads(raw, object_pairs_hook=lambda pairs: pairs)
    except (ValueError, RecursionError):
        return
    if isinstance(top, list):
        names = [k for k, _ in top]
        if len(set(names)) < len(names):
            twice = next(n for i, n in enumerate(names) if n in names[:i])
            raise FileError(f"the header lists tensor {twice} twice", path)
