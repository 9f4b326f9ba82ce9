"""The architectures of core/arch beyond the Llama family and Gemma 3 (Qwen3, Qwen3-MoE, Mixtral,
Phi-3, gpt-oss): logits and greedy output against transformers' own classes, the same models as llama.cpp's
converter writes them (float and Q8_0, kept quantized), and the mixture-of-experts promises."""
from __future__ import annotations

import json
import math

import pytest
import torch

from brisk.core import GREEDY, LLM, Session
from brisk.core.arch import from_hf_config
from brisk.core.batching import Engine, Request
from brisk.core.errors import FileError
from brisk.core.hf_export import hf_config
from brisk.core.model import MoE
from brisk.core.spec.build import make_speculator

from conftest import write_hf_checkpoint
from llama_cpp import convert
from test_model import check_parity

IDS = list(range(3, 43))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """kind -> (HF folder, llama.cpp's F32 GGUF, its Q8_0 GGUF), made once per kind."""
    made = {}

    def get(kind):
        if kind not in made:
            d = tmp_path_factory.mktemp(f"gguf_{kind}")
            hf = write_hf_checkpoint(d / "hf", kind, seed=4, tokens=296)  # the converter wants ids < 300
            if kind.startswith("phi3"):  # its converter reads a byte-level BPE only as GPT-2's
                tc = json.loads((hf / "tokenizer_config.json").read_text())
                (hf / "tokenizer_config.json").write_text(json.dumps({**tc, "tokenizer_class": "GPT2Tokenizer"}))
            made[kind] = hf, convert(hf, d / "f32.gguf", "f32"), convert(hf, d / "q8_0.gguf", "q8_0")
        return made[kind]
    return get


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "qwen3_moe_norm", "mixtral", "phi3", "gpt_oss"])
def test_tiny_checkpoints_match_transformers(kind, tmp_path):
    path = write_hf_checkpoint(tmp_path, kind, seed=4)
    # Phi-3's longrope takes its short factors within the pretrained context (64 here)
    llm = check_parity(path, IDS, atol=1e-4, steps=16 if kind == "phi3" else 32,
                       ctx=64 if kind == "phi3" else None)
    assert llm.config.arch == from_hf_config(json.loads((path / "config.json").read_text())).arch


def test_phi3_long_factors_past_the_pretrained_context(tmp_path):
    """A context past original_max_position_embeddings takes the long factors, as transformers
    does for a sequence that long (and llama.cpp for such a context); the attention factor is
    sqrt(1 + ln(256/64) / ln 64) either way."""
    import transformers as tf

    path = write_hf_checkpoint(tmp_path, "phi3", seed=4)
    ids = list(range(3, 83))  # 80 tokens > 64
    llm = LLM.load(str(path), device="cpu", dtype="float32", quantize="none", ctx=256)
    assert llm.config.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    hf = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ref - llm.logits(ids)).abs().max() < 1e-4
    short = LLM.load(str(path), device="cpu", dtype="float32", quantize="none", ctx=64)
    assert (ref[:60] - short.logits(ids[:60])).abs().max() > 1e-3  # the factors do matter


def test_gpt_oss_parts_all_bite(tiny_gpt_oss_dir):
    """The tiny gpt-oss that matches transformers exercises what sets the architecture apart: SwiGLU
    clamps some gate values, and the sinks, YaRN and the top-k softmax each move the logits."""
    from brisk.core.model import Transformer

    llm = LLM.load(str(tiny_gpt_oss_dir), device="cpu", dtype="float32")
    llm.model.__class__ = Transformer
    gates = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: gates.append(out.detach()))
             for n, m in llm.model.named_modules() if n.endswith("experts.0.gate_proj")]
    ref = llm.logits(IDS)
    for h in hooks:
        h.remove()
    assert any((g > llm.config.swiglu_limit).any() for g in gates)
    with torch.no_grad():
        for layer in llm.model.model.layers:
            layer.self_attn.sinks.zero_()
    assert (llm.logits(IDS) - ref).abs().max() > 1e-2
    assert llm.config.rope_scaling["rope_type"] == "yarn" and llm.config.routing == "topk_softmax"


def test_gpt_oss_mxfp4_as_released_and_as_llama_cpp_converts_it(tmp_path):
    """OpenAI's layout (MXFP4 `*_blocks` / `*_scales` experts in a Hugging Face folder) stays MXFP4 on
    load and gives the logits of the same model with its experts dequantized by transformers' own
    MXFP4 code; llama.cpp's converter repacks that folder into GGUF MXFP4 experts, which brisk keeps
    too, with the same values."""
    from conftest import write_gpt_oss_mxfp4

    mx_dir, float_dir = write_gpt_oss_mxfp4(tmp_path, seed=4)
    ref = LLM.load(str(float_dir), device="cpu", dtype="float32", ctx=64).logits(IDS)
    hf = LLM.load(str(mx_dir), device="cpu", dtype="float32", ctx=64)
    gguf = LLM.load(str(convert(mx_dir, tmp_path / "mxfp4.gguf", "f32")), device="cpu", dtype="float32", ctx=64)
    for llm in (hf, gguf):
        experts = [m for n, m in llm.model.named_modules() if ".experts." in n and n.endswith("_proj")]
        assert len(experts) == 4 * 4 * 3 and all(getattr(m, "type_name", None) == "MXFP4" for m in experts)
    got = hf.logits(IDS)
    p, q = ref.log_softmax(-1), got.log_softmax(-1)
    assert (p.exp() * (p - q)).sum(-1).mean() < 1e-4  # the kernels' 16-bit activations, nothing else
    assert (gguf.logits(IDS) - got).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen3_moe_norm", "mixtral", "phi3", "gpt_oss"])
def test_llama_cpp_gguf_files(kind, converted):
    """llama.cpp's converter output: the F32 file gives transformers' logits through brisk's GGUF
    reader (stacked expert tensors, fused q/k/v and gate/up, Qwen's un-interleaved q/k rows,
    Phi-3's factor tensors); the Q8_0 file stays quantized, experts included, and follows the widened
    file (Qwen2's q/k/v biases kept beside their quantized layers)."""
    hf_dir, f32, q8 = converted(kind)
    ref = LLM.load(str(hf_dir), device="cpu", dtype="float32", quantize="none", ctx=64).logits(IDS)
    ours = LLM.load(str(f32), device="cpu", dtype="float32", quantize="none", ctx=64)
    assert ours.config.arch == ("qwen2" if kind == "qwen2" else kind.removesuffix("_norm"))
    assert (ours.logits(IDS) - ref).abs().max() < 1e-4
    kept = LLM.load(str(q8), device="cpu", dtype="float32", ctx=64)
    widened = LLM.load(str(q8), device="cpu", dtype="float32", ctx=64, quantize="none").logits(IDS)
    layers = [m for n, m in kept.model.named_modules() if n.endswith(("_proj", "lm_head"))]
    assert layers and all(type(m).__name__ == "GGUFLinear" and m.type_name == "Q8_0" for m in layers)
    assert (kept.logits(IDS) - widened).abs().max() < 1e-3


def test_moe_token_runs_only_its_experts(tiny_qwen3_moe_dir):
    """A decode step of the torch blocks calls exactly top-k experts per MoE layer (the others'
    weights are never read; decoder.c's moe() likewise runs only experts with rows routed to them)."""
    from brisk.core.model import Transformer

    llm = LLM.load(str(tiny_qwen3_moe_dir), device="cpu", dtype="float32")
    llm.model.__class__ = Transformer  # not the native blocks: their experts run in C
    calls = []
    moe_layers = [m for m in llm.model.modules() if isinstance(m, MoE)]
    assert len(moe_layers) == 2  # of 3 layers: layer 1 is dense (mlp_only_layers)
    hooks = [e.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
             for moe in moe_layers for e in moe.experts]
    cache = llm.new_cache()
    with torch.inference_mode():
        llm.model(torch.tensor([IDS]), 0, cache)
        calls.clear()
        llm.model(torch.tensor([[7]]), len(IDS), cache)
    for h in hooks:
        h.remove()
    assert calls == [1] * (2 * llm.config.n_experts_used)


@pytest.mark.parametrize("folder", ["tiny_qwen3_moe_dir", "tiny_gpt_oss_dir"])
def test_moe_batched_and_speculative_equal_plain_greedy(folder, request):
    """A token's routing and bits never depend on its batch: the batching engine's answers and
    n-gram speculation's equal plain greedy decoding token for token (gpt-oss: sinks in the paged
    and contiguous caches alike)."""
    llm = LLM.load(str(request.getfixturevalue(folder)), device="cpu", dtype="float32")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 300, (int(n),), generator=g).tolist() for n in (5, 17, 30, 9)]
    want = []
    for p in prompts:
        s = Session(llm)
        list(s.stream(p, GREEDY, 20))
        want.append(s.last.tokens)
    got = [s.result.tokens for s in Engine(llm, block_size=4).run([Request(p, GREEDY, 20) for p in prompts])]
    assert got == want
    spec = make_speculator(llm, "ngram", 3)
    for p, w in zip(prompts, want):
        s = Session(llm, speculator=spec)
        list(s.stream(p, GREEDY, 20))
        assert s.last.tokens == w


@pytest.mark.parametrize("quantize,folder", [("int8", "tiny_qwen3_moe_dir"), ("int4", "tiny_qwen3_moe_dir"),
                                             ("int8", "tiny_gpt_oss_dir")])
def test_moe_quantized_at_load(quantize, folder, request):
    """-q int8|int4 quantizes every expert, never the router, and stays close to the float model."""
    path = request.getfixturevalue(folder)
    base = LLM.load(str(path), device="cpu", dtype="float32")
    llm = LLM.load(str(path), device="cpu", dtype="float32", quantize=quantize)
    experts = [m for n, m in llm.model.named_modules() if ".experts." in n and n.endswith("_proj")]
    assert experts and all(type(m).__name__ == f"Int{quantize[3]}Linear" for m in experts)
    assert all(type(m.gate).__name__ == "NativeRouter" and m.gate.weight.dtype == torch.float32
               for m in llm.model.modules() if isinstance(m, MoE))
    p, q = base.logits(IDS).log_softmax(-1), llm.logits(IDS).log_softmax(-1)
    assert (p.exp() * (p - q)).sum(-1).mean() < (0.01 if quantize == "int8" else 0.1)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "mixtral", "phi3"])
def test_exported_config_reads_back(kind, tmp_path):
    """hf_config (what brisk quantize writes for a GGUF source) gives the same ModelConfig back."""
    llm = LLM.load(str(write_hf_checkpoint(tmp_path, kind, seed=4)), device="cpu", dtype="float32")
    assert from_hf_config(hf_config(llm.config, llm.tokenizer)) == llm.config


def test_inconsistent_experts_are_one_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_hf_checkpoint(tmp_path / "m", "mixtral", seed=4)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 3}))
    with pytest.raises(FileError, match=r"layer 0 holds experts 0\.\.3 \(4\), but the config says 3"):
        LLM.load(str(path), device="cpu")
    (path / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 9}))
    with pytest.raises(FileError, match="num_experts_per_tok must be an integer from 1 to 4, got 9"):
        LLM.load(str(path), device="cpu")
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(FileError, match="lacks 1 weights, e.g. model.layers.1.mlp.experts.2.up_proj.weight"):
        LLM.load(str(path), device="cpu")


def test_inconsistent_gpt_oss_experts_are_one_clear_error(tmp_path):
    """gpt-oss's stacked experts, float or MXFP4, of a shape the config does not give: one line."""
    from safetensors.torch import load_file, save_file

    from conftest import write_gpt_oss_mxfp4

    mx_dir, float_dir = write_gpt_oss_mxfp4(tmp_path, seed=4)
    mx = load_file(mx_dir / "model.safetensors")
    for folder, name in ((float_dir, "model.layers.2.mlp.experts.down_proj"),
                         (mx_dir, "model.layers.2.mlp.experts.down_proj_blocks")):
        tensors = load_file(folder / "model.safetensors")
        tensors[name] = tensors[name][:3].contiguous()
        save_file(tensors, folder / "model.safetensors")
        with pytest.raises(FileError, match=rf"{name} has shape \[3, .*: this model's experts need \[4, "):
            LLM.load(str(folder), device="cpu")
    del mx["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    save_file(mx, mx_dir / "model.safetensors")
    with pytest.raises(FileError, match="gate_up_proj_scales has no gate_up_proj_blocks beside it"):
        LLM.load(str(mx_dir), device="cpu")


def test_gguf_expert_tensor_of_the_wrong_shape(converted, tmp_path):
    """A GGUF whose stacked expert tensor holds another number of experts than expert_count."""
    import gguf

    _, f32, _ = converted("mixtral")
    reader = gguf.GGUFReader(f32)
    out = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(out, "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == "llama.expert_count":
            value = 5
        vtype = field.types[0]
        writer.add_key_value(field.name, value, vtype, sub_type=field.types[1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(FileError, match=r"ffn_\w+_exps\.weight has shape \[4, \d+, \d+\]: the model needs 5 experts"):
        LLM.load(str(out), device="cpu")


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "microsoft-Phi-3.5-mini-instruct",
                                  "mistralai-Mistral-Nemo-Instruct-2407", "openai-gpt-oss-120b"])
def test_shipped_chat_templates_render_as_transformers(name, tmp_path):
    """The templates these models ship (system prompt, a past turn, Qwen3's think-tag handling)
    give brisk's prompt text exactly as transformers renders it."""
    import transformers as tf

    from brisk.core.tokenizer import Tokenizer
    from conftest import train_tiny_tokenizer
    from llama_cpp import template

    fast = tf.PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(), bos_token="<s>", eos_token="</s>")
    fast.chat_template = template(f"{name}.jinja")
    fast.save_pretrained(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>\nGreet.\n</think>\n\nHello!"},
                {"role": "user", "content": "What is 2+2?"}]
    want = fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template(messages) == want


def test_info_counts_the_active_experts(converted):
    """brisk info on an MoE model, from its GGUF and from its folder: experts, a token's active
    parameters (all but the 6 of 8 experts it is not routed to) and the bytes a decode step reads."""
    import transformers as tf

    from brisk.core.model_info import model_info

    hf_dir, f32, _ = converted("qwen3_moe_norm")
    hf = tf.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    total = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    embedding = hf.get_input_embeddings().weight.numel()
    for source in (f32, hf_dir):
        info = model_info(str(source))
        assert (info.experts, info.experts_used) == (8, 2)
        assert info.active_parameters == total - experts * 6 // 8
        assert info.read_bytes_per_token == 4 * (total - experts * 6 // 8 - embedding + embedding // 300)


def test_moe_on_the_command_line(tiny_qwen3_moe_dir, tmp_path):
    """generate runs an MoE folder; quantize --method awq refuses it in one line, leaving nothing behind."""
    import subprocess
    import sys
    from pathlib import Path

    brisk = [str(Path(sys.executable).parent / "brisk")]
    r = subprocess.run(brisk + ["generate", str(tiny_qwen3_moe_dir), "Hello", "--raw", "-n", "4", "--temperature", "0",
                                "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout)["generated_tokens"] == 4, r.stderr
    out = tmp_path / "q"
    r = subprocess.run(brisk + ["quantize", str(tiny_qwen3_moe_dir), "-o", str(out), "--method", "awq"],
                       capture_output=True, text=True, timeout=300)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1 and "mixture-of-experts" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and not out.exists() and not out.with_name("q.partial").exists()


@pytest.mark.parametrize("folder", ["tiny_qwen3_moe_dir", "tiny_gpt_oss_dir"])
def test_moe_rows_get_the_same_bits_in_any_batch(folder, request):
    """Each row of an MoE pass, alone (the decode path) or among others (prefill, batches): equal bits."""
    from brisk.quant import native

    if not native.available():
        pytest.skip("torch's float kernels may give a row other bits in a longer product")
    llm = LLM.load(str(request.getfixturevalue(folder)), device="cpu", dtype="float32")
    moe = next(m for m in llm.model.modules() if isinstance(m, MoE))
    x = torch.randn(1, 9, llm.config.dim, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        together = moe(x)
        alone = torch.cat([moe(x[:, i:i + 1]) for i in range(9)], dim=1)
    assert torch.equal(together, alone)


def test_gptq_moe_checkpoint(tmp_path, monkeypatch):
    """A GPTQ checkpoint of Mixtral in GPTQModel's layout (each expert's w1/w2/w3 packed under its own
    name, the router float): every expert loads as a GPTQ layer, and the logits are those of the float
    model holding the checkpoint's dequantized weights."""
    from safetensors.torch import load_file, save_file

    from brisk.quant import gptq_format
    from brisk.quant.gptq import rtn
    from brisk.quant.zero_point_linear import ZeroPointLinear

    monkeypatch.setattr(ZeroPointLinear, "exact", True)
    src = write_hf_checkpoint(tmp_path / "float", "mixtral", seed=4)
    tensors = load_file(src / "model.safetensors")
    deq = dict(tensors)
    for name in [k for k in tensors if ".experts." in k or "self_attn" in k]:
        r = rtn(tensors[name], 4, 32, True)
        for suffix, t in r.tensors("gptq").items():
            tensors[name.replace(".weight", f".{suffix}")] = t
        del tensors[name]
        deq[name] = r.dequantized.to(torch.float16).float()  # the scales are stored in float16
    out = tmp_path / "gptq"
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(tensors, out / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": gptq_format.quantization_config(4, 32)}))
    save_file(deq, src / "model.safetensors")  # the reference: the float model of the dequantized weights
    llm = LLM.load(str(out), device="cpu", dtype="float32")
    experts = [m for n, m in llm.model.named_modules() if ".experts." in n and n.endswith("_proj")]
    assert len(experts) == 2 * 4 * 3 and all(type(m).__name__ == "GPTQLinear" for m in experts)
    ref = LLM.load(str(src), device="cpu", dtype="float32", quantize="none").logits(IDS)
    assert (llm.logits(IDS) - ref).abs().max() < 1e-3


def test_gptq_quantize_of_an_moe_model(tiny_qwen3_moe_dir, tmp_path, monkeypatch):
    """brisk quantize --method gptq of an MoE model: each expert by GPTQ on the tokens routed to it,
    an expert no calibration token reaches (here expert 7, never routed to while calibrating) on the
    same grid without compensation; routers float, the dense layer quantized; the folder loads as
    GPTQ layers and follows the float model."""
    from safetensors.torch import load_file

    from brisk.core.quantize import QuantOptions, quantize_model

    route = MoE.route

    def never_seven(self, x):
        logits = self.gate(x).float()
        logits[:, 7] = -torch.inf
        probs = logits.softmax(dim=-1)
        w, e = probs.topk(self.top_k, dim=-1)
        return (w / w.sum(-1, keepdim=True) if self.renormalize else w), e

    monkeypatch.setattr(MoE, "route", never_seven)
    out = tmp_path / "gptq"
    quantize_model(str(tiny_qwen3_moe_dir), out, QuantOptions("gptq", group_size=32, samples=8, seq_len=64))
    monkeypatch.setattr(MoE, "route", route)
    stored = load_file(out / "model.safetensors")
    assert "model.layers.0.mlp.experts.7.down_proj.qweight" in stored and "model.layers.1.mlp.down_proj.qweight" in stored
    assert stored["model.layers.0.mlp.gate.weight"].is_floating_point()  # the router stays float
    llm = LLM.load(str(out), device="cpu", dtype="float32")
    experts = [m for n, m in llm.model.named_modules() if ".experts." in n and n.endswith("_proj")]
    assert len(experts) == 2 * 8 * 3 and all(type(m).__name__ == "GPTQLinear" for m in experts)
    base = LLM.load(str(tiny_qwen3_moe_dir), device="cpu", dtype="float32").logits(IDS).log_softmax(-1)
    kl = (base.exp() * (base - llm.logits(IDS).log_softmax(-1))).sum(-1).mean()
    assert kl < 0.05


def test_quantized_mixtral_keeps_its_own_names(tmp_path):
    """brisk quantize writes a Mixtral's experts and routers under Mixtral's names (block_sparse_moe,
    w1/w2/w3), as transformers and GPTQModel read them, and loads them back."""
    from safetensors.torch import load_file

    from brisk.core.quantize import QuantOptions, quantize_model

    src = write_hf_checkpoint(tmp_path / "float", "mixtral", seed=4)
    out = tmp_path / "q"
    quantize_model(str(src), out, QuantOptions("int8", samples=0))
    names = set(load_file(out / "model.safetensors"))
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.1.block_sparse_moe.gate.weight" in names and not any(".mlp." in n for n in names)
    base = LLM.load(str(src), device="cpu", dtype="float32").logits(IDS).log_softmax(-1)
    q = LLM.load(str(out), device="cpu", dtype="float32").logits(IDS).log_softmax(-1)
    assert (base.exp() * (base - q)).sum(-1).mean() < 0.01
