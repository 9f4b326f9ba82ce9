"""The fixed-shape decode step behind CUDA graphs (core/cuda_graph.py): positions as a tensor, a
fixed number of cache slots attended over with a mask. On the CPU the same step runs eagerly and
must give the logits of the ordinary step; on CUDA the graph replays must give the eager tokens."""
from __future__ import annotations

import pytest
import torch

from brisk.core import LLM
from brisk.core import cuda_graph
from brisk.core.generate import Session
from brisk.core.kv import FixedKeys
from brisk.core.sampling import SamplingParams

from test_distill import heads_dir  # noqa: F401 (fixture: heads trained on the tiny model in seconds)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kind", ["tiny_llama_dir", "tiny_gemma3_dir", "tiny_mistral_dir"])
@torch.inference_mode()
def test_fixed_shape_step_matches_the_ordinary_step(kind, request):
    """20 decode steps past the sliding window (8 or 16 for the tiny Gemma 3 / Mistral), over a
    key range larger than the sequence and a cache that holds garbage past it."""
    llm = LLM.load(str(request.getfixturevalue(kind)), device="cpu", dtype="float32", ctx=64)
    model = llm.model
    ref, fixed = llm.new_cache(64), llm.new_cache(64)
    for t in fixed.k + fixed.v:
        t.normal_()  # unused slots are masked, never read into the result
    prompt = torch.randint(3, llm.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    model(prompt, 0, ref)
    model(prompt, 0, fixed)
    tok = 7
    for pos in range(5, 25):
        a = model(torch.tensor([[tok]]), pos, ref)[0, -1]
        b = model(torch.tensor([[tok]]), torch.tensor([pos]), FixedKeys(fixed, 32))[0, -1]
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        tok = int(a.argmax())


def test_moe_models_run_without_graphs(tiny_llama_dir, tiny_qwen3_moe_dir, monkeypatch):
    """Routing reads the chosen experts back to the host, which no capture can hold: a model
    with MoE layers decodes eagerly on CUDA (found on an H100: the capture refused the copy)."""
    monkeypatch.setenv("BRISK_CUDA_GRAPHS", "1")
    dense = LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32").model
    moe = LLM.load(str(tiny_qwen3_moe_dir), device="cpu", dtype="float32").model
    assert cuda_graph.graphs_enabled("cuda", dense) and not cuda_graph.graphs_enabled("cuda", moe)
    assert not cuda_graph.graphs_enabled("cpu", dense)


def test_buckets_double_up_to_the_context():
    # a step at position p sees p + 1 slots
    assert [cuda_graph.key_bucket(p + 1, 1000) for p in (0, 255, 256, 511, 512, 999)] == [256, 256, 512, 512, 1000, 1000]


def _greedy(llm, graphs: bool, monkeypatch, prompt="one two three", n=48):
    monkeypatch.setenv("BRISK_CUDA_GRAPHS", "1" if graphs else "0")
    s = Session(llm)
    text = "".join(s.stream(llm.prompt_ids(prompt, raw=True), SamplingParams(temperature=0), n))
    return s.last.tokens, text


@cuda
@pytest.mark.parametrize("kind", ["tiny_llama_dir", "tiny_gemma3_dir"])
def test_graph_replays_give_the_eager_tokens(kind, request, monkeypatch):
    """Greedy tokens through graph replays equal the eager loop's, across bucket changes."""
    monkeypatch.setattr(cuda_graph, "FIRST_BUCKET", 16)
    llm = LLM.load(str(request.getfixturevalue(kind)), device="cuda", dtype="float32", ctx=128)
    assert _greedy(llm, True, monkeypatch) == _greedy(llm, False, monkeypatch)


@cuda
def test_graph_replays_on_a_quantized_model(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(cuda_graph, "FIRST_BUCKET", 16)
    llm = LLM.load(str(tiny_llama_dir), device="cuda", dtype="float32", ctx=128, quantize="int4")
    assert _greedy(llm, True, monkeypatch) == _greedy(llm, False, monkeypatch)


# ---------------------------------------------------------------- verifying passes (speculation)

# (start, tokens, parents): a chain, trees of several shapes (padded to 8 and 16), one token, and
# one too close to the end of a 64-slot cache to pad (the eager pass instead)
PASSES = [(21, [5, 9, 11, 4, 3, 8, 2], None), (21, [5, 9, 11, 4, 3, 8], [-1, 0, 0, 1, -1]),
          (30, [7] + list(range(40, 50)), [-1, 0, 1, 2, -1, 4, 4, 6, 0, -1]), (25, [6], None),
          (58, [1, 2, 3, 4, 5], [-1, 0, -1, 2])]


@pytest.mark.parametrize("kind", ["tiny_llama_dir", "tiny_gemma3_dir", "tiny_mistral_dir"])
@torch.inference_mode()
def test_fixed_verifying_pass_matches_the_eager_pass(kind, request):
    """The graphs' verifying pass, run eagerly on the CPU: the eager tree/chain pass's logits and
    hidden rows, and the same K/V in the pass's slots, with garbage in the cache past them."""
    llm = LLM.load(str(request.getfixturevalue(kind)), device="cpu", dtype="float32", ctx=64)
    model = llm.model
    prompt = torch.randint(3, llm.config.vocab_size, (1, 58), generator=torch.Generator().manual_seed(1))
    for start, tokens, parents in PASSES:
        ref, fixed = llm.new_cache(64), llm.new_cache(64)
        for t in fixed.k + fixed.v:
            t.normal_()
        model(prompt[:, :start], 0, ref)
        model(prompt[:, :start], 0, fixed)
        eager = cuda_graph.verify_pass(model, ref, fixed=False)
        graphed = cuda_graph.verify_pass(model, fixed, fixed=True)
        assert isinstance(graphed, cuda_graph.FixedVerifier)
        for hidden in (False, True):
            (a, ha), (b, hb) = eager(tokens, start, parents, hidden), graphed(tokens, start, parents, hidden)
            assert b.shape == a.shape == (len(tokens), llm.config.vocab_size)
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            if hidden:
                torch.testing.assert_close(hb, ha, rtol=1e-5, atol=1e-5)
            else:
                assert ha is None and hb is None
        end = start + len(tokens)
        for x, y in zip(ref.k + ref.v, fixed.k + fixed.v):
            torch.testing.assert_close(y[:, :, :end], x[:, :, :end], rtol=1e-5, atol=1e-5)


def _speculators(llm, heads_dir, answer):
    from test_lookahead import RandomTrees

    from brisk.core.spec.build import make_speculator
    from brisk.core.spec.speculator import Speculator

    out = {"ngram": make_speculator(llm, "ngram", 4), "lookahead": make_speculator(llm, "lookahead", lookahead="3,3,2"),
           "lookahead auto": make_speculator(llm, "lookahead"), "random trees": Speculator(RandomTrees(answer, 0), "fixed")}
    if heads_dir is not None:  # heads are trained for one model (the tiny llama)
        out["heads"] = make_speculator(llm, f"heads:{heads_dir}", 8)
    return out


def _same_as_plain(llm, heads_dir, prompt_ids, n=40):
    plain = Session(llm)
    plain_text = "".join(plain.stream(prompt_ids, SamplingParams(temperature=0), n))
    sessions = {}
    for name, sp in _speculators(llm, heads_dir, prompt_ids + plain.last.tokens).items():
        s = Session(llm, speculator=sp)
        text = "".join(s.stream(prompt_ids, SamplingParams(temperature=0), n))
        assert s.last.tokens == plain.last.tokens and text == plain_text, name
        assert s.last.spec["passes"] < n - 1 or name == "lookahead auto", name
        sessions[name] = s
    return sessions


def test_fixed_verifier_gives_plain_greedy(tiny, heads_dir, monkeypatch):
    """Speculative sessions verifying through the fixed shapes (eagerly, on the CPU): plain greedy."""
    from brisk.core import generate

    monkeypatch.setattr(generate, "verify_pass", lambda model, cache: cuda_graph.verify_pass(model, cache, fixed=True))
    sessions = _same_as_plain(tiny, heads_dir, tiny.prompt_ids("def add(a, b):\n    return a + b\n\n", raw=True))
    assert all(isinstance(s._verify, cuda_graph.FixedVerifier) for s in sessions.values())


@cuda
@pytest.mark.parametrize("kind", ["tiny_llama_dir", "tiny_gemma3_dir"])
def test_graphed_verifying_passes_give_plain_greedy_on_cuda(kind, request, heads_dir, monkeypatch):
    """On CUDA every verifying pass is a graph replay: plain greedy's tokens for chains, trees and
    the heads' hidden rows, across key buckets (heads: trained on the tiny llama only)."""
    monkeypatch.setattr(cuda_graph, "FIRST_BUCKET", 16)
    llm = LLM.load(str(request.getfixturevalue(kind)), device="cuda", dtype="float32", ctx=128)
    prompt = llm.prompt_ids("def add(a, b):\n    return a + b\n\n", raw=True)
    sessions = _same_as_plain(llm, heads_dir if kind == "tiny_llama_dir" else None, prompt, n=60)
    graphs = [s._verify for s in sessions.values()]
    assert all(isinstance(g, cuda_graph.FixedVerifier) and g.graphs for g in graphs)


def _engine_tokens(llm, fixed: bool, prompts, max_tokens):
    from brisk.core.batching import Engine, Request

    engine = Engine(llm, max_batch=8, block_size=4, fixed_decode=fixed)
    seqs = engine.run([Request(p, SamplingParams(temperature=0), n, ignore_eos=True) for p, n in zip(prompts, max_tokens)])
    return [s.result.tokens for s in seqs], engine


def _engine_case(llm):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, llm.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 9, 14, 5, 20)]
    return prompts, [30, 12, 25, 40, 18]  # sequences leave at different steps: the batch bucket shrinks


@pytest.mark.parametrize("kind", ["tiny_llama_dir", "tiny_gemma3_dir"])
def test_fixed_shape_engine_steps_give_the_engines_tokens(kind, request, monkeypatch):
    """The batching engine's decode steps at fixed shapes (5 rows padded to 8, then fewer; block
    tables padded to key buckets of 16, 32, 64; Gemma 3's sliding window) give the tokens of its
    ordinary steps."""
    monkeypatch.setattr(cuda_graph, "FIRST_BUCKET", 16)
    llm = LLM.load(str(request.getfixturevalue(kind)), device="cpu", dtype="float32", ctx=128)
    prompts, n = _engine_case(llm)
    ref, _ = _engine_tokens(llm, False, prompts, n)
    got, engine = _engine_tokens(llm, True, prompts, n)
    assert got == ref
    shapes = set(engine.decode_graphs.inputs)
    # (batch, blocks of 4 keys): 5 rows padded to 8 over 32 keys, fewer rows, then 64 keys
    assert {(8, 8), (4, 8), (4, 16), (1, 16)} <= shapes, shapes


@cuda
@pytest.mark.parametrize("kind", ["tiny_llama_dir", "tiny_gemma3_dir"])
def test_engine_graph_replays_give_the_eager_tokens(kind, request, monkeypatch):
    monkeypatch.setattr(cuda_graph, "FIRST_BUCKET", 16)
    llm = LLM.load(str(request.getfixturevalue(kind)), device="cuda", dtype="float32", ctx=128)
    prompts, n = _engine_case(llm)
    ref, _ = _engine_tokens(llm, False, prompts, n)
    got, engine = _engine_tokens(llm, None, prompts, n)
    assert engine.decode_graphs is not None and len(engine.decode_graphs.graphs) >= 4
    assert got == ref
