"""`brisk info`: facts read from headers only, checked against the gguf package's own reader and
against what loading the model actually holds."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import default_sigint
from typer.testing import CliRunner

from brisk.cli.main import app
from brisk.core import model_info as mi
from brisk.core.errors import FileError

runner = CliRunner()
BRISK = [sys.executable, "-c", "from brisk.cli.main import run; run()"]
FIXTURES = Path(__file__).parent / "fixtures"


def brisk(*args, timeout=300):
    return subprocess.run(BRISK + list(args), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"}, preexec_fn=default_sigint)


def assert_clean_error(r, *words):
    assert r.returncode == 1
    err = r.stderr.strip()
    assert "Traceback" not in r.stderr + r.stdout
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for w in words:
        assert w.lower() in err.lower(), err


def _reader_totals(path: Path):
    """Per-type (tensors, bytes) and the parameter count, by the gguf package's own reader."""
    import gguf

    reader = gguf.GGUFReader(path)
    per_type = defaultdict(lambda: [0, 0])
    for t in reader.tensors:
        per_type[t.tensor_type.name][0] += 1
        per_type[t.tensor_type.name][1] += int(t.n_bytes)
    return dict(per_type), sum(int(t.n_elements) for t in reader.tensors)


@pytest.fixture(params=["tiny", "smollm2"])
def gguf_path(request):
    return request.getfixturevalue("tiny_gguf_path" if request.param == "tiny" else "smollm2_path")


def test_gguf_facts_match_the_gguf_reader(gguf_path):
    info = mi.model_info(str(gguf_path))
    per_type, params = _reader_totals(gguf_path)
    assert info.format == "gguf" and info.architecture == "llama"
    assert info.parameters == params
    assert {u.type: [u.tensors, u.bytes] for u in info.quantization} == per_type
    assert [u.bytes for u in info.quantization] == sorted((u.bytes for u in info.quantization), reverse=True)
    assert info.file_bytes == gguf_path.stat().st_size
    assert sum(u.elements for u in info.quantization) == params


def test_smollm2_facts(smollm2_path):
    info = mi.model_info(str(smollm2_path))
    assert 134e6 < info.parameters < 136e6
    assert {u.type for u in info.quantization} == {"Q4_1", "Q8_0", "F32"}
    assert (info.layers, info.heads, info.kv_heads, info.head_dim, info.hidden_size) == (30, 9, 3, 64, 576)
    assert info.context_length == 8192 and info.ctx == 4096  # min(4096, the model's), as the loader
    assert info.vocab_size == 49152 and info.tie_embeddings and info.chat_template
    assert info.kv_bytes == 4096 * info.kv_bytes_per_token
    assert info.memory[0].device == "cpu" and info.memory[0].needed_bytes == info.memory[0].weights_bytes + info.kv_bytes


def test_default_model_is_the_embedded_one(smollm2_path):
    info = mi.model_info(None)
    assert Path(info.path) == smollm2_path and "default" in info.name


def test_ctx_choice(tiny_gguf_path):
    small = mi.model_info(str(tiny_gguf_path), ctx=512)
    assert small.ctx == 512 and small.kv_bytes == 512 * small.kv_bytes_per_token and not small.notes
    assert small.memory[0].kv_bytes == small.kv_bytes
    big = mi.model_info(str(tiny_gguf_path), ctx=10**6)
    assert big.ctx == big.context_length == 2048
    assert any("caps" in n for n in big.notes)
    assert mi.model_info(str(tiny_gguf_path)).ctx == 2048  # min(4096, 2048)


@pytest.mark.parametrize("which", ["tiny", "smollm2", "gemma"])
def test_memory_estimate_matches_a_loaded_model(which, request):
    """The CPU weight bytes and KV bytes per token equal what LLM.load actually holds."""
    from brisk.core.llm import LLM

    path = request.getfixturevalue({"tiny": "tiny_gguf_path", "smollm2": "smollm2_path", "gemma": "gemma_path"}[which])
    info = mi.model_info(str(path), ctx=64)
    llm = LLM.load(str(path), device="cpu", ctx=64)
    cpu = info.memory[0]
    assert abs(cpu.weights_bytes - llm.load_info.param_bytes) <= 0.10 * llm.load_info.param_bytes
    assert not cpu.approximate
    cache = llm.new_cache()
    assert cache.nbytes / cache.max_len == info.kv_bytes_per_token
    assert str(llm.dtype).removeprefix("torch.") == info.kv_dtype == cpu.dtype
    if which == "gemma":
        assert info.sliding_layers > 0 and info.sliding_window and any("sliding" in n for n in info.notes)


def test_hf_folder(tiny_llama_dir):
    from safetensors import safe_open

    from brisk.core.llm import LLM

    info = mi.model_info(str(tiny_llama_dir))
    files = sorted(tiny_llama_dir.glob("*.safetensors"))
    elements, per_dtype = 0, defaultdict(int)
    for f in files:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                s = st.get_slice(k)
                elements += math.prod(s.get_shape())
                per_dtype[s.get_dtype()] += 1
    llm = LLM.load(str(tiny_llama_dir), device="cpu")
    assert info.format == "hf" and info.architecture == "llama" and info.quant_method is None
    assert info.parameters == elements == mi._logical_parameters(llm.config)
    assert {u.type: u.tensors for u in info.quantization} == dict(per_dtype)
    assert info.file_bytes == sum(f.stat().st_size for f in files)
    assert info.chat_template and info.context_length == 256 and info.ctx == 256
    assert info.memory[0].weights_bytes == llm.load_info.param_bytes
    cache = llm.new_cache()
    assert cache.nbytes / cache.max_len == info.kv_bytes_per_token


@pytest.mark.parametrize("name", ["gptq_4bit_g32_desc_act", "awq_gemm_4bit_g128", "bnb_nf4", "bnb_int8"])
def test_quantized_hf_folder(name):
    from brisk.core.llm import LLM

    folder = FIXTURES / name
    info = mi.model_info(str(folder))
    assert info.quant_method.split()[0] == name.split("_")[0].replace("bnb", "bitsandbytes")
    # the float model's own parameter count, not the packed tensors' element count
    llm = LLM.load(str(folder), device="cpu")
    assert info.parameters == mi._logical_parameters(llm.config)
    assert info.parameters > sum(u.elements for u in info.quantization if u.type in ("I32", "U8", "I8")) > 0
    cpu = info.memory[0]
    assert cpu.approximate
    param_bytes = llm.load_info.param_bytes
    assert abs(cpu.weights_bytes - param_bytes) <= 0.2 * param_bytes


def test_describe_quant():
    assert mi._describe_quant({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}) \
        == "gptq 4-bit, group 128, act-order"
    assert mi._describe_quant({"quant_method": "awq", "bits": 4, "group_size": 128, "sym": False}) \
        == "awq 4-bit, group 128, asymmetric"
    assert mi._describe_quant({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                               "bnb_4bit_use_double_quant": True}) == "bitsandbytes nf4 (double quant)"
    assert mi._describe_quant({"quant_method": "bitsandbytes", "load_in_8bit": True}) == "bitsandbytes int8"


def test_never_reads_tensor_data(tmp_path, tiny_gguf_path, tiny_llama_dir, monkeypatch):
    """A fresh copy (no header cache yet) is parsed with every tensor-data reader disabled, and the
    header parser never reads past the first tensor's offset."""
    import gguf
    import numpy as np
    import safetensors
    import safetensors.torch

    from brisk.core import checkpoint, gguf_file

    copy = tmp_path / "fresh.gguf"
    shutil.copy(tiny_gguf_path, copy)
    first = min(int(t.data_offset) for t in gguf.GGUFReader(copy).tensors)

    def refuse(*a, **k):
        raise AssertionError("tensor data read")

    for owner, attr in [(gguf_file, "dequantize_tensor"), (gguf_file.GGUFFile, "load"), (gguf_file.GGUFFile, "raw"),
                        (gguf.quants, "dequantize"), (checkpoint, "load_gguf"), (checkpoint, "load_checkpoint"),
                        (checkpoint, "load_hf_tensors"), (checkpoint, "_load_safetensors"),
                        (safetensors.torch, "load_file"), (safetensors, "safe_open")]:
        monkeypatch.setattr(owner, attr, refuse)
    furthest = [0]
    take = gguf_file.GGUFFile._take

    def recording_take(self, n):
        furthest[0] = max(furthest[0], self.pos + n)
        return take(self, n)

    monkeypatch.setattr(gguf_file.GGUFFile, "_take", recording_take)
    info = mi.model_info(str(copy))
    assert info.parameters > 0 and 0 < furthest[0] <= first

    # np.memmap appears only in the header reader: the info path maps nothing else
    maps = []
    memmap = np.memmap
    monkeypatch.setattr(np, "memmap", lambda *a, **k: maps.append(a[0]) or memmap(*a, **k))
    mi.model_info(str(tiny_llama_dir))
    mi.model_info(str(copy))  # cached header now: no mapping at all
    assert maps == []


def test_safetensors_header_errors(tmp_path, tiny_llama_dir):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes((10**9).to_bytes(8, "little") + data[8:])
    with pytest.raises(FileError, match="corrupt safetensors header"):
        mi.model_info(str(folder))
    weights.write_bytes(data[:8] + b"x" * (len(data) - 8))
    with pytest.raises(FileError, match="not JSON"):
        mi.model_info(str(folder))
    weights.write_bytes(data[:4])
    with pytest.raises(FileError, match="not a safetensors file"):
        mi.model_info(str(folder))
    weights.unlink()
    with pytest.raises(FileError, match="no \\*.safetensors"):
        mi.model_info(str(folder))
    (folder / "config.json").write_text("{")
    with pytest.raises(FileError, match="invalid JSON"):
        mi.model_info(str(folder))


def test_memory_available(tmp_path, tiny_gguf_path, monkeypatch):
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    8000000 kB\n")
    assert mi.memory_available(str(fake)) == (8000000 * 1024, 16000000 * 1024)
    assert mi.memory_available(str(tmp_path / "none")) == (None, None)
    real_available, real_total = mi.memory_available()
    assert real_available is None or 0 < real_available <= real_total

    monkeypatch.setattr(mi, "memory_available", lambda: (1000, 2000))
    info = mi.model_info(str(tiny_gguf_path))
    assert info.memory[0].fits is False and info.memory[0].available_bytes == 1000
    r = runner.invoke(app, ["info", str(tiny_gguf_path)])
    assert r.exit_code == 0 and "NO:" in r.output


def test_cli_table_and_json(smollm2_path):
    r = runner.invoke(app, ["info", str(smollm2_path)])
    assert r.exit_code == 0, r.output
    for text in ("parameters", "134.5M", "Q4_1", "Q8_0", "8192 tokens max", "49152", "chat template  yes",
                 "per token", "fits"):
        assert text in r.output, r.output
    r = runner.invoke(app, ["info", "-m", str(smollm2_path), "--json", "--ctx", "1000"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["parameters"] == mi.model_info(str(smollm2_path)).parameters
    assert d["ctx"] == 1000 and d["kv_bytes"] == 1000 * d["kv_bytes_per_token"]
    assert d["chat_template"] is True and d["memory"][0]["device"] == "cpu"
    assert {"type", "tensors", "bytes", "elements"} <= set(d["quantization"][0])


def test_help():
    r = runner.invoke(app, ["info", "--help"])
    assert r.exit_code == 0 and "without loading" in r.output and "--ctx" in r.output and "<bool>" not in r.output


def test_bad_inputs_fail_cleanly(tmp_path, tiny_gguf_path):
    text = tmp_path / "x.gguf"
    text.write_text("hello, not a model\n")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf_path.read_bytes()[:100_000])
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("no config")
    cases = [([str(tmp_path / "missing.gguf")], "no such file"), ([str(text)], "not a GGUF"),
             ([str(truncated)], "truncated"), ([str(folder)], "config.json"),
             (["nobody-here/no-such-model-xyz"], "local Hugging Face cache")]
    for args, words in cases:
        assert_clean_error(brisk("info", *args), words)


def test_gpu_rows(smollm2_path, monkeypatch):
    """With a GPU (faked here: the figures come from torch.cuda), a second row: bf16 cache and
    widened weights, Q4_1/Q8_0 repacked as the CUDA load does, marked as an estimate."""
    monkeypatch.setattr(mi, "_cuda_count", lambda: 1)
    monkeypatch.setattr(mi, "_cuda_memory", lambda device: (10**9, 2 * 10**9))
    monkeypatch.setattr(mi, "_auto_dtype", lambda device: __import__("torch").float32 if device == "cpu"
                        else __import__("torch").bfloat16)
    info = mi.model_info(str(smollm2_path))
    cpu, gpu = info.memory
    assert gpu.device == "cuda:0" and gpu.dtype == "bfloat16" and gpu.approximate and not cpu.approximate
    assert gpu.kv_bytes * 2 == cpu.kv_bytes
    assert 0.5 * cpu.weights_bytes < gpu.weights_bytes < 1.5 * cpu.weights_bytes
    assert gpu.fits is True and gpu.available_bytes == 10**9
    r = runner.invoke(app, ["info", str(smollm2_path)])
    assert r.exit_code == 0 and "on cuda:0" in r.output and "~" in r.output
