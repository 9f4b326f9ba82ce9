"""A small safetensors reader/writer for the fuzzer: the header as JSON text or as an ordered dict,
the data after it as bytes, so that a mutator can rewrite either without the library's checks."""
from __future__ import annotations

import json
import struct
from pathlib import Path


def read(path: Path) -> tuple[dict, bytes]:
    """(header, data): the header's entries in file order (with __metadata__ when present)."""
    raw = path.read_bytes()
    n = struct.unpack_from("<Q", raw)[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_text(path: Path, header_text: str, data: bytes) -> None:
    """A file with this exact header text (padded to 8 bytes, as safetensors writes it)."""
    text = header_text.encode("utf-8", "surrogatepass")
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def write(path: Path, header: dict, data: bytes) -> None:
    write_text(path, json.dumps(header, allow_nan=True), data)


def tensor_bytes(header: dict, data: bytes, name: str) -> bytes:
    a, b = header[name]["data_offsets"]
    return data[a:b]


def rebuilt(entries: list[tuple[str, str, list[int], bytes]], metadata: dict | None = None) -> tuple[str, bytes]:
    """(header text, data) for (name, dtype, shape, bytes) entries laid out one after another; names
    may repeat (the text is built by hand, so a repeated key stays in it)."""
    parts, data, at = [], bytearray(), 0
    if metadata is not None:
        parts.append(f'"__metadata__": {json.dumps(metadata)}')
    for name, dtype, shape, blob in entries:
        parts.append(f'{json.dumps(name)}: {json.dumps({"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(blob)]})}')
        data += blob
        at += len(blob)
    return "{" + ", ".join(parts) + "}", bytes(data)


def entries(header: dict, data: bytes) -> list[tuple[str, str, list[int], bytes]]:
    return [(k, v["dtype"], list(v["shape"]), tensor_bytes(header, data, k)) for k, v in header.items()
            if k != "__metadata__"]
