"""bitsandbytes NF4/FP4/int8 written by GPTQ on the format's own grid (issue 15): the same tensors as
round-to-nearest, read by the same loaders (and by bitsandbytes itself) as the weights GPTQ
measured, and a model output clearly closer to the float model's."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import kl_to
from safetensors.torch import load_file

from brisk.quant import bnb_format, nf4
from brisk.quant.gptq import GPTQ, CodebookGrid, output_error


def _layer():
    """A weight and calibration inputs with uneven, correlated channels (as real activations have)."""
    gen = torch.Generator().manual_seed(0)
    N, K = 96, 256
    mix = torch.randn(K, K, generator=gen) / K ** 0.5 + torch.eye(K)
    x = (torch.randn(1024, K, generator=gen) @ mix) * (torch.rand(K, generator=gen) * 3 + 0.1)
    w = torch.randn(N, K, generator=gen) * 0.05
    g = GPTQ(w)
    g.add_batch(x)
    return w, g


def _loaded(tensors: dict) -> torch.Tensor:
    return bnb_format.load_linear({f"p.{k}": v for k, v in tensors.items()}, "p", {}, None).dequantize()


@pytest.mark.parametrize("quant_type, double_quant", [("nf4", False), ("nf4", True), ("fp4", True)])
def test_4bit_checkpoint_decodes_to_what_gptq_compensated(quant_type, double_quant):
    """The loader's weight is exactly the one GPTQ measured, double-quantized absmax included (the
    error it spread is the error the model has); the tensors are round-to-nearest's, other values."""
    w, g = _layer()
    stored = lambda s, group: (s,)  # noqa: E731
    if double_quant:
        _, nested, offset = nf4.double_quantize(nf4.quantize_blockwise_4bit(w, quant_type, 64)[1])
        rows = torch.arange(w.shape[0]) * (w.shape[1] // 64)
        stored = lambda s, group: nf4.round_nested(s, rows + group, nested, offset)  # noqa: E731
    measured = GPTQ.with_hessian(w, g.H).run(CodebookGrid(nf4.codebook(quant_type), stored), 64)
    mine = bnb_format.quantize_4bit(w, quant_type, 64, double_quant, hessian=g.H)
    assert torch.equal(_loaded(mine), measured.dequantized)

    rtn = bnb_format.quantize_4bit(w, quant_type, 64, double_quant)
    assert {k: (v.dtype, v.shape) for k, v in mine.items()} == {k: (v.dtype, v.shape) for k, v in rtn.items()}
    key = f"weight.quant_state.bitsandbytes__{quant_type}"
    state, ref_state = (json.loads(bytes(t[key].numpy())) for t in (mine, rtn))
    assert state.pop("nested_offset", None) == ref_state.pop("nested_offset", None)  # fixed from the rounded absmax
    assert state == ref_state
    assert not torch.equal(mine["weight"], rtn["weight"])
    # stored absmax below the block's largest |w| where clipping paid off
    top = int(nf4.codebook(quant_type).argmax())  # the code of 1.0: decodes to the block's absmax
    absmax = _loaded({**mine, "weight": torch.full_like(mine["weight"], top * 17)}).reshape(-1, 64)[:, 0]
    assert bool((absmax < w.reshape(-1, 64).abs().amax(1) * 0.99).any())
    assert output_error(_loaded(mine), w, g.H) < 0.8 * output_error(_loaded(rtn), w, g.H)


def test_int8_checkpoint_decodes_to_what_gptq_compensated():
    """SCB / 127 is a bf16 value: brisk's bf16 row scales and bitsandbytes' SCB / 127 decode alike."""
    w, g = _layer()
    mine, rtn = bnb_format.quantize_int8(w, hessian=g.H), bnb_format.quantize_int8(w)
    assert {k: (v.dtype, v.shape) for k, v in mine.items()} == {k: (v.dtype, v.shape) for k, v in rtn.items()}
    scale = mine["SCB"] / 127
    assert torch.equal(scale.to(torch.bfloat16).float(), scale)
    assert torch.equal(_loaded(mine), mine["weight"].float() * scale[:, None])
    assert bool((mine["SCB"] < rtn["SCB"]).any()) and int(mine["weight"].abs().max()) == 127
    assert output_error(_loaded(mine), w, g.H) < 0.9 * output_error(_loaded(rtn), w, g.H)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_fast_nearest_code_is_bucketize(quant_type):
    """The grid's table lookup picks the entry bucketize (the reference rule: nearest, ties to the
    lower entry) picks, on the boundaries themselves, one float step either side of them, signed
    zeros, values far beyond the end codes and random values, on the table path and the small one."""
    grid = CodebookGrid(nf4.codebook(quant_type))
    mids, nearest = grid._mids, grid._nearest
    assert nearest is not None
    big = torch.finfo(torch.float32).max
    edge = torch.cat((mids, mids.nextafter(torch.tensor(big)), mids.nextafter(torch.tensor(-big)),
                      grid._sorted, torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.5, -1.5, 1e30, -1e30, big, -big])))
    gen = torch.Generator().manual_seed(0)
    rand = torch.cat((torch.randn(40_000, generator=gen), torch.rand(10_000, generator=gen) * 2 - 1))
    for x in (edge, torch.cat((edge, rand)), torch.cat((edge, rand))[:50_000].reshape(100, 100, 5)):
        assert torch.equal(nearest(x).long(), torch.bucketize(x, mids))
    # through the grid: codes and values as the bucketize rule gives them, for scales of any size
    s = torch.full((1,), 0.03)
    for w in (edge * s, torch.cat((edge, rand)) * s):
        q, v = grid.round(w, (s,))
        ref = grid._order[torch.bucketize(w / s, mids)]
        assert torch.equal(q.long(), ref) and torch.equal(v, grid.code[ref] * s)


def test_grid_search_batching_picks_what_one_at_a_time_does(monkeypatch):
    """The candidates rounded all at once or one by one (how the search batches them to bound its
    memory): the same codes and scales."""
    from brisk.quant import gptq

    w, g = _layer()
    grid = CodebookGrid(nf4.codebook("nf4"))
    together = GPTQ.with_hessian(w, g.H).run(grid, 64)
    monkeypatch.setattr(gptq, "_BATCH", 1)
    alone = GPTQ.with_hessian(w, g.H).run(grid, 64)
    assert torch.equal(together.q, alone.q) and torch.equal(together.params[0], alone.params[0])


def _bnb():
    try:
        import bitsandbytes.functional as bf
    except Exception as e:  # noqa: BLE001  (a broken native library is as good as absent)
        pytest.skip(f"bitsandbytes is not importable ({e})")
    return bf


@pytest.mark.parametrize("quant_type, double_quant", [("nf4", False), ("nf4", True), ("fp4", True)])
def test_bitsandbytes_reads_calibrated_4bit_as_brisk_does(quant_type, double_quant):
    bf = _bnb()
    w, g = _layer()
    t = bnb_format.quantize_4bit(w, quant_type, 64, double_quant, hessian=g.H)
    qs = bf.QuantState.from_dict({k.removeprefix("weight."): v for k, v in t.items() if k != "weight"}, torch.device("cpu"))
    theirs = bf.dequantize_4bit(t["weight"], qs)
    assert torch.equal(theirs.float(), _loaded(t))


def test_bitsandbytes_reads_calibrated_int8_as_brisk_does():
    bf = _bnb()
    w, g = _layer()
    t = bnb_format.quantize_int8(w, hessian=g.H)
    theirs = bf.int8_vectorwise_dequant(t["weight"], t["SCB"])
    torch.testing.assert_close(theirs, _loaded(t), rtol=1e-6, atol=0)  # bnb multiplies by 1/127


# ---------------------------------------------------------------- the whole model's output

@pytest.mark.parametrize("method, double_quant, max_ratio", [("nf4", None, 0.4), ("nf4", True, 0.4),
                                                             ("int8", None, 0.4)])
def test_calibrated_beats_round_to_nearest_on_the_model_output(trained_tiny, tmp_path, method, double_quant,
                                                               max_ratio):
    """brisk quantize's default (calibrated) against --samples 0 (bitsandbytes' round-to-nearest):
    KL to the float model on text it was not calibrated on, through the checkpoint loaders; the
    files hold the same tensors (names, dtypes, shapes)."""
    from quant_interop import TEXT

    from brisk.core.llm import LLM
    from brisk.core.quantize import QuantOptions, quantize_model

    base = LLM.load(str(trained_tiny), device="cpu", dtype="float32", quantize="none")
    ids = base.tokenizer.encode(TEXT)[:256]
    kl, layout = {}, {}
    for samples in (32, 0):
        out = tmp_path / f"q{samples}"
        calib = dict(samples=32, seq_len=64) if samples else dict(samples=0)
        s = quantize_model(str(trained_tiny), out, QuantOptions(method, double_quant=double_quant, **calib))
        assert s.error_kind == ("output" if samples else "weight")
        kl[samples] = kl_to(base, LLM.load(str(out), device="cpu", dtype="float32"), ids)
        layout[samples] = {k: (v.dtype, v.shape) for k, v in load_file(str(out / "model.safetensors")).items()}
        assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "bitsandbytes"
    assert layout[32] == layout[0]
    assert 0 < kl[32] < max_ratio * kl[0], kl
