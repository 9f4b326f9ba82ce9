"""Weight-only quantized linears: accuracy per bit width, packing, kernel vs fallback, whole models."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from brisk.quant.linear import (Int4Linear, Int8Linear, dequantize_int4, pack_int4, quantize_int4, quantize_int8,
                                quantize_model, unpack_int4)


def rel_err(y, ref):
    y, ref = y.detach().float(), ref.detach().float()
    return float((y - ref).norm() / ref.norm())


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    lin = nn.Linear(256, 192, bias=True)
    with torch.no_grad():
        lin.bias.normal_(0, 0.1)
    return lin


def test_int8_close_to_float(layer):
    x = torch.randn(2, 3, 256)
    q = Int8Linear.from_float(layer)
    assert q.weight.dtype == torch.int8 and q.use_kernel
    # 8 bits per output channel: ~0.5% of the output; bf16 activations add ~0.3%
    assert rel_err(q(x), layer(x)) < 0.015


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_close_to_float(layer, group_size):
    x = torch.randn(5, 256)
    q = Int4Linear.from_float(layer, group_size)
    assert q.codes().shape == (192, 128) and q.codes().dtype == torch.uint8 and q.use_kernel
    # 16 levels per group: each weight off by at most half a step, ~6-7% of the output here
    assert rel_err(q(x), layer(x)) < 0.1


def test_int4_error_within_half_a_step(layer):
    w = layer.weight.detach()
    q, scales, zeros = quantize_int4(w, 32)
    assert int(q.max()) <= 15
    back = dequantize_int4(pack_int4(q), scales, zeros, 32)
    step = scales.float().repeat_interleave(32, dim=1)
    assert bool(((back - w).abs() <= step / 2 + 1e-6).all())


def test_int8_error_within_half_a_step(layer):
    w = layer.weight.detach()
    q, scales = quantize_int8(w)
    back = q.float() * scales.float()[:, None]
    assert bool(((back - w).abs() <= scales.float()[:, None] / 2 + 1e-6).all())


def test_int4_pack_unpack_round_trip_exact():
    q = torch.randint(0, 16, (48, 96), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (48, 48) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert int(packed[0, 0]) == int(q[0, 0]) | int(q[0, 1]) << 4  # even column in the low nibble


@pytest.mark.parametrize("make", [Int8Linear.from_float, lambda l: Int4Linear.from_float(l, 64)])
def test_kernel_matches_dequantized_fallback(layer, make):
    x = torch.randn(4, 256)
    q = make(layer)
    fast = q(x)
    q.use_kernel = False  # what another device runs: dequantize, then F.linear
    slow = q(x)
    assert rel_err(fast, slow) < 0.005  # only the bf16 activations differ


def test_odd_shapes_fall_back_or_stay_float():
    torch.manual_seed(1)
    odd_out = nn.Linear(64, 300, bias=False)  # 300 rows: not torch's int4 kernel's tiling
    q = Int4Linear.from_float(odd_out, 32)
    assert not q.use_kernel or q.layout == "native"  # the native kernels take any number of rows
    x = torch.randn(3, 64)
    assert rel_err(q(x), odd_out(x)) < 0.1
    model = nn.Sequential(nn.Linear(48, 64))  # 48 columns: no whole group of 32
    quantize_model(model, "int4", 32)
    assert type(model[0]) is nn.Linear


def test_bad_arguments():
    with pytest.raises(ValueError, match="method"):
        quantize_model(nn.Sequential(nn.Linear(64, 64)), "int3")
    with pytest.raises(ValueError, match="group size"):
        quantize_model(nn.Sequential(nn.Linear(64, 64)), "int4", group_size=48)


@pytest.mark.parametrize("method,tol", [("int8", 0.03), ("int4", 0.25)])
def test_quantized_tiny_model_logits_close(tiny_llama_dir, method, tol):
    from brisk.core import LLM
    from torch.nn import Linear

    llm = LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32")
    ids = llm.prompt_ids("The quick brown fox jumps over the lazy dog.", raw=True)
    ref = llm.logits(ids)
    embed = llm.model.model.embed_tokens.weight
    quantize_model(llm.model, method, 32)
    assert not any(isinstance(m, Linear) for n, m in llm.model.named_modules() if n != "lm_head")
    assert isinstance(llm.model.lm_head, Linear)  # the head stays float by default
    assert llm.model.model.embed_tokens.weight is embed
    out = llm.logits(ids)
    assert rel_err(out, ref) < tol
    assert float((out.argmax(-1) == ref.argmax(-1)).float().mean()) >= (0.8 if method == "int8" else 0.6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_falls_back_to_dequantize(layer, dtype):
    x = torch.randn(4, 256)
    for q, tol in ((Int8Linear.from_float(layer), 0.015), (Int4Linear.from_float(layer, 32), 0.1)):
        q = q.to("cuda")
        y = q(x.to("cuda", dtype))
        assert y.dtype == dtype and y.device.type == "cuda"
        assert rel_err(y.cpu(), layer(x)) < tol + (0.01 if dtype == torch.bfloat16 else 0)


@pytest.mark.parametrize("cls", ["int8", "int4"])
def test_refined_head_top_logits_are_float32_exact(cls):
    torch.manual_seed(0)
    head = nn.Linear(128, 512, bias=False)
    q = Int8Linear.from_float(head) if cls == "int8" else Int4Linear.from_float(head, 32)
    x = torch.randn(3, 128) * 4
    coarse = q(x).float()
    q.refine_top = 16
    fine = q(x)
    exact = x @ q.dequantize().t()  # float32 against the stored weights
    top = coarse.topk(16, dim=-1).indices  # the outputs refine() recomputed
    assert torch.allclose(fine.gather(1, top), exact.gather(1, top), atol=1e-4)
    assert torch.equal(fine.argmax(-1), exact.argmax(-1))
    # the bf16 output of torch's kernel alone is visibly coarser at the top (the native kernels'
    # output is float32 already)
    from brisk.quant import native

    if not native.usable(q.in_features):
        assert (coarse.gather(1, top) - exact.gather(1, top)).abs().max() > 1e-3


@pytest.mark.slow
def test_int4_at_load_keeps_the_tied_heads_codes(smollm2_path):
    """-q int4 on a tied model: embedding lookups read the head's rows from codes kept at load, not
    from the kernel layout (rebuilding that for a 49k-row vocabulary took ~7 s and 1.5 GB)."""
    from brisk.core import GREEDY, LLM, Session
    from brisk.quant import linear

    llm = LLM.load(str(smollm2_path), device="cpu", quantize="int4")
    assert isinstance(llm.model.lm_head, linear.Int4Linear) and llm.model.lm_head.weight is not None
    before = linear._int4_kernel_layout.cache_info().misses
    s = Session(llm)
    list(s.stream(llm.prompt_ids("What is the capital of France?"), GREEDY, 8))
    assert linear._int4_kernel_layout.cache_info().misses == before and len(s.last.tokens) == 8


@pytest.mark.slow
def test_int4_at_load_keeps_a_ggufs_4bit_blocks(smollm2_path):
    """-q int4 on a Q4_1 GGUF: the Q4_1 layers stay exactly as stored (no float round trip, no
    float copy of the model), the Q8_0 head is converted alone; -q int8 the other way round."""
    from brisk.core import LLM
    from brisk.quant import linear

    from brisk.quant import gguf_blocks
    from brisk.quant.gguf_linear import GGUFLinear

    auto = LLM.load(str(smollm2_path), device="cpu")
    int4 = LLM.load(str(smollm2_path), device="cpu", quantize="int4")
    int8 = LLM.load(str(smollm2_path), device="cpu", quantize="int8")
    a, b = auto.model.model.layers[3].mlp.down_proj, int4.model.model.layers[3].mlp.down_proj
    head = auto.model.lm_head
    if isinstance(a, GGUFLinear):  # the file's own blocks (native kernels): the same codes, repacked
        a = gguf_blocks.to_layer(a.file_blocks().numpy(), a.out_features, a.in_features, a.qtype)
        head = gguf_blocks.to_layer(head.file_blocks().numpy(), head.out_features, head.in_features, head.qtype)
    assert isinstance(a, linear.Int4Linear) and torch.equal(a.codes(), b.codes()) and torch.equal(a.scales, b.scales)
    assert int4.quantization == "int4" and isinstance(int4.model.lm_head, linear.Int4Linear)
    assert int8.quantization == "int8" and torch.equal(int8.model.lm_head.weight, head.weight)


# ---------------------------------------------------------------- one forward for every kind

def _zero_point_layer(fmt: str, bits: int = 4, group_size: int = 32, act_order: bool = False):
    """A GPTQ or AWQ layer [96, 256] with bias, loaded as a checkpoint's would be."""
    from brisk.quant import awq_format, gptq_format

    torch.manual_seed(bits + group_size)
    N, K, G = 96, 256, 256 // group_size
    q = torch.randint(0, 2 ** bits, (N, K), dtype=torch.int32)
    zeros = torch.randint(1, 2 ** bits, (G, N), dtype=torch.int32)
    scales = (torch.rand(G, N) * 0.02).half().float()
    if fmt == "awq":
        t, cfg = awq_format.pack_layer(q, zeros, scales), awq_format.quantization_config(group_size=group_size)
    else:
        g_idx = torch.arange(K) // group_size
        if act_order:
            g_idx = g_idx[torch.randperm(K)]
        t = gptq_format.pack_layer(q, zeros, scales, g_idx, bits)
        cfg = gptq_format.quantization_config(bits, group_size, desc_act=act_order)
    return (awq_format if fmt == "awq" else gptq_format).load_linear({f"l.{k}": v for k, v in t.items()}, "l", cfg,
                                                                        torch.randn(N) * 0.1)


def _nf4(layer):
    from brisk.quant.nf4 import NF4Linear

    return NF4Linear.from_float(layer, "nf4", 64)


KINDS = {
    "int8": (Int8Linear.from_float, True),
    "int4": (lambda layer: Int4Linear.from_float(layer, 64), True),
    "gptq act-order": (lambda layer: _zero_point_layer("gptq", 4, 32, act_order=True), True),
    "gptq 8-bit": (lambda layer: _zero_point_layer("gptq", 8, 128), False),
    "awq": (lambda layer: _zero_point_layer("awq", 4, 64), True),
    "nf4": (_nf4, False),
}


def test_quantized_layers_share_one_forward():
    """Every kind runs QuantLinear.forward; subclasses supply only _matmul, dequantize (and rows,
    _fallback where they have faster ones)."""
    from brisk.quant import awq_format, bnb_format, gptq_format  # noqa: F401  (define the other kinds)
    from brisk.quant.linear import QuantLinear

    kinds, todo = set(), [QuantLinear]
    while todo:
        for sub in todo.pop().__subclasses__():
            kinds.add(sub)
            todo.append(sub)
    assert {"Int8Linear", "Int4Linear", "ZeroPointLinear", "GPTQLinear", "AWQLinear", "NF4Linear"} \
        <= {k.__name__ for k in kinds}
    assert [k.__name__ for k in kinds if "forward" in vars(k)] == []


@pytest.mark.filterwarnings("ignore:.*dequantiz")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_computes_its_dequantized_weight(layer, kind, dtype):
    make, kernel = KINDS[kind]
    q = make(layer)
    assert q.use_kernel == kernel
    x = torch.randn(2, 3, q.in_features).to(dtype)
    y = q(x)
    assert y.dtype == dtype and y.shape == (2, 3, q.out_features)
    ref = F.linear(x.float(), q.dequantize(), q.bias)
    assert rel_err(y, ref) < (0.01 if dtype == torch.float32 else 0.02)  # bf16 activations or outputs
