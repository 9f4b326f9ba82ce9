"""`brisk quantize --format gguf --method gptq` on MoE models (Qwen3-MoE, Mixtral, gpt-oss from Hugging Face
folders): each expert compensated on the calibration tokens its router sends it, its blocks written
into llama.cpp's stacked expert tensors. Each expert's output error on its tokens is below llama.cpp's
round-to-nearest's (gpt-oss's expert biases kept as rtn keeps them), the file's KL to the float model
on held-out text is below the rtn file's, an expert with too few tokens gets rtn's own blocks, and
llama.cpp runs the file as brisk does."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from brisk.quant import gguf_types, native
from brisk.quant.gptq import GPTQ

from conftest import write_hf_checkpoint
from test_quantize_gguf_gptq import _kl, _quantize

pytestmark = [pytest.mark.skipif(not native.available(), reason="no native kernels here (GGUF quantization needs them)"),
              pytest.mark.usefixtures("one_thread")]
N_EXPERTS = {"qwen3_moe": 8, "mixtral": 4, "gpt_oss": 4}


def _moe_folder(folder: Path, kind: str) -> Path:
    """A tiny random MoE whose rows are 256 wide (Q4_K_M's K-quant blocks, no fallback types), with the
    tiny tokenizer of write_hf_checkpoint."""
    import transformers as tf

    write_hf_checkpoint(folder, "llama", seed=6, tokens=296)  # the tokenizer files; the model is replaced
    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    torch.manual_seed(6)
    common = dict(vocab_size=300, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, intermediate_size=512, head_dim=64, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=256, norm_topk_prob=True)
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif kind == "gpt_oss":  # biases on every expert, its clamped SwiGLU
        cfg = tf.GptOssConfig(**common, intermediate_size=256, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=8)
        model = tf.GptOssForCausalLM(cfg)
    else:
        cfg = tf.MixtralConfig(**common, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2)
        model = tf.MixtralForCausalLM(cfg)
    with torch.no_grad():  # random norms, so that channels differ in scale as a trained model's do
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.5 * torch.randn_like(p).abs())
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_per_expert_gptq(kind, tmp_path):
    """Every expert of every layer's gate/up/down compensated (its error on its routed tokens below
    rtn's), the stacked tensors of rtn's types and shapes, the rest of the file rtn's bytes, and the
    whole file closer to the float model (KL on held-out text) than llama.cpp's rounding."""
    from brisk.core.gguf_file import open_gguf

    hf = _moe_folder(tmp_path / "hf", kind)
    f32, rtn_out, gptq_out = tmp_path / "f32.gguf", tmp_path / "rtn.gguf", tmp_path / "gptq.gguf"
    _quantize(hf, f32, "F32", "rtn")
    _quantize(hf, rtn_out, "Q4_K_M", "rtn")
    s = _quantize(hf, gptq_out, "Q4_K_M", "gptq", "--samples", "16", "--seq-len", "64")
    n = N_EXPERTS[kind]
    experts = {k: v for k, v in s["errors"].items() if "_exps." in k}
    assert sorted(experts) == sorted(f"blk.{i}.ffn_{p}_exps.{e}.weight" for i in range(2)
                                     for p in ("gate", "up", "down") for e in range(n))
    for name, (gptq_err, rtn_err) in experts.items():
        assert gptq_err < rtn_err, (name, gptq_err, rtn_err)
    rtn, q = open_gguf(rtn_out), open_gguf(gptq_out)
    by_name = {t.name: t for t in rtn.tensors}
    for t in q.tensors:
        r = by_name[t.name]
        assert (t.qtype, t.shape) == (r.qtype, r.shape), t.name
        same = np.array_equal(np.asarray(q.raw(t)), np.asarray(rtn.raw(r)))
        assert same == (t.name not in s["errors"] and "_exps.weight" not in t.name), t.name  # biases, router: rtn's
        if "_exps.weight" in t.name:
            assert t.shape[0] == n and gguf_types.BY_ID[t.qtype].name in ("Q4_K", "Q6_K"), (t.name, t.qtype)
    kl_gptq, kl_rtn = _kl(gptq_out, f32), _kl(rtn_out, f32)
    assert kl_gptq < kl_rtn, (kl_gptq, kl_rtn)


def test_expert_with_few_tokens_gets_rtn_blocks():
    """Below MIN_EXPERT_TOKENS routed tokens an expert's blocks are llama.cpp's round-to-nearest, byte
    for byte; from there on GPTQ's, below rtn's error; the stacked tensor is the experts' blocks in
    expert order once the last is in."""
    from brisk.core.quantize.gguf_gptq import _nearest
    from brisk.core.quantize.gguf_gptq_moe import MIN_EXPERT_TOKENS, StackedExperts

    torch.manual_seed(0)
    qtype = gguf_types.Q4_K
    stack = StackedExperts({"blk.3.ffn_up_exps.weight": qtype, "blk.3.ffn_gate_inp.weight": gguf_types.F32}, 2, _nearest)
    assert stack.target("model.layers.3.mlp.experts.1.up_proj.weight") == ("blk.3.ffn_up_exps.weight", 1, qtype)
    assert stack.target("model.layers.3.mlp.experts.1.gate_proj.weight") is None  # not asked for
    assert stack.target("model.layers.3.mlp.gate.weight") is None
    out, errors, rows = {}, {}, {}
    for e, tokens in ((1, MIN_EXPERT_TOKENS - 1), (0, 4 * MIN_EXPERT_TOKENS)):
        w = torch.randn(16, 256) * 0.02
        g = GPTQ(w)
        g.add_batch(torch.randn(tokens, 256) @ (torch.eye(256) + 0.3 * torch.randn(256, 256) / 16))
        stack.quantize(g, ("blk.3.ffn_up_exps.weight", e, qtype), 0.01, out, errors)
        rows[e] = native.quantize_rows(qtype, w.numpy())
        assert ("blk.3.ffn_up_exps.weight" in out) == (e == 0)
    gptq_err, rtn_err = errors["blk.3.ffn_up_exps.1.weight"]
    assert gptq_err == rtn_err
    gptq_err, rtn_err = errors["blk.3.ffn_up_exps.0.weight"]
    assert gptq_err < rtn_err
    whole = out["blk.3.ffn_up_exps.weight"]
    assert whole.shape == (32, rows[0].shape[1])
    assert np.array_equal(whole[16:], rows[1]) and not np.array_equal(whole[:16], rows[0])


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_llama_cpp_runs_gptq_moe(kind, tmp_path):
    """llama-server runs brisk's GPTQ MoE file: each token of its greedy continuation is the
    one brisk's kept-quantized run of the file ranks first after the same tokens, up to a near-tie
    (1% of the logits' range: a tiny random model's top logits are close, and llama.cpp rounds
    activations its own way, so the two continuations can part at a tie)."""
    from brisk.core import LLM

    from test_quantize_gguf_hf import IDS, _llama_greedy, llama_server

    server = llama_server()
    out = tmp_path / "gptq.gguf"
    _quantize(_moe_folder(tmp_path / "hf", kind), out, "Q4_K_M", "gptq", "--samples", "8", "--seq-len", "32")
    llm = LLM.load(str(out), device="cpu", dtype="float32", ctx=256)
    prompt = IDS[:12]
    got = _llama_greedy(server, out, prompt, 12, 256)
    logits = llm.logits(prompt + got[:-1])[len(prompt) - 1:]
    spread = float(logits.max() - logits.min())
    short = logits.max(-1).values - logits[torch.arange(len(got)), torch.tensor(got)]
    assert float(short.max()) <= 0.01 * spread, (got, short)


def test_an_interrupted_moe_run_from_a_folder_resumes(tmp_path, monkeypatch):
    """Ctrl-C after the first block of a Hugging Face MoE folder's gptq run: the rerun converts the
    folder again, takes block 0's stacked experts from the partial run (and sets the expert linears to
    them, so block 1's inputs are as before) and writes an uninterrupted run's bytes."""
    from typer.testing import CliRunner

    from brisk.cli.main import app
    from brisk.core.quantize import resume

    hf = _moe_folder(tmp_path / "hf", "mixtral")
    args = ["--format", "gguf", "--type", "Q4_K_M", "--samples", "8", "--seq-len", "32"]
    whole = tmp_path / "whole.gguf"
    r = CliRunner().invoke(app, ["quantize", str(hf), "-o", str(whole), *args])
    assert r.exit_code == 0, r.output
    saved, real_save = [], resume.save_layer

    def save_then_stop(partial, i, *rest):
        real_save(partial, i, *rest)
        saved.append(i)
        if i == 0 and len(saved) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(resume, "save_layer", save_then_stop)
    out = tmp_path / "m.gguf"
    r = CliRunner().invoke(app, ["quantize", str(hf), "-o", str(out), *args])
    assert r.exit_code == 130 and not out.exists(), r.output
    r = CliRunner().invoke(app, ["quantize", str(hf), "-o", str(out), *args])
    assert r.exit_code == 0, r.output
    assert saved == [0, 1], saved  # block 0 came from the partial run
    assert out.read_bytes() == whole.read_bytes()
