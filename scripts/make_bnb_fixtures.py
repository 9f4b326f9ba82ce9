"""Write the bitsandbytes interop fixtures in tests/fixtures/bnb_* with the reference tools.

Each fixture is conftest's tiny random Llama (hidden 64, 2 layers, vocab 300) loaded by transformers
with a BitsAndBytesConfig and saved again: the checkpoint exactly as transformers + bitsandbytes write
it. reference.safetensors holds fixed input ids and the float32 logits of the same model with every
quantized weight replaced by bitsandbytes' own dequantization of the saved tensors (what the
checkpoint means, free of any kernel's activation rounding). Run once, commit the output:

    .venv/bin/pip install bitsandbytes transformers && .venv/bin/python scripts/make_bnb_fixtures.py
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import write_hf_checkpoint  # noqa: E402

OUT = ROOT / "tests" / "fixtures"
INPUT_IDS = [0, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 260, 280, 290, 150]
KEEP = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja")
SPECS = {  # name -> BitsAndBytesConfig arguments
    "bnb_nf4_dq": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "bnb_nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False),
    "bnb_fp4_dq": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True),
    "bnb_int8": dict(load_in_8bit=True),
}


def dequantized_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every quantized layer's float weight, by bitsandbytes' own functions on the saved tensors."""
    import bitsandbytes.functional as bf
    from safetensors.torch import load_file

    sd = load_file(folder / "model.safetensors")
    out = {}
    for key in sd:
        if ".weight.quant_state.bitsandbytes__" in key:
            prefix = key.split(".weight.quant_state.")[0]
            qs = bf.QuantState.from_dict({k[len(prefix) + len(".weight."):]: v for k, v in sd.items()
                                          if k.startswith(prefix + ".weight.")}, device="cpu")
            out[prefix + ".weight"] = bf.dequantize_4bit(sd[prefix + ".weight"], qs).float()
        elif key.endswith(".SCB"):
            prefix = key[:-len(".SCB")]
            out[prefix + ".weight"] = sd[prefix + ".weight"].float() * sd[key][:, None] / 127
    return out


@torch.inference_mode()
def reference_logits(float_dir: Path, folder: Path) -> torch.Tensor:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    weights = dequantized_weights(folder)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and len(weights) == 14, (unexpected, len(weights))  # 7 linears x 2 layers
    return model(torch.tensor([INPUT_IDS])).logits[0].float()


@torch.inference_mode()
def bnb_logits(folder: Path) -> torch.Tensor:
    """transformers + bitsandbytes running the saved checkpoint (a sanity check of the reference)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", dtype=torch.float32)
    return model(torch.tensor([INPUT_IDS])).logits[0].float()


def main() -> None:
    import transformers as tf
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        float_dir = write_hf_checkpoint(Path(tmp) / "float", "llama")
        for name, spec in SPECS.items():
            qcfg = tf.BitsAndBytesConfig(**spec, bnb_4bit_compute_dtype=torch.float32)
            model = tf.AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=qcfg, device_map="cpu",
                                                            dtype=torch.float32)
            saved = Path(tmp) / name
            model.save_pretrained(saved)
            out = OUT / name
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            for f in KEEP:
                if (saved / f).exists():
                    shutil.copy(saved / f, out / f)
                elif (float_dir / f).exists():
                    shutil.copy(float_dir / f, out / f)
            ref = reference_logits(float_dir, out)
            diff = (bnb_logits(out) - ref).abs().max().item()
            save_file({"input_ids": torch.tensor(INPUT_IDS), "logits": ref.contiguous()}, out / "reference.safetensors")
            print(f"{name}: written; transformers+bitsandbytes forward differs from the reference by {diff:.2e}")


if __name__ == "__main__":
    main()
