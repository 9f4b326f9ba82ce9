"""`brisk quantize --format gguf --method gptq`: GPTQ on llama.cpp's own block grids (quant/gguf_grid.py).
The blocks decode as ggml decodes them (gguf-py's dequantization), every linear's output error on its
calibration inputs is below llama.cpp's round-to-nearest's, the rest of the file is the rtn file's, brisk
runs it, and its KL to the float model on held-out text is below the rtn file's."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from brisk.cli.main import app
from brisk.quant import gguf_grid, gguf_types, gguf_weighted_fit, native
from brisk.quant.gptq import GPTQ, output_error

from test_quantize_gguf import f32_gguf  # noqa: F401  (the tiny float32 Llama fixture)

runner = CliRunner()
pytestmark = pytest.mark.skipif(not native.available(), reason="no native kernels here (GGUF quantization needs them)")
HELDOUT = Path(__file__).resolve().parents[1] / "bench" / "heldout.txt"


def _dequantize(qtype: int, raw: np.ndarray, shape) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(raw, np.uint8).reshape(shape[0], -1), gguf.GGMLQuantizationType(qtype))


@pytest.mark.parametrize("qtype", gguf_grid.GRIDS)
def test_block_fields_and_codes_are_ggmls(qtype):
    """brisk's reading of a block (scales, offsets, codes) decodes as gguf-py's dequantization, bit for bit,
    for llama.cpp's own blocks and for any codes written into them; writing the codes read back is the identity."""
    rng = np.random.default_rng(qtype)
    rows = (rng.standard_normal((8, 512)) ** 3).astype(np.float32)
    raw = native.quantize_rows(qtype, rows)
    lay = gguf_grid.LAYOUTS[qtype]
    blocks = raw.reshape(-1, gguf_types.BY_ID[qtype].block_bytes)
    assert np.array_equal(lay.put_codes(blocks, lay.codes(blocks)), blocks)
    assert np.array_equal(gguf_grid.decode(qtype, raw, 8, 512).numpy(), _dequantize(qtype, raw, (8, 512)))
    codes = rng.integers(lay.lo, lay.hi + 1, size=(blocks.shape[0], lay.weights))
    other = lay.put_codes(blocks, codes)
    assert np.array_equal(lay.codes(other), codes)
    assert np.array_equal(gguf_grid.decode(qtype, other, 8, 512).numpy(), _dequantize(qtype, other, (8, 512)))


@pytest.mark.parametrize("qtype", gguf_grid.GRIDS)
def test_gptq_on_a_grid_beats_rtn(qtype):
    """One layer on correlated inputs: the blocks GPTQ writes decode to exactly the weights it compensated
    for, each block's scales are llama.cpp's for some weights (the fit), and the output error is below
    llama.cpp's round-to-nearest of the same weights."""
    torch.manual_seed(qtype)
    N, K = 64, 512
    w = torch.randn(N, K) * 0.02
    x = torch.randn(2048, K) @ (torch.eye(K) + 0.3 * torch.randn(K, K) / K ** 0.5)  # correlated inputs
    g = GPTQ(w)
    g.add_batch(x)
    grid = gguf_grid.GGUFGrid(qtype)
    c = g.run(grid, grid.block, group_order=False)
    raw = grid.encode(c.q, c.params[2])
    assert raw.shape == (N, K // grid.block * gguf_types.BY_ID[qtype].block_bytes)
    assert torch.equal(gguf_grid.decode(qtype, raw, N, K), c.dequantized)
    assert np.array_equal(_dequantize(qtype, raw, (N, K)), c.dequantized.numpy())
    rtn = torch.from_numpy(_dequantize(qtype, native.quantize_rows(qtype, w.numpy()), (N, K)))
    assert c.error < 0.9 * output_error(rtn, w, g.H), (c.error, output_error(rtn, w, g.H))


@pytest.mark.parametrize("qtype", gguf_weighted_fit.WEIGHTED)
def test_weighted_fit_beats_llamas_rounding(qtype):
    """The scales searched under an importance per column: valid blocks (their fields decode as ggml's),
    and rows rounded onto them with less importance-weighted error than onto llama.cpp's own scales,
    on nearly every row and in total."""
    torch.manual_seed(qtype)
    B = gguf_types.BY_ID[qtype].block_weights
    w = torch.randn(256, B) * 0.02 * torch.exp(0.5 * torch.randn(B))
    importance = torch.exp(1.5 * torch.randn(B))
    grid, llamas = gguf_grid.GGUFGrid(qtype), native.quantize_rows(qtype, w.numpy())
    mine = gguf_weighted_fit.fit_blocks(qtype, w, importance, llamas)
    assert np.array_equal(gguf_grid.decode(qtype, mine, 256, B).numpy(), _dequantize(qtype, mine, (256, B)))
    ours, theirs = grid._error(w, importance, mine), grid._error(w, importance, llamas)
    assert (ours < theirs).float().mean() > 0.95 and ours.sum() < 0.85 * theirs.sum(), (ours.sum(), theirs.sum())
    fitted = grid.fit(w, importance, 0)[2].numpy()  # the fit keeps, per row, the better of the two
    assert torch.equal(grid._error(w, importance, fitted), torch.minimum(ours, theirs))


def _quantize(src, out, mix, method, *extra):
    r = runner.invoke(app, ["quantize", str(src), "-o", str(out), "--format", "gguf", "--type", mix,
                            "--method", method, "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])


def _kl(model, base) -> float:
    r = runner.invoke(app, ["eval", str(model), "--base", str(base), "--text", str(HELDOUT), "--ctx", "128", "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])["kl_mean"]


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q3_K_M", "Q2_K"])
def test_whole_file_gptq(f32_gguf, tmp_path, mix):  # noqa: F811
    from brisk.core import LLM
    from brisk.core.gguf_file import open_gguf

    rtn_out, gptq_out = tmp_path / "rtn.gguf", tmp_path / "gptq.gguf"
    _quantize(f32_gguf, rtn_out, mix, "rtn")
    s = _quantize(f32_gguf, gptq_out, mix, "gptq", "--samples", "8", "--seq-len", "64")
    assert s["method"] == "gptq" and s["calibration_tokens"] == 8 * 64 and s["out_bytes"] == gptq_out.stat().st_size
    # every linear of the 8 blocks, and each one's output error below round-to-nearest's
    assert len(s["errors"]) == 8 * 7
    for name, (gptq_err, rtn_err) in s["errors"].items():
        assert gptq_err < rtn_err, (name, gptq_err, rtn_err)
    rtn, q = open_gguf(rtn_out), open_gguf(gptq_out)
    assert q.metadata == rtn.metadata
    by_name = {t.name: t for t in rtn.tensors}
    for t in q.tensors:
        r = by_name[t.name]
        assert (t.qtype, t.shape) == (r.qtype, r.shape), t.name
        raw = np.asarray(q.raw(t))
        if t.name in s["errors"]:  # GPTQ's blocks: ggml's decoding is brisk's
            rows = int(np.prod(t.shape[:-1]))
            assert np.array_equal(gguf_grid.decode(t.qtype, raw, rows, t.shape[-1]).numpy(),
                                  _dequantize(t.qtype, raw, (rows, t.shape[-1]))), t.name
            assert not np.array_equal(raw, np.asarray(rtn.raw(r))), t.name
        else:  # token table, output head, norms: llama.cpp's rounding, as rtn wrote them
            assert np.array_equal(raw, np.asarray(rtn.raw(r))), t.name
    # brisk runs it from its blocks, and it is closer to the float model than llama.cpp's rounding
    kept = LLM.load(str(gptq_out), device="cpu", dtype="float32")
    wide = LLM.load(str(gptq_out), device="cpu", dtype="float32", quantize="none")
    ids = kept.tokenizer.encode("The quick brown fox jumps over the lazy dog. Paris is the capital of France.")
    try:
        native.set_act8(False)  # float activations: the blocks' own values, up to round-off
        lk = kept.logits(ids)
    finally:
        native.set_act8(True)
    lw = wide.logits(ids)
    assert (lk - lw).abs().max() < 1e-3 * lw.abs().max() and torch.equal(lk.argmax(-1), lw.argmax(-1))
    assert kept.generate("The quick brown fox", max_tokens=8).tokens
    kl_gptq, kl_rtn = _kl(gptq_out, f32_gguf), _kl(rtn_out, f32_gguf)
    print(f"{mix}: KL to float on bench/heldout.txt, gptq {kl_gptq:.6f}, rtn {kl_rtn:.6f}")
    assert 0 < kl_gptq < kl_rtn, (kl_gptq, kl_rtn)


def test_gptq_is_the_default_and_an_interrupted_run_resumes(f32_gguf, tmp_path, monkeypatch):  # noqa: F811
    """Without --method, --format gguf runs gptq (it calibrates). Ctrl-C in the middle: exit 130, a line
    saying how to resume, no OUT; the rerun with the same arguments quantizes only the blocks left and
    writes the bytes of an uninterrupted run, and leaves no .partial behind."""
    from brisk.core.quantize import resume

    args = ["--format", "gguf", "--type", "Q4_K_M", "--samples", "4", "--seq-len", "32"]
    whole = tmp_path / "whole.gguf"
    r = runner.invoke(app, ["quantize", str(f32_gguf), "-o", str(whole), *args])
    assert r.exit_code == 0, r.output
    saved, fits, stop_at = [], [], [3]
    real_save, real_fit = resume.save_layer, gguf_grid.GGUFGrid.fit

    def save_then_stop(partial, i, *rest):
        real_save(partial, i, *rest)
        saved.append(i)
        if len(saved) == stop_at[0]:
            raise KeyboardInterrupt

    monkeypatch.setattr(resume, "save_layer", save_then_stop)
    monkeypatch.setattr(gguf_grid.GGUFGrid, "fit", lambda self, *a: fits.append(1) or real_fit(self, *a))
    out = tmp_path / "m.gguf"
    r = runner.invoke(app, ["quantize", str(f32_gguf), "-o", str(out), *args])
    assert r.exit_code == 130 and "resume" in r.output and saved == [0, 1, 2], r.output
    assert not out.exists() and (tmp_path / "m.gguf.gptq.partial").is_dir()
    first_fits, saved[:], stop_at[0] = len(fits), [], None
    r = runner.invoke(app, ["quantize", str(f32_gguf), "-o", str(out), *args])
    assert r.exit_code == 0, r.output
    assert saved == [3, 4, 5, 6, 7], saved  # blocks 0-2 came from the partial run
    assert len(fits) - first_fits == 5 * first_fits // 3  # and GPTQ ran on the other five only
    assert out.read_bytes() == whole.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "whole.gguf"]
