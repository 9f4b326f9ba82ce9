"""bench/quant.py's off-grid base (issue 15): the same model's function, its linear weights moved off
the file's quantization grid, so llama.cpp's quantizer cannot recover them exactly."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def bench_quant():
    spec = importlib.util.spec_from_file_location("bench_quant", ROOT / "bench" / "quant.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_offgrid_base_keeps_the_function(tiny_gguf_path, tmp_path):
    gguf = pytest.importorskip("gguf")
    from brisk.core.llm import LLM

    bq = bench_quant()
    wide = bq.widened_gguf(tiny_gguf_path, tmp_path / "wide.gguf")
    off = bq.offgrid_gguf(wide, tmp_path / "off.gguf")
    a, b = gguf.GGUFReader(wide), gguf.GGUFReader(off)
    assert [f for f in a.fields if not f.startswith("GGUF.")] == [f for f in b.fields if not f.startswith("GGUF.")]
    before = {t.name: np.array(t.data) for t in a.tensors}
    moved = 0
    for t in b.tensors:
        w = np.array(t.data)
        assert w.dtype == np.float32 and w.shape == before[t.name].shape
        if t.name.startswith("blk."):
            rel = np.linalg.norm(w - before[t.name]) / np.linalg.norm(before[t.name])
            assert rel > 0.02, t.name  # every linear and pre-norm rescaled
            moved += 1
        else:
            assert np.array_equal(w, before[t.name]), t.name  # the table and the final norm as they were
    assert moved == len([n for n in before if n.startswith("blk.")])

    ids = list(range(1, 40))
    la = LLM.load(str(wide), device="cpu", dtype="float32", quantize="none").logits(ids).double()
    lb = LLM.load(str(off), device="cpu", dtype="float32", quantize="none").logits(ids).double()
    assert (la - lb).abs().max() < 1e-4 * la.abs().max()  # float32 rounding only
    assert torch.equal(la.argmax(-1), lb.argmax(-1))
