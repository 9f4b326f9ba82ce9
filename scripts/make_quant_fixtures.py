"""Write the GPTQ/AWQ interop fixtures in tests/fixtures/ with the reference tool (GPTQModel).

Each fixture is a tiny random Llama (hidden 128, 2 layers, vocab 300) quantized by GPTQModel, plus
reference.safetensors: fixed input ids and reference logits (see reference_logits). The tests load the folder in brisk and compare, without
needing GPTQModel installed. Run once, commit the output:

    python -m venv /work/refvenv && /work/refvenv/bin/pip install torch==2.13.0 gptqmodel==7.6.0 pytest
    GPTQMODEL_CPU_WORKERS=2 /work/refvenv/bin/python scripts/make_quant_fixtures.py [names...]
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import CHAT_TEMPLATE, train_tiny_tokenizer  # noqa: E402

OUT = ROOT / "tests" / "fixtures"
INPUT_IDS = [0, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 260, 280, 290, 150]
KEEP = ("config.json", "generation_config.json", "model.safetensors", "quantize_config.json", "tokenizer.json",
        "tokenizer_config.json", "chat_template.jinja")
SPECS = {  # name -> GPTQModel config arguments
    "gptq_4bit_g32_desc_act": dict(method="gptq", bits=4, group_size=32, sym=True, desc_act=True),
    "gptq_4bit_g64_asym": dict(method="gptq", bits=4, group_size=64, sym=False, desc_act=False),
    "gptq_8bit_g128": dict(method="gptq", bits=8, group_size=128, sym=True, desc_act=False),
    "awq_gemm_4bit_g128": dict(method="awq", bits=4, group_size=128, sym=False, format="gemm"),
}


def calibration_texts() -> list[str]:
    lines = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
             "def add(a, b):\n    return a + b", "Hello, world! How are you today?",
             "1, 2, 3, 5, 8, 13, 21, 34, 55, 89", "A list: apples; pears; plums; cherries."]
    return [" ".join(lines[(i + j) % len(lines)] for j in range(4)) for i in range(48)]


def write_float_model(folder: Path) -> None:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=True)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random norms: a wrong convention shows in the logits
                p.normal_(1.0, 0.2)
            elif p.dim() == 2 and "embed" not in name:
                p.normal_(0, 0.05)
    model.save_pretrained(folder)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(), bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def quantize(float_dir: Path, out: Path, spec: dict) -> None:
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig

    model = GPTQModel.load(str(float_dir), QuantizeConfig(**spec), device="cpu")
    # the torch backend packs on the CPU (AWQ's default GEMM packer wants CUDA)
    model.quantize(calibration_texts(), batch_size=4, backend=BACKEND.TORCH)
    model.save(str(out))


def tool_dequantize(mod) -> torch.Tensor:
    """GPTQModel's dequantization of one of its layers, [K, N], computed in float32."""
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    scales = mod.scales.float()  # so that (q - z) * s is computed in float32
    if hasattr(mod, "dequantize_weight"):  # GPTQ layers; the class's method, not the compiled copy
        mod.scales = scales
        return type(mod).dequantize_weight(mod)
    return dequantize_gemm(mod.qweight, mod.qzeros, scales, mod.bits, mod.group_size)  # AWQ GEMM


@torch.inference_mode()
def reference_logits(folder: Path, float_dir: Path) -> dict[str, torch.Tensor]:
    """Two references: "logits", a float32 transformers model whose linear weights are GPTQModel's
    own dequantization of the checkpoint (exact: brisk must match it to float32 rounding), and
    "tool_logits", GPTQModel's quantized forward (its CPU kernels run float16 only: looser)."""
    import transformers as tf
    from gptqmodel import BACKEND, GPTQModel

    ids = torch.tensor([INPUT_IDS])
    # float16, the scales' own dtype: loading as bfloat16 would round them
    # and the plain torch kernels, whose dequantize_weight is the reference
    qmodel = GPTQModel.load(str(folder), device="cpu", dtype=torch.float16, backend=BACKEND.TORCH)
    tool_logits = qmodel.model(ids).logits[0].float()
    ref = tf.AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32)
    tensors = load_file(str(folder / "model.safetensors"))
    state = {k: v.float() for k, v in tensors.items() if k.endswith(".weight")}
    for name, mod in qmodel.model.named_modules():
        if hasattr(mod, "qweight"):
            state[f"{name}.weight"] = tool_dequantize(mod).T.float()
    missing = set(ref.state_dict()) - set(state) - {"lm_head.weight"}
    assert not missing, missing
    ref.load_state_dict(state, strict=False)
    ref.tie_weights()
    return {"input_ids": ids[0], "logits": ref(ids).logits[0].float(), "tool_logits": tool_logits}


def main(names: list[str]) -> None:

    with tempfile.TemporaryDirectory() as tmp:
        float_dir = Path(tmp) / "float"
        write_float_model(float_dir)
        for name in names or SPECS:
            spec = SPECS[name]
            work = Path(tmp) / name
            quantize(float_dir, work, spec)
            dest = OUT / name
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            for f in KEEP:
                if (work / f).exists():
                    shutil.copy(work / f, dest / f)
            refs = reference_logits(dest, float_dir)
            save_file({k: v.contiguous() for k, v in refs.items()}, str(dest / "reference.safetensors"))
            print(name, sum(p.stat().st_size for p in dest.iterdir()) // 1024, "KB")


if __name__ == "__main__":
    main(sys.argv[1:])  # fixture names to (re)write; all when none
