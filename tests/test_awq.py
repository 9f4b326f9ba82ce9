"""AWQ: AutoAWQ's GEMM packing, the layer, the scale and clip search against round-to-nearest on
real SmolLM2 layers, and interop with GPTQModel's AWQ both ways."""
from __future__ import annotations

import pytest
import torch

from brisk.quant import awq, awq_format
from brisk.quant.awq_format import AWQLinear, load_linear, pack_awq, pack_layer, unpack_awq, unpack_layer
from brisk.quant.zero_point_linear import ZeroPointLinear
from quant_interop import (check_logits, fixture_logits, float_weight, layer_inputs, out_error, tool_reference,
                           write_quantized)


def test_awq_packing_order():
    # nibble i of each word holds column AWQ_ORDER[i] = 0, 2, 4, 6, 1, 3, 5, 7 of its eight
    assert int(pack_awq(torch.arange(8)[None])) == 0x75316420
    assert int(pack_awq(torch.arange(8, 16)[None])) & 0xFFFFFFFF == 0xFDB9ECA8


def test_awq_layout_round_trip_exact():
    N, K, G = 96, 256, 2
    q = torch.randint(0, 16, (N, K), dtype=torch.int32)
    zeros = torch.randint(0, 16, (G, N), dtype=torch.int32)  # AWQ stores zeros as they are: 0 is fine
    scales = torch.rand(G, N).half().float()
    t = pack_layer(q, zeros, scales)
    assert t["qweight"].shape == (K, N // 8) and t["qzeros"].shape == (G, N // 8) and t["scales"].shape == (G, N)
    q2, z2, s2 = unpack_layer(t["qweight"], t["qzeros"], t["scales"])
    assert torch.equal(q2, q) and torch.equal(z2, zeros) and torch.equal(s2, scales)
    assert torch.equal(unpack_awq(pack_awq(q)), q)


@pytest.mark.parametrize("group_size,N,kernel", [(32, 96, True), (64, 64, True), (128, 128, True), (128, 40, False)])
def test_awq_linear_matches_the_formula(monkeypatch, group_size, N, kernel):
    monkeypatch.setattr(ZeroPointLinear, "exact", True)  # the bfloat16 path: test_gptq.py
    torch.manual_seed(group_size)
    K = 256
    G = K // group_size
    q = torch.randint(0, 16, (N, K), dtype=torch.int32)
    zeros = torch.randint(0, 16, (G, N), dtype=torch.int32)
    scales = (torch.rand(G, N) * 0.02).half().float()
    t = {f"l.{k}": v for k, v in pack_layer(q, zeros, scales).items()}
    layer = load_linear(t, "l", awq_format.quantization_config(group_size=group_size), None)
    assert isinstance(layer, AWQLinear) and layer.use_kernel == kernel and not t
    g = torch.arange(K) // group_size
    w = (q - zeros.T[:, g]).float() * scales.T[:, g]
    assert torch.equal(layer.dequantize(), w)
    x = torch.randn(3, K)
    assert (layer(x).double() - x.double() @ w.double().T).abs().max() < 1e-4


def test_quantize_decodes_to_its_dequantized_weight():
    torch.manual_seed(0)
    w, x = torch.randn(64, 256) * 0.05, torch.randn(300, 256)
    clip = awq.search_clip(x, w, 4, 64)
    assert clip.shape == (64, 4) and bool((clip <= w.abs().reshape(64, 4, 64).amax(-1)).all())
    res = awq.quantize(w, 4, 64, clip=clip, x=x)
    layer = load_linear({f"l.{k}": v for k, v in res.tensors().items()}, "l", awq_format.quantization_config(4, 64), None)
    assert torch.equal(layer.dequantize(), res.dequantized)
    assert abs(res.error - out_error(res.dequantized, w, x)) < 1e-4 * res.error


@pytest.fixture(scope="module")
def smol_mlp(smollm2):
    """SmolLM2's layer-6 MLP: gate/up (one shared input) and down, with their inputs split into
    calibration and held-out tokens."""
    names = ("model.layers.6.mlp.gate_proj", "model.layers.6.mlp.up_proj", "model.layers.6.mlp.down_proj")
    w = {n: float_weight(smollm2, n) for n in names}
    return w, layer_inputs(smollm2, names[0]), layer_inputs(smollm2, names[2])


@pytest.mark.slow
def test_awq_beats_round_to_nearest_on_smollm2(smol_mlp):
    w, (x_in, held_in), (x_down, held_down) = smol_mlp
    groups = [(["model.layers.6.mlp.gate_proj", "model.layers.6.mlp.up_proj"], x_in, held_in),
              (["model.layers.6.mlp.down_proj"], x_down, held_down)]
    for names, x, held in groups:
        s = awq.search_scales(x, [w[n] for n in names], 4, 64)
        assert s.shape == (x.shape[1],) and bool((s > 0).all())
        for n in names:
            clip = awq.search_clip(x / s, w[n] * s, 4, 64)
            res = awq.quantize(w[n] * s, 4, 64, clip=clip)
            effective = res.dequantized / s  # the scale is folded into the op before the layer
            base = awq.quantize(w[n], 4, 64).dequantized  # the same grid without AWQ's scales and clipping
            # on calibration and held-out tokens alike (measured: 0.74-0.91 of rounding's error)
            assert out_error(effective, w[n], x) < 0.95 * out_error(base, w[n], x), n
            assert out_error(effective, w[n], held) < 0.95 * out_error(base, w[n], held), n


@pytest.mark.parametrize("exact", [False, True])
def test_gptqmodel_awq_checkpoint_loads(monkeypatch, exact):
    """An AWQ GEMM checkpoint GPTQModel wrote gives the logits of a float model built from
    GPTQModel's own dequantization, and of its quantized forward (float16)."""
    monkeypatch.setattr(ZeroPointLinear, "exact", exact)
    logits, ref, llm = fixture_logits("awq_gemm_4bit_g128")
    layer = llm.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, AWQLinear) and layer.use_kernel
    check_logits(logits, ref, exact)


@pytest.mark.parametrize("group_size", [32, 64])
def test_brisk_awq_checkpoints_load_in_gptqmodel(monkeypatch, tiny_llama_dir, tmp_path, group_size):
    pytest.importorskip("gptqmodel", reason="GPTQModel is not installed (pip install gptqmodel==7.6.0)")
    monkeypatch.setattr(ZeroPointLinear, "exact", True)
    from brisk.core.llm import LLM

    def quantize(w):
        x = torch.randn(256, w.shape[1])
        return awq.quantize(w, 4, group_size, clip=awq.search_clip(x, w, 4, group_size)).tensors()

    out = write_quantized(tiny_llama_dir, tmp_path / "q", quantize, awq_format.quantization_config(4, group_size))
    ref = tool_reference(out, tiny_llama_dir)
    check_logits(LLM.load(str(out), device="cpu", dtype="float32").logits(ref["input_ids"].tolist()), ref, True)


def test_scales_folded_into_a_gemma_norm_survive_bfloat16():
    """A norm stored as w for offset + w (Gemma's 1 + w) takes AWQ's scales as (1 + w) / s - 1: in
    bfloat16 that loses most of a small (1 + w) / s. The search's `folded` rescales each candidate
    (any constant gives the same weight error) so the folded scales keep the norm's own size, and
    reports the rounding left, which the search then measures."""
    from brisk.core.model import RMSNorm
    from brisk.core.quantize.recipes import _offset_norm_fold

    torch.manual_seed(0)
    norm = RMSNorm(256, 1e-6, offset=1.0)
    g = torch.rand(256) * 1.5 + 0.5
    norm.weight.data = g - 1
    s = 60 * torch.exp(0.5 * torch.randn(256))  # salient inputs scaled up: (1 + w) / s near 0.02
    s2, factor = _offset_norm_fold(norm, torch.bfloat16)(s)
    assert torch.allclose(s2 / s, (s2 / s)[:1].expand(256))  # the same scales, up to one constant
    stored = (g / s2 - 1).bfloat16().float() + 1
    assert torch.allclose(factor, stored * s2 / g)
    naive = ((g / s - 1).bfloat16().float() + 1) * s / g
    assert (factor - 1).abs().median() < 2 ** -9 < 0.1 * (naive - 1).abs().median()
    assert _offset_norm_fold(RMSNorm(256, 1e-6), torch.bfloat16) is None  # Llama's norm rounds relatively


def test_search_scales_measures_what_the_checkpoint_holds():
    """With `folded`, a candidate is judged on the inputs the folded op will give: a rounding that
    wrecks every scaled candidate leaves the search at the unscaled one (a = 0)."""
    torch.manual_seed(1)
    x = torch.randn(512, 128) * torch.exp(torch.randn(128))  # uneven channels: AWQ scales them
    w = torch.randn(64, 128) * 0.05
    plain = awq.search_scales(x, [w], 4, 32)
    wn = w.abs().reshape(64, 4, 32)
    a0 = 1 / (wn / wn.amax(-1, keepdim=True)).reshape(64, 128).mean(0).clamp(min=1e-4)
    a0 = a0 / (a0.max() * a0.min()).sqrt()
    assert not torch.allclose(plain, a0)  # unconstrained, it scales the inputs

    def wrecked(s):  # any scaling away from a = 0 costs each channel 30% of its input
        return s, torch.where(torch.isclose(s, a0, rtol=1e-5), 1.0, 0.7)

    assert torch.allclose(awq.search_scales(x, [w], 4, 32, folded=wrecked), a0)
