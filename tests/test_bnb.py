"""bitsandbytes checkpoints: NF4/FP4 (with and without double quantization) and LLM.int8.

Against bitsandbytes itself where it is importable (its CPU quantize/dequantize), and always
against fixtures written by transformers + bitsandbytes (scripts/make_bnb_fixtures.py)."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from brisk.quant import bnb_format, nf4
from brisk.quant.formats import FormatError, find_format
from brisk.quant.linear import Int8Linear

FIXTURES = Path(__file__).parent / "fixtures"
FOUR_BIT = ["bnb_nf4_dq", "bnb_nf4", "bnb_fp4_dq"]


def _bnb():
    try:
        import bitsandbytes.functional as bf
    except Exception as e:  # noqa: BLE001  (a broken native library is as good as absent)
        pytest.skip(f"bitsandbytes is not importable ({e})")
    return bf


def _layer_tensors(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(folder / "model.safetensors").items() if k.startswith(prefix + ".")}


# ---------------------------------------------------------------- the format, from bnb-written files

def test_codebooks_match_the_ones_bitsandbytes_wrote():
    sd = load_file(FIXTURES / "bnb_nf4_dq" / "model.safetensors")
    assert torch.equal(sd["model.layers.0.self_attn.q_proj.weight.quant_map"], nf4.codebook("nf4"))
    assert torch.equal(sd["model.layers.0.self_attn.q_proj.weight.nested_quant_map"], nf4.dynamic_code())
    fp4 = load_file(FIXTURES / "bnb_fp4_dq" / "model.safetensors")
    assert torch.equal(fp4["model.layers.1.mlp.up_proj.weight.quant_map"], nf4.codebook("fp4"))


@pytest.mark.parametrize("name", FOUR_BIT + ["bnb_int8"])
def test_fixture_loads_with_matching_logits(name):
    from brisk.core.llm import LLM

    llm = LLM.load(str(FIXTURES / name), device="cpu", dtype="float32")
    ref = load_file(FIXTURES / name / "reference.safetensors")
    q_proj = llm.model.model.layers[0].self_attn.q_proj
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = llm.logits(ref["input_ids"].tolist())
    if name == "bnb_int8":
        assert isinstance(q_proj, Int8Linear) and q_proj.weight.dtype == torch.int8
        # bf16 row scales and bf16 activations (what torch's int8 kernel takes): ~0.3% here
        assert (out - ref["logits"]).abs().max() < 1e-2 * ref["logits"].abs().max()
    else:
        assert isinstance(q_proj, nf4.NF4Linear) and q_proj.weight.dtype == torch.uint8
        assert q_proj.weight.numel() * 2 == q_proj.in_features * q_proj.out_features  # still 4-bit in memory
        torch.testing.assert_close(out, ref["logits"], atol=2e-5, rtol=1e-5)
    assert out.argmax(-1).tolist() == ref["logits"].argmax(-1).tolist()


@pytest.mark.parametrize("name", FOUR_BIT)
def test_4bit_layer_equals_bitsandbytes_dequantization(name):
    bf = _bnb()
    prefix = "model.layers.1.mlp.down_proj"
    t = _layer_tensors(FIXTURES / name, prefix)
    qs = bf.QuantState.from_dict({k[len(prefix) + 8:]: v for k, v in t.items() if k.startswith(prefix + ".weight.")},
                                 device="cpu")
    ref = bf.dequantize_4bit(t[prefix + ".weight"], qs)
    layer = bnb_format.load_linear(dict(t), prefix, {}, None)
    assert torch.equal(layer.dequantize(torch.float32), ref.float())


def test_int8_mapping_keeps_the_stored_int8():
    prefix = "model.layers.0.mlp.gate_proj"
    t = _layer_tensors(FIXTURES / "bnb_int8", prefix)
    layer = bnb_format.load_linear(dict(t), prefix, {}, None)
    assert torch.equal(layer.weight, t[prefix + ".weight"])
    exact = t[prefix + ".weight"].float() * t[prefix + ".SCB"][:, None] / 127
    # the only rounding: SCB / 127 to a bf16 scale
    assert ((layer.dequantize() - exact).abs() <= exact.abs() * 2 ** -8).all()


def test_load_linear_consumes_its_keys_and_leaves_float_layers():
    prefix = "model.layers.0.self_attn.o_proj"
    t = _layer_tensors(FIXTURES / "bnb_nf4_dq", prefix)
    assert len(t) == 6
    assert bnb_format.load_linear(t, prefix, {}, None) is not None and t == {}
    assert bnb_format.load_linear({"lm_head.weight": torch.zeros(3, 4)}, "lm_head", {}, None) is None


def test_detect_and_config():
    qcfg = json.loads((FIXTURES / "bnb_nf4_dq" / "config.json").read_text())["quantization_config"]
    assert find_format(qcfg) is bnb_format
    assert bnb_format.detect({"load_in_8bit": True}) and not bnb_format.detect({"quant_method": "gptq"})
    mine = bnb_format.quantization_config("nf4", double_quant=True, compute_dtype="float32")
    assert mine == qcfg  # what transformers wrote for the same BitsAndBytesConfig
    int8 = json.loads((FIXTURES / "bnb_int8" / "config.json").read_text())["quantization_config"]
    assert bnb_format.quantization_config("int8") == int8
    with pytest.raises(ValueError):
        bnb_format.quantization_config("int5")


# ---------------------------------------------------------------- quantizing, against bitsandbytes

@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(96, 128), (33, 70), (5, 3)])
def test_quantize_4bit_matches_bitsandbytes(quant_type, dtype, shape):
    bf = _bnb()
    torch.manual_seed(0)
    w = (torch.randn(*shape) * 0.05).to(dtype)
    mine = bnb_format.quantize_4bit(w, quant_type, 64, double_quant=False)
    q, qs = bf.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=False)
    ref = {f"weight.{k}": v for k, v in qs.as_dict(packed=True).items()} | {"weight": q}
    assert mine.keys() == ref.keys()
    for k in mine:
        assert mine[k].dtype == ref[k].dtype and mine[k].shape == ref[k].shape, k
        assert torch.equal(mine[k], ref[k]), k


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_double_quant_matches_bitsandbytes(quant_type):
    bf = _bnb()
    torch.manual_seed(1)
    w = torch.randn(384, 256) * 0.02
    mine = bnb_format.quantize_4bit(w, quant_type, 64, double_quant=True)
    q, qs = bf.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=True)
    ref = {f"weight.{k}": v for k, v in qs.as_dict(packed=True).items()} | {"weight": q}
    assert mine.keys() == ref.keys()
    key = f"weight.quant_state.bitsandbytes__{quant_type}"
    js_mine, js_ref = (json.loads(bytes(d[key].numpy())) for d in (mine, ref))
    assert js_mine.pop("nested_offset") == pytest.approx(js_ref.pop("nested_offset"), rel=1e-7)
    assert js_mine == js_ref
    for k in ("weight", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map"):
        assert torch.equal(mine[k], ref[k]), k
    # absmax codes: ours are the nearest entries; bnb's search may land one entry off
    diff = (mine["weight.absmax"].int() - ref["weight.absmax"].int()).abs()
    assert diff.max() <= 1 and diff.float().mean() < 0.05
    ours = bnb_format.load_linear({f"p.{k}": v for k, v in mine.items()}, "p", {}, None).dequantize()
    assert (ours - w).abs().mean() <= (bf.dequantize_4bit(q, qs) - w).abs().mean() * 1.001


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_int8_matches_bitsandbytes(dtype):
    bf = _bnb()
    torch.manual_seed(2)
    w = (torch.randn(48, 80) * 0.05).to(dtype)
    mine = bnb_format.quantize_int8(w)
    cb, scb, _ = bf.int8_vectorwise_quant(w.to(torch.float16))  # what Int8Params does
    assert torch.equal(mine["weight"], cb) and torch.equal(mine["SCB"], scb)
    assert mine["weight_format"].dtype == torch.uint8 and mine["weight_format"].item() == 0


# ---------------------------------------------------------------- brisk's output, read by transformers

def _write_quantized(src: Path, dest: Path, method: str) -> None:
    shutil.copytree(src, dest)
    sd = load_file(src / "model.safetensors")
    out = {}
    for k, w in sd.items():
        if k.endswith("_proj.weight") and w.dim() == 2:
            prefix = k[:-len(".weight")]
            t = bnb_format.quantize_int8(w) if method == "int8" else bnb_format.quantize_4bit(w, method, 64, True)
            out.update({f"{prefix}.{s}": v for s, v in t.items()})
        else:
            out[k] = w
    save_file(out, dest / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = bnb_format.quantization_config(method, double_quant=True, compute_dtype="float32")
    (dest / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("method", ["nf4", "fp4", "int8"])
def test_brisk_checkpoint_loads_in_transformers(method, tiny_llama_dir, tmp_path):
    _bnb()
    tf = pytest.importorskip("transformers")
    from brisk.core.llm import LLM

    dest = tmp_path / method
    _write_quantized(tiny_llama_dir, dest, method)
    ids = [0, 5, 77, 120, 9, 250, 31, 64]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = tf.AutoModelForCausalLM.from_pretrained(dest, device_map="cpu", dtype=torch.float32)
        llm = LLM.load(str(dest), device="cpu", dtype="float32")
        mine = llm.logits(ids)
        with torch.no_grad():
            theirs = hf(torch.tensor([ids])).logits[0].float()
    q_proj = hf.model.layers[0].self_attn.q_proj
    if method == "int8":
        assert type(q_proj).__name__ == "Linear8bitLt"
        # transformers' own int8 matmul also quantizes the activations: compare loosely
        assert (mine - theirs).abs().max() < 3e-2 * theirs.abs().max()
    else:
        assert type(q_proj).__name__ == "Linear4bit" and q_proj.weight.quant_state.quant_type == method
        if q_proj.weight.quant_state.dtype == torch.float32:
            torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=1e-5)
        else:  # bitsandbytes >= 0.49 on CPUs with bf16 computes its 4-bit matmul in bf16 (measured 0.4%)
            assert float((mine - theirs).norm() / theirs.norm()) < 1e-2
            assert mine.argmax(-1).tolist() == theirs.argmax(-1).tolist()


# ---------------------------------------------------------------- the layer

@pytest.mark.parametrize("shape", [(96, 128), (40, 70), (7, 3)])
def test_nf4_linear_forward_and_rows(shape, monkeypatch):
    torch.manual_seed(3)
    N, K = shape
    lin = torch.nn.Linear(K, N, bias=True)
    layer = nf4.NF4Linear.from_float(lin, "nf4", 64, double_quant=True)
    w = layer.dequantize()
    assert (w - lin.weight).abs().max() < lin.weight.abs().max() * 0.2
    x = torch.randn(2, 5, K)
    ref = F.linear(x, w, lin.bias)
    monkeypatch.setattr(nf4.NF4Linear, "SLAB", 64)  # many slabs: their edges must fall on blocks and bytes
    sliced = nf4.NF4Linear(layer.weight, layer.absmax, layer.code, shape, 64, "nf4", lin.bias)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sliced(x), ref, atol=1e-5, rtol=1e-5)
    assert sliced._slab_rows < N or N * K <= 64
    ids = torch.tensor([[0, N - 1], [N // 2, 1]])
    assert torch.equal(layer.rows(ids), F.embedding(ids, w))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_bitsandbytes_kernel_path(quant_type, monkeypatch):
    """The branch CUDA takes (bnb.matmul_4bit on a QuantState built from the layer's tensors), run
    here on bitsandbytes' CPU backend: same numbers as the plain-torch path."""
    _bnb()
    import bitsandbytes

    torch.manual_seed(4)
    lin = torch.nn.Linear(128, 96, bias=True)
    layer = nf4.NF4Linear.from_float(lin, quant_type, 64, double_quant=True)
    x = torch.randn(2, 3, 128)
    ref = F.linear(x, layer.dequantize(), lin.bias)
    monkeypatch.setattr(nf4.NF4Linear, "_fast_path", staticmethod(lambda device: bitsandbytes))
    torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=1e-5)
    assert layer(x[0, :1].to(torch.bfloat16)).dtype == torch.bfloat16  # decode shape, other dtype: new state


def test_nf4_linear_warns_once_on_cpu():
    nf4._warn_once.cache_clear()
    layer = nf4.NF4Linear.from_float(torch.nn.Linear(64, 32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(torch.randn(1, 64))
        layer(torch.randn(1, 64))
    assert len([w for w in caught if "dequantized per call" in str(w.message)]) == 1


# ---------------------------------------------------------------- damaged checkpoints

def _nf4_tensors():
    return {f"p.{k}": v for k, v in bnb_format.quantize_4bit(torch.randn(32, 64), "nf4", 64, True).items()}


@pytest.mark.parametrize("damage", ["no_absmax", "bad_json", "bad_shape", "no_offset"])
def test_damaged_4bit_layer_is_a_format_error(damage):
    t = _nf4_tensors()
    key = "p.weight.quant_state.bitsandbytes__nf4"
    state = json.loads(bytes(t[key].numpy()))
    if damage == "no_absmax":
        del t["p.weight.absmax"]
    elif damage == "bad_json":
        t[key] = torch.tensor(list(b"{not json"), dtype=torch.uint8)
    elif damage == "bad_shape":
        state["shape"] = [64, 64]
    elif damage == "no_offset":
        del state["nested_offset"]
    if damage in ("bad_shape", "no_offset"):
        t[key] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    with pytest.raises(FormatError):
        bnb_format.load_linear(t, "p", {}, None)


def test_damaged_int8_layer_is_a_format_error():
    t = {f"p.{k}": v for k, v in bnb_format.quantize_int8(torch.randn(8, 16)).items()}
    t["p.weight_format"] = torch.tensor(1, dtype=torch.uint8)
    with pytest.raises(FormatError, match="weight_format"):
        bnb_format.load_linear(t, "p", {}, None)
    with pytest.raises(FormatError, match="SCB"):
        bnb_format.load_linear({"p.weight": torch.zeros(8, 16, dtype=torch.int8)}, "p", {}, None)
