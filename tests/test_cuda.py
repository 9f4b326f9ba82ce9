"""brisk on a CUDA GPU: each quantized format through its GPU kernel against the references the
CPU tests use, batched and speculative greedy equal to plain greedy. Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

from brisk.core import GREEDY, LLM, Session
from brisk.core.batching import Engine, Request
from brisk.core.spec.build import make_speculator
from brisk.quant.linear import Int4Linear, Int8Linear

from quant_interop import FIXTURES, check_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def greedy(llm, ids, n=24):
    s = Session(llm)
    list(s.stream(ids, GREEDY, n))
    return s.last.tokens


@pytest.mark.parametrize("name", ["gptq_4bit_g32_desc_act", "gptq_4bit_g64_asym", "gptq_8bit_g128",
                                  "awq_gemm_4bit_g128", "bnb_int8", "bnb_nf4", "bnb_nf4_dq", "bnb_fp4_dq"])
def test_quantized_checkpoints_on_cuda(name):
    """GPTQ/AWQ 4-bit run the Triton int4 kernel (act-order through the column permutation), int8
    the Triton int8 kernel, NF4/FP4 bitsandbytes: logits as the CPU tests require of the CPU path."""
    from safetensors.torch import load_file

    if name.startswith("bnb_") and "int8" not in name:
        pytest.importorskip("bitsandbytes")
    ref = load_file(str(FIXTURES / name / "reference.safetensors"))
    llm = LLM.load(str(FIXTURES / name), device="cuda", dtype="float32")
    q = llm.model.model.layers[0].self_attn.q_proj
    if getattr(q, "bits", 4) == 4 and name.startswith(("gptq", "awq")):
        assert q.use_kernel and q._q4.is_cuda
    logits = llm.logits(ref["input_ids"].tolist()).cpu()
    if "tool_logits" in ref:
        check_logits(logits, ref, exact=False)
    else:  # the bitsandbytes fixtures record the dequantized model's logits only
        assert rel(logits, ref["logits"]) < 2e-2
        assert logits.argmax(-1).tolist() == ref["logits"].argmax(-1).tolist()


@pytest.mark.parametrize("quantize", ["int8", "int4", "nf4"])
def test_quantize_at_load_on_cuda_matches_cpu(tiny_llama_dir, quantize):
    if quantize == "nf4":
        pytest.importorskip("bitsandbytes")
    ids = list(range(5, 40))
    cpu = LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32", quantize=quantize).logits(ids)
    gpu = LLM.load(str(tiny_llama_dir), device="cuda", dtype="float32", quantize=quantize).logits(ids).cpu()
    assert rel(gpu, cpu) < 2e-2


@pytest.mark.slow
def test_gguf_stays_quantized_on_cuda(smollm2_path):
    """SmolLM2's Q4_1 blocks run on tinygemm, its Q8_0 head on the Triton int8 kernel; logits as
    close to the CPU's default (quantized) load as bf16 allows, same greedy answer."""
    llm = LLM.load(str(smollm2_path), device="cuda")
    int4 = [m for m in llm.model.modules() if isinstance(m, Int4Linear)]
    assert int4 and all(m.layout == "tinygemm" and m._packed.is_cuda for m in int4)
    assert all(m.weight.is_cuda for m in llm.model.modules() if isinstance(m, Int8Linear))
    ref = LLM.load(str(smollm2_path), device="cpu", dtype="float32")
    ids = ref.prompt_ids("What is the capital of France?")
    a, b = llm.logits(ids).cpu(), ref.logits(ids)
    assert rel(a, b) < 6e-2 and float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.9
    assert greedy(llm, ids, 8) == greedy(ref, ids, 8)


@pytest.mark.parametrize("kind", ["tiny_llama_dir", "tiny_gemma3_dir"])
def test_batched_greedy_equals_single_stream_on_cuda(kind, request):
    llm = LLM.load(str(request.getfixturevalue(kind)), device="cuda", dtype="float32")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 300, (int(n),), generator=g).tolist() for n in (3, 17, 40, 9, 25, 1)]
    engine = Engine(llm, max_batch=4)
    seqs = [engine.add(Request(p, max_tokens=20, ignore_eos=True)) for p in prompts]
    while engine.has_work():
        engine.step()
    for p, s in zip(prompts, seqs):
        s2 = Session(llm)
        list(s2.stream(p, GREEDY, 20))
        assert s.result.tokens[:len(s2.last.tokens)] == s2.last.tokens


@pytest.mark.parametrize("draft", ["ngram", "self:int4", "self:int8"])
def test_speculative_greedy_equals_plain_on_cuda(tiny_llama_dir, draft):
    llm = LLM.load(str(tiny_llama_dir), device="cuda", dtype="float32")
    ids = [5, 6, 7, 5, 6, 7, 5, 6, 30, 31]
    plain = greedy(llm, ids, 40)
    s = Session(llm, speculator=make_speculator(llm, draft, 4))
    list(s.stream(ids, GREEDY, 40))
    assert s.last.tokens == plain


@pytest.mark.parametrize("kind", ["tiny_qwen2_dir", "tiny_llama_dir"])
def test_int8_embedding_folder_on_cuda(kind, request, tmp_path):
    """`brisk quantize --embedding int8` folders (tied: the Q8_0 output layer the embedding reads;
    untied: the embedding's own table) load on CUDA and compute the CPU's logits."""
    from typer.testing import CliRunner

    from brisk.cli.main import app

    out = tmp_path / "q"
    r = CliRunner().invoke(app, ["quantize", str(request.getfixturevalue(kind)), "-o", str(out), "--method", "int8",
                                 "--samples", "0", "--embedding", "int8"])
    assert r.exit_code == 0, r.output
    ids = list(range(5, 60))
    cpu = LLM.load(str(out), device="cpu", dtype="float32").logits(ids)
    gpu = LLM.load(str(out), device="cuda", dtype="float32")
    assert all(p.is_cuda for p in gpu.model.parameters())
    assert rel(gpu.logits(ids).cpu(), cpu) < 2e-2
    assert greedy(gpu, ids, 12) == greedy(LLM.load(str(out), device="cpu", dtype="float32"), ids, 12)


@pytest.mark.parametrize("layout", ["planes", "tinygemm"])
def test_int4_cuda_layouts(layout, monkeypatch):
    """Both CUDA int4 layouts against float64 for 1..300 rows, the codes intact through a CPU
    layer's move to CUDA and back, and fused layers' originals still computing their own columns
    (tinygemm ignores the strides of an original's scale slice: found here on an H100)."""
    from brisk.quant import linear
    from brisk.quant.linear import concat_linears

    monkeypatch.setattr(linear, "CUDA_INT4", layout)
    torch.manual_seed(0)
    parts = [Int4Linear.from_float(torch.nn.Linear(512, n, bias=False), 64) for n in (256, 64, 64)]
    codes = [m.codes().clone() for m in parts]
    parts = [m.to("cuda") for m in parts]
    assert all(m.layout == layout for m in parts)
    assert all(torch.equal(m.codes().cpu(), c) for m, c in zip(parts, codes))
    for M in (1, 5, 16, 33, 300):
        x = torch.randn(M, 512, device="cuda").to(torch.bfloat16)
        for m in parts:
            ref = x.double() @ m.dequantize(torch.float64).T
            assert rel(m(x), ref) < 1e-2
    fused = concat_linears(parts)
    assert fused is not None and fused.layout == layout
    x = torch.randn(7, 512, device="cuda").to(torch.bfloat16)
    for m, y in zip(parts, fused(x).split([256, 64, 64], dim=-1)):
        assert rel(m(x), y) < 1e-3  # the same columns (planes may split K differently for another N)
    assert torch.equal(parts[1].to("cpu").codes(), codes[1])


def test_int4_planes_rows_do_not_change_a_row():
    """Up to 16 rows share one tile: a row's output bits are the same alone or among others (what
    speculative greedy == plain greedy needs of an int4 target)."""
    from brisk.quant import triton_matmul as tm

    torch.manual_seed(1)
    N, K, G = 4096, 4096, 128
    q = torch.randint(0, 16, (N, K), device="cuda", dtype=torch.uint8)
    sz = torch.rand(K // G, N, 2, device="cuda").to(torch.bfloat16)
    words = tm.pack_int4_planes(q)
    x = torch.randn(16, K, device="cuda").to(torch.bfloat16)
    full = tm.int4_planes_matmul(x, words, sz, G)
    for M in (1, 2, 5, 9):
        assert torch.equal(tm.int4_planes_matmul(x[:M], words, sz, G), full[:M])


def test_int4_target_speculative_greedy_on_cuda_planes(tiny_llama_dir, monkeypatch):
    """An int4 target on the planes kernel: ngram speculation gives plain greedy's tokens."""
    from brisk.quant import linear

    monkeypatch.setattr(linear, "CUDA_INT4", "planes")
    llm = LLM.load(str(tiny_llama_dir), device="cuda", quantize="int4")
    assert any(m.layout == "planes" for m in llm.model.modules() if isinstance(m, Int4Linear))
    ids = [5, 6, 7, 5, 6, 7, 5, 6, 30, 31]
    plain = greedy(llm, ids, 40)
    s = Session(llm, speculator=make_speculator(llm, "ngram", 4))
    list(s.stream(ids, GREEDY, 40))
    assert s.last.tokens == plain


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory):
    """A small llama GGUF of random blocks as a Q4_K_M file mixes them: Q4_K matrices, a Q6_K head,
    Q5_K and Q8_0 in two places (bench/bench_files.py's writer)."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parent.parent / "bench")
    sys.path.insert(0, bench)
    try:
        from bench_files import write_random_llama
    finally:
        sys.path.remove(bench)
    path = tmp_path_factory.mktemp("kquant") / "k.gguf"
    write_random_llama(path, dict(dim=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=32000, ctx=256),
                       {"*": "Q4_K", "output.weight": "Q6_K", "blk.0.ffn_down.weight": "Q5_K",
                        "blk.1.attn_v.weight": "Q8_0"})
    return path


def test_k_quant_gguf_on_cuda(k_quant_gguf):
    """What most GGUF users download (Q4_K_M) on the GPU: Q4_K stays 4-bit (tinygemm), Q8_0 8-bit,
    Q5_K/Q6_K widened to bf16 (a warning names the Q5_K matrix); logits as close to the CPU's
    kept-quantized load (the native kernels) as bf16 allows."""
    with pytest.warns(UserWarning, match="Q5_K weights"):
        llm = LLM.load(str(k_quant_gguf), device="cuda")
    int4 = [m for m in llm.model.modules() if isinstance(m, Int4Linear)]
    assert len(int4) >= 10 and all(m._packed.is_cuda for m in int4)
    assert any(isinstance(m, Int8Linear) and m.weight.is_cuda for m in llm.model.modules())
    ref = LLM.load(str(k_quant_gguf), device="cpu", dtype="float32")
    ids = ref.prompt_ids("What is the capital of France?")
    a, b = llm.logits(ids).cpu(), ref.logits(ids)
    assert rel(a, b) < 6e-2


@pytest.mark.parametrize("kind,quantize", [("tiny_qwen3_moe_dir", "none"), ("tiny_gpt_oss_dir", "none"),
                                           ("tiny_qwen3_moe_dir", "int4")])
def test_moe_on_cuda_matches_cpu(kind, quantize, request):
    """Mixture-of-experts models on the GPU: the CPU load's logits (float32: to rounding; int4:
    as the dense int4 test allows), its greedy tokens, and batched greedy equal to single-stream
    (the engine keeps MoE steps eager: routing reads the chosen experts back to the host)."""
    path = str(request.getfixturevalue(kind))
    ids = list(range(5, 40))
    cpu = LLM.load(path, device="cpu", dtype="float32", quantize=quantize)
    gpu = LLM.load(path, device="cuda", dtype="float32", quantize=quantize)
    assert rel(gpu.logits(ids).cpu(), cpu.logits(ids)) < (2e-2 if quantize == "int4" else 1e-4)
    if quantize == "none":
        assert greedy(gpu, ids, 16) == greedy(cpu, ids, 16)
    engine = Engine(gpu, max_batch=4)
    assert engine.decode_graphs is None
    prompts = [ids[:n] for n in (3, 11, 30)]
    seqs = engine.run([Request(p, max_tokens=12, ignore_eos=True) for p in prompts])
    for p, s in zip(prompts, seqs):
        ref = greedy(gpu, p, 12)
        assert s.result.tokens[:len(ref)] == ref
