"""GGUF Q4_0/Q4_1/Q8_0 weights kept quantized: the repacking against the gguf package's own
quantizer and dequantizer, and the default model run from its blocks against its float widening."""
import gguf
import numpy as np
import pytest
import torch

from brisk.core import LLM
from brisk.core.llm import model_bytes
from brisk.quant import gguf_blocks
from brisk.quant.linear import Int4Linear, Int8Linear, QuantEmbedding

T = gguf.GGMLQuantizationType


@pytest.fixture
def torch_kernels(monkeypatch):
    """Loads as on a machine without brisk's native kernels (or on CUDA): blocks repacked for torch's."""
    from brisk.quant import native

    monkeypatch.setattr(native, "ENABLED", False)


def _blocks(qtype, rows=64, cols=128, seed=0, bf16_exact=False):
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    if bf16_exact:  # round every fp16 scale/min to a value bf16 holds, so the repacking must be exact
        b = raw.reshape(rows, cols // 32, -1).copy()
        for at in ((0, 2) if qtype == T.Q4_1 else (0,)):
            v = np.ascontiguousarray(b[..., at:at + 2]).view(np.float16)
            v = torch.from_numpy(v.astype(np.float32)).bfloat16().float().numpy().astype(np.float16)
            b[..., at:at + 2] = v.view(np.uint8).reshape(b[..., at:at + 2].shape)
        raw = b.reshape(rows, -1)
    return raw, gguf.quants.dequantize(raw, qtype)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_block_decoding_matches_gguf(qtype):
    raw, ref = _blocks(qtype)
    ours = gguf_blocks.dequantize(raw, 64, 128, int(qtype))
    assert torch.equal(ours, torch.from_numpy(ref))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1])
def test_4bit_blocks_repack_exactly(qtype):
    raw, ref = _blocks(qtype, bf16_exact=True)
    layer = gguf_blocks.to_layer(raw, 64, 128, int(qtype))
    assert isinstance(layer, Int4Linear) and layer.use_kernel and layer.group_size == 32
    assert torch.equal(layer.dequantize(), torch.from_numpy(ref))
    x = torch.randn(3, 128)
    # the kernel itself (bf16 activations) against the exact weights
    y_ref = x @ torch.from_numpy(ref).t()
    assert (layer(x) - y_ref).abs().max() < 0.02 * y_ref.abs().max()


def test_q8_0_requantized_per_row_is_close():
    raw, ref = _blocks(T.Q8_0)
    layer = gguf_blocks.to_layer(raw, 64, 128, int(T.Q8_0))
    assert isinstance(layer, Int8Linear)
    err = (layer.dequantize() - torch.from_numpy(ref)).abs()
    assert float(err.max()) <= float(layer.scales.float().max()) * 0.51  # half a per-row step


def test_row_permutation_moves_whole_rows():
    raw, ref = _blocks(T.Q4_1, rows=64, bf16_exact=True)
    order = torch.randperm(64)
    layer = gguf_blocks.to_layer(gguf_blocks.permute_rows(raw, 64, order), 64, 128, int(T.Q4_1))
    assert torch.equal(layer.dequantize(), torch.from_numpy(ref)[order])


@pytest.mark.slow
def test_default_model_runs_from_its_blocks(smollm2_path, tmp_path, monkeypatch, torch_kernels):
    q = LLM.load(str(smollm2_path), device="cpu", dtype="float32")  # quantize="auto": keep the blocks
    f = LLM.load(str(smollm2_path), device="cpu", dtype="float32", quantize="none")
    assert isinstance(q.model.lm_head, Int8Linear) and isinstance(q.model.model.embed_tokens, QuantEmbedding)
    assert isinstance(q.model.model.layers[0].mlp.down_proj, Int4Linear)
    # about llama.cpp's footprint: the GGUF file's size, not the 540 MB of float32
    assert model_bytes(q.model) < 1.15 * smollm2_path.stat().st_size
    assert model_bytes(f.model) > 5 * smollm2_path.stat().st_size
    # the repacked q_proj (rows un-interleaved) equals the float widening up to bf16 scale rounding
    wq = q.model.model.layers[3].self_attn.q_proj.dequantize()
    wf = f.model.model.layers[3].self_attn.q_proj.weight
    assert (wq - wf).abs().max() < 0.01 * wf.abs().max()
    ids = q.prompt_ids("Write a haiku about the sea.")
    lq, lf = q.logits(ids), f.logits(ids)
    assert float((lq.argmax(-1) == lf.argmax(-1)).float().mean()) > 0.9
    p, r = torch.log_softmax(lf, -1), torch.log_softmax(lq, -1)
    kl = float((p.exp() * (p - r)).sum(-1).mean())
    assert kl < 0.02, kl
    # a second load comes from the repacked cache and gives the same logits
    again = LLM.load(str(smollm2_path), device="cpu", dtype="float32")
    assert torch.equal(again.logits(ids), lq)


@pytest.mark.slow
def test_default_model_runs_from_the_files_own_blocks(smollm2_path):
    """With brisk's native kernels the file's Q4_1/Q8_0 blocks are the layers (memory-mapped, no
    repacking): their weights are exactly the float widening's, the bytes held about the file's."""
    from brisk.quant import native
    from brisk.quant.gguf_linear import GGUFLinear

    if not native.available():
        pytest.skip("no native kernels here")
    q = LLM.load(str(smollm2_path), device="cpu", dtype="float32")
    f = LLM.load(str(smollm2_path), device="cpu", dtype="float32", quantize="none")
    assert isinstance(q.model.lm_head, GGUFLinear) and isinstance(q.model.model.embed_tokens, QuantEmbedding)
    assert q.quantization == "q4_1+q8_0"
    assert model_bytes(q.model) < 1.05 * smollm2_path.stat().st_size
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):  # q/k rows un-interleaved too
        layer, wide = q.model.model.layers[3].get_submodule(name), f.model.model.layers[3].get_submodule(name)
        assert isinstance(layer, GGUFLinear) and torch.equal(layer.dequantize(), wide.weight)
    assert torch.equal(q.model.lm_head.dequantize(), f.model.lm_head.weight)
    ids = q.prompt_ids("Write a haiku about the sea.")
    lq, lf = q.logits(ids), f.logits(ids)
    assert (lq - lf).abs().max() < 1e-3 * lf.abs().max()  # the same weights: float32 summation order only


def test_interleaved_weights_get_memory_that_can_take_huge_pages():
    """The loader packs into private anonymous memory aligned to 2 MB (where Linux may use huge pages:
    4 KB ones cost a 1.1B model's decode ~15%); it must outlive its mapping object and hold its bytes."""
    import gc
    import sys

    from brisk.core.anonymous_memory import anonymous_bytes

    t = anonymous_bytes(1000 * 4200, huge_pages=True).view(1000, 4200)
    assert t.shape == (1000, 4200) and t.dtype == torch.uint8 and t.is_contiguous()
    if sys.platform == "linux":
        assert t.data_ptr() % (2 << 20) == 0
    gc.collect()
    assert not t.any()  # zero-filled, as the KV cache's views rely on
    t.fill_(3)
    assert int(t.sum()) == 3 * 1000 * 4200
    small = anonymous_bytes(4 * 8, huge_pages=True).view(4, 8)
    assert small.shape == (4, 8) and not small.any()


def test_type_table_agrees_with_the_gguf_package():
    """brisk's table of GGUF types (quant/gguf_types.py) against gguf-py's own ids, names and sizes,
    and every fact its readers take from it: the kernels, layouts and fallbacks exist."""
    from brisk.quant import gguf_interleave, gguf_types, native

    assert len(gguf_types.BY_ID) == len(gguf_types.TYPES)
    for t in gguf_types.TYPES:
        assert T(t.id).name == t.name
        assert gguf.GGML_QUANT_SIZES[T(t.id)] == (t.block_weights, t.block_bytes), t.name
        assert all((native.KERNELS / k).exists() for k in t.kernels), t.kernels
        assert t.interleave is None or t.interleave in gguf_interleave._LAYOUTS
        assert t.fallback in (gguf_types.INT4, gguf_types.INT8, gguf_types.WIDEN, "float")
        assert (t.fallback == "float") == (not t.quantized)
    assert {t.id for t in gguf_types.REPACKED} == set(gguf_blocks.BLOCK_SHAPE)
    assert set(native.BLOCK) == {t.id for t in gguf_types.TYPES if t.quantized and t.kernels}
    assert set(gguf_interleave.TYPES) <= set(native.BLOCK)
