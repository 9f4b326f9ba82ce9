"""A small GGUF reader/writer for the fuzzer: the positions of every header field (to corrupt them
in place) and a re-serializer (to change metadata values and add keys such as a chat template)."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


@dataclass
class Field:
    kind: str  # "magic" "version" "counts" "key_len" "value_type" "str_len" "array_count" "scalar" "dim" "n_dims" "qtype" "offset"
    offset: int
    size: int
    name: str = ""


@dataclass
class Layout:
    fields: list[Field] = field(default_factory=list)
    header_end: int = 0  # end of the tensor infos (before alignment padding)
    data_start: int = 0
    kv: list[tuple[str, int, object]] = field(default_factory=list)  # (key, type, value) in file order
    tensors: list[tuple[str, list[int], int, int]] = field(default_factory=list)  # name, dims, qtype, offset


def parse(buf: bytes) -> Layout:
    lay = Layout()
    pos = 0

    def take(fmt, kind, name=""):
        nonlocal pos
        size = struct.calcsize("<" + fmt)
        (v,) = struct.unpack_from("<" + fmt, buf, pos)
        lay.fields.append(Field(kind, pos, size, name))
        pos += size
        return v

    def string(kind, name=""):
        nonlocal pos
        n = take("Q", kind, name)
        s = buf[pos:pos + n].decode("utf-8")
        pos += n
        return s

    def value(vtype, name):
        if vtype == STRING:
            return string("str_len", name)
        if vtype == ARRAY:
            etype = take("I", "value_type", name)
            count = take("Q", "array_count", name)
            if etype in SCALAR_FMT and etype != 7 and count > 64:  # big numeric arrays: one slice
                nonlocal pos
                fmt = SCALAR_FMT[etype]
                size = struct.calcsize(fmt)
                vals = list(struct.unpack_from(f"<{count}{fmt}", buf, pos))
                pos += count * size
                return (etype, vals)
            return (etype, [value(etype, name) if etype in (STRING, ARRAY) else take(SCALAR_FMT[etype], "scalar", name)
                            for _ in range(count)])
        return take(SCALAR_FMT[vtype], "scalar", name)

    pos = 4
    lay.fields.append(Field("magic", 0, 4))
    take("I", "version")
    n_tensors = take("Q", "counts")
    n_kv = take("Q", "counts")
    for _ in range(n_kv):
        key = string("key_len")
        vtype = take("I", "value_type", key)
        lay.kv.append((key, vtype, value(vtype, key)))
    for _ in range(n_tensors):
        name = string("key_len", "tensor")
        n_dims = take("I", "n_dims", name)
        dims = [take("Q", "dim", name) for _ in range(n_dims)]
        qtype = take("I", "qtype", name)
        off = take("Q", "offset", name)
        lay.tensors.append((name, dims, qtype, off))
    lay.header_end = pos
    align = 32
    for k, _, v in lay.kv:
        if k == "general.alignment":
            align = v
    lay.data_start = -(-pos // align) * align
    return lay


def _w_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _w_value(vtype: int, v) -> bytes:
    if vtype == STRING:
        return _w_string(v)
    if vtype == ARRAY:
        etype, items = v
        out = [struct.pack("<IQ", etype, len(items))]
        if etype in SCALAR_FMT:
            out.append(struct.pack(f"<{len(items)}{SCALAR_FMT[etype]}", *items))
        else:
            out += [_w_value(etype, x) for x in items]
        return b"".join(out)
    return struct.pack("<" + SCALAR_FMT[vtype], v)


def serialize(kv, tensors, data: bytes, align: int = 32) -> bytes:
    """A GGUF v3 file: metadata `kv` [(key, type, value)], tensor infos, then the tensor data
    (the bytes after the original data start, offsets relative to it as before)."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(kv))]
    for key, vtype, v in kv:
        out += [_w_string(key), struct.pack("<I", vtype), _w_value(vtype, v)]
    for name, dims, qtype, off in tensors:
        out += [_w_string(name), struct.pack("<I", len(dims))] + [struct.pack("<Q", d) for d in dims]
        out.append(struct.pack("<IQ", qtype, off))
    head = b"".join(out)
    pad = -len(head) % align
    return head + b"\0" * pad + data
