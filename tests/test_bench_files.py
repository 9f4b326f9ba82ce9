"""bench/bench_files.py's random-weight GGUF files, written with brisk's GGUF writer: read back by
the gguf package (llama.cpp's own reader), with the keys, types and shapes asked for and sane scales."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(dim=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=32000, ctx=256)


def bench_files():
    spec = importlib.util.spec_from_file_location("bench_files", ROOT / "bench" / "bench_files.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_random_llama_of_mixed_blocks(tmp_path):
    gguf = pytest.importorskip("gguf")
    bf = bench_files()
    path = tmp_path / "k.gguf"
    bf.write_random_llama(path, SMALL, {"*": "Q4_K", "output.weight": "Q6_K", "blk.0.ffn_down.weight": "Q5_K"})
    r = gguf.GGUFReader(path)
    kv = fields(r)
    assert kv["general.architecture"] == "llama" and kv["general.name"] == "brisk bench random llama"
    assert (kv["llama.context_length"], kv["llama.embedding_length"], kv["llama.block_count"]) == (256, 256, 2)
    assert (kv["llama.attention.head_count"], kv["llama.attention.head_count_kv"], kv["llama.rope.dimension_count"]) \
        == (4, 2, 64)
    assert kv["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert kv["general.file_type"] == 1 and len(kv["tokenizer.ggml.tokens"]) == 32000
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["output.weight"] == "Q6_K" and types["blk.0.ffn_down.weight"] == "Q5_K"
    assert types["blk.1.ffn_down.weight"] == "Q4_K" and types["blk.0.attn_norm.weight"] == "F32"
    t = next(t for t in r.tensors if t.name == "blk.1.attn_q.weight")
    assert list(t.shape) == [256, 256]  # GGUF's order: the row length first
    d = np.asarray(t.data).reshape(-1, 144)[:, :2].copy().view(np.float16)  # Q4_K's super-block scale
    assert np.isfinite(d).all() and (d > 0).all() and (d < 1e-3).all()


def test_random_llama_in_f16_and_moe(tmp_path):
    gguf = pytest.importorskip("gguf")
    bf = bench_files()
    bf.write_random_llama(tmp_path / "f16.gguf", SMALL)
    r = gguf.GGUFReader(tmp_path / "f16.gguf")
    assert {t.tensor_type.name for t in r.tensors} == {"F16", "F32"}
    w = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert 0.015 < float(np.asarray(w.data, np.float32).std()) < 0.025
    moe = dict(bf.MOE_SHAPES["gpt-oss"], dim=256, heads=4, kv_heads=2, head_dim=64, experts=4, used=2, expert_ffn=128)
    bf.write_random_moe(tmp_path / "moe.gguf", 2, moe)
    r = gguf.GGUFReader(tmp_path / "moe.gguf")
    kv = fields(r)
    assert kv["gpt-oss.rope.scaling.type"] == "yarn" and kv["gpt-oss.attention.sliding_window"] == 128
    assert (kv["gpt-oss.expert_count"], kv["gpt-oss.expert_used_count"], kv["general.file_type"]) == (4, 2, 7)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "Q8_0" and types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert types["blk.1.attn_sinks.weight"] == "F32"
