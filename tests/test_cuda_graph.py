"""The fixed-shape decode step behind CUDA graphs (core/cuda_graph.py): positions as a tensor, a
fixed number of cache slots attended over with a mask. On the CPU the same step runs eagerly and
must give the logits of the ordinary step; on CUDA the graph replays must give the eager tokens."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from brisk.core import LLM
from brisk.core import cuda_graph
from brisk.core.generate import Session
from brisk.core.kv import FixedKeys
from brisk.core.sampling import SamplingParams

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


def test_buckets_double_up_to_the_context():
    g = cuda_graph.GraphedDecoder.__new__(cuda_graph.GraphedDecoder)
    g.cache = SimpleNamespace(max_len=1000)
    assert [g.bucket(p) for p in (0, 255, 256, 511, 512, 999)] == [256, 256, 512, 512, 1000, 1000]


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
