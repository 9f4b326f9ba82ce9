"""brisk's native CPU kernels (quant/kernels/brisk_kernels.c) at every instruction-set level this
CPU has, against float64 products of the dequantized weights: odd shapes, a ragged last row tile,
batch invariance (a row's bits do not depend on the other rows), and the layers that use them."""
from __future__ import annotations

import os

import pytest
import torch

from brisk.quant import native
from brisk.quant.linear import Int4Linear, Int8Linear, dequantize_int4, dequantize_int8, pack_int4, quantize_int4, quantize_int8



@pytest.fixture(autouse=True)
def enabled(monkeypatch):
    """The kernels are opt-in (BRISK_NATIVE=1); these tests turn them on."""
    monkeypatch.setattr(native, "ENABLED", True)
    native.library.cache_clear()
    if not native.available():
        pytest.skip("no C compiler: the native kernels are not built")
    yield
    native.library.cache_clear()


@pytest.fixture(params=[0, 1, 2], ids=["scalar", "avx2", "avx512"])
def level(request, monkeypatch):
    if request.param > native.library().bk_cpu_level():
        pytest.skip("this CPU lacks the instructions")
    monkeypatch.setenv("BRISK_NATIVE_LEVEL", str(request.param))
    native.level.cache_clear()
    yield request.param
    native.level.cache_clear()


SHAPES = [(32, 32, 32), (7, 64, 32), (45, 96, 32), (130, 256, 64), (64, 384, 128)]  # N, K, group


@pytest.mark.parametrize("N,K,G", SHAPES)
def test_int4_float_activations(level, N, K, G):
    g = torch.Generator().manual_seed(N * K)
    q, s, z = quantize_int4(torch.randn(N, K, generator=g), G)
    codes = pack_int4(q)
    x = torch.randn(5, K, generator=g)
    ref = x.double() @ dequantize_int4(codes, s, z, G).double().T
    y = native.int4_matmul(x, codes, s, z, G)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for i in range(5):  # alone, each row gives the same bits as in the batch
        assert torch.equal(native.int4_matmul(x[i:i + 1], codes, s, z, G)[0], y[i])


def test_threads_split_rows_without_changing_bits():
    """Rows split across threads (and a thread that never gets a chunk) give the same bits."""
    g = torch.Generator().manual_seed(3)
    q, s, z = quantize_int4(torch.randn(1000, 256, generator=g), 32)
    codes, x = pack_int4(q), torch.randn(3, 256, generator=g)
    native.set_threads(1)
    one = native.int4_matmul(x, codes, s, z, 32)
    native.set_threads(4)
    try:
        for _ in range(20):
            assert torch.equal(native.int4_matmul(x, codes, s, z, 32), one)
    finally:
        native.set_threads(torch.get_num_threads())


@pytest.mark.parametrize("N,K,G", SHAPES)
def test_int4_int8_activations(level, N, K, G):
    g = torch.Generator().manual_seed(N + K)
    q, s, z = quantize_int4(torch.randn(N, K, generator=g), G)
    codes = pack_int4(q)
    x = torch.randn(3, K, generator=g)
    ref = x.double() @ dequantize_int4(codes, s, z, G).double().T
    y = native.int4_matmul(x, codes, s, z, G, int8_activations=True)
    assert ((y.double() - ref).norm() / ref.norm()) < 0.01  # 8-bit activations: ~0.5% error
    assert torch.equal(native.int4_matmul(x[1:2], codes, s, z, G, int8_activations=True)[0], y[1])


@pytest.mark.parametrize("N,K", [(33, 64), (96, 160), (7, 96)])
def test_int8(level, N, K):
    g = torch.Generator().manual_seed(N)
    q, s = quantize_int8(torch.randn(N, K, generator=g))
    x = torch.randn(4, K, generator=g)
    ref = x.double() @ dequantize_int8(q, s).double().T
    y = native.int8_matmul(x, q, s.float())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(native.int8_matmul(x[3:], q, s.float())[0], y[3])
    y8 = native.int8_matmul(x, q, s.float(), int8_activations=True)
    assert ((y8.double() - ref).norm() / ref.norm()) < 0.01
    assert torch.equal(native.int8_matmul(x[3:], q, s.float(), int8_activations=True)[0], y8[3])


def test_layers_use_them_and_match_the_fallback():
    lin = torch.nn.Linear(96, 40)
    l4, l8 = Int4Linear.from_float(lin, 32), Int8Linear.from_float(lin)
    assert l4.layout == "native"
    x = torch.randn(2, 3, 96)
    torch.testing.assert_close(l4(x), torch.nn.functional.linear(x, l4.dequantize(), l4.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l8(x), torch.nn.functional.linear(x, l8.dequantize(), l8.bias), rtol=1e-5, atol=1e-5)


def test_no_compiler_falls_back_to_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(RuntimeError):
        native.build(tmp_path)


@pytest.mark.slow
def test_native_kernels_keep_greedy_promises_on_the_default_model(smollm2_path):
    """The default model, Q4_1 kept, on the native kernels, float32: greedy speculative decoding and
    batched decoding give plain greedy decoding's tokens (torch's int4 kernel rounds its bf16
    output differently with the number of rows, which breaks this)."""
    from brisk.core import GREEDY, LLM, Session
    from brisk.core.batching import Engine, Request
    from brisk.core.speculative import make_speculator

    llm = LLM.load(str(smollm2_path), device="cpu", dtype="float32")
    assert "int4" in llm.quantization
    prompts = ["What is the capital of France?", "Write a haiku about the sea.",
               "Rewrite this sentence more formally: gonna grab food, brb."]
    plain = []
    for p in prompts:
        s = Session(llm)
        list(s.stream(llm.prompt_ids(p), GREEDY, 40))
        plain.append(s.last.tokens)
    for p, want in zip(prompts, plain):
        s = Session(llm, make_speculator(llm, "ngram", 3))
        list(s.stream(llm.prompt_ids(p), GREEDY, 40))
        assert s.last.tokens == want
    seqs = Engine(llm, max_batch=4).run([Request(llm.prompt_ids(p), GREEDY, 40) for p in prompts])
    assert [q.result.tokens for q in seqs] == plain
