"""The engine's logits against HF transformers, on tiny random checkpoints and real models."""
from __future__ import annotations

import pytest
import torch

from brisk.core import LLM
from brisk.core.model import LAST


def _hf_model(path):
    import transformers as tf

    if path.is_file():  # transformers dequantizes GGUF weights itself: an independent reader
        return tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                       dtype=torch.float32).eval()
    return tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _hf_greedy(hf, ids: list[int], steps: int) -> list[int]:
    """HF's own cached greedy loop, EOS included (generate() would stop or mask it)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(steps):
            r = hf(x, past_key_values=past, use_cache=True)
            past = r.past_key_values
            out.append(int(r.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def _brisk_greedy(llm, ids: list[int], steps: int) -> list[int]:
    cache = llm.new_cache()
    logits = llm.model(torch.tensor([ids]), 0, cache, logit_rows=LAST)
    out = []
    for i in range(steps):
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        logits = llm.model(torch.tensor([[tok]]), len(ids) + i, cache)
    return out


def check_parity(path, ids, atol, steps=32, ctx=None):
    # quantize="none": transformers widens GGUF weights to float, so brisk must too for exact parity
    llm = LLM.load(str(path), device="cpu", dtype="float32", quantize="none", ctx=ctx)
    hf = _hf_model(path)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = llm.logits(ids)
    diff = (ref - ours).abs().max().item()
    assert diff < atol, f"max |logit diff| {diff}"
    assert _brisk_greedy(llm, ids, steps) == _hf_greedy(hf, ids, steps)
    return llm


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_mistral_dir", "tiny_gemma3_dir"])
def test_tiny_hf_checkpoints_match_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    ids = list(range(3, 43))  # longer than the 8/16-token test windows: exercises sliding layers
    check_parity(path, ids, atol=1e-4)


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2_path):
    llm = LLM.load(str(smollm2_path), device="cpu", dtype="float32")
    ids = llm.prompt_ids("Write a haiku about the sea.")
    check_parity(smollm2_path, ids, atol=2e-3)


@pytest.mark.slow
def test_gemma3_gguf_matches_transformers(gemma_path):
    llm = LLM.load(str(gemma_path), device="cpu", dtype="float32")
    ids = llm.tokenizer.encode("The history of the printing press begins")
    check_parity(gemma_path, ids, atol=5e-3)


def test_kv_cache_decoding_equals_full_recomputation(tiny_gemma3_dir, tiny_llama_dir):
    for path in (tiny_llama_dir, tiny_gemma3_dir):
        llm = LLM.load(str(path), device="cpu", dtype="float32")
        ids = list(range(5, 45))
        full = llm.logits(ids)
        cache = llm.new_cache()
        with torch.inference_mode():
            parts = [llm.model(torch.tensor([ids[:17]]), 0, cache)[0]]
            for i in range(17, len(ids)):
                parts.append(llm.model(torch.tensor([[ids[i]]]), i, cache)[0])
        assert torch.allclose(torch.cat(parts), full, atol=1e-5)


def test_cache_rewrite_from_a_position(tiny_llama_dir):
    """Writing from position 10 on replaces what the cache held there (a rewritten chat turn)."""
    llm = LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32")
    a, b = list(range(10, 30)), list(range(10, 20)) + list(range(50, 60))
    cache = llm.new_cache()
    with torch.inference_mode():
        llm.model(torch.tensor([a]), 0, cache)
        tail = llm.model(torch.tensor([b[10:]]), 10, cache)[0]
    assert torch.allclose(tail, llm.logits(b)[10:], atol=1e-5)


def test_bfloat16_runs_and_agrees_roughly(tiny_llama_dir):
    f32 = LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32")
    bf16 = LLM.load(str(tiny_llama_dir), device="cpu", dtype="bfloat16")
    ids = list(range(3, 23))
    a, b = f32.logits(ids), bf16.logits(ids)
    assert b.dtype == torch.float32 and (a - b).abs().max() < 0.1 * a.abs().max()
