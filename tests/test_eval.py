"""brisk eval: sliding-window perplexity against transformers, KL / top-1 agreement, bad input."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from brisk.core.errors import BriskError
from brisk.core.evaluate import evaluate, windows

TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France.\n"
        "def add(a, b):\n    return a + b\nHello, world! How are you today? 1, 2, 3, 5, 8, 13.\n") * 2


def brisk(*args, timeout=300):
    return subprocess.run([sys.executable, "-c", "from brisk.cli.main import run; run()", *args],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "COLUMNS": "200"})


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from brisk.core.llm import LLM

    return LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32", quantize="none")


@pytest.mark.parametrize("n,ctx,stride", [(50, 16, 8), (50, 16, 5), (17, 16, 16), (40, 16, 16), (5, 16, 8), (2, 16, 1)])
def test_windows_score_each_token_once(n, ctx, stride):
    spans = windows(n, ctx, stride)
    scored = [t for _, end, first in spans for t in range(first, end)]
    assert len(scored) == len(set(scored))
    for begin, end, first in spans:
        assert end - begin <= ctx and first > begin
        if begin > 0 and stride < ctx:
            assert first - begin >= ctx - stride  # context every scored token gets past the first window
    if stride < ctx:
        assert scored == list(range(1, n))
    else:  # non-overlapping windows: a window's first token has nothing before it there
        assert set(range(1, n)) - set(scored) == set(range(stride, n, stride))


@pytest.mark.parametrize("ctx,stride", [(16, 8), (16, 16), (32, 7)])
def test_perplexity_matches_transformers(tiny, tiny_llama_dir, ctx, stride):
    tf = pytest.importorskip("transformers")
    ids = tiny.tokenizer.encode(TEXT)
    res = evaluate(tiny, ids, ctx, stride)
    # Hugging Face's perplexity guide, run on transformers' own model: labels before the window's
    # new tokens are -100; the model shifts labels internally, so label 0 never counts.
    hf = tf.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    nll_sum, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + ctx, len(ids))
        inp = torch.tensor([ids[begin:end]])
        labels = inp.clone()
        labels[:, :-(end - prev_end)] = -100
        with torch.no_grad():
            loss = hf(inp, labels=labels).loss
        n = int((labels[:, 1:] != -100).sum())
        nll_sum, count = nll_sum + loss.item() * n, count + n
        prev_end = end
        if end == len(ids):
            break
    assert res.tokens == count
    assert res.ppl == pytest.approx(math.exp(nll_sum / count), rel=1e-5)


def test_kl_of_a_model_against_itself_is_zero(tiny):
    res = evaluate(tiny, tiny.tokenizer.encode(TEXT), 16, 8, base=tiny)
    assert res.kl_mean == 0 and res.kl_max == 0 and res.top1_agreement == 1
    assert res.ppl == res.base_ppl and res.ppl_ratio == 1


def test_int8_against_float_is_close_but_not_equal(tiny, tiny_llama_dir):
    from brisk.core.llm import LLM

    q = LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32", quantize="int8")
    res = evaluate(q, tiny.tokenizer.encode(TEXT), 32, 16, base=tiny)
    assert 0 < res.kl_mean < 1e-2 and res.kl_max < 0.1
    assert res.top1_agreement > 0.9
    assert res.ppl_ratio == pytest.approx(1, abs=0.02)
    assert res.base_ppl == pytest.approx(evaluate(tiny, tiny.tokenizer.encode(TEXT), 32, 16).ppl, rel=1e-9)


def test_bad_arguments(tiny):
    with pytest.raises(BriskError, match="at least 2"):
        evaluate(tiny, [5], 16, 8)
    with pytest.raises(BriskError, match="stride"):
        evaluate(tiny, [5, 6, 7], 16, 17)
    with pytest.raises(BriskError, match="exceeds the context"):
        evaluate(tiny, [5, 6, 7], tiny.ctx + 1, 8)


def test_cli_json_and_table(tiny, tiny_llama_dir, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    r = brisk("eval", str(tiny_llama_dir), "--text", str(f), "--ctx", "32", "--stride", "16", "--quantize", "none",
              "--base", str(tiny_llama_dir), "--json", "--dtype", "float32")  # as the fixture (CPUs with bf16 default to it)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ppl"] == pytest.approx(evaluate(tiny, tiny.tokenizer.encode(TEXT), 32, 16).ppl, rel=1e-6)
    assert out["kl_mean"] == 0 and out["top1_agreement"] == 1 and out["tokens"] == len(tiny.tokenizer.encode(TEXT)) - 1
    r = brisk("eval", str(tiny_llama_dir), "--text", str(f), "--ctx", "32", "--dtype", "float32")
    assert r.returncode == 0 and "perplexity" in r.stdout and f"{out['ppl']:.4f}" in r.stdout


def _assert_clean_error(r, *words):
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w.lower() in r.stderr.lower(), r.stderr


def test_cli_bad_input(tiny_llama_dir, tiny_gguf_path, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    _assert_clean_error(brisk("eval", str(tiny_llama_dir), "--text", str(empty)), "empty")
    _assert_clean_error(brisk("eval", str(tiny_llama_dir), "--text", str(tmp_path / "nope.txt")), "no such file")
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    _assert_clean_error(brisk("eval", str(tiny_llama_dir), "--text", str(f), "--ctx", "16", "--stride", "17"), "stride")
    _assert_clean_error(brisk("eval", str(tiny_llama_dir), "--text", str(f), "--base", str(tiny_gguf_path)),
                        "do not share a tokenizer")


def test_cli_window_longer_than_the_model(tiny_llama_dir, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT * 8)
    r = brisk("eval", str(tiny_llama_dir), "--text", str(f), "--json")  # default 512 > the model's 256
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ctx"] == 256
    _assert_clean_error(brisk("eval", str(tiny_llama_dir), "--text", str(f), "--ctx", "300"), "exceeds the context")
