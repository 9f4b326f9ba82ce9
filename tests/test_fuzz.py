"""Malformed model files, configs, templates and prompts give one clean `error:` line, fast: a
seeded slice of the fuzz harness (tests/fuzz/harness.py; `make fuzz` runs the long one), then one
test per fix it led to."""
from __future__ import annotations

import json
import shutil
import struct
import sys
import time
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fuzz import folder_mutators, gguf_edit, harness  # noqa: E402

from brisk.core.errors import BriskError, FileError  # noqa: E402

FUZZ_SEED, FUZZ_CASES = 20261125, 250


def test_fuzz_slice():
    """A few hundred seeded cases: none may be internal, hang, memory or crash (~1.5 min). Run as
    `make fuzz` runs, from a fresh process: children forked from this test process after hundreds
    of other tests once hung on a case that runs in 0.6 s from a fresh one."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "fuzz.py"
    r = subprocess.run([sys.executable, str(script), "-n", str(FUZZ_CASES), "--seed", str(FUZZ_SEED),
                        "--timeout", "20", "--cli-checks", "3"], capture_output=True, text=True, timeout=1800)
    print(r.stdout[-6000:])
    assert r.returncode == 0, "replay with python scripts/fuzz.py --replay ID:\n" + r.stdout[-3000:] + r.stderr[-2000:]
    counts = r.stdout[r.stdout.index(f"{FUZZ_CASES} cases (seed {FUZZ_SEED}):"):].splitlines()[0]
    assert " ok 0," not in counts and " clean 0," not in counts, counts  # the mutations do both


@pytest.fixture(scope="module")
def folder_corpus(tmp_path_factory):
    harness.prepare_parent()
    corpus = harness.Corpus(tmp_path_factory.mktemp("fuzz"))
    return corpus, harness.calibrate(corpus, 20.0)


@pytest.mark.parametrize("mutator", sorted(folder_mutators.FOLDER_MUTATORS))
def test_fuzz_folder_category(folder_corpus, mutator):
    """A few seeded cases of each model-folder category, drawn for it (the slice above may miss
    one): none may be internal, hang, memory, crash, silent, outside or lost."""
    corpus, budget = folder_corpus
    results = [harness.run_case_forked(harness.make_case(corpus, FUZZ_SEED, i, mutator), 20.0, budget) for i in range(4)]
    bad = [r for r in results if r.category not in ("ok", "clean")]
    assert not bad, "\n".join(f"{r.case.id} {r.category} {r.case.detail}: {r.message}" for r in bad)


def test_fuzz_verdicts(tmp_path):
    """The folder rules: an inconsistent folder that loads is silent, a stale file read while
    loading is silent, an outside target opened is outside, a changed file is lost."""
    outside = tmp_path / "outside"
    case = harness.Case("t", "hf", "m", "", tmp_path / "hf", marks=folder_mutators.Marks("float", must_refuse=True))
    assert harness.verdict(case, "ok", "", [], False, [])[0] == "silent"
    assert harness.verdict(case, "clean", "x", [], False, [])[0] == "clean"
    case.marks = folder_mutators.Marks("float", forbidden=[tmp_path / "hf" / "stale.safetensors"])
    assert harness.verdict(case, "ok", "", [str(tmp_path / "hf" / "stale.safetensors")], False, [])[0] == "silent"
    case.marks = folder_mutators.Marks("float", outside=outside / "x.safetensors")
    assert harness.verdict(case, "clean", "", [str(outside / "x.safetensors")], False, [])[0] == "outside"
    assert harness.verdict(case, "hang", "", [], True, [])[0] == "outside"
    assert harness.verdict(case, "ok", "", [], False, ["hf/config.json"])[0] == "lost"


def test_outside_fifo_opened_is_seen(tmp_path):
    import os
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert not harness._fifo_opened(fifo)
    t = threading.Thread(target=lambda: open(fifo, "rb").read(), daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not harness._fifo_opened(fifo) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert time.monotonic() < deadline
    t.join(5)


# ---------------------------------------------------------------- GGUF header

@pytest.fixture(scope="module")
def tiny(tiny_gguf_path):
    data = tiny_gguf_path.read_bytes()
    return data, gguf_edit.parse(data)


def _write(tmp_path, data: bytes) -> Path:
    p = tmp_path / "m.gguf"
    p.write_bytes(data)
    return p


def _one_line_error(path, *needles, seconds=1.0):
    from brisk.core.gguf_file import GGUFFile

    t0 = time.perf_counter()
    with pytest.raises(FileError) as e:
        GGUFFile(path)
    assert time.perf_counter() - t0 < seconds
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    for n in needles:
        assert n in msg, msg
    return msg


def _patched(tiny, pred, value):
    data, lay = tiny
    f = next(f for f in lay.fields if pred(f))
    b = bytearray(data)
    b[f.offset:f.offset + f.size] = value.to_bytes(f.size, "little")
    return bytes(b), f


def test_gguf_huge_string_length_names_the_key(tiny, tmp_path):
    data, f = _patched(tiny, lambda f: f.kind == "str_len" and f.name == "general.name", 2**60)
    _one_line_error(_write(tmp_path, data), "key general.name", str(2**60))


def test_gguf_huge_array_count_names_the_key(tiny, tmp_path):
    data, f = _patched(tiny, lambda f: f.kind == "array_count" and f.name == "tokenizer.ggml.scores", 2**62)
    _one_line_error(_write(tmp_path, data), "key tokenizer.ggml.scores", "cannot fit")


def test_gguf_huge_counts(tiny, tmp_path):
    data, f = _patched(tiny, lambda f: f.kind == "counts", 2**40)
    _one_line_error(_write(tmp_path, data), "implausible counts")


@pytest.mark.parametrize("dim", [0, 2**40, 2**63, 2**64 - 1])
def test_gguf_absurd_tensor_dims(tiny, tmp_path, dim):
    data, f = _patched(tiny, lambda f: f.kind == "dim" and f.name == "output.weight", dim)
    _one_line_error(_write(tmp_path, data), "tensor output.weight")


def test_gguf_tensor_type_that_does_not_fit_its_rows(tiny, tmp_path):
    data, f = _patched(tiny, lambda f: f.kind == "qtype" and f.name == "blk.0.attn_norm.weight", 14)  # Q6_K
    _one_line_error(_write(tmp_path, data), "tensor blk.0.attn_norm.weight", "Q6_K")


def test_gguf_tensor_offset_outside_the_file(tiny, tmp_path):
    data, f = _patched(tiny, lambda f: f.kind == "offset" and f.name == "blk.1.attn_v.weight", 2**63)
    _one_line_error(_write(tmp_path, data), "tensor blk.1.attn_v.weight", "past the end")


@pytest.mark.parametrize("key,vtype,value,needle", [
    ("llama.attention.head_count", 4, 0, "head_count"),
    ("llama.attention.head_count_kv", 4, 2**32 - 1, "head_count_kv"),
    ("llama.block_count", 10, 2**40, "block_count"),
    ("llama.attention.layer_norm_rms_epsilon", 8, "banana", "layer_norm_rms_epsilon"),
    ("llama.embedding_length", 12, 1e300, "embedding_length"),
    ("general.alignment", 4, 0, "general.alignment"),
])
def test_gguf_bad_config_values(tiny, tmp_path, key, vtype, value, needle):
    from brisk.core.checkpoint import load_checkpoint

    data, lay = tiny
    kv = [e for e in lay.kv if e[0] != key] + [(key, vtype, value)]
    path = _write(tmp_path, gguf_edit.serialize(kv, lay.tensors, data[lay.data_start:]))
    with pytest.raises(FileError) as e:
        load_checkpoint(str(path))
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- HF folders

@pytest.fixture
def hf_copy(tiny_llama_dir, tmp_path):
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))


@pytest.mark.parametrize("key,value", [("num_key_value_heads", 10**18), ("head_dim", 1.5), ("model_type", []),
                                       ("num_hidden_layers", {"a": 1}), ("rope_theta", float("nan")),
                                       ("hidden_size", 0), ("rope_scaling", [1])])
def test_hf_bad_config_values(hf_copy, key, value):
    from brisk.core.checkpoint import load_checkpoint

    cfg = json.loads((hf_copy / "config.json").read_text())
    cfg[key] = value
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BriskError) as e:
        load_checkpoint(str(hf_copy))
    assert key in str(e.value) and "\n" not in str(e.value)


def test_hf_config_not_an_object(hf_copy):
    from brisk.core.checkpoint import load_checkpoint

    (hf_copy / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(FileError, match="must be a JSON object"):
        load_checkpoint(str(hf_copy))


def test_hf_quantization_config_not_an_object(hf_copy):
    from brisk.core.checkpoint import load_checkpoint

    cfg = json.loads((hf_copy / "config.json").read_text())
    (hf_copy / "config.json").write_text(json.dumps({**cfg, "quantization_config": [1, 2]}))
    with pytest.raises(FileError, match="quantization_config must be an object"):
        load_checkpoint(str(hf_copy))


def test_bad_generation_config_values_are_ignored_with_a_warning(hf_copy):
    from brisk.core.checkpoint import load_checkpoint

    (hf_copy / "generation_config.json").write_text(json.dumps({"temperature": "hot", "top_k": -5, "top_p": 0.5}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = load_checkpoint(str(hf_copy))
    assert ckpt.generation == {"top_p": 0.5}
    assert sum("not a valid setting" in str(w.message) for w in caught) == 2


# ---------------------------------------------------------------- chat templates, prompts

def _tok(template: str):
    from brisk.core.tokenizer import Tokenizer
    from tests.conftest import train_tiny_tokenizer

    return Tokenizer(train_tiny_tokenizer(), chat_template=template)


@pytest.mark.parametrize("name", ["huge_range", "nested_loops", "nested_output", "string_mult", "list_mult",
                                  "recursion", "center", "format_width", "string_loop"])
def test_hostile_chat_templates_are_refused_quickly(name, monkeypatch):
    from brisk.core import tokenizer

    monkeypatch.setattr(tokenizer, "TEMPLATE_SECONDS", 0.5)
    monkeypatch.setattr(tokenizer, "TEMPLATE_MAX_CHARS", 1 << 20)
    tok = _tok(harness.EVIL_TEMPLATES[name])
    t0 = time.perf_counter()
    with pytest.raises(BriskError, match="chat template refused") as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - t0 < 3 and "\n" not in str(e.value)


def test_template_limits_restore_the_previous_tracer(monkeypatch):
    def tracer(frame, event, arg):
        return None

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        _tok("{{ messages[0]['content'] }}").apply_chat_template([{"role": "user", "content": "hi"}])
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(old)


def test_ordinary_template_still_renders():
    from tests.conftest import CHAT_TEMPLATE

    out = _tok(CHAT_TEMPLATE).apply_chat_template([{"role": "user", "content": "hi"}])
    assert out.endswith("<|user|>hi</s><|assistant|>")


def test_prompt_with_undecodable_argv_bytes_encodes():
    """A command-line prompt with bytes that are not UTF-8 (Python keeps them as lone surrogates)
    used to fail in the tokenizer with 'TextInputSequence must be str'."""
    tok = _tok("")
    assert tok.encode("caf\udcc3\udca9 \udcff") == tok.encode("café \ufffd")


# ---------------------------------------------------------------- found by the long run (make fuzz)

def _load_with(tiny, tmp_path, kv=None, tensors=None):
    from brisk.core import checkpoint

    data, lay = tiny
    path = _write(tmp_path, gguf_edit.serialize(lay.kv if kv is None else kv, lay.tensors if tensors is None else tensors,
                                               data[lay.data_start:]))
    return checkpoint.load_checkpoint(str(path))


def test_gguf_merges_that_are_not_pairs(tiny, tmp_path, monkeypatch):
    from brisk.core import checkpoint

    monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path / "cache")
    kv = [(k, t, v if k != "tokenizer.ggml.model" else "gpt2") for k, t, v in tiny[1].kv]
    kv.append(("tokenizer.ggml.merges", 9, (8, ["a b", "ab"])))
    with pytest.raises(FileError, match="tokenizer.ggml.merges"):
        _load_with(tiny, tmp_path, kv)


def test_gguf_chat_template_that_is_not_text_is_ignored(tiny, tmp_path, monkeypatch):
    from brisk.core import checkpoint

    monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path / "cache")
    with pytest.warns(UserWarning, match="chat_template is not text"):
        ckpt = _load_with(tiny, tmp_path, list(tiny[1].kv) + [("tokenizer.chat_template", 4, 12345)])
    assert ckpt.tokenizer.chat_template is None


def test_gguf_weight_with_three_dimensions(tiny, tmp_path, monkeypatch):
    from brisk.core import checkpoint

    monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path / "cache")
    tensors = [(n, d + [2] if n == "blk.0.attn_k.weight" else d, q, o) for n, d, q, o in tiny[1].tensors]
    with pytest.raises(FileError, match="tensor blk.0.attn_k.weight has shape"):
        _load_with(tiny, tmp_path, tensors=tensors)


@pytest.mark.parametrize("file,key,value", [("generation_config.json", "eos_token_id", {}),
                                            ("generation_config.json", "bos_token_id", 2**40),
                                            ("tokenizer_config.json", "brisk_eos_token_ids", 5)])
def test_odd_token_ids_in_json_are_ignored(hf_copy, file, key, value):
    from brisk.core.tokenizer import Tokenizer

    data = json.loads((hf_copy / file).read_text()) if (hf_copy / file).exists() else {}
    (hf_copy / file).write_text(json.dumps({**data, key: value}))
    tok = Tokenizer.from_hf_folder(hf_copy)
    assert all(0 <= i < tok.vocab_size for i in tok.eos_ids) and (tok.bos_id is None or tok.bos_id < tok.vocab_size)


def test_a_huge_number_is_not_printed_whole(hf_copy):
    from brisk.core.checkpoint import load_checkpoint

    cfg = json.loads((hf_copy / "config.json").read_text())
    (hf_copy / "config.json").write_text(json.dumps({**cfg, "hidden_size": 10**400}))
    with pytest.raises(FileError, match="a 401-digit number") as e:
        load_checkpoint(str(hf_copy))
    assert len(str(e.value)) < 300


def test_an_integer_too_big_for_a_float(hf_copy):
    """rope_theta = 10**400 (an integer in JSON): math.isfinite overflowed on it."""
    from brisk.core.checkpoint import load_checkpoint

    cfg = json.loads((hf_copy / "config.json").read_text())
    (hf_copy / "config.json").write_text(json.dumps({**cfg, "rope_theta": 10**400}))
    with pytest.raises(FileError, match="rope_theta must be a positive number"):
        load_checkpoint(str(hf_copy))
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    (hf_copy / "generation_config.json").write_text(json.dumps({"temperature": 10**400}))
    with pytest.warns(UserWarning, match="temperature"):
        assert "temperature" not in load_checkpoint(str(hf_copy)).generation


def test_an_integer_rope_theta_past_int64(hf_copy):
    """rope_parameters.rope_theta = 2**64 passed the range check (under 1e30) and then overflowed
    torch's conversion of a Python integer when the rope table was built."""
    from brisk.core import LLM
    from brisk.core.sampling import SamplingParams

    cfg = json.loads((hf_copy / "config.json").read_text())
    key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    cfg.pop("rope_theta", None)
    cfg[key] = {**cfg[key], "rope_theta": 2**64}
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    llm = LLM.load(str(hf_copy), device="cpu", dtype="float32")
    assert llm.generate("hi", SamplingParams(temperature=0), max_tokens=2).tokens


def test_prompt_argument_that_is_not_utf8_is_replaced_and_said_once(capsys):
    from brisk.cli.generate_cmd import _split_args

    sys_stdin = sys.stdin
    sys.stdin = None
    try:
        model, prompt = _split_args(["caf\udcc3\udca9 \udcff!"], None, None)
    finally:
        sys.stdin = sys_stdin
    assert prompt == "café \ufffd!"
    assert capsys.readouterr().err.count("not valid UTF-8") == 1
