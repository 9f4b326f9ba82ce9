"""GGUF Q4_K weights kept quantized as Int4Linear: the decoding against the gguf package's dequantizer,
the repacking up to bf16 rounding of scale and zero, and Gemma 3 (a Q4_K_M file) run from its blocks."""
import gguf
import numpy as np
import pytest
import torch

from brisk.core import LLM
from brisk.quant import gguf_blocks
from brisk.quant.linear import Int4Linear, Int8Linear, unpack_int4


@pytest.fixture
def torch_kernels(monkeypatch):
    """Loads as on a machine without brisk's native kernels (or on CUDA): blocks repacked for torch's."""
    from brisk.quant import native

    monkeypatch.setattr(native, "ENABLED", False)

Q4_K = int(gguf.GGMLQuantizationType.Q4_K)


def _q4_k_bytes(rows=64, cols=512, seed=0):
    """Random Q4_K blocks (gguf cannot quantize to Q4_K): any codes and 6-bit scales/mins are valid;
    d and dmin random fp16 of either sign, around the sizes real files hold."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        v = (rng.standard_normal(b.shape[:2]) * 1e-3).astype(np.float16)
        b[..., at:at + 2] = v[..., None].view(np.uint8)
    raw = b.reshape(rows, -1)
    return raw, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)


def _bf16_bound(layer: Int4Linear) -> torch.Tensor:
    """Per group, the most that rounding scale and zero to bf16 (8 bits) can move a weight: half a unit
    in the last place of each, times |q - 8| <= 8 for the scale."""
    s, z = layer.scales.float(), layer.zeros.float()
    bound = 2.0 ** -8 * (8 * s.abs() + z.abs()) * 1.001  # 0.1%: float32 rounding of the products
    return bound.repeat_interleave(layer.group_size, dim=1)


def test_q4_k_decoding_matches_gguf():
    raw, ref = _q4_k_bytes()
    assert torch.equal(gguf_blocks.dequantize(raw, 64, 512, Q4_K), torch.from_numpy(ref))


def test_q4_k_repacks_up_to_bf16_scales():
    raw, ref = _q4_k_bytes()
    ref = torch.from_numpy(ref)
    layer = gguf_blocks.to_layer(raw, 64, 512, Q4_K)
    assert isinstance(layer, Int4Linear) and layer.use_kernel and layer.group_size == 32
    err = (layer.dequantize() - ref).abs()
    assert bool((err <= _bf16_bound(layer)).all()), float(err.max())
    assert float(err.max()) > 0  # the bound is not vacuous: these scales do not all fit bf16
    # exactly the formula: ggml's codes, scale = d * sc and zero = 8 * scale - dmin * m, rounded to bf16
    q, scale, mins = gguf_blocks._q4_k(gguf_blocks._blocks(raw, 64, 512, Q4_K))
    zero = 8 * scale - mins
    assert torch.equal(unpack_int4(layer.codes()), q)
    assert torch.equal(layer.scales, scale.bfloat16()) and torch.equal(layer.zeros, zero.bfloat16())
    w = (q.double().view(64, -1, 32) - 8) * scale.double()[..., None] + zero.double()[..., None]
    assert (w.view(64, 512) - ref.double()).abs().max() < 1e-6 * ref.abs().max()
    x = torch.randn(3, 512)
    y_ref = x @ ref.t()
    assert (layer(x) - y_ref).abs().max() < 0.02 * y_ref.abs().max()


def test_q4_k_rows_not_whole_blocks_are_refused():
    assert gguf_blocks.fits(Q4_K, 512) and not gguf_blocks.fits(Q4_K, 640)
    assert gguf_blocks.fits(int(gguf.GGMLQuantizationType.Q4_0), 640)
    with pytest.raises(ValueError):
        gguf_blocks.to_layer(np.zeros(64 * 640 // 256 * 144, np.uint8), 64, 640, Q4_K)


def test_q4_k_rows_permute_and_cache():
    raw, ref = _q4_k_bytes(rows=64, cols=256, seed=1)
    order = torch.randperm(64)
    layer = gguf_blocks.to_layer(gguf_blocks.permute_rows(raw, 64, order), 64, 256, Q4_K)
    whole = gguf_blocks.to_layer(raw, 64, 256, Q4_K)
    assert torch.equal(layer.dequantize(), whole.dequantize()[order])
    data, desc = gguf_blocks.layer_state("l", layer)
    again = gguf_blocks.restore_layer("l", data, desc)
    assert torch.equal(again.dequantize(), layer.dequantize())
    x = torch.randn(2, 256)
    assert torch.equal(again(x), layer(x))


@pytest.mark.slow
def test_gemma_q4_k_layers_load_as_int4(gemma_path, torch_kernels):
    q = LLM.load(str(gemma_path), device="cpu", dtype="float32")  # quantize="auto": keep the blocks
    f = LLM.load(str(gemma_path), device="cpu", dtype="float32", quantize="none")
    table = {t.name: t.tensor_type for t in gguf.GGUFReader(gemma_path).tensors}
    n = 0
    for i, layer in enumerate(q.model.model.layers):
        for gg, mod in (("attn_output", layer.self_attn.o_proj), ("ffn_down", layer.mlp.down_proj)):
            if table[f"blk.{i}.{gg}.weight"] == gguf.GGMLQuantizationType.Q4_K:
                assert isinstance(mod, Int4Linear) and mod.use_kernel, (i, gg)
                n += 1
    assert n == 27  # every o_proj and half the down_proj; the rest of Q4_K_M is Q5_0/Q6_K/Q8_0
    o = q.model.model.layers[5].self_attn.o_proj
    err = (o.dequantize() - f.model.model.layers[5].self_attn.o_proj.weight).abs()
    assert bool((err <= _bf16_bound(o)).all())
    ids = q.tokenizer.encode("The history of the printing press begins")
    lq, lf = q.logits(ids), f.logits(ids)
    assert float((lq.argmax(-1) == lf.argmax(-1)).float().mean()) > 0.85
    p, r = torch.log_softmax(lf, -1), torch.log_softmax(lq, -1)
    kl = float((p.exp() * (p - r)).sum(-1).mean())
    assert kl < 0.02, kl
    # a second load maps the repacked cache (Q4_K layers included) and gives the same logits
    again = LLM.load(str(gemma_path), device="cpu", dtype="float32")
    assert isinstance(again.model.model.layers[5].self_attn.o_proj, Int4Linear)
    assert isinstance(again.model.lm_head, Int8Linear)
    assert torch.equal(again.logits(ids), lq)


@pytest.mark.slow
def test_gemma_keeps_every_k_quant_block(gemma_path):
    """Gemma 3 270M Q4_K_M on the native kernels: Q4_K, Q5_0, Q6_K and Q8_0 all stay in the file's
    blocks (nothing widened), their weights exactly the float widening's, the logits its logits
    (with 16-bit activations; with the K-quants' default 8-bit ones, its distribution)."""
    from brisk.quant import native
    from brisk.quant.gguf_linear import GGUFLinear

    if not native.available():
        pytest.skip("no native kernels here")
    q = LLM.load(str(gemma_path), device="cpu", dtype="float32")
    f = LLM.load(str(gemma_path), device="cpu", dtype="float32", quantize="none")
    table = {t.name: t.tensor_type for t in gguf.GGUFReader(gemma_path).tensors}
    layer = q.model.model.layers[5]
    for gg, mod, wide in (("ffn_down", layer.mlp.down_proj, f.model.model.layers[5].mlp.down_proj),
                          ("attn_q", layer.self_attn.q_proj, f.model.model.layers[5].self_attn.q_proj)):
        assert isinstance(mod, GGUFLinear) and mod.qtype == int(table[f"blk.5.{gg}.weight"])
        assert torch.equal(mod.dequantize(), wide.weight)
    assert not any(isinstance(m, torch.nn.Linear) for m in q.model.modules())
    ids = q.tokenizer.encode("The history of the printing press begins in the fifteenth century, when a goldsmith "
                             "in Mainz combined movable metal type, oil-based ink and a screw press.")
    lf = f.logits(ids)
    try:  # the K-quants' exact 16-bit activations: the widened model's logits up to float32 round-off
        native.set_act8(False)
        lq = q.logits(ids)
    finally:
        native.set_act8(True)
    assert (lq - lf).abs().max() < 1e-3 * lf.abs().max()
    # the default 8-bit ones (llama.cpp's grid): close in distribution (bench/kept_kl.py: KL 0.008)
    lq = q.logits(ids)
    p, r = torch.log_softmax(lf, -1), torch.log_softmax(lq, -1)
    kl = float((p.exp() * (p - r)).sum(-1).mean())
    assert kl < 0.03, kl
    assert float((lq.argmax(-1) == lf.argmax(-1)).float().mean()) > 0.85
