"""lm-evaluation-harness's `local-completions` model against `brisk serve` (a client nobody here
wrote): on a handful of items of the project's multiple-choice task (bench/lm_eval/), every
choice's log-likelihood lm-eval reports equals the one computed directly from the model (the
continuation's tokens scored after the context), and so do acc and acc_norm. The comparison with
llama.cpp's llama-server on the whole task is a benchmark: bench/lm_eval_compare.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
TASK = Path(__file__).resolve().parent.parent / "bench" / "lm_eval"
ITEMS = 6


@pytest.mark.slow
def test_lm_eval_scores_equal_the_models_own(smollm2, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from test_serve import Server

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tok_dir = tmp_path / "tokenizer"
    smollm2.tokenizer.save(tok_dir)  # lm-eval tokenizes with the model's own tokenizer, offline
    include = tmp_path / "tasks"
    include.mkdir()
    yaml = (TASK / "brisk_mc.yaml").read_text().replace("bench/lm_eval/brisk_mc.jsonl", str(TASK / "brisk_mc.jsonl"))
    (include / "brisk_mc.yaml").write_text(yaml)
    s = Server(smollm2, name="smollm2", api_key=None)
    try:
        out = simple_evaluate(
            model="local-completions", tasks=["brisk_mc"], limit=ITEMS, log_samples=True,
            task_manager=TaskManager(include_path=str(include)),
            model_args=f"base_url=http://127.0.0.1:{s.port}/v1/completions,model=smollm2,tokenizer_backend=huggingface,"
                       f"tokenizer={tok_dir},tokenized_requests=True,max_retries=1,num_concurrent=1")
    finally:
        s.close()
    samples = out["samples"]["brisk_mc"]
    assert len(samples) == ITEMS
    tok = smollm2.tokenizer
    right = 0
    for sample in samples:
        doc = sample["doc"]
        context = f"Question: {doc['question']}\nAnswer:"
        scores = []
        for choice, (got, _) in zip(doc["choices"], (r[0] for r in sample["resps"])):
            whole = tok.encode(context + " " + choice, add_special=False)
            ctx = len(tok.encode(context, add_special=False))
            with torch.inference_mode():
                lp = torch.log_softmax(smollm2.model(torch.tensor([whole]), 0, smollm2.new_cache())[0].float(), -1)
            want = sum(float(lp[i - 1, whole[i]]) for i in range(ctx, len(whole)))
            assert got == pytest.approx(want, abs=2e-3), (doc["question"], choice)
            scores.append(want)
        right += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    assert out["results"]["brisk_mc"]["acc,none"] == pytest.approx(right / ITEMS)
