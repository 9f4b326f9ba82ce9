"""`brisk quantize --format gguf`: blocks byte for byte llama.cpp's (its own ggml-quants.c, compiled here
from the vendored source, called through ctypes; Q8_0/Q4_0 also gguf-py's numpy quantizers), the tensor
types of llama.cpp's mixes (against a Q4_K_M file llama-quantize wrote), and a whole file: types,
metadata, bytes, and brisk running it from its blocks."""
from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from brisk.cli.main import app
from brisk.quant import gguf_types, native
from brisk.quant.gguf_mix import MIXES, ModelShape, more_bits, seventy_b, tensor_types

import llama_cpp

runner = CliRunner()
WRITTEN = [t.id for t in gguf_types.WRITTEN]
REF_NAMES = {gguf_types.Q4_0: "q4_0", gguf_types.Q5_0: "q5_0", gguf_types.Q5_1: "q5_1", gguf_types.Q8_0: "q8_0",
             gguf_types.Q2_K: "q2_K", gguf_types.Q3_K: "q3_K", gguf_types.Q4_K: "q4_K", gguf_types.Q5_K: "q5_K",
             gguf_types.Q6_K: "q6_K"}
# ggml-quants.c calls these only on paths the reference rounding never takes (errors, other types)
_STUBS = """#include <stdlib.h>
#include <stddef.h>
void ggml_abort(const char *f, int l, const char *fmt, ...) { abort(); }
size_t ggml_row_size(int t, long long n) { abort(); }
const char *ggml_type_name(int t) { abort(); }
size_t ggml_type_size(int t) { abort(); }
"""

pytestmark = pytest.mark.skipif(not native.available(), reason="no native kernels here (GGUF quantization needs them)")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """llama.cpp's ggml-quants.c as a small shared library (no fused multiply-adds: the C source's own
    arithmetic, as llama.cpp's x86-64 builds without FMA run it)."""
    src = llama_cpp.SOURCE / "ggml" / "src"
    if not (src / "ggml-quants.c").is_file():
        pytest.skip(f"llama.cpp's ggml-quants.c is not at {src} (make test fetches it)")
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("ggml_ref")
    (d / "stubs.c").write_text(_STUBS)
    lib = d / "libggml_ref.so"
    r = subprocess.run([cc, "-O2", "-DNDEBUG", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11",
                        f"-I{llama_cpp.SOURCE / 'ggml' / 'include'}", f"-I{src}", str(src / "ggml-quants.c"),
                        str(d / "stubs.c"), "-o", str(lib), "-lm"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return ctypes.CDLL(str(lib))


def ref_quantize(ref, qtype: int, rows: np.ndarray) -> np.ndarray:
    w, b = gguf_types.block(qtype)
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    out = np.zeros((rows.shape[0], rows.shape[1] // w * b), np.uint8)
    f = getattr(ref, f"quantize_row_{REF_NAMES[qtype]}_ref")
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    f(rows.ctypes.data, out.ctypes.data, rows.size)
    return out


def random_rows(seed=0, n=48, k=1024) -> dict[str, np.ndarray]:
    """Rows that take each search's branches: plain, heavy-tailed, all one sign, sparse, tiny, all zero."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((n, k))
    rows = {"normal": g, "heavy": g ** 3, "positive": np.abs(g) * 0.02 + 0.01,
            "sparse": np.where(rng.random((n, k)) < 0.8, 0.0, g), "tiny": g * 1e-6,
            "zero": np.zeros((4, k)), "half_zero": np.concatenate([np.zeros((n, k // 2)), g[:, k // 2:]], 1)}
    return {name: r.astype(np.float32) for name, r in rows.items()}


def real_rows(path: Path, names=("blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight")) -> dict:
    """Rows of a real model (dequantized from its file), cut to a multiple of 256 columns."""
    from brisk.core.gguf_file import open_gguf

    f = open_gguf(path)
    out = {}
    for t in f.tensors:
        if t.name in names:
            rows = f.load(t).numpy().reshape(-1, t.shape[-1])[:64]
            out[t.name] = np.ascontiguousarray(rows[:, : rows.shape[1] // 256 * 256])
    return out


@pytest.mark.parametrize("qtype", WRITTEN, ids=lambda t: gguf_types.BY_ID[t].name)
def test_blocks_equal_llama_cpp_reference(reference, qtype, smollm2_path):
    rows = {**random_rows(), **real_rows(smollm2_path)}
    for name, x in rows.items():
        ours, theirs = native.quantize_rows(qtype, x), ref_quantize(reference, qtype, x)
        bad = np.flatnonzero((ours != theirs).any(1))
        assert bad.size == 0, f"{name}: rows {bad[:8]} differ"


@pytest.mark.parametrize("qtype", [gguf_types.Q8_0, gguf_types.Q4_0], ids=["Q8_0", "Q4_0"])
def test_q8_0_q4_0_equal_gguf_py(qtype):
    for name, x in random_rows(seed=1).items():
        assert np.array_equal(native.quantize_rows(qtype, x), gguf.quants.quantize(x, gguf.GGMLQuantizationType(qtype))), name


def test_rows_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="Q4_K"):
        native.quantize_rows(gguf_types.Q4_K, np.zeros((2, 576), np.float32))


def test_mix_matches_a_file_llama_quantize_wrote(gemma_path):
    """Gemma 3 270M Q4_K_M as its publisher made it with llama-quantize (from a float file): every
    quantized tensor's type is the mix's choice (the float ones' types stand in for the source's)."""
    from brisk.core.gguf_file import open_gguf

    f = open_gguf(gemma_path)
    m = f.metadata
    shape = ModelShape(n_layer=m["gemma3.block_count"], gqa=m["gemma3.attention.head_count"] //
                       m["gemma3.attention.head_count_kv"])
    got = tensor_types({t.name: (t.shape, gguf_types.F32) for t in f.tensors}, MIXES["Q4_K_M"], shape)
    want = {t.name: t.qtype for t in f.tensors}
    assert {n: gguf_types.BY_ID[t].name for n, t in got.items() if t != want[n]} == {}


def test_mix_rules():
    """llama-quant.cpp's rules, by hand: Q4_K_M's more-bits layers, Q3_K_M's and Q2_K's raised tensors,
    the output at Q6_K, a tied token table as the output, fallbacks where 256 does not divide a row."""
    assert [i for i in range(24) if more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    tensors = {"token_embd.weight": ((100, 512), 0), "output_norm.weight": ((512,), 0)}
    for i in range(8):
        tensors |= {f"blk.{i}.attn_v.weight": ((128, 512), 0), f"blk.{i}.ffn_down.weight": ((512, 1024), 0),
                    f"blk.{i}.attn_output.weight": ((512, 512), 0), f"blk.{i}.attn_norm.weight": ((512,), 0),
                    f"blk.{i}.ffn_up.weight": ((1024, 576 - 64), 0)}
    shape = ModelShape(n_layer=8, gqa=4)
    t = tensor_types(tensors, MIXES["Q4_K_M"], shape)
    name = lambda q: gguf_types.BY_ID[q].name  # noqa: E731
    assert name(t["token_embd.weight"]) == "Q6_K" and t["output_norm.weight"] == 0  # tied: as the output
    assert [name(t[f"blk.{i}.attn_v.weight"]) for i in range(8)] == ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K",
                                                                     "Q4_K", "Q6_K", "Q6_K"]
    t = tensor_types({**tensors, "output.weight": ((100, 512), 0)}, MIXES["Q3_K_M"], shape)
    assert name(t["token_embd.weight"]) == "Q3_K" and name(t["output.weight"]) == "Q6_K"
    assert [name(t[f"blk.{i}.attn_v.weight"]) for i in range(3)] == ["Q5_K", "Q5_K", "Q4_K"]
    assert name(t["blk.0.attn_output.weight"]) == "Q4_K" and name(t["blk.0.ffn_down.weight"]) == "Q4_K"
    t = tensor_types(tensors, MIXES["Q2_K"], shape)
    assert name(t["blk.0.attn_v.weight"]) == "Q4_K" and name(t["blk.7.ffn_down.weight"]) == "Q3_K"
    assert name(tensor_types(tensors, MIXES["Q2_K"], ModelShape(8, 2))["blk.0.attn_v.weight"]) == "Q3_K"
    # llama.cpp's 70B class: attention V one step up from Q3_K/Q4_K (Llama 80 layers with fewer K/V heads)
    assert seventy_b("llama", 80, 64, 8, 0) and not seventy_b("llama", 80, 64, 64, 0) and not seventy_b("llama", 32, 32, 8, 0)
    big = ModelShape(n_layer=8, gqa=8, is_70b=True)
    assert [name(tensor_types(tensors, MIXES[m], big)["blk.1.attn_v.weight"]) for m in ("Q4_K_M", "Q2_K")] == ["Q5_K", "Q5_K"]
    assert name(tensor_types(tensors, MIXES["Q4_K_M"], big)["blk.0.attn_v.weight"]) == "Q6_K"
    odd = {"blk.0.ffn_gate.weight": ((64, 576), 0), "blk.0.ffn_down.weight": ((64, 48), 0)}
    assert [name(q) for q in tensor_types(odd, MIXES["Q4_K_M"], ModelShape(1, 1)).values()] == ["F16", "Q5_0"]


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    """A tiny random Llama with rows of 256 and 512 (K-quant blocks, no fallbacks), 8 layers, one K/V head
    per 4, as llama.cpp's converter writes it in float32."""
    import transformers as tf
    from conftest import CHAT_TEMPLATE, train_tiny_tokenizer

    llama_cpp.converter()
    d = tmp_path_factory.mktemp("llama256")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():  # random norms; the weights keep transformers' initialization (std 0.02)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.2)
    model.save_pretrained(d)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(300), bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(d)
    return llama_cpp.convert(d, d / "model-f32.gguf")


def test_whole_file_q4_k_m(f32_gguf, tmp_path, request):
    from brisk.core import LLM
    from brisk.core.gguf_file import open_gguf

    out = tmp_path / "model-Q4_K_M.gguf"
    r = runner.invoke(app, ["quantize", str(f32_gguf), "-o", str(out), "--format", "gguf", "--type", "Q4_K_M",
                            "--method", "rtn", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["type"] == "Q4_K_M" and summary["method"] == "rtn" and summary["out_bytes"] == out.stat().st_size
    assert not (tmp_path / "model-Q4_K_M.gguf.partial").exists()
    src, q = open_gguf(f32_gguf), open_gguf(out)
    # metadata: the source's keys and values, the file type and quantization version set
    assert q.metadata.pop("general.file_type") == 15 and q.metadata.pop("general.quantization_version") == 2
    src.metadata.pop("general.file_type", None)
    src.metadata.pop("general.quantization_version", None)
    assert q.metadata == src.metadata
    assert q.metadata["tokenizer.chat_template"] and len(q.metadata["tokenizer.ggml.tokens"]) == 300
    # types: the mix's; by hand for the raised ones (8 layers: more bits in 0, 3, 6, 7)
    types = {t.name: gguf_types.BY_ID[t.qtype].name for t in q.tensors}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert [types[f"blk.{i}.ffn_down.weight"] for i in (0, 1, 3, 7)] == ["Q6_K", "Q4_K", "Q6_K", "Q6_K"]
    assert types["blk.1.attn_q.weight"] == "Q4_K" and types["blk.1.attn_norm.weight"] == "F32"
    # bytes: each tensor llama.cpp's rounding of the source's rows (where its source is here)
    try:
        reference = request.getfixturevalue("reference")
    except pytest.skip.Exception:
        reference = None
    by_name = {t.name: t for t in src.tensors}
    for t in q.tensors if reference is not None else ():
        rows = src.load(by_name[t.name]).numpy().reshape(-1, t.shape[-1])
        want = rows.view(np.uint8) if t.qtype == gguf_types.F32 else ref_quantize(reference, t.qtype, rows)
        assert np.array_equal(np.asarray(q.raw(t)), want.reshape(-1)), t.name
    # brisk runs it from its blocks: the logits of the same weights widened to float, up to round-off
    # (16-bit activations), and close to the float source's
    kept = LLM.load(str(out), device="cpu", dtype="float32")
    wide = LLM.load(str(out), device="cpu", dtype="float32", quantize="none")
    base = LLM.load(str(f32_gguf), device="cpu", dtype="float32", quantize="none")
    ids = kept.tokenizer.encode("The quick brown fox jumps over the lazy dog. Paris is the capital of France.")
    try:
        native.set_act8(False)
        lk = kept.logits(ids)
    finally:
        native.set_act8(True)
    lw, lb = wide.logits(ids), base.logits(ids)
    assert (lk - lw).abs().max() < 1e-3 * lw.abs().max()
    assert torch.equal(lk.argmax(-1), lw.argmax(-1))
    p, r = torch.log_softmax(lb, -1), torch.log_softmax(lw, -1)
    kl = float((p.exp() * (p - r)).sum(-1).mean())
    assert 0 < kl < 0.01, kl


def test_refusals(smollm2_path, tmp_path):
    """One line naming the flag or file, exit 1: a quantized source, a bad --type,
    a flag of the Hugging Face formats, a method gguf has not, a calibration flag without gptq."""
    out = str(tmp_path / "o.gguf")
    cases = [([str(smollm2_path), "--type", "Q4_K_M"], "Q4_1"),
             ([str(smollm2_path), "--type", "Q4_K_S"], "--type"),
             ([str(smollm2_path)], "--type"),
             ([str(smollm2_path), "--type", "Q8_0", "--bits", "4"], "--bits"),
             ([str(smollm2_path), "--type", "Q8_0", "--method", "awq"], "--method"),
             ([str(smollm2_path), "--type", "Q8_0", "--method", "rtn", "--samples", "4"], "--samples"),
             ([str(smollm2_path), "--type", "Q8_0", "--method", "gptq", "--group-size", "32"], "--group-size"),
             ([str(smollm2_path), "--type", "Q8_0", "--method", "gptq", "--samples", "0"], "--samples")]
    for args, word in cases:
        r = runner.invoke(app, ["quantize", *args, "-o", out, "--format", "gguf"])
        assert r.exit_code == 1, (args, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and word in lines[0], (args, r.output)
        assert not Path(out).exists()


def test_interrupted_run_leaves_nothing(f32_gguf, tmp_path, monkeypatch):
    """Ctrl-C mid-file: exit 130 and a line saying so; neither OUT nor its .partial is left behind."""
    calls = []

    def interrupt(qtype, rows):
        calls.append(qtype)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(qtype, rows)

    real = native.quantize_rows
    monkeypatch.setattr(native, "quantize_rows", interrupt)
    out = tmp_path / "m.gguf"
    r = runner.invoke(app, ["quantize", str(f32_gguf), "-o", str(out), "--format", "gguf", "--type", "Q6_K", "--method", "rtn"])
    assert r.exit_code == 130 and "interrupted" in r.output, r.output
    assert list(tmp_path.iterdir()) == []
