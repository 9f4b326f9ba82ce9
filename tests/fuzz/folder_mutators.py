"""The fuzzer's mutators of whole Hugging Face folders: safetensors headers and shard indexes, special
files in place of any file, every JSON file, quantized checkpoints' settings and tensors, and
tokenizer.json. Each one edits a copy of a base folder (the float llama of tests/conftest.py or a
quantized fixture of tests/fixtures/) in place and says what it did; it marks the cases whose
folder no longer describes one model (`must_refuse`: loading it anyway is `silent`), the files
that must not be read (`forbidden`) and the outside target an index names (`outside`)."""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

from . import safetensors_edit as st

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
GPTQ = ("gptq_4bit_g64_asym", "gptq_4bit_g32_desc_act", "gptq_8bit_g128")
AWQ = ("awq_gemm_4bit_g128",)
BNB = ("bnb_nf4", "bnb_int8", "bnb_fp4_dq", "bnb_nf4_dq")
QUANTIZED = GPTQ + AWQ + BNB
FLOAT = "float"  # the tiny llama of write_hf_checkpoint: untied head, llama3 rope scaling
ANY = (FLOAT,) * 4 + QUANTIZED

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2,
               "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}

ODD_VALUES = ["abc", "", -1, 0, 1, 2**31, 2**63, 2**64, 10**30, -(10**30), 1e308, -1e308, 1e-320, float("nan"),
              float("inf"), float("-inf"), 1.5, None, [], {}, True, False, [1, "x"], {"a": {"b": [None]}}, "x" * 5000]


@dataclass
class Marks:
    """What a mutation means for its case's verdict."""
    base: str
    must_refuse: bool = False  # an inconsistent folder: loading it quietly is `silent`
    forbidden: list[Path] = field(default_factory=list)  # files that must not be opened (stale weights)
    outside: Path | None = None  # the target outside the folder an index names (opening it is `outside`)
    timeout: float | None = None  # a shorter bound (special files: a blocked read shows at once)
    prompt: str | None = None


def weights(folder: Path) -> Path:
    return folder / "model.safetensors"


def _json(path: Path):
    return json.loads(path.read_text())


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, allow_nan=True, default=str))


def shard(rng, folder: Path, n: int | None = None) -> dict[str, str]:
    """The folder's model.safetensors split into 2-3 shards with an index, as transformers saves a
    big model; returns the weight map."""
    header, data = st.read(weights(folder))
    items = st.entries(header, data)
    n = n or rng.choice([2, 3])
    weight_map = {}
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = items[i::n]
        text, blob = st.rebuilt(part, {"format": "pt"})
        st.write_text(folder / name, text, blob)
        weight_map.update({e[0]: name for e in part})
    weights(folder).unlink()
    _write_json(folder / "model.safetensors.index.json",
                {"metadata": {"total_size": sum(len(e[3]) for e in items)}, "weight_map": weight_map})
    return weight_map


def _flip_bytes(rng, blob: bytes) -> bytes:
    b = bytearray(blob)
    for _ in range(max(1, len(b) // 8)):
        b[rng.randrange(len(b))] ^= 0x5A
    return bytes(b)


def copy_into(rng, folder: Path, name: str, src: str, dst: str, same: bool) -> None:
    """Tensor `name` of shard `src` added to shard `dst` too (its bytes changed unless `same`)."""
    h, d = st.read(folder / src)
    blob = st.tensor_bytes(h, d, name)
    h2, d2 = st.read(folder / dst)
    extra = (name, h[name]["dtype"], h[name]["shape"], blob if same else _flip_bytes(rng, blob))
    text, data = st.rebuilt(st.entries(h2, d2) + [extra], {"format": "pt"})
    st.write_text(folder / dst, text, data)


def stale_copy(rng, folder: Path, files: list[str], stale: Path) -> None:
    """Every tensor of the shards, with other values, in one file `stale` beside them."""
    items = []
    for f in files:
        h, d = st.read(folder / f)
        items += [(k, dt, sh, _flip_bytes(rng, b)) for k, dt, sh, b in st.entries(h, d)]
    text, data = st.rebuilt(items, {"format": "pt"})
    st.write_text(stale, text, data)


def drop_tensors(folder: Path, pred) -> None:
    header, data = st.read(weights(folder))
    text, blob = st.rebuilt([e for e in st.entries(header, data) if not pred(e[0])], header.get("__metadata__"))
    st.write_text(weights(folder), text, blob)


# ---------------------------------------------------------------- safetensors headers

def m_safetensors_header(rng, folder: Path, marks: Marks) -> str:
    path = weights(folder)
    raw = path.read_bytes()
    n = struct.unpack_from("<Q", raw)[0]
    header, data = st.read(path)
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    choice = rng.choice(["length", "dtype", "shape", "offsets", "duplicate", "metadata", "extra"])
    if choice == "length":
        v = rng.choice([0, 1, 7, n - 1, n + 1, n + 8, len(raw) - 8, len(raw), len(raw) + 1, 2**63])
        path.write_bytes(struct.pack("<Q", v) + raw[8:])
        marks.must_refuse = v != n
        return f"header length {v} (was {n})"
    if choice == "dtype":
        old = header[name]["dtype"]
        new = rng.choice(sorted(DTYPE_BYTES) + ["XX", "", 5, None, "f32"])
        header[name]["dtype"] = new
        st.write(path, header, data)
        numel = math.prod(header[name]["shape"])
        a, b = header[name]["data_offsets"]
        marks.must_refuse = DTYPE_BYTES.get(new, 0) * numel != b - a or (old in FLOAT_DTYPES) != (new in FLOAT_DTYPES)
        return f"dtype of {name} {old} -> {new!r}"
    if choice == "shape":
        old = list(header[name]["shape"])
        numel = math.prod(old)
        new = rng.choice([list(reversed(old)), [numel], old + [1], [1] + old, [2**40, 2**40], [0], [-1, 5], [3, 3],
                          [numel * 2], [2**64], ["x"], None])
        header[name]["shape"] = new
        st.write(path, header, data)
        marks.must_refuse = new != old and not (isinstance(new, list) and new[:1] == [1] and new[1:] == old)
        return f"shape of {name} {old} -> {new}"
    if choice == "offsets":
        a, b = header[name]["data_offsets"]
        other = header[rng.choice(names)]["data_offsets"]
        new = rng.choice([[b, a], [a, a], [a + 1, b + 1], [0, len(data) + 64], [a, 2**64 - 1], list(other),
                          [a, b + 8], ["a", 1], [a], None, [-8, b]])
        header[name]["data_offsets"] = new
        st.write(path, header, data)
        marks.must_refuse = new != [a, b]
        return f"data_offsets of {name} {[a, b]} -> {new}"
    if choice == "duplicate":
        items = st.entries(header, data)
        i = names.index(name)
        blob = items[i][3]
        same = rng.random() < 0.3
        items.insert(rng.randrange(len(items) + 1), (name, items[i][1], items[i][2], blob if same else _flip_bytes(rng, blob)))
        text, blob = st.rebuilt(items, header.get("__metadata__"))
        st.write_text(path, text, blob)
        marks.must_refuse = True
        return f"{name} twice in the header ({'same' if same else 'different'} data)"
    if choice == "metadata":
        header["__metadata__"] = rng.choice([{"format": "tf"}, {"format": 5}, [], "x", {"a": {"b": 1}}, None,
                                             {"x" * 10: "y" * 100_000}, {"format": "pt", "total_size": 1}])
        st.write(path, header, data)
        return f"__metadata__ = {str(header['__metadata__'])[:40]}"
    extra = rng.choice(["model.layers.9.mlp.up_proj.weight", "model.norm.bias", "lm_head.weight_scale", "x" * 300, ""])
    items = st.entries(header, data) + [(extra, rng.choice(["F32", "I8", "BOOL"]), [4], bytes(4 * 4))]
    items[-1] = items[-1][:3] + (bytes(DTYPE_BYTES[items[-1][1]] * 4),)
    text, blob = st.rebuilt(items, header.get("__metadata__"))
    st.write_text(path, text, blob)
    return f"extra tensor {extra[:40]!r}"


# ---------------------------------------------------------------- shards and their index

OUTSIDE_NAMES = ["../outside/{}", "{abs}", "sub/../../outside/{}", "./../outside/{}", "sub/../{}"]


def m_shards(rng, folder: Path, marks: Marks) -> str:
    weight_map = shard(rng, folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(weight_map.values()))
    choice = rng.choice(["plain", "dup_diff", "dup_same", "missing", "outside", "outside", "bad_name", "stale",
                         "unlisted", "misplaced", "index_shape"])
    if choice == "plain":
        return f"{len(files)} shards, consistent"
    if choice in ("dup_diff", "dup_same"):
        name = rng.choice(sorted(weight_map))
        src, dst = weight_map[name], rng.choice([f for f in files if f != weight_map[name]])
        copy_into(rng, folder, name, src, dst, same=choice == "dup_same")
        marks.must_refuse = True
        return f"{name} in {src} and {dst} ({'different' if choice == 'dup_diff' else 'same'} data)"
    if choice == "missing":
        gone = rng.choice(files)
        (folder / gone).unlink()
        marks.must_refuse = True
        return f"shard {gone} missing"
    if choice == "outside":
        moved = rng.choice(files)
        outside = folder.parent / "outside"
        outside.mkdir(exist_ok=True)
        target = outside / moved
        fifo = rng.random() < 0.4
        if fifo:  # opening it blocks: the parent sees a reader
            (folder / moved).unlink()
            os.mkfifo(target)
        else:  # a real shard: loading it from there would work
            shutil.move(str(folder / moved), target)
        form = rng.choice(OUTSIDE_NAMES)
        named = str(target.resolve()) if form == "{abs}" else form.format(moved)
        if form == "sub/../{}":  # stays inside the folder once normalized; the file is outside, so it is missing
            named = form.format(moved)
        _write_json(index, {"metadata": {}, "weight_map": {k: (named if v == moved else v) for k, v in weight_map.items()}})
        marks.must_refuse, marks.outside = True, target
        return f"index names {named!r} ({'a FIFO' if fifo else 'a shard'} outside)"
    if choice == "bad_name":
        bad = rng.choice([None, 5, "", "a\x00b", "sub", "model.safetensors.index.json", "config.json", [], "C:\\x"])
        if bad == "sub":
            (folder / "sub").mkdir()
        name = rng.choice(sorted(weight_map))
        weight_map[name] = bad
        _write_json(index, {"metadata": {}, "weight_map": weight_map})
        marks.must_refuse = True
        return f"index maps {name} to {bad!r}"
    if choice == "stale":  # transformers reads only the index's shards; a stale single file beside them must stay unread
        stale = folder / rng.choice(["model.safetensors", "model-00009-of-00009.safetensors"])
        stale_copy(rng, folder, files, stale)
        marks.forbidden.append(stale)
        return f"stale {stale.name} beside the index's shards"
    if choice == "unlisted":
        name = rng.choice(sorted(weight_map))
        del weight_map[name]
        _write_json(index, {"metadata": {}, "weight_map": weight_map})
        return f"index does not list {name}"
    if choice == "misplaced":
        name = rng.choice(sorted(weight_map))
        weight_map[name] = rng.choice([f for f in files if f != weight_map[name]])
        _write_json(index, {"metadata": {}, "weight_map": weight_map})
        return f"index puts {name} in the wrong shard"
    obj = rng.choice([{"weight_map": []}, {"weight_map": "x"}, {"weight_map": {}}, {}, {"metadata": 5, "weight_map": weight_map},
                      {"weight_map": {5: files[0]}}])
    _write_json(index, obj)
    marks.must_refuse = obj.get("weight_map") != weight_map
    return f"index = {str(obj)[:50]}"


# ---------------------------------------------------------------- special files

def m_special_file(rng, folder: Path, marks: Marks) -> str:
    if rng.random() < 0.3 and weights(folder).exists():
        shard(rng, folder)
    present = sorted(p.name for p in folder.iterdir())
    name = rng.choice(present + ["special_tokens_map.json", "chat_template.json", "model.safetensors.index.json"])
    path = folder / name
    if path.exists() or path.is_symlink():
        path.unlink()
    kind = rng.choice(["fifo", "dev_zero", "dev_null", "folder", "dangling", "loop", "fifo_link"])
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "dev_null":
        path.symlink_to("/dev/null")
    elif kind == "folder":
        path.mkdir()
    elif kind == "dangling":
        path.symlink_to(folder / "nowhere")
    elif kind == "loop":
        path.symlink_to(path)
    else:  # a symlink to a FIFO elsewhere, as the Hugging Face cache links to blobs
        blobs = folder.parent / "blobs"
        blobs.mkdir(exist_ok=True)
        os.mkfifo(blobs / name)
        path.symlink_to(blobs / name)
    marks.timeout = 5.0
    return f"{name} is {kind}"


# ---------------------------------------------------------------- every JSON file

def json_files(folder: Path) -> list[str]:
    return [n for n in ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
                        "model.safetensors.index.json", "quantize_config.json", "chat_template.json", "tokenizer.json")
            if (folder / n).exists()]


def _paths(obj, prefix=(), depth=0):
    """Every key path in a JSON tree, to depth 3 (lists by index)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for k, v in list(items)[:400]:
        yield prefix + (k,)
        if depth < 3:
            yield from _paths(v, prefix + (k,), depth + 1)


def m_json_file(rng, folder: Path, marks: Marks) -> str:
    if rng.random() < 0.25 and weights(folder).exists():
        shard(rng, folder)
    if rng.random() < 0.3:  # the optional ones, present
        jinja = folder / "chat_template.jinja"
        extra = rng.choice(["special_tokens_map.json", "chat_template.json"])
        if extra == "chat_template.json" and jinja.exists():
            _write_json(folder / extra, {"chat_template": jinja.read_text()})
            jinja.unlink()
        elif extra == "special_tokens_map.json":
            _write_json(folder / extra, {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}})
    name = rng.choice(json_files(folder))
    path = folder / name
    text = path.read_text()
    choice = rng.choice(["top", "value", "value", "value", "remove", "nest", "huge", "not_utf8", "numbers", "truncate"])
    if choice == "top":
        path.write_text(json.dumps(rng.choice([[], "x", 5, None, True, [{}]])))
        return f"{name} is {path.read_text()[:20]}"
    if choice in ("value", "remove"):
        obj = json.loads(text)
        paths = list(_paths(obj))
        if not paths:
            return f"{name} unchanged (empty)"
        keys = rng.choice(paths)
        parent = obj
        for k in keys[:-1]:
            parent = parent[k]
        if choice == "remove":
            del parent[keys[-1]]
            detail = f"{name} without {'.'.join(map(str, keys))}"
        else:
            parent[keys[-1]] = v = rng.choice(ODD_VALUES)
            detail = f"{name} {'.'.join(map(str, keys))} = {str(v)[:30]}"
        _write_json(path, obj)
        return detail
    if choice == "nest":
        d = rng.choice([500, 5000, 100_000])
        nested = rng.choice(["[", '{"a":'])
        close = "]" if nested == "[" else "}"
        inner = nested * d + "1" + close * d
        obj_text = text.rstrip()
        path.write_text(obj_text[:obj_text.index("{") + 1] + f'"deep": {inner}, ' + obj_text[obj_text.index("{") + 1:]
                        if obj_text.startswith("{") else inner)
        return f"{name} nested {d} deep"
    if choice == "huge":
        kind = rng.choice(["sparse", "string", "spaces"])
        if kind == "sparse":  # past brisk's bound without writing it: a file of zeros
            with open(path, "wb") as f:
                f.truncate((128 << 20) + 1)
        elif kind == "string":
            obj = json.loads(text)
            if isinstance(obj, dict):
                obj["huge"] = "x" * (8 << 20)
            _write_json(path, obj)
        else:
            path.write_text(" " * (8 << 20) + text)
        return f"{name} huge ({kind})"
    if choice == "not_utf8":
        kind = rng.choice(["ff", "utf16", "latin1", "bom", "surrogate"])
        if kind == "ff":
            b = bytearray(text.encode())
            b.insert(rng.randrange(len(b)), 0xFF)
            path.write_bytes(bytes(b))
        elif kind == "utf16":
            path.write_bytes(text.encode("utf-16"))
        elif kind == "latin1":
            path.write_bytes(text.replace("}", ', "caf\u00e9": "\u00e9"}', 1).encode("latin-1", "replace"))
        elif kind == "bom":
            path.write_bytes(b"\xef\xbb\xbf" + text.encode())
        else:
            path.write_bytes(text.replace("{", '{"s": "\\udcff\\ud800", ', 1).encode())
        return f"{name} not UTF-8 ({kind})"
    if choice == "numbers":
        lit = rng.choice(["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "9" * 5000, "-0", "1" + "0" * 400])
        key = rng.choice(["vocab_size", "hidden_size", "bits", "group_size", "temperature", "top_k", "eos_token_id",
                          "max_position_embeddings", "rope_theta", "x"])
        path.write_text(text.replace("{", f'{{"{key}": {lit}, ', 1) if "{" in text else lit)
        return f"{name} {key} = {lit[:20]}"
    path.write_text(text[:rng.randrange(len(text))])
    return f"{name} truncated"


# ---------------------------------------------------------------- quantized checkpoints: settings

def _layer_groups(folder: Path, base: str) -> list[tuple[int, int]]:
    """(input features, scale rows) of every GPTQ/AWQ layer of the folder's weights."""
    header, _ = st.read(weights(folder))
    bits = _json(folder / "config.json")["quantization_config"]["bits"]
    out = []
    for k, v in header.items():
        if k.endswith(".qweight"):
            stem = k[:-len("qweight")]
            rows = header[stem + "scales"]["shape"][0]
            ins = v["shape"][0] * 32 // bits if base in GPTQ else v["shape"][0]
            out.append((ins, rows))
    return out


def matches_tensors(folder: Path, base: str, group_size) -> bool:
    """Whether a group_size fits every layer's scales (the check a loader has to make)."""
    if type(group_size) is not int or group_size == 0 or group_size < -1:
        return False
    return all(-(-ins // (ins if group_size == -1 else group_size)) == rows for ins, rows in _layer_groups(folder, base))


def m_quant_config(rng, folder: Path, marks: Marks) -> str:
    cfg_path = folder / "config.json"
    cfg = _json(cfg_path)
    q = cfg["quantization_config"]
    if marks.base in BNB:
        key = rng.choice(["bnb_4bit_quant_type", "load_in_4bit", "load_in_8bit", "llm_int8_skip_modules",
                          "bnb_4bit_compute_dtype", "bnb_4bit_use_double_quant", "quant_method", "llm_int8_threshold"])
        q[key] = rng.choice(["fp4", "nf4", "int8", True, False, None, 5, "x", ["lm_head", 5], [], float("nan"), -1,
                             "bitsandbytes", "gptq"])
        if key == "quant_method" and q[key] in ("gptq", "awq"):
            marks.must_refuse = True
        _write_json(cfg_path, cfg)
        return f"quantization_config.{key} = {q[key]!r}"
    target = rng.random()
    key = rng.choice(["bits", "bits", "group_size", "group_size", "sym", "desc_act", "dynamic", "dynamic",
                      "quant_method", "checkpoint_format", "zero_point", "version", "pack_dtype"])
    if key == "bits":
        old = q["bits"]
        v = rng.choice([0, 1, 2, 3, 4, 5, 8, 16, 32, 4.0, "4", None, True, -4, [4], 2**64])
        marks.must_refuse = not (type(v) is int and v == old)
    elif key == "group_size":
        v = rng.choice([0, -1, 7, 16, 32, 64, 128, 256, "64", 64.0, None, 2**40, -2])
        # AWQ without a group_size (null too) takes the groups the tensors have
        marks.must_refuse = not matches_tensors(folder, marks.base, v) and not (v is None and marks.base in AWQ)
    elif key == "dynamic":
        pattern = rng.choice(["-:(", "+:[a-", "-:(a+)+$", "-:^((\\w|.)+)*\\1\\1\\1$", "-:(\\w|.)*!", "-:.*",
                              "+:.*", ".*", "-:model\\.layers\\.0\\..*", "+:model\\.layers\\.1\\.mlp\\..*", "-:\\"])
        rule = rng.choice([{}, {"bits": 8}, {"group_size": 7}, {"group_size": 32}, 5, None, {"bits": "x"}])
        v = rng.choice([{pattern: rule}, {pattern: rule}, [], "x", 5])
        # rules that would change how a layer's tensors are read, or leave a quantized layer unquantized
        if isinstance(v, dict):
            if pattern.startswith("-:") and pattern in ("-:.*", "-:model\\.layers\\.0\\..*"):
                marks.must_refuse = True
            if not pattern.startswith("-:") and pattern not in ("+:[a-",) and isinstance(rule, dict):
                if "bits" in rule and rule["bits"] != q["bits"]:
                    marks.must_refuse = True
                if "group_size" in rule and not matches_tensors(folder, marks.base, rule["group_size"]):
                    marks.must_refuse = True
    elif key == "quant_method":
        v = rng.choice(["gptq", "awq", "bitsandbytes", "fp8", "nope", 5, None])
        marks.must_refuse = v in ("gptq", "awq", "bitsandbytes") and v != q.get("quant_method")
    elif key in ("checkpoint_format", "version", "pack_dtype"):
        v = rng.choice(["gptq", "gptq_v2", "marlin", "gemm", "gemv", "gemv_fast", "int64", "int16", "x", 5, None])
    else:
        v = rng.choice([True, False, "yes", None, 0, 1, [], "x"])
    if target < 0.25 and (folder / "quantize_config.json").exists():  # AutoGPTQ's copy, which loaders do not read
        qc = _json(folder / "quantize_config.json")
        qc[key] = v
        _write_json(folder / "quantize_config.json", qc)
        marks.must_refuse = False
        return f"quantize_config.json {key} = {str(v)[:40]}"
    q[key] = v
    _write_json(cfg_path, cfg)
    return f"quantization_config.{key} = {str(v)[:40]}"


# ---------------------------------------------------------------- quantized checkpoints: tensors

QUANT_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".absmax", ".quant_map", ".SCB", ".nested_absmax",
                  ".nested_quant_map", "bitsandbytes__nf4", "bitsandbytes__fp4", ".weight_format")


def _resized(blob: bytes, size: int) -> bytes:
    return (blob * (size // max(1, len(blob)) + 1))[:size] if blob else bytes(size)


def m_quant_tensors(rng, folder: Path, marks: Marks) -> str:
    path = weights(folder)
    header, data = st.read(path)
    quant = [k for k in header if k != "__metadata__" and (k.endswith(QUANT_SUFFIXES)
                                                          or (header[k]["dtype"] in ("U8", "I8") and k.endswith(".weight")))]
    name = rng.choice(quant)
    items = st.entries(header, data)
    i = next(j for j, e in enumerate(items) if e[0] == name)
    n, dtype, shape, blob = items[i]
    integer = dtype not in FLOAT_DTYPES
    choice = rng.choice(["shape", "shape", "dtype", "dtype", "remove", "values"])
    if choice == "shape":
        numel = math.prod(shape)
        new = rng.choice([list(reversed(shape)), [numel], shape + [1], [d * 2 for d in shape], [max(1, d // 2) for d in shape],
                          [shape[0] + 1] + shape[1:] if shape else [1], [0] + shape[1:]])
        items[i] = (n, dtype, new, _resized(blob, math.prod(new) * DTYPE_BYTES[dtype]))
        # a unit dimension more or less keeps the values and their order (the flag, the JSON blob, absmax)
        same = [d for d in new if d != 1] == [d for d in shape if d != 1]
        marks.must_refuse = not same
        detail = f"shape of {name} {shape} -> {new}"
    elif choice == "dtype":
        new = rng.choice(["F32", "F16", "BF16", "I32", "I64", "I16", "I8", "U8", "F64"])
        size = DTYPE_BYTES[new] * math.prod(shape)
        converted = rng.random() < 0.5 and (new in FLOAT_DTYPES) == (not integer)
        if converted:  # the same values in another type of the same kind (fp32 scales are legitimate)
            import torch
            from safetensors.torch import _getdtype

            t = torch.frombuffer(bytearray(blob), dtype=_getdtype(dtype)).reshape(shape) if blob else torch.empty(shape)
            blob2 = t.to(_getdtype(new)).reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
            items[i] = (n, new, shape, blob2)
            detail = f"dtype of {name} {dtype} -> {new} (values converted)"
        else:
            items[i] = (n, new, shape, _resized(blob, size))
            storage = name.endswith(".weight") and marks.base in BNB and "int8" not in marks.base  # 4-bit codes: any storage type
            flag = name.endswith(".weight_format")  # its value is read and checked, whatever the type
            marks.must_refuse = new != dtype and (integer == (new in FLOAT_DTYPES)) and not storage and not flag
            detail = f"dtype of {name} {dtype} -> {new} (bytes reinterpreted)"
    elif choice == "remove":
        del items[i]
        optional = (name.endswith(".g_idx") and marks.base != "gptq_4bit_g32_desc_act") or name.endswith(".weight_format")
        marks.must_refuse = not optional  # (g_idx is k // group_size without act-order; weight_format 0 by default)
        detail = f"{name} removed"
    else:
        if name.endswith(".g_idx"):
            import array

            vals = array.array("i", blob)
            k = rng.randrange(len(vals))
            vals[k] = rng.choice([-1, max(vals) + 1, 2**31 - 1, -(2**31)])
            items[i] = (n, dtype, shape, vals.tobytes())
            marks.must_refuse = True
            detail = f"{name}[{k}] = {vals[k]}"
        elif "bitsandbytes__" in name:  # the quant state is JSON in a byte tensor
            state = rng.choice([b"{}", b"[1]", b"\xff\xfe", b'{"quant_type": "nf5", "blocksize": 0, "dtype": "x", "shape": [-1]}',
                                b'{"quant_type": "fp4"}', blob[:len(blob) // 2]])
            items[i] = (n, dtype, [len(state)], state)
            marks.must_refuse = state != blob
            detail = f"{name} = {state[:40]!r}"
        else:
            items[i] = (n, dtype, shape, _flip_bytes(rng, blob))
            detail = f"{name} values changed"
    text, blob = st.rebuilt(items, header.get("__metadata__"))
    st.write_text(path, text, blob)
    return detail


# ---------------------------------------------------------------- tokenizer.json

BEYOND = "<beyond>"


def m_tokenizer_model(rng, folder: Path, marks: Marks) -> str:
    path = folder / "tokenizer.json"
    tj = _json(path)
    vocab_rows = _json(folder / "config.json").get("vocab_size", 300)
    choice = rng.choice(["type", "vocab_ids", "vocab_shift", "added_past", "added_odd", "pre_tokenizer", "normalizer",
                         "decoder", "merges", "post_processor"])
    model = tj["model"]
    if choice == "type":
        model["type"] = rng.choice(["Unigram", "WordPiece", "WordLevel", "Nope", 5, None])
        detail = f"model type {model['type']!r}"
    elif choice == "vocab_ids":
        tokens = sorted(model["vocab"])
        for _ in range(rng.randint(1, 5)):
            model["vocab"][rng.choice(tokens)] = rng.choice([vocab_rows, 10**6, -1, 2**40, 2**64, 0, "x", 1.5])
        detail = "vocab ids out of range"
    elif choice == "vocab_shift":  # every id past the model's embedding: any prompt meets one
        model["vocab"] = {t: i + vocab_rows + 100 for t, i in model["vocab"].items()}
        for a in tj.get("added_tokens", []):
            a["id"] += vocab_rows + 100
        marks.must_refuse = True
        detail = f"vocab ids shifted past {vocab_rows} rows"
    elif choice == "added_past":
        tid = rng.choice([vocab_rows, vocab_rows + 1, 10**6, 2**32 - 1])
        tj.setdefault("added_tokens", []).append({"id": tid, "content": BEYOND, "single_word": False, "lstrip": False,
                                                  "rstrip": False, "normalized": False, "special": True})
        marks.prompt = f"hello {BEYOND} there"
        marks.must_refuse = True
        detail = f"added token {BEYOND} id {tid} in the prompt"
    elif choice == "added_odd":
        tj["added_tokens"] = rng.choice([[{"id": "x", "content": "a"}], [{"id": 5, "content": 5}], [5], "x",
                                         [{"id": 1, "content": ""}], [{"id": 2, "content": "hi", "special": "yes"}]])
        detail = f"added_tokens = {str(tj['added_tokens'])[:40]}"
    elif choice == "pre_tokenizer":
        pattern = rng.choice(["(", "(a+)+b", "[", "\\", "(?<=a)b", "a{99999}{99999}", "\\p{Nope}", "(x*)*y", "",
                              "(?:(?:a*)*)*$", "(.*)*\\1"])
        tj["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
        marks.prompt = "a" * 40 + "!"
        detail = f"pre-tokenizer regex {pattern!r}"
    elif choice == "normalizer":
        tj["normalizer"] = rng.choice([{"type": "Replace", "pattern": {"Regex": "("}, "content": "x"}, {"type": "Nope"},
                                       {"type": "Precompiled", "precompiled_charsmap": "!!"}, 5,
                                       {"type": "Replace", "pattern": {"String": ""}, "content": "xx"},
                                       {"type": "Sequence", "normalizers": [{"type": "NFKC"}] * 1000}])
        detail = f"normalizer {str(tj['normalizer'])[:40]}"
    elif choice == "decoder":
        tj["decoder"] = rng.choice([{"type": "Nope"}, None, 5, {"type": "Replace", "pattern": {"Regex": "("}, "content": ""},
                                    {"type": "ByteFallback"}, {"type": "Strip", "content": " ", "start": 2**40, "stop": 0}])
        detail = f"decoder {str(tj['decoder'])[:40]}"
    elif choice == "merges":
        model["merges"] = rng.choice([[["zz", "qq"]], ["a b c"], [["a"]], [[5, 6]], ["\u0120 \u0120"] * 3000, []])
        detail = f"merges {str(model['merges'])[:40]}"
    else:
        tid = rng.choice([vocab_rows + 5, 10**6])
        tj["post_processor"] = {"type": "TemplateProcessing",
                                "single": [{"SpecialToken": {"id": "<x>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                                "special_tokens": {"<x>": {"id": "<x>", "ids": [tid], "tokens": ["<x>"]}}}
        detail = f"post-processor adds id {tid} (brisk encodes without it)"
    path.write_text(json.dumps(tj))
    return f"tokenizer.json {detail}"


# ---------------------------------------------------------------- inconsistent folders (the silent class)

def m_inconsistent(rng, folder: Path, marks: Marks) -> str:
    """Folders that no longer describe one model; each must be refused (the stale file, not read)."""
    if marks.base in GPTQ + AWQ:
        cfg = _json(folder / "config.json")
        v = rng.choice([g for g in (16, 32, 64, 128, 256, -1) if not matches_tensors(folder, marks.base, g)])
        cfg["quantization_config"]["group_size"] = v
        _write_json(folder / "config.json", cfg)
        marks.must_refuse = True
        return f"group_size {v}, not the tensors'"
    if marks.base in BNB:
        drop_tensors(folder, lambda n: n.startswith("lm_head."))
        marks.must_refuse = True
        return "lm_head removed (untied)"
    choice = rng.choice(["dup_header", "dup_shards", "stale", "no_head", "rope"])
    if choice == "dup_header":
        header, data = st.read(weights(folder))
        items = st.entries(header, data)
        k = rng.randrange(len(items))
        n, dt, sh, b = items[k]
        items.append((n, dt, sh, _flip_bytes(rng, b)))
        text, blob = st.rebuilt(items, header.get("__metadata__"))
        st.write_text(weights(folder), text, blob)
        marks.must_refuse = True
        return f"{n} twice in the header, different data"
    if choice == "dup_shards":
        weight_map = shard(rng, folder)
        name = rng.choice(sorted(weight_map))
        dst = rng.choice([f for f in sorted(set(weight_map.values())) if f != weight_map[name]])
        copy_into(rng, folder, name, weight_map[name], dst, same=False)
        marks.must_refuse = True
        return f"{name} in two shards, different data"
    if choice == "stale":
        weight_map = shard(rng, folder)
        stale = folder / "model.safetensors"
        stale_copy(rng, folder, sorted(set(weight_map.values())), stale)
        marks.forbidden.append(stale)
        return "stale model.safetensors beside the index's shards"
    if choice == "no_head":
        drop_tensors(folder, lambda n: n == "lm_head.weight")
        cfg = _json(folder / "config.json")
        how = rng.choice(["false", "absent"])
        if how == "absent":
            cfg.pop("tie_word_embeddings", None)
        else:
            cfg["tie_word_embeddings"] = False
        _write_json(folder / "config.json", cfg)
        marks.must_refuse = True
        return f"lm_head removed, tie_word_embeddings {how}"
    cfg = _json(folder / "config.json")
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    v = rng.choice([0, 0.0, float("nan"), float("inf"), float("-inf"), -1, -8.0])
    field_ = rng.choice(["factor", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"])
    cfg[key] = {**cfg[key], field_: v}
    _write_json(folder / "config.json", cfg)
    marks.must_refuse = True
    return f"{key}.{field_} = {v}"


FOLDER_MUTATORS = {  # name: (mutator, weight, bases)
    "hf.safetensors_header": (m_safetensors_header, 2, ANY),
    "hf.shards": (m_shards, 2, (FLOAT,)),
    "hf.special_file": (m_special_file, 1.5, ANY),
    "hf.json_file": (m_json_file, 2, ANY),
    "hf.quant_config": (m_quant_config, 2, GPTQ + AWQ + BNB[:2]),
    "hf.quant_tensors": (m_quant_tensors, 2, QUANTIZED),
    "hf.tokenizer_model": (m_tokenizer_model, 1.5, (FLOAT,) * 3 + QUANTIZED),
    "hf.inconsistent": (m_inconsistent, 2, (FLOAT,) * 5 + GPTQ + AWQ + BNB[:1]),
}
