"""The KV cache's types (--kv-type, core/kv/kv_type.py): q8_0 blocks byte for byte as gguf-py's
Q8_0 quantizer writes them, decoder.c's stored values as torch/numpy convert them, each type's
logits against the float32 cache's through the native and the torch blocks, greedy speculation
equal to plain greedy, the flag. (Batch invariance per type: tests/test_native_decoder.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from brisk.core import LLM
from brisk.core.errors import InvalidValue
from brisk.core.kernel_passes import NativeBlocksTransformer
from brisk.core.kv import ContiguousKV
from brisk.core.kv.kv_type import TYPES, check_kv_type, dequantize_q8_0, quantize_q8_0, resolve
from brisk.core.model import Transformer

NARROW = ["f16", "bf16", "q8_0"]
# each type's logits against the float32 cache's, as a fraction of the largest logit: a value's
# relative rounding is 2^-11 (f16), 2^-8 (bf16), up to 1/254 of its block's largest (q8_0)
TOLERANCE = {"f16": 2e-3, "bf16": 2e-2, "q8_0": 3e-2}
MODELS = ["tiny_gemma3_dir", "tiny_gpt_oss_hd32_dir"]  # sliding windows; gpt-oss: sinks too
native_only = pytest.mark.skipif(not __import__("brisk.quant.native", fromlist=["x"]).available(),
                                 reason="no native kernels")


def test_q8_0_blocks_are_gguf_pys_bytes():
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-6, 3, 64)[:, None]
    x[0] = 0  # d = 0: all codes 0
    x[1, :32] = 0.5  # one value repeated: q = 127
    x[2, :32] = (torch.arange(32) - 15.5) / 15.5 * 127 / 2  # halves: rounded away from zero
    x[3, :32] = torch.tensor([1e-8] * 31 + [65000.0])  # a subnormal-free scale, tiny values to 0
    got = quantize_q8_0(x).numpy()
    want = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert got.dtype == np.uint8 and np.array_equal(got, want)
    np.testing.assert_array_equal(dequantize_q8_0(torch.from_numpy(want)).numpy(),
                                  gguf.quants.dequantize(want, gguf.GGMLQuantizationType.Q8_0))


def test_kv_type_parsing_and_errors():
    assert check_kv_type(" F16 ") == "f16"
    with pytest.raises(InvalidValue) as e:
        check_kv_type("q4_0")
    assert e.value.cli_message() == "--kv-type 'q4_0': use one of auto, f32, f16, bf16, q8_0"
    assert resolve("auto", torch.float32, torch.device("cpu")).name == "f32"
    assert resolve("auto", torch.bfloat16, torch.device("cuda")).name == "bf16"
    with pytest.raises(InvalidValue, match="on cuda the cache is kept in the activations' dtype"):
        resolve("q8_0", torch.bfloat16, torch.device("cuda"))
    with pytest.raises(InvalidValue, match="multiple of 32; this model's is 16"):
        ContiguousKV(1, 1, 16, 8, torch.float32, "cpu", kv_type=TYPES["q8_0"])


def test_storage_shapes_and_bytes():
    for name, per_value in (("f32", 4), ("f16", 2), ("bf16", 2), ("q8_0", 34 / 32)):
        kv = ContiguousKV(3, 2, 64, 100, torch.float32, "cpu", kv_type=TYPES[name])
        assert kv.k[0].dtype == TYPES[name].storage
        assert kv.nbytes == 2 * 3 * 2 * 64 * 100 * per_value


def _load(path, kv_type, torch_blocks=False):
    """A tiny random model with int8 products, or a GGUF as stored, on the CPU."""
    quantize = "auto" if str(path).endswith(".gguf") else "int8"
    llm = LLM.load(str(path), device="cpu", dtype="float32", quantize=quantize, kv_type=kv_type)
    if torch_blocks:
        llm.model.__class__ = Transformer
    return llm


IDS = [(7 * i + 3) % 290 + 2 for i in range(40)]  # past every sliding window (8)
TEXT = ("The KV cache holds each layer's keys and values for every position a sequence has seen, so a "
        "decode step attends over them instead of recomputing the prompt. Its size grows with the context: "
        "layers times heads times head size times positions, twice, in whatever type it stores. ") * 2


@native_only
@pytest.mark.parametrize("blocks", ["native", "torch"])
@pytest.mark.parametrize("model", MODELS + ["smollm2_path"])
def test_each_type_against_the_float32_cache(model, blocks, request):
    path = request.getfixturevalue(model)
    f32 = _load(path, "f32", blocks == "torch")
    ids = IDS if model != "smollm2_path" else f32.tokenizer.encode(TEXT)
    want = f32.logits(ids)
    for name in NARROW:
        llm = _load(path, name, blocks == "torch")
        assert (type(llm.model) is NativeBlocksTransformer) == (blocks == "native")
        got = llm.logits(ids)
        scale = want.abs().max().item()
        err = (got - want).abs().max().item() / scale
        assert 0 < err < TOLERANCE[name], (name, err)


@native_only
@pytest.mark.parametrize("level_", [0, 1, 2], ids=["plain", "avx2", "avx512"])
@pytest.mark.parametrize("name", NARROW)
def test_native_and_torch_blocks_agree_per_type(name, level_, tiny_gpt_oss_hd32_dir, monkeypatch):
    """The same type through decoder.c (each instruction set's conversions) and the torch blocks: the
    same stored rounding, so as close as the two paths are on a float32 cache."""
    from brisk.quant import native

    if level_ > native.library().bk_cpu_level():
        pytest.skip("this CPU lacks that instruction set")
    monkeypatch.setenv("BRISK_NATIVE_LEVEL", str(level_))
    native.level.cache_clear()
    native.set_int_dot(False)  # float32 activations into the products: the paths differ only in summation order
    try:
        got = _load(tiny_gpt_oss_hd32_dir, name).logits(IDS)
        want = _load(tiny_gpt_oss_hd32_dir, name, torch_blocks=True).logits(IDS)
    finally:
        native.level.cache_clear()
        native.set_int_dot(True)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


@native_only
@pytest.mark.parametrize("name", NARROW)
def test_decoder_stores_what_torch_and_gguf_convert_to(name, tiny_gemma3_dir):
    """Layer 0's keys and values do not depend on the cache (nothing has attended yet): decoder.c's
    stored bytes for them are the float32 cache's values converted by torch (f16, bf16: round to
    nearest even) or quantized by gguf-py (q8_0)."""
    f32 = _load(tiny_gemma3_dir, "f32")
    narrow = _load(tiny_gemma3_dir, name)
    with torch.inference_mode():
        kf, kn = f32.new_cache(64), narrow.new_cache(64)
        f32.model(torch.tensor([IDS]), 0, kf)
        narrow.model(torch.tensor([IDS]), 0, kn)
    n = len(IDS)
    for a, b in ((kf.k[0], kn.k[0]), (kf.v[0], kn.v[0])):
        want = TYPES[name].encode(a[:, :, :n])
        assert torch.equal(b[:, :, :n].view(torch.uint8), want.view(torch.uint8))
        assert not b[:, :, n:].view(torch.uint8).any()  # never written: still zeros
    if name == "q8_0":
        gguf = pytest.importorskip("gguf")
        vals = kf.k[0][:, :, :n].numpy()
        assert np.array_equal(kn.k[0][:, :, :n].numpy(),
                              gguf.quants.quantize(vals, gguf.GGMLQuantizationType.Q8_0))


@native_only
@pytest.mark.parametrize("name", NARROW)
def test_greedy_speculation_equals_plain_greedy_per_type(name, tiny_gemma3_dir):
    """Verifying passes (chains: ngram; trees: lookahead) read the drafts' keys as stored, as the
    plain steps do: the same tokens for each type."""
    from brisk.core import GREEDY, Session
    from brisk.core.spec.build import make_speculator

    llm = _load(tiny_gemma3_dir, name)
    ids = llm.prompt_ids("def add(a, b):\n    return a + b\n\ndef add(a, b):\n", raw=True)
    plain = Session(llm)
    list(plain.stream(ids, GREEDY, 40))
    for draft, k, lookahead in (("ngram", 4, None), ("lookahead", "auto", "5,3,2")):
        s = Session(llm, speculator=make_speculator(llm, draft, k, lookahead))
        list(s.stream(ids, GREEDY, 40))
        assert s.last.tokens == plain.last.tokens, draft


@pytest.mark.parametrize("args", [["generate", "--kv-type", "q4_0", "hi"], ["chat", "-ctk", "int8"],
                                  ["bench", "--kv-type", "f16,fp8"], ["serve", "--cache-type-k", "x"],
                                  ["eval", "--text", __file__, "--kv-type", "q4"],
                                  ["info", "--kv-type", "f64"]])
def test_a_bad_kv_type_is_one_error_line_before_any_load(args):
    from typer.testing import CliRunner

    from brisk.cli.main import app

    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --kv-type ") and "use one of auto, f32" in lines[0]


def test_generate_and_info_take_the_type(tiny_gemma3_dir):
    import json

    from typer.testing import CliRunner

    from brisk.cli.main import app

    runner = CliRunner()
    r = runner.invoke(app, ["generate", str(tiny_gemma3_dir), "hello", "-t", "0", "-n", "4", "--json",
                            "-ctk", "q8_0"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["kv_type"] == "q8_0"
    sizes = {}
    for name in ("auto", "f16", "q8_0"):
        r = runner.invoke(app, ["info", str(tiny_gemma3_dir), "--json", "--kv-type", name])
        assert r.exit_code == 0, r.output
        sizes[name] = json.loads(r.stdout)["kv_bytes_per_token"]
    per_value = 2 * 6 * 1 * 32  # K and V, layers, kv heads, head size
    assert sizes == {"auto": per_value * 4, "f16": per_value * 2, "q8_0": per_value * 34 // 32}
    r = runner.invoke(app, ["generate", str(tiny_gemma3_dir), "hello", "--device", "cuda", "--kv-type", "q8_0"])
    assert r.exit_code == 1  # no GPU here: that error, or CUDA's refusal of the type; one line either way
    assert len(r.output.strip().splitlines()) == 1 and r.output.startswith("error: ")


def test_bench_rows_per_type_and_a_saved_chat_records_its_type(tiny_gemma3_dir, tmp_path):
    import json

    from typer.testing import CliRunner

    from brisk.cli.main import app
    from brisk.core.chat import Chat

    r = CliRunner().invoke(app, ["bench", str(tiny_gemma3_dir), "-p", "8", "-n", "4", "-r", "1", "--json",
                                 "--kv-type", "f32,q8_0"])
    assert r.exit_code == 0, r.output
    assert [(x["kv_type"], x["test"]) for x in json.loads(r.stdout)] == [("f32", "pp8"), ("f32", "tg4"),
                                                                          ("q8_0", "pp8"), ("q8_0", "tg4")]
    conv = Chat(_load(tiny_gemma3_dir, "bf16"), max_tokens=3)
    list(conv.send("hello"))
    conv.save(tmp_path / "chat.json")
    assert json.loads((tmp_path / "chat.json").read_text())["kv_type"] == "bf16"
    other = Chat(_load(tiny_gemma3_dir, "q8_0"), max_tokens=3)
    other.load(tmp_path / "chat.json")  # the cache is recomputed from the text, in this chat's type
    list(other.send("again"))
    assert other.session.last.prompt_tokens > 6 and other.session.cache.type.name == "q8_0"  # both turns
