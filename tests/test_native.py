"""brisk's native CPU kernels (quant/kernels/brisk_kernels.c) at every instruction-set level this
CPU has, against float64 products of the dequantized weights: odd shapes, a ragged last row tile,
batch invariance (a row's bits do not depend on the other rows), and the layers that use them."""
from __future__ import annotations

import os

import pytest
import torch

from brisk.quant import native
from int_dot_bound import activation_bound
from brisk.quant.linear import Int4Linear, Int8Linear, dequantize_int4, dequantize_int8, pack_int4, quantize_int4, quantize_int8



@pytest.fixture(autouse=True)
def enabled(monkeypatch):
    monkeypatch.setattr(native, "ENABLED", True)
    if not native.available():
        pytest.skip("no C compiler: the native kernels are not built")


SHAPES = [(32, 32, 32), (7, 64, 32), (45, 96, 32), (130, 256, 64), (64, 384, 128), (9, 160, 160)]  # N, K, group


def _close(y, ref):
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("N,K,G", SHAPES)
def test_int4_groups(level, N, K, G):
    g = torch.Generator().manual_seed(N * K)
    q, s, z = quantize_int4(torch.randn(N, K, generator=g), G)
    codes = pack_int4(q)
    w = native.NativeWeight(native.I4G, N, K, codes, s, z, G)
    x = torch.randn(5, K, generator=g)
    dense = dequantize_int4(codes, s, z, G)
    err = (w.matmul(x).double() - x.double() @ dense.double().T).abs()  # groups of 32k: 16-bit activations
    bound = activation_bound(x, dense, native.I4G) if G % 32 == 0 else 0
    assert (err <= 1e-5 * (x.double().abs() @ dense.double().abs().T) + 1.001 * bound).all()
    assert torch.equal(w.dequantize(), dense)  # the same floats as the torch reference
    y = w.matmul(x)
    for i in range(5):  # alone, each row gives the same bits as in the batch
        assert torch.equal(w.matmul(x[i:i + 1])[0], y[i])


@pytest.mark.parametrize("N,K", [(33, 64), (96, 160), (7, 96)])
def test_int8_rows(level, N, K):
    g = torch.Generator().manual_seed(N)
    q, s = quantize_int8(torch.randn(N, K, generator=g))
    w = native.NativeWeight(native.I8R, N, K, q, row_scales=s)
    x = torch.randn(4, K, generator=g)
    dense = dequantize_int8(q, s).double()
    err = (w.matmul(x).double() - x.double() @ dense.T).abs()
    assert (err <= 1e-5 * (x.double().abs() @ dense.abs().T) + 1.001 * activation_bound(x, dense, native.I8R)).all()
    assert torch.equal(w.matmul(x[3:])[0], w.matmul(x)[3])
    assert torch.equal(w.rows(torch.tensor([5, 0])), dequantize_int8(q, s)[[5, 0]])


@pytest.mark.parametrize("N,K", [(7, 32), (45, 96), (130, 576), (9, 1568)])
def test_float_rows(level, N, K):
    """Float32 rows read in place (a float model's weights): a ragged last tile, K past the 512-column
    chunk, activation rows in groups of 4 (or 2), their remainders and past a block of 64; up to 4
    rows take the row-by-row path (decode), more the tiles, with the same bits."""
    g = torch.Generator().manual_seed(N + K)
    dense = torch.randn(N, K, generator=g)
    w = native.NativeWeight(native.F32, N, K, dense)
    x = torch.randn(70, K, generator=g)
    y = w.matmul(x)
    _close(y, x.double() @ dense.double().T)
    for i in (0, 3, 5, 63, 64, 69):  # alone, each row gives the same bits as in the batch
        assert torch.equal(w.matmul(x[i:i + 1])[0], y[i])
    assert torch.equal(w.matmul(x[5:11]), y[5:11])
    for m in (2, 3, 4):
        assert torch.equal(w.matmul(x[7:7 + m]), y[7:7 + m])
    assert torch.equal(w.rows(torch.tensor([N - 1, 0])), dense[[N - 1, 0]])


def test_threads_split_rows_without_changing_bits():
    """Rows split across threads (and a thread that never gets a chunk) give the same bits."""
    g = torch.Generator().manual_seed(3)
    q, s, z = quantize_int4(torch.randn(1000, 256, generator=g), 32)
    w, x = native.NativeWeight(native.I4G, 1000, 256, pack_int4(q), s, z, 32), torch.randn(3, 256, generator=g)
    native.set_threads(1)
    one = w.matmul(x)
    native.set_threads(4)
    try:
        for _ in range(20):
            assert torch.equal(w.matmul(x), one)
    finally:
        native.set_threads(torch.get_num_threads())


@pytest.mark.parametrize("threads", [1, 3])
def test_read_probe_reads_every_word(threads):
    """The benchmarks' read-bandwidth probe folds every 64-bit word of the buffer (a partial last
    chunk and odd tail included), split across threads: its XOR equals numpy's."""
    import numpy as np

    words = np.random.default_rng(threads).integers(0, 2**63, (1 << 17) * 3 + 13, dtype=np.uint64)
    native.set_threads(threads)
    try:
        got = native.library().bk_read_probe(words.ctypes.data, words.nbytes)
    finally:
        native.set_threads(torch.get_num_threads())
    assert got == int(np.bitwise_xor.reduce(words))
    assert native.read_bandwidth(threads, n_bytes=1 << 24, repeats=1) > 0


def test_bad_weights_are_refused():
    with pytest.raises(ValueError):  # fewer bytes than the shape needs
        native.NativeWeight(3, 4, 64, torch.zeros(4 * 39, dtype=torch.uint8))
    w = native.NativeWeight(3, 4, 64, torch.zeros(4 * 40, dtype=torch.uint8))
    with pytest.raises(IndexError):
        w.rows(torch.tensor([4]))


def test_layers_use_them_and_match_the_fallback():
    lin = torch.nn.Linear(96, 40)
    l4, l8 = Int4Linear.from_float(lin, 32), Int8Linear.from_float(lin)
    assert l4.layout == "native"
    x = torch.randn(2, 3, 96)
    for layer, kind in ((l4, native.I4G), (l8, native.I8R)):
        w = layer.dequantize()
        err = (layer(x) - torch.nn.functional.linear(x, w, layer.bias)).abs().reshape(6, 40).double()
        assert (err <= 1e-5 + 1.001 * activation_bound(x.reshape(6, 96), w, kind)).all()


def test_no_compiler_falls_back_to_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(RuntimeError):
        native.build(tmp_path)


@pytest.mark.slow
def test_default_load_keeps_greedy_promises(smollm2_path):
    """The default model as a user runs it (Q4_1 blocks kept, native kernels, the CLI's auto dtype):
    greedy speculative decoding (prompt lookup: a quantized model refuses a quantized self-draft) and
    batched decoding give plain greedy decoding's tokens (torch's int4 kernel rounds its bf16 output
    differently with the number of rows, which broke this)."""
    from brisk.core import LLM

    llm = LLM.load(str(smollm2_path))
    assert llm.quantization == "q4_1+q8_0" and llm.dtype == torch.float32
    _greedy_promises(llm, ["What is the capital of France?", "Write a haiku about the sea.",
                           "Rewrite this sentence more formally: gonna grab food, brb.",
                           "List three uses of a paperclip.", "Summarize: the cat sat on the mat all day."])


@pytest.mark.slow
def test_k_quant_model_keeps_greedy_promises(gemma_path):
    """The same on Gemma 3 270M Q4_K_M (Q4_K, Q5_0, Q6_K and Q8_0 blocks, all kept)."""
    from brisk.core import LLM

    llm = LLM.load(str(gemma_path))
    assert set(llm.quantization.split("+")) == {"q4_k", "q5_0", "q6_k", "q8_0"}
    _greedy_promises(llm, ["The capital of France is", "Once upon a time"], max_tokens=24)


def _greedy_promises(llm, prompts, max_tokens=40):
    from brisk.core import GREEDY, Session
    from brisk.core.batching import Engine, Request
    from brisk.core.spec.build import make_speculator

    plain = []
    for p in prompts:
        s = Session(llm)
        list(s.stream(llm.prompt_ids(p), GREEDY, max_tokens))
        plain.append(s.last.tokens)
    spec = make_speculator(llm, "ngram", 3)
    for p, want in zip(prompts, plain):
        s = Session(llm, spec)
        list(s.stream(llm.prompt_ids(p), GREEDY, max_tokens))
        assert s.last.tokens == want, p
    seqs = Engine(llm, max_batch=4).run([Request(llm.prompt_ids(p), GREEDY, max_tokens) for p in prompts])
    assert [q.result.tokens for q in seqs] == plain


@pytest.mark.slow
def test_kept_blocks_follow_the_widened_model(smollm2_path):
    """32 greedy steps on the file's blocks give the widened float32 model's tokens (both run the
    same float weights; only the summation order differs), or the first difference is a near-tie."""
    from brisk.core import GREEDY, LLM, Session

    kept, wide = LLM.load(str(smollm2_path)), LLM.load(str(smollm2_path), quantize="none", dtype="float32")
    ids = kept.prompt_ids("Explain in two sentences why the sky is blue.")
    s = Session(kept)
    list(s.stream(ids, GREEDY, 32))
    tokens = s.last.tokens
    logits = wide.logits(ids + tokens)[len(ids) - 1:]  # the widened model's view of each step
    for i, t in enumerate(tokens):
        top2 = logits[i].topk(2)
        if top2.indices[0] != t:
            assert top2.values[0] - logits[i][t] < 1e-3, f"step {i}: not a near-tie"
            break


def test_joined_weights_give_each_weights_bits(level):
    """q/k/v-style joined products (one call, no copy) equal each weight's own product, bit for bit,
    for any number of rows and whatever the split of rows across threads."""
    g = torch.Generator().manual_seed(5)
    parts = []
    for n in (45, 18, 18):  # row counts that do not fall on the kernels' 4-row tiles
        q, s, z = quantize_int4(torch.randn(n, 96, generator=g), 32)
        parts.append(native.NativeWeight(native.I4G, n, 96, pack_int4(q), s, z, 32))
    joined = native.JoinedWeights(parts)
    x = torch.randn(6, 96, generator=g)
    want = torch.cat([w.matmul(x) for w in parts], dim=1)
    for threads in (1, 3):
        native.set_threads(threads)
        try:
            assert torch.equal(joined.matmul(x), want)
            assert torch.equal(joined.matmul(x[2:3])[0], want[2])
        finally:
            native.set_threads(torch.get_num_threads())
    with pytest.raises(ValueError):  # different input sizes cannot share a call
        native.JoinedWeights([parts[0], native.NativeWeight(native.I8R, 4, 64, torch.zeros(4, 64, dtype=torch.int8),
                                                            row_scales=torch.ones(4))])


@pytest.mark.cross
def test_builds_for_arm_with_neon(tmp_path):
    """The kernels cross-compile for 64-bit ARM with the same commands brisk runs (one plain copy,
    NEON through the compiler), link, and the product's loop is NEON fused multiply-adds. Needs
    zig's C compiler (`make check-arm` installs the ziglang package); skipped without it."""
    import subprocess
    import sys

    pytest.importorskip("ziglang")
    zig = [sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-gnu"]
    cmds, objs = native._compile_commands(["cc"], tmp_path, x86=False)
    assert len(cmds) == len(native.PER_LEVEL) + 1  # tiles.c and decoder.c once (plain), brisk_kernels.c
    for cmd in cmds:
        subprocess.run(zig + cmd[1:], check=True, capture_output=True)
    lib = tmp_path / "libbrisk_kernels.so"
    subprocess.run(zig + ["-shared", "-o", str(lib), *map(str, objs), "-lm"], check=True, capture_output=True)
    assert lib.read_bytes()[18] == 183  # ELF e_machine: EM_AARCH64
    tiles = [c for c in cmds if str(native.KERNELS / "tiles.c") in c][0]
    asm = tmp_path / "tiles.s"
    subprocess.run(zig + [a for a in tiles[1:] if a != "-c"][:-2] + ["-S", "-o", str(asm)], check=True,
                   capture_output=True)
    text = asm.read_bytes().decode("utf-8", "replace")  # string constants in it need not be UTF-8
    assert ".4s" in text and "fmla" in text  # the float products
    assert "smlal" in text  # the 16-bit activations' integer products, widening NEON multiply-adds



@pytest.mark.parametrize("name", ["gptq_4bit_g64_asym", "awq_gemm_4bit_g128", "gptq_4bit_g32_desc_act"])
def test_gptq_awq_checkpoints_run_on_the_native_kernels(name):
    """GPTQModel's and AutoAWQ's 4-bit checkpoints run as int4 groups on the native kernels (all
    blocks in one call unless act-order permutes the columns), so their greedy promises hold too."""
    from quant_interop import FIXTURES

    from brisk.core import LLM
    from brisk.core.native_decoder import NativeDecoder
    from brisk.quant.zero_point_linear import ZeroPointLinear

    llm = LLM.load(str(FIXTURES / name), device="cpu", dtype="float32")
    layers = [m for m in llm.model.modules() if isinstance(m, ZeroPointLinear)]
    assert layers and all(m._native() is not None for m in layers)
    act_order = "desc_act" in name
    assert all(m.native != act_order for m in layers) and NativeDecoder.takes(llm.model) != act_order
    _greedy_promises(llm, ["Hello", "The quick brown fox", "1 2 3 4"], max_tokens=16)
