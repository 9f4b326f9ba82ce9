"""The native blocks (core/native_decoder.py, quant/kernels/decoder.c) against the torch blocks of the
same model: logits of a pass, every architecture flag (q/k/v bias, sliding window, Gemma's norms,
GELU, q/k norms, partial rotary, experts, gpt-oss's sinks, biases, clamped SwiGLU and top-k
softmax), decode steps against one pass, a paged batch against single sequences (on each KV cache
type too)."""
import pytest
import torch

from brisk.core import LLM
from brisk.core.kernel_passes import NativeBlocksTransformer
from brisk.core.model import Transformer

pytestmark = pytest.mark.skipif(not __import__("brisk.quant.native", fromlist=["x"]).available(),
                                reason="no native kernels")


def _torch_blocks(model):
    """The same model with the torch blocks (the class the native pass replaced)."""
    model.__class__ = Transformer
    return model


def _native_logits(llm, ids):
    assert type(llm.model) is NativeBlocksTransformer
    return llm.logits(ids)


@pytest.fixture(params=["llama", "qwen2", "mistral", "gemma3", "qwen3_moe", "phi3", "gpt_oss"])
def tiny_int8(request):
    """A tiny random model of each kind with int8 rows (products on the native kernels); the MoE
    one with a dense layer between its MoE layers and unnormalized top-k weights, Phi-3 with
    partial rotary and longrope, gpt-oss with YaRN, sinks, biases everywhere and gate weights large
    enough for SwiGLU's clamps to bite."""
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.mark.parametrize("level_", [0, 1, 2], ids=["plain", "avx2", "avx512"])
def test_native_blocks_match_torch_blocks(tiny_int8, level_, monkeypatch):
    """Float32 activations for the products here (set_int_dot(False)): 16-bit ones round at grid
    points, so float32 summation-order differences between the two paths could move a code."""
    from brisk.quant import native

    if level_ > native.library().bk_cpu_level():
        pytest.skip("this CPU lacks that instruction set")
    monkeypatch.setenv("BRISK_NATIVE_LEVEL", str(level_))
    native.level.cache_clear()
    native.set_int_dot(False)
    try:
        llm = LLM.load(str(tiny_int8), device="cpu", dtype="float32", quantize="int8")
        ids = [(7 * i + 3) % 290 + 2 for i in range(40)]  # past every sliding window (8, 16)
        got = _native_logits(llm, ids)
        want = LLM.logits(_with(llm, _torch_blocks(llm.model)), ids)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    finally:
        native.level.cache_clear()
        native.set_int_dot(True)


def _with(llm, model):
    llm.model = model
    return llm


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_float_model_runs_native_for_short_passes(arch, request):
    """A float32 model (-q none): its weights read in place by the native kernels, blocks in one
    native call for passes up to native.F32_MAX_ROWS rows (decode steps, verification, batched
    steps: their bits the same in every such pass); longer passes (prefill) run the torch blocks
    on torch's sgemm, with the same results up to float32 round-off."""
    from brisk.core.kernel_passes import NativeLinear
    from brisk.quant import native

    llm = LLM.load(str(request.getfixturevalue(f"tiny_{arch}_dir")), device="cpu", dtype="float32", quantize="none")
    assert type(llm.model) is NativeBlocksTransformer and type(llm.model.lm_head) is NativeLinear
    assert llm.model.lm_head.native
    ids = [(7 * i + 3) % 290 + 2 for i in range(native.F32_MAX_ROWS + 6)]
    with torch.inference_mode():
        kv = llm.new_cache(128)
        steps = [llm.model(torch.tensor([[t]]), i, kv)[0, -1] for i, t in enumerate(ids[:20])]
        kv2 = llm.new_cache(128)
        chunks = torch.cat([llm.model(torch.tensor([ids[s:s + 5]]), s, kv2)[0] for s in range(0, 20, 5)])
    assert llm.model.__dict__["_native_decoder"][1] is not None  # the passes above ran natively
    assert torch.equal(torch.stack(steps), chunks)
    long_pass = llm.logits(ids)  # more rows than the native pass takes: the torch blocks
    torch.testing.assert_close(long_pass[:20], chunks, rtol=1e-4, atol=1e-4 * chunks.abs().max().item())
    want = LLM.logits(_with(llm, _torch_blocks(llm.model)), ids[:20])
    torch.testing.assert_close(chunks, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_gpt_oss_runs_native_and_each_part_counts(tiny_gpt_oss_dir):
    """gpt-oss's blocks run natively, and the parity test above would catch any of its parts
    ignored: dropping one from the native description moves the logits far past its tolerance.
    The top-k softmax equals a softmax over all logits renormalized over the top k (gpt-oss's
    norm_topk_prob), so it is checked with that flag off, which its routing ignores."""
    from brisk.core.native_decoder import NativeDecoder
    from brisk.quant import native

    llm = LLM.load(str(tiny_gpt_oss_dir), device="cpu", dtype="float32", quantize="int8")
    assert type(llm.model) is NativeBlocksTransformer and NativeDecoder.takes(llm.model)
    llm.model.cfg.norm_topk_prob = False  # read by the native description only: made on the first pass
    ids = [(7 * i + 3) % 290 + 2 for i in range(40)]
    native.set_int_dot(False)
    try:
        got = llm.logits(ids)
        made = llm.model.__dict__["_native_decoder"][1]
        assert made is not None and not made.arch.norm_topk
        want = LLM.logits(_with(llm, _torch_blocks(llm.model)), ids)
        llm.model.__class__ = NativeBlocksTransformer
        tol = 1e-4 * want.abs().max().item()
        assert (got - want).abs().max() < tol

        def off(structs, field, value):  # the logits' error with one part dropped, then restored
            old = [getattr(s, field) for s in structs]
            for s in structs:
                setattr(s, field, value)
            try:
                return (llm.logits(ids) - want).abs().max()
            finally:
                for s, v in zip(structs, old):
                    setattr(s, field, v)

        for field in ("sinks", "o_bias", "router_bias", "expert_bias"):
            assert all(getattr(L, field) for L in made.layers)
            assert off(made.layers, field, None) > 100 * tol, field
        for field, value in (("act", native.Arch.ACTS["silu"]), ("swiglu_limit", 1e30), ("topk_softmax", 0)):
            assert off([made.arch], field, value) > 100 * tol, field
    finally:
        native.set_int_dot(True)


# each narrower KV cache type too (core/kv/kv_type.py), on a model with sliding windows and sinks
KV_TYPES = [("tiny_gpt_oss_hd32_dir", t) for t in ("f16", "bf16", "q8_0")]


@pytest.mark.parametrize("model,kv_type", [(m, "auto") for m in ("tiny_gemma3_dir", "tiny_qwen3_moe_dir",
                                                                 "tiny_gpt_oss_dir")] + KV_TYPES)
def test_decode_steps_equal_one_pass_bit_for_bit(model, kv_type, request):
    """A token's logits do not depend on the pass it is in (one-token steps, chunks, one prefill):
    an MoE layer's experts run on the rows routed to them, each row's result its own."""
    llm = LLM.load(str(request.getfixturevalue(model)), device="cpu", dtype="float32", quantize="int8",
                   kv_type=kv_type)
    assert type(llm.model) is NativeBlocksTransformer
    ids = [(5 * i + 1) % 290 + 2 for i in range(30)]
    one = llm.logits(ids)
    with torch.inference_mode():
        kv = llm.new_cache(64)
        steps = [llm.model(torch.tensor([[t]]), i, kv)[0, -1] for i, t in enumerate(ids)]
        kv2 = llm.new_cache(64)
        chunks = torch.cat([llm.model(torch.tensor([ids[s:s + 7]]), s, kv2)[0] for s in range(0, 30, 7)])
    assert torch.equal(torch.stack(steps), one)
    assert torch.equal(chunks, one)


@pytest.mark.parametrize("model,kv_type", [("tiny_mistral_dir", "auto"), ("tiny_gpt_oss_dir", "auto")] + KV_TYPES)
def test_a_paged_batch_gives_each_sequence_its_own_bits(model, kv_type, request):
    """The batching engine's paged steps (decode rows beside prefill chunks) against each prompt
    alone on a contiguous cache: the same logits, bit for bit, so the same greedy tokens."""
    from brisk.core import GREEDY, Session
    from brisk.core.batching import Engine, Request

    llm = LLM.load(str(request.getfixturevalue(model)), device="cpu", dtype="float32", quantize="int8",
                   kv_type=kv_type)
    assert type(llm.model) is NativeBlocksTransformer
    prompts = [[(3 * i + j) % 290 + 2 for i in range(n)] for j, n in enumerate((5, 23, 11, 40))]
    alone = []
    for p in prompts:
        s = Session(llm)
        list(s.stream(p, GREEDY, 12))
        alone.append(s.last.tokens)
    engine = Engine(llm, max_batch=3)
    assert engine.kv.type is llm.kv_type
    seqs = engine.run([Request(p, GREEDY, 12) for p in prompts])
    assert [q.result.tokens for q in seqs] == alone


def test_passes_it_does_not_take_run_the_torch_blocks(tiny_llama_dir):
    """A tree of candidates (tree attention mask) is not a native pass: the torch blocks run it,
    with the same results as a plain pass on the tree's one chain."""
    llm = LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32", quantize="int8")
    ids = [5, 9, 13, 17, 21]
    chain = torch.ones(3, 3, dtype=torch.bool).tril()  # a tree that is one chain: plain causal
    with torch.inference_mode():
        kv = llm.new_cache(16)
        llm.model(torch.tensor([ids[:2]]), 0, kv)
        tree_logits = llm.model(torch.tensor([ids[2:]]), 2, kv, tree=chain)[0]
    torch.testing.assert_close(tree_logits, llm.logits(ids)[2:], rtol=1e-4, atol=1e-4)


def _long_context(folder, tmp_path):
    """The tiny model with room for positions past several attention spans (decoder.c ATT_SPAN)."""
    import json
    import shutil

    dst = tmp_path / folder.name
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_gemma3_dir", "tiny_gpt_oss_dir"])
def test_keys_past_one_span_combine_to_the_torch_result(model, request, tmp_path):
    """Rows whose keys cross spans of 512 positions are attended span by span and combined (with
    gpt-oss's sinks, and sliding windows that start inside a span): the torch blocks' logits, and
    decode steps past two span boundaries equal to the one pass over all the tokens, bit for bit."""
    from brisk.quant import native

    path = _long_context(request.getfixturevalue(model), tmp_path)
    ids = [(11 * i + 5) % 290 + 2 for i in range(1100)]
    native.set_int_dot(False)
    try:
        llm = LLM.load(str(path), device="cpu", dtype="float32", quantize="int8", ctx=1200)
        one = _native_logits(llm, ids)
        with torch.inference_mode():
            kv = llm.new_cache(1200)
            llm.model(torch.tensor([ids[:1090]]), 0, kv)
            steps = [llm.model(torch.tensor([[t]]), 1090 + i, kv)[0, -1] for i, t in enumerate(ids[1090:])]
        assert torch.equal(torch.stack(steps), one[1090:])
        want = LLM.logits(_with(llm, _torch_blocks(llm.model)), ids)
        torch.testing.assert_close(one, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    finally:
        native.set_int_dot(True)
