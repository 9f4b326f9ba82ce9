"""`brisk quantize`: the calibrate-and-write pipeline, its resume, its errors, and what it writes
loading back (in brisk, and where the reference exists, in transformers)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import default_sigint
from interrupt import brisk_command, stop_after
from typer.testing import CliRunner

from brisk.cli.main import app
from brisk.core import calibration
from brisk.core.errors import BriskError
from brisk.core.quantize import QuantOptions, quantize_model, resume

runner = CliRunner()


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny models gain nothing from threads, and on a busy machine spinning OpenMP workers cost
    seconds per test. (Byte-identity holds for a fixed thread count: the subprocesses use one too.)"""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
CALIB = ["--samples", "8", "--seq-len", "64"]  # small: the tiny models see 512 calibration tokens


def quantize(model, out, *args, env=None):
    return runner.invoke(app, ["quantize", str(model), "-o", str(out), *args], env=env)


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def kl_top1(base, other, ids):
    a, b = base.logits(ids).log_softmax(-1), other.logits(ids).log_softmax(-1)
    kl = (a.exp() * (a - b)).sum(-1).mean().item()
    return kl, (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def float_llm(path):
    from brisk.core.llm import LLM

    return LLM.load(None if path is None else str(path), device="cpu", dtype="float32", quantize="none")


TEXT = ("The river town had two bridges. Customer: my order arrived broken. def add(a, b): return a + b. "
        "Temperatures in May ranged from 4.1 to 31.2 degrees.")


# ---------------------------------------------------------------- calibration data

def test_calibration_windows_are_deterministic(tiny_llama_dir):
    from brisk.core.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_folder(tiny_llama_dir)
    texts = calibration.load_texts(None)
    a = calibration.calibration_batch(tok, texts, 16, 128)
    b = calibration.calibration_batch(tok, texts, 16, 128)
    assert a.shape == (16, 128) and torch.equal(a, b)
    stream = sum((tok.encode(t + "\n\n") for t in texts), [])
    assert a[0].tolist() == stream[:128] and a[-1].tolist() == stream[-128:]  # spread end to end
    assert len({tuple(r) for r in a.tolist()}) == 16


def test_builtin_text_is_long_enough_for_the_defaults(smollm2_path):
    from brisk.core.checkpoint import load_checkpoint
    from brisk.core.quantize import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN

    tok = load_checkpoint(str(smollm2_path)).tokenizer
    n = sum(len(tok.encode(t)) for t in calibration.builtin_texts())
    assert n >= DEFAULT_SAMPLES * DEFAULT_SEQ_LEN  # windows do not overlap at the defaults


def test_calib_file_formats(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "first doc"}\n\n{"text": "second"}\n')
    assert calibration.load_texts(p) == ["first doc", "second"]
    p.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(BriskError, match=r"c.jsonl:2"):
        calibration.load_texts(p)
    t = tmp_path / "c.txt"
    t.write_text("plain text\n\nwith paragraphs")
    assert calibration.load_texts(t) == ["plain text\n\nwith paragraphs"]


# ---------------------------------------------------------------- bad input: one line, nothing written

@pytest.mark.parametrize("args, words", [
    (["--method", "q5"], ["unknown --method"]),
    (["--method", "awq", "--bits", "8"], ["awq", "4-bit"]),
    (["--method", "gptq", "--bits", "5"], ["gptq", "5"]),
    (["--method", "nf4", "--group-size", "64"], ["nf4", "group-size"]),
    (["--method", "int8", "--bits", "4"], ["int8", "8-bit"]),
    (["--method", "gptq", "--group-size", "48"], ["group-size"]),
    (["--method", "gptq", "--group-size", "128"], ["does not divide"]),  # the tiny model's in_features are 64
    (["--method", "awq", "--sym"], ["awq", "sym"]),
    (["--method", "nf4", "--samples", "0", "--calib", "x.txt"], ["--calib", "--samples 0"]),
    (["--method", "int8", "--samples", "0", "--seq-len", "64"], ["--seq-len", "--samples 0"]),
    (["--method", "gptq", "--samples", "0"], ["--samples", "at least 1"]),
    (["--method", "nf4", "--samples", "-1"], ["--samples", "0: round to nearest"]),
    (["--method", "gptq", "--calib", "/nonexistent/calib.txt"], ["no such file"]),
    (["--method", "gptq", "--seq-len", "1000"], ["exceeds"]),
    (["--method", "gptq", "--embedding", "int4"], ["--embedding", "16bit or int8"]),
    (["--method", "gptq", "--dynamic", "down_proj"], ["--dynamic", "REGEX=BITS"]),
    (["--method", "gptq", "--dynamic", ".*down_proj=5"], ["--dynamic", "2, 3, 4, 8"]),
    (["--method", "gptq", "--dynamic", "(down=8"], ["--dynamic", "not a regex"]),
    (["--method", "awq", "--dynamic", ".*down_proj=8"], ["--dynamic", "gptq only"]),
    (["--method", "gptq", "--compensate"], ["--compensate", "awq only"]),
    ([], ["--method", "required"]),
    (["--method", "gptq", "--type", "Q4_K_M"], ["--type", "--format gguf only"]),
    (["--method", "gptq", "--format", "onnx"], ["--format", "hf or gguf"]),
])
def test_bad_arguments(tiny_llama_dir, tmp_path, args, words):
    out = tmp_path / "out"
    r = quantize(tiny_llama_dir, out, *args)
    assert r.exit_code == 1 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.output
    for w in words:
        assert w in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_empty_calibration_file(tiny_llama_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    r = quantize(tiny_llama_dir, tmp_path / "out", "--method", "gptq", "--calib", str(empty))
    assert r.exit_code == 1 and "holds no text" in r.stderr
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "too short"}\n')
    r = quantize(tiny_llama_dir, tmp_path / "out", "--method", "gptq", "--calib", str(short))
    assert r.exit_code == 1 and "fewer than --seq-len" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "short.jsonl"]


def test_existing_output_needs_force(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = quantize(tiny_llama_dir, out, "--method", "gptq", *CALIB)
    assert r.exit_code == 1 and "already exists" in r.stderr and "--force" in r.stderr
    assert files(out) == {"keep.txt": b"mine"} and sorted(tmp_path.iterdir()) == [out]
    r = quantize(tiny_llama_dir, out, "--method", "gptq", *CALIB, "--force")
    assert r.exit_code == 0, r.output
    assert "keep.txt" not in files(out) and (out / "config.json").exists()
    assert sorted(tmp_path.iterdir()) == [out]  # no partial or replaced folder left behind


def test_not_enough_disk(tiny_llama_dir, tmp_path, monkeypatch):
    import shutil

    from brisk.core.quantize import resume

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(resume.shutil, "disk_usage", lambda p: usage._replace(free=10_000))
    r = quantize(tiny_llama_dir, tmp_path / "out", "--method", "gptq", *CALIB)
    assert r.exit_code == 1 and "not enough disk space" in r.stderr, r.output
    assert list(tmp_path.iterdir()) == []


def test_output_over_the_input_is_refused(tiny_llama_dir):
    before = files(tiny_llama_dir)
    r = quantize(tiny_llama_dir, tiny_llama_dir, "--method", "int8", "--force")
    assert r.exit_code == 1 and "input model's own folder" in r.stderr
    assert files(tiny_llama_dir) == before


def test_already_quantized_input(tiny_llama_dir, tmp_path):
    out = tmp_path / "q"
    assert quantize(tiny_llama_dir, out, "--method", "gptq", *CALIB).exit_code == 0
    r = quantize(out, tmp_path / "again", "--method", "awq", *CALIB)
    assert r.exit_code == 1 and "already quantized" in r.stderr
    assert not (tmp_path / "again").exists() and not (tmp_path / "again.partial").exists()


# ---------------------------------------------------------------- resume

SAVE_LAYER = "brisk.core.quantize.resume:save_layer"  # the step after which an interrupted run stops


@pytest.mark.parametrize("kind, method", [("tiny_llama_dir", "gptq"), ("tiny_gemma3_dir", "awq")])
def test_resume_gives_the_same_bytes(kind, method, request, tmp_path):
    model = request.getfixturevalue(kind)
    args = ["--method", method, *CALIB]
    whole = tmp_path / "whole"
    assert quantize(model, whole, *args).exit_code == 0

    # a run that dies after one block (as a crash would), in its own process
    out = tmp_path / "resumed"
    r = subprocess.run(brisk_command(SAVE_LAYER, 1) + ["quantize", str(model), "-o", str(out), *args],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 1 and "stopped after 1 calls of save_layer" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    partial = out.with_name("resumed.partial")
    assert [p.name for p in (partial / "layers").iterdir()] == ["layer_0000.safetensors"]

    events = []
    quantize_model(str(model), out, QuantOptions(method=method, samples=8, seq_len=64),
                   report=lambda e, **i: events.append((e, i)))
    assert ("resume", {"layers": 1}) in events
    assert files(out) == files(whole)
    assert not partial.exists()


def test_other_arguments_start_over(tiny_llama_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as m:  # dies after its first block, as a crash would
        m.setattr(resume, "save_layer", stop_after(resume.save_layer, 1))
        r = quantize(tiny_llama_dir, out, "--method", "gptq", *CALIB, "--damp", "0.05")
    assert r.exit_code == 1 and (tmp_path / "out.partial").exists()
    events = []
    quantize_model(str(tiny_llama_dir), out, QuantOptions(method="gptq", samples=8, seq_len=64),
                   report=lambda e, **i: events.append(e))
    assert "restart" in events and "resume" not in events
    whole = tmp_path / "whole"
    assert quantize(tiny_llama_dir, whole, "--method", "gptq", *CALIB).exit_code == 0
    assert files(out) == files(whole)


# ---------------------------------------------------------------- what is written loads back

@pytest.mark.parametrize("method, extra, max_kl", [  # about 4x the KL measured when written
    ("gptq", [], 2e-4), ("gptq", ["--bits", "8", "--act-order", "--asym"], 1e-6),
    ("gptq", ["--bits", "3", "--group-size", "32"], 1e-3), ("awq", [], 2e-4), ("awq", ["--compensate"], 2e-4),
    ("nf4", [], 4e-4), ("fp4", ["--double-quant"], 8e-4), ("int8", [], 2e-6),
    ("nf4", ["--samples", "0"], 4e-4), ("int8", ["--samples", "0"], 2e-6),  # round-to-nearest
])
def test_output_loads_back_close_to_float(tiny_llama_dir, tmp_path, method, extra, max_kl):
    from brisk.core.llm import LLM
    from brisk.quant.formats import find_format

    out = tmp_path / "out"
    calib = [] if "--samples" in extra else CALIB
    r = quantize(tiny_llama_dir, out, "--method", method, *calib, *extra, "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert len(summary["layers"]) == 2 and all(len(s["errors"]) == 7 for s in summary["layers"])

    cfg = json.loads((out / "config.json").read_text())
    qcfg = cfg["quantization_config"]
    assert cfg["torch_dtype"] == "float16" and cfg["model_type"] == "llama"
    assert find_format(qcfg).__name__.endswith({"gptq": "gptq_format", "awq": "awq_format"}.get(method, "bnb_format"))
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"} <= set(files(out))

    base, q = float_llm(tiny_llama_dir), LLM.load(str(out), device="cpu", dtype="float32")
    assert q.quantization != "none"
    kl, top1 = kl_top1(base, q, base.tokenizer.encode(TEXT))
    assert 0 < kl < max_kl, (kl, top1)  # (top-1 is fragile here: a random model's logits are nearly flat)

    # every quantized weight stands for its float weight, up to the format's precision
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" in tensors and tensors["model.embed_tokens.weight"].dtype == torch.float16
    fmt = find_format(qcfg)
    for name in ("model.layers.1.self_attn.k_proj", "model.layers.0.mlp.down_proj"):
        w = base.model.get_submodule(name).weight
        sub = {k: v for k, v in tensors.items() if k.startswith(name + ".")}
        deq = fmt.load_linear(sub, name, qcfg, sub.pop(name + ".bias", None)).dequantize(torch.float32)
        rel = ((deq - w).norm() / w.norm()).item()
        if method != "awq":  # AWQ's weights carry the folded scales: compare through the model instead
            # GPTQ clips ranges (grid search) and spreads errors: more weight error, less output error
            assert rel < {4: 0.2, 3: 0.45, 8: 0.02}[summary["options"]["bits"]], (name, rel)
        assert torch.equal(q.model.get_submodule(name).dequantize(torch.float32), deq)


def test_gptq_dynamic_bits_per_layer(tiny_llama_dir, tmp_path):
    """--dynamic: the layers a regex matches get its bits (first match wins), written as GPTQModel's
    dynamic config; they load back at those bits, the rest at --bits."""
    from safetensors.torch import load_file

    from brisk.core.llm import LLM

    out = tmp_path / "out"
    r = quantize(tiny_llama_dir, out, "--method", "gptq", "--group-size", "32", "--asym", *CALIB, "--dynamic", r".*\.1\.mlp\.down_proj=4",
                 "--dynamic", r".*down_proj=8", "--dynamic", r"model\.layers\.0\.self_attn\.v_proj=3")
    assert r.exit_code == 0, r.output
    assert "4/8" in r.stdout and "3/4/8" in r.stdout  # the summary's bits per layer
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    # 8-bit layers symmetric whatever --sym says: Q8_0 blocks for the native kernels
    assert qcfg["bits"] == 4 and qcfg["dynamic"] == {r".*\.1\.mlp\.down_proj": {"bits": 4}, ".*down_proj": {"bits": 8, "sym": True},
                                                     r"model\.layers\.0\.self_attn\.v_proj": {"bits": 3}}
    tensors = load_file(str(out / "model.safetensors"))
    q = LLM.load(str(out), device="cpu", dtype="float32")
    base = float_llm(tiny_llama_dir)
    expect = {"model.layers.0.mlp.down_proj": 8, "model.layers.1.mlp.down_proj": 4, "model.layers.0.self_attn.v_proj": 3,
              "model.layers.1.self_attn.v_proj": 4, "model.layers.0.mlp.up_proj": 4}
    for name, bits in expect.items():
        layer = q.model.get_submodule(name)
        assert layer.bits == bits and tensors[f"{name}.qweight"].shape[0] == layer.in_features * bits // 32, name
        assert layer.native == (bits in (4, 8)), name  # (3-bit: the fallback)
        w = base.model.get_submodule(name).weight
        rel = ((layer.dequantize(torch.float32) - w).norm() / w.norm()).item()
        assert rel < {3: 0.45, 4: 0.2, 8: 0.02}[bits], (name, rel)
    kl, _ = kl_top1(base, q, base.tokenizer.encode(TEXT))
    assert 0 < kl < 2e-4


@pytest.fixture(scope="module")
def tiny_mha_dir(tiny_qwen2_dir, tmp_path_factory):
    """Qwen2 with as many K/V heads as query heads: AWQ then also scales o_proj against v_proj (and its bias)."""
    import shutil

    import transformers as tf

    folder = tmp_path_factory.mktemp("tiny_mha")
    torch.manual_seed(4)
    cfg = tf.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    model = tf.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_qwen2_dir / f, folder / f)
    return folder


@pytest.mark.parametrize("kind", ["tiny_mha_dir", "tiny_gemma3_dir", "tiny_llama_dir"])
def test_awq_folding_keeps_the_function(kind, request):
    """Every AWQ scale folded (norm weights with and without Gemma's 1 + w, v_proj rows and bias,
    up_proj rows), the float block computes what it did."""
    from brisk.core.kv import NoKV
    from brisk.core.quantize import awq_groups, fold_scales

    llm = float_llm(request.getfixturevalue(kind))
    net = llm.model
    block = net.model.layers[0]
    x = torch.randn(2, 12, llm.config.dim)
    rope, kv = net.rope_at(0, 12), NoKV()
    kv.begin(0, 12)
    with torch.no_grad():
        before = block(x, rope, kv)
        groups = awq_groups(block)
        assert len(groups) == (4 if kind == "tiny_mha_dir" else 3)
        gen = torch.Generator().manual_seed(0)
        for prev, names in groups:
            k = block.get_submodule(names[0]).in_features
            fold_scales(block, prev, names, torch.rand(k, generator=gen) * 3 + 0.2)
        torch.testing.assert_close(block(x, rope, kv), before, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind, max_kl", [("tiny_mha_dir", 1.5e-4), ("tiny_gemma3_dir", 4e-3)])  # gemma3: 6 layers
def test_awq_and_gptq_other_architectures(kind, max_kl, request, tmp_path):
    from brisk.core.llm import LLM

    model = request.getfixturevalue(kind)
    base = float_llm(model)
    ids = base.tokenizer.encode(TEXT)
    for method in ("awq", "gptq"):
        out = tmp_path / method
        assert quantize(model, out, "--method", method, *CALIB).exit_code == 0
        kl, _ = kl_top1(base, LLM.load(str(out), device="cpu", dtype="float32"), ids)
        assert 0 < kl < max_kl, (method, kl)


def test_gptq_beats_round_to_nearest(tiny_llama_dir, tmp_path):
    """The same bits and groups, rounded to nearest, move the model's output further."""
    from brisk.core.llm import LLM
    from brisk.quant.gptq import rtn

    out = tmp_path / "out"
    assert quantize(tiny_llama_dir, out, "--method", "gptq", "--bits", "3", *CALIB).exit_code == 0
    base, q, r = float_llm(tiny_llama_dir), LLM.load(str(out), device="cpu", dtype="float32"), float_llm(tiny_llama_dir)
    with torch.no_grad():
        for name, m in list(r.model.named_modules()):
            if name.startswith("model.layers.") and name.endswith("_proj"):
                m.weight.copy_(rtn(m.weight, bits=3, group_size=64).dequantized)
    ids = calibration.calibration_batch(base.tokenizer, calibration.builtin_texts(), 8, 64).flatten().tolist()[:240]
    assert kl_top1(base, q, ids)[0] < 0.8 * kl_top1(base, r, ids)[0]


@pytest.mark.parametrize("kind, method, calib", [("tiny_qwen2_dir", "gptq", CALIB), ("tiny_llama_dir", "int8", ["--samples", "0"])])
def test_int8_embedding(kind, method, calib, request, tmp_path):
    """--embedding int8: the table is written as 8-bit codes with a float16 scale per 32, GGUF Q8_0's
    reference quantizer to the bit (the gguf package's); brisk loads it (tied: as the Q8_0 output
    layer the embedding reads its rows from; untied: as the embedding's own table) and computes what
    the 16-bit folder computes with those rows."""
    import gguf
    from safetensors.torch import load_file

    from brisk.core.llm import LLM
    from brisk.quant import embedding_format as ef
    from brisk.quant.gguf_linear import GGUFLinear

    model = request.getfixturevalue(kind)
    base = float_llm(model)
    table = base.model.model.embed_tokens.weight.detach()
    outs = {}
    for emb in ("16bit", "int8"):
        outs[emb] = tmp_path / emb
        r = quantize(model, outs[emb], "--method", method, *calib, "--embedding", emb, "--json")
        assert r.exit_code == 0, r.output
    tensors = {}
    for f in outs["int8"].glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    q, sc = tensors[ef.QWEIGHT], tensors[ef.SCALES]
    assert "model.embed_tokens.weight" not in tensors and q.dtype == torch.int8 and sc.dtype == torch.float16
    assert q.shape == table.shape and sc.shape == (table.shape[0], table.shape[1] // 32)
    V, D = table.shape
    ref = gguf.quants.quantize(table.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(V, D // 32, 34)
    assert np.array_equal(ref[..., :2].view(np.float16).reshape(V, -1), sc.numpy())
    assert np.array_equal(ref[..., 2:].view(np.int8).reshape(V, D), q.numpy())
    deq = ef.decoded(tensors)
    assert json.loads((outs["int8"] / "config.json").read_text())[ef.CONFIG_KEY]["format"] == "q8_0_rows"
    r = runner.invoke(app, ["info", str(outs["int8"]), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["quant_method"].endswith("8-bit embedding"), r.output
    assert (sum(p.stat().st_size for p in outs["int8"].iterdir())
            < sum(p.stat().st_size for p in outs["16bit"].iterdir()) - table.numel() * 0.9)

    q8, q16 = (LLM.load(str(outs[e]), device="cpu", dtype="float32") for e in ("int8", "16bit"))
    tied = base.config.tie_embeddings
    assert tied == (kind == "tiny_qwen2_dir")
    held = q8.model.lm_head if tied else q8.model.model.embed_tokens.head
    assert isinstance(held, GGUFLinear) and held.type_name == "Q8_0"
    ids = base.tokenizer.encode(TEXT)
    torch.testing.assert_close(q8.model.embed(torch.tensor([ids])), deq[ids][None])
    # the same model with the 8-bit rows put in the 16-bit folder's float table
    with torch.no_grad():
        q16.model.model.embed_tokens.weight.copy_(deq)
    if calib[-1] == "0":  # uncalibrated: the blocks are the same bytes in both folders (float32 round-off)
        torch.testing.assert_close(q8.logits(ids), q16.logits(ids), rtol=1e-4, atol=1e-4)
    kl8, kl16 = kl_top1(base, q8, ids)[0], kl_top1(base, q16, ids)[0]
    assert kl8 < 2 * kl16 + 1e-4, (kl8, kl16)


def test_bad_int8_embedding_is_refused(tiny_qwen2_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from brisk.core.errors import FileError
    from brisk.core.llm import LLM
    from brisk.quant import embedding_format as ef

    out = tmp_path / "out"
    assert quantize(tiny_qwen2_dir, out, "--method", "int8", "--samples", "0", "--embedding", "int8").exit_code == 0
    shard = next(out.glob("*.safetensors"))
    good = load_file(str(shard))
    for change, words in ((lambda t: t.pop(ef.SCALES), "model.embed_tokens.scales is missing"),
                          (lambda t: t.update({ef.QWEIGHT: t[ef.QWEIGHT][:-1]}), "must be int8 [300, 64]"),
                          (lambda t: t.update({ef.SCALES: t[ef.SCALES].float()}), "must be float16 [300, 2]")):
        t = dict(good)
        change(t)
        save_file(t, str(shard), metadata={"format": "pt"})
        with pytest.raises(FileError, match=words.replace("[", r"\[").replace("]", r"\]")):
            LLM.load(str(out), device="cpu", dtype="float32")
    save_file(good, str(shard), metadata={"format": "pt"})
    r = runner.invoke(app, ["generate", str(out), "hi", "-n", "2", "--temperature", "0"])
    assert r.exit_code == 0, r.output


def test_sharded_output(tiny_qwen2_dir, tmp_path):
    """A small shard limit gives shards and an index; the model (tied embeddings, q/k/v biases) reloads."""
    from brisk.core.llm import LLM

    one, many = tmp_path / "one", tmp_path / "many"
    opts = QuantOptions(method="gptq", samples=8, seq_len=64)
    quantize_model(str(tiny_qwen2_dir), one, opts)
    quantize_model(str(tiny_qwen2_dir), many, opts, max_shard_bytes=60_000)
    index = json.loads((many / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((many / s).exists() for s in shards)
    assert "lm_head.weight" not in index["weight_map"]  # tied
    assert "model.layers.0.self_attn.q_proj.bias" in index["weight_map"]
    ids = list(range(3, 40))
    assert torch.equal(LLM.load(str(one), device="cpu", dtype="float32").logits(ids),
                       LLM.load(str(many), device="cpu", dtype="float32").logits(ids))


# ---------------------------------------------------------------- GGUF input, configs transformers reads

def test_gguf_input(tiny_gguf_path, tmp_path):
    """A GGUF has no config.json: one is built. transformers reads it and the tokenizer; brisk reloads
    the model close to the GGUF's float weights (dim 16 fits no group size: one group per row)."""
    import transformers as tf

    from brisk.core.llm import LLM

    out = tmp_path / "out"
    r = quantize(tiny_gguf_path, out, "--method", "gptq", "--bits", "8", *CALIB, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["options"]["group_size"] == -1
    base = float_llm(tiny_gguf_path)
    cfg = tf.AutoConfig.from_pretrained(out)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_key_value_heads, cfg.tie_word_embeddings) == ("llama", 16, 4, False)
    hf_tok = tf.AutoTokenizer.from_pretrained(out)
    assert hf_tok(TEXT, add_special_tokens=True)["input_ids"] == base.tokenizer.encode(TEXT)
    q = LLM.load(str(out), device="cpu", dtype="float32")
    kl, top1 = kl_top1(base, q, base.tokenizer.encode(TEXT))
    assert kl < 1e-3 and top1 > 0.9


def bnb_misreads_blocks_across_rows(folder) -> float:
    """How far bitsandbytes' own dequantize_4bit of the folder's 16-wide q_proj (each 64-value block
    spans 4 rows) lands from the format by hand: code[nibble] * absmax[i // 64], high nibble first.
    Relative to the largest weight. bitsandbytes 0.50's CPU path was seen 0.28 off on an Intel Xeon VM,
    brisk exactly on the definition; where this test passed (AMD EPYC), bnb read them as brisk does."""
    import bitsandbytes.functional as bf
    from safetensors.torch import load_file

    key = "model.layers.0.self_attn.q_proj.weight"
    tensors = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items() if k.startswith(key)}
    state = bf.QuantState.from_dict({k[len(key) + 1:]: v for k, v in tensors.items() if k != key}, torch.device("cpu"))
    absmax = bf.dequantize_blockwise(state.absmax, state.state2) + state.offset if state.nested else state.absmax
    b = tensors[key].flatten()
    n = state.shape[0] * state.shape[1]
    codes = torch.stack(((b >> 4) & 0xF, b & 0xF), 1).flatten().long()[:n]
    by_hand = state.code[codes] * absmax.float().repeat_interleave(state.blocksize)[:n]
    return float((bf.dequantize_4bit(tensors[key], state).float().flatten() - by_hand).abs().max() / by_hand.abs().max())


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_gguf_input_loads_in_transformers(method, tiny_gguf_path, tmp_path):
    """The whole folder (built config, tokenizer, bitsandbytes tensors) as transformers +
    bitsandbytes read it gives brisk's logits."""
    import warnings

    tf = pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    from brisk.core.llm import LLM

    out = tmp_path / "out"
    assert quantize(tiny_gguf_path, out, "--method", method).exit_code == 0
    ids = LLM.load(str(tiny_gguf_path), device="cpu", dtype="float32").tokenizer.encode(TEXT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = tf.AutoModelForCausalLM.from_pretrained(out, device_map="cpu", dtype=torch.float32)
        with torch.no_grad():
            try:
                theirs = hf(torch.tensor([ids])).logits[0].float()
            except (RuntimeError, AssertionError) as e:  # the reference, not brisk: bitsandbytes >= 0.50's CPU kernel
                if "divisible by block_n" not in str(e):  # takes no 16-wide layers
                    raise
                pytest.skip(f"bitsandbytes' CPU 4-bit kernel refuses this tiny model: {e}")
    assert type(hf.model.layers[0].mlp.down_proj).__name__ == {"nf4": "Linear4bit", "int8": "Linear8bitLt"}[method]
    if method == "nf4" and (off := bnb_misreads_blocks_across_rows(out)) > 1e-4:
        pytest.skip(f"the reference is off on this CPU: bitsandbytes' dequantize_4bit reads a 16-wide layer's "
                    f"64-value blocks (which span rows) {off:.2g} of the largest weight away from the format's own definition")
    mine = LLM.load(str(out), device="cpu", dtype="float32").logits(ids)
    # transformers runs the 4-bit matmuls in the checkpoint's float16; its int8 path quantizes activations too
    assert (mine - theirs).abs().max() < {"nf4": 3e-3, "int8": 1.5e-2}[method] * theirs.abs().max()
    assert (mine.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.95


@pytest.mark.parametrize("kind", ["tiny_llama_dir", "tiny_gemma3_dir", "tiny_qwen2_dir", "tiny_mistral_dir"])
def test_built_config_matches_transformers(kind, request):
    """hf_config (used for GGUF inputs) describes the same model as the original config.json: transformers
    builds from it a model that gives the original's logits."""
    import transformers as tf

    from brisk.core.checkpoint import load_checkpoint
    from brisk.core.arch import from_hf_config
    from brisk.core.hf_export import hf_config

    folder = request.getfixturevalue(kind)
    ckpt = load_checkpoint(str(folder))
    built = hf_config(ckpt.config, ckpt.tokenizer)
    assert from_hf_config(built) == ckpt.config
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**built), dtype=torch.float32)
    ours.load_state_dict(ref.state_dict())
    ids = torch.tensor([list(range(5, 60))])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits)


@pytest.mark.slow
def test_default_model_nf4_interrupted_and_resumed(tmp_path):
    """The embedded SmolLM2 (a GGUF) to bitsandbytes NF4, stopped by Ctrl-C after a few layers and run
    again: transformers reads the config, brisk reloads it close to the same format made at load."""
    import transformers as tf

    from brisk.core.llm import LLM

    out = tmp_path / "smol-nf4"
    manifest = tmp_path / "smol-nf4.partial" / "manifest.json"
    # A Ctrl-C after two blocks, delivered by the process to itself at that point: polling for
    # the manifest and signalling from here raced with nf4's ~50 ms blocks (the run could finish).
    args = ["--method", "nf4", "--double-quant", "--samples", "0"]  # round-to-nearest, as nf4 made at load
    p = subprocess.Popen(brisk_command(SAVE_LAYER, 2, "sigint") + ["quantize", "-o", str(out), *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130 and "run the same command again" in err, err
    assert not out.exists() and manifest.exists()

    r = runner.invoke(app, ["quantize", "-o", str(out), *args])
    assert r.exit_code == 0, r.output
    assert "resuming:" in r.stderr and not manifest.parent.exists()
    assert "bitsandbytes NF4" in r.stdout and "29" in r.stdout  # the summary table, 30 layers
    cfg = tf.AutoConfig.from_pretrained(out)
    assert cfg.model_type == "llama" and cfg.tie_word_embeddings and cfg.num_hidden_layers == 30
    base, q = float_llm(None), LLM.load(str(out), device="cpu", dtype="float32")
    at_load = LLM.load(None, device="cpu", dtype="float32", quantize="nf4")  # the same format, made at load
    ids = base.tokenizer.encode(HELD_OUT)
    # SmolLM2 ships as Q4_1: a second 4-bit grid on top of it costs about 0.3 nats per token
    assert kl_top1(base, q, ids)[0] < 0.45
    kl, top1 = kl_top1(at_load, q, ids)  # differ only by float16 rounding before quantizing
    assert kl < 0.005 and top1 > 0.95, (kl, top1)


HELD_OUT = """A bicycle stays upright mostly because the rider steers. When it starts to lean to the left, the
rider turns the front wheel slightly to the left, which moves the wheels back under the centre of mass.
The geometry of the fork helps: the front wheel touches the ground a little behind the line of the
steering axis, so a leaning bicycle tends to steer itself into the lean. Children learning to ride often
pedal too slowly, and at low speed these corrections have to be large and quick, which is why the first
few metres are the hardest. Once the bicycle is moving at walking pace or faster, small movements of the
handlebars are enough, and most riders make them without noticing. The same principle explains why it
is easier to balance on a moving bicycle than on a stationary one, and why a bicycle pushed along
without a rider can travel a surprising distance before it falls over."""


def test_output_files_are_readable_by_others(tiny_llama_dir, tmp_path):
    """The weights get the same permissions as the JSON files beside them (the umask's), not the
    0600 that safetensors creates files with."""
    import os

    out = tmp_path / "out"
    assert quantize(tiny_llama_dir, out, "--method", "int8").exit_code == 0
    mode = lambda name: os.stat(out / name).st_mode & 0o777  # noqa: E731
    assert mode("model.safetensors") == mode("config.json")
