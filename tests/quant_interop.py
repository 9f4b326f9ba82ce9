"""Helpers shared by test_gptq.py and test_awq.py: real calibration activations from SmolLM2, the
committed fixtures written by GPTQModel, and brisk-written checkpoints for GPTQModel to read back."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

FIXTURES = Path(__file__).parent / "fixtures"
SCRIPTS = Path(__file__).parent.parent / "scripts"

# About a thousand tokens of ordinary prose, code and tables: the first part calibrates, the rest is held out.
TEXT = """The history of the bicycle is a story of small improvements. Early machines had no pedals: riders
pushed along the ground with their feet. Pedals came next, fixed to the front wheel, and wheels grew
larger to go faster, until the chain drive let a small wheel turn quickly and made the safety bicycle.
Air-filled tyres, gears and lighter frames followed, and by 1900 millions of people rode to work.

def mean(values):
    total = 0.0
    for v in values:
        total += v
    return total / max(len(values), 1)

Bread needs four things: flour, water, salt and yeast. Mix them, knead the dough for ten minutes, and
let it rise in a warm place until it doubles. Shape the loaf, let it rise again, then bake it at a high
temperature. The crust browns because sugars and proteins react in the heat of the oven.

Q: What is the capital of Japan? A: Tokyo. Q: How many legs does a spider have? A: Eight.
Q: Which planet is known as the red planet? A: Mars. Q: What do bees make? A: Honey and wax.
The committee met on Tuesday to review the budget, which rose by 4.5 percent to 12.3 million, mostly
because of new staff and the cost of repairing the north bridge after the winter floods.

A lighthouse keeper's day began before dawn. He climbed the spiral stairs, trimmed the wick, polished
the great lens and wound the clockwork that turned it. Ships far out at sea counted the flashes to know
which light they saw, because every station had its own pattern: two short flashes, or one long one
every ten seconds. In fog he sounded a horn, and in storms he watched the water for boats in trouble.

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

Dear Ms. Alvarez, thank you for your letter of 3 March. I am sorry that the parcel arrived damaged. We
have sent a replacement by express post, and you should receive it within five working days. Please
keep the original box until the courier collects it. If you have any further questions, call us on
weekdays between nine and five. Yours sincerely, Daniel Okafor, Customer Services.

Rivers shape the land they cross. In the mountains they run fast and cut deep valleys; on the plains
they slow down, drop their sand and silt, and wander in wide loops called meanders. Where a river meets
the sea it may build a delta, a fan of new land that grows a little every year. Farmers have always
settled on these plains, because floods leave behind a layer of rich soil, though the same floods can
destroy a harvest in a single night.

| city    | population | founded |
|---------|------------|---------|
| Lyon    | 522,000    | 43 BC   |
| Porto   | 232,000    | 300 BC  |
| Kraków  | 804,000    | 1038    |

To change a flat tyre, loosen the wheel nuts a little while the car is still on the ground, then raise it
with the jack. Remove the nuts and the wheel, fit the spare, and tighten the nuts by hand in a star
pattern. Lower the car and tighten them fully. Check the pressure of the spare as soon as you can, and
have the damaged tyre repaired or replaced before your next long journey."""


@torch.inference_mode()
def layer_inputs(llm, module_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs [n, K] that reach `module_name` while the model reads TEXT: (calibration, held out)."""
    module = llm.model.get_submodule(module_name)
    seen = []
    handle = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    try:
        llm.logits(llm.tokenizer.encode(TEXT, add_special=True))
    finally:
        handle.remove()
    x = torch.cat(seen).float()
    cut = len(x) * 3 // 4
    return x[:cut], x[cut:]


def float_weight(llm, module_name: str) -> torch.Tensor:
    m = llm.model.get_submodule(module_name)
    return m.dequantize(torch.float32) if hasattr(m, "dequantize") else m.weight.detach().float()


def out_error(w_q: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> float:
    """Relative output error of weight w_q against w on inputs x."""
    return float((x @ (w_q - w).T).pow(2).sum() / (x @ w.T).pow(2).sum())


def check_logits(logits: torch.Tensor, ref: dict[str, torch.Tensor], exact: bool) -> None:
    """brisk's logits against the fixture's references: the float model built from the tool's
    dequantization ("logits") and the tool's own float16 forward ("tool_logits"). Exact layers
    match the first to float32 rounding; the int4 kernel's bfloat16 path within ~0.6% (measured)."""
    def rel(a, b):
        return float((a - b).norm() / b.norm())

    if exact:
        assert (logits - ref["logits"]).abs().max() < 1e-4
        assert (logits - ref["tool_logits"]).abs().max() < 5e-3
    else:
        assert rel(logits, ref["logits"]) < 2e-2 and rel(logits, ref["tool_logits"]) < 2e-2


def fixture_logits(name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], object]:
    """brisk's logits for a committed fixture, the references recorded with it, and the LLM."""
    from safetensors.torch import load_file

    from brisk.core.llm import LLM

    ref = load_file(str(FIXTURES / name / "reference.safetensors"))
    llm = LLM.load(str(FIXTURES / name), device="cpu", dtype="float32")
    return llm.logits(ref["input_ids"].tolist()), ref, llm


# ---------------------------------------------------------------- brisk-written checkpoints

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def write_quantized(src: Path, out: Path, quantize_layer, qcfg: dict) -> Path:
    """Copy the float HF checkpoint `src` to `out` with each decoder linear replaced by
    quantize_layer(weight) -> {suffix: tensor}, and qcfg as config.json's quantization_config."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    torch.manual_seed(0)
    for i in range(cfg["num_hidden_layers"]):
        for n in LINEARS:
            name = f"model.layers.{i}.{n}"
            for k, v in quantize_layer(tensors.pop(f"{name}.weight").float()).items():
                tensors[f"{name}.{k}"] = v
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}, indent=2))
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    return out


def tool_reference(folder: Path, float_dir: Path) -> dict[str, torch.Tensor]:
    """GPTQModel's references for a checkpoint (see scripts/make_quant_fixtures.py)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from make_quant_fixtures import reference_logits
    finally:
        sys.path.remove(str(SCRIPTS))
    return reference_logits(folder, float_dir)
