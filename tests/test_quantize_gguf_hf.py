"""`brisk quantize HF_FOLDER --format gguf`: the file llama.cpp's own converter writes (tensors byte for
byte, its metadata keys and values, read back by gguf-py), the logits transformers computes on the
folder (brisk running the file), llama.cpp running it (greedy tokens equal brisk's), the q/k rows in
llama.cpp's rotary order, SmolLM2's tokenizer, and the mixes the same as from a float GGUF."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from brisk.cli.main import app
from brisk.quant import gguf_types, native

import llama_cpp
from conftest import write_gpt_oss_mxfp4, write_hf_checkpoint
from test_model import _brisk_greedy, _hf_greedy, _hf_model

runner = CliRunner()
IDS = list(range(3, 43))  # past the tiny models' sliding windows
KINDS = ["llama", "qwen2", "qwen3", "gemma3", "phi3", "mixtral", "qwen3_moe_norm", "gpt_oss"]
GGUF_ARCH = {"mixtral": "llama", "qwen3_moe_norm": "qwen3moe", "gpt_oss": "gpt-oss"}  # MoEs: llama.cpp's names  # where llama.cpp's name is not the kind's
pytestmark = [pytest.mark.skipif(not native.available(), reason="no native kernels here (GGUF quantization needs them)"),
              pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """kind -> a tiny random HF folder (a tokenizer of 296 ids: llama.cpp's converter wants ids < 300)."""
    made = {}

    def get(kind):
        if kind not in made:
            # not named phi3: llama.cpp then expects Phi-3's own <unk>, <s> and <|endoftext|> in the vocabulary
            # (general.name is the folder's name), which the tiny tokenizer has not
            made[kind] = write_hf_checkpoint(tmp_path_factory.mktemp(f"hf_{kind.replace('phi3', 'p3')}"), kind,
                                             seed=4, tokens=296)
        return made[kind]
    return get


def convert(folder: Path, out: Path, qtype: str, *extra: str) -> dict:
    r = runner.invoke(app, ["quantize", str(folder), "-o", str(out), "--format", "gguf", "--type", qtype, *extra, "--json"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".") or p.suffix == ".partial") == []
    return json.loads(r.stdout.strip().splitlines()[-1])


def fields(path: Path) -> dict:
    """gguf-py's reading of the metadata: {key: (value types, value)}."""
    r = gguf.GGUFReader(str(path))
    return {k: ([t.name for t in f.types], f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3", "mixtral", "qwen3_moe_norm", "gpt_oss"])
def test_same_file_as_llama_cpp_converter(kind, folders, tmp_path):
    """--type F32 against convert_hf_to_gguf.py --outtype f32: every tensor's name, type, shape and bytes
    (q/k rows permuted, Gemma's norms + 1, llama3's rope_freqs, MoE experts stacked [n_expert, rows,
    cols] with the router as ffn_gate_inp, gpt-oss's expert biases [n_expert, rows] and attention sinks), every metadata key it writes with the same value type and
    value (but the name it makes up and its size label)."""
    hf = folders(kind)
    ref = llama_cpp.convert(hf, tmp_path / "ref.gguf", "f32")
    summary = convert(hf, tmp_path / "mine.gguf", "F32")
    assert summary["type"] == "F32" and summary["method"] == "convert"
    a, b = gguf.GGUFReader(str(ref)), gguf.GGUFReader(str(tmp_path / "mine.gguf"))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert sorted(ta) == sorted(tb)
    for n, t in ta.items():
        assert (t.tensor_type, list(t.shape)) == (tb[n].tensor_type, list(tb[n].shape)), n
        assert np.array_equal(t.data, tb[n].data), n
    fa, fb = fields(ref), fields(tmp_path / "mine.gguf")
    for key in ("general.name", "general.size_label"):
        fa.pop(key)
    if kind == "qwen2":  # llama.cpp's Qwen2 tokenizer class adds <|endoftext|>, which this folder lacks
        assert fa.pop("tokenizer.ggml.tokens")[1][296] == "<|endoftext|>"
        assert fb.pop("tokenizer.ggml.tokens")[1][296] == "[PAD296]"
        fa.pop("tokenizer.ggml.token_type"), fb.pop("tokenizer.ggml.token_type")
    for key, value in fa.items():
        assert fb.get(key) == value, key
    arch = GGUF_ARCH.get(kind, kind)
    assert fb[f"{arch}.context_length"] == (["UINT32"], 256) and fb["tokenizer.ggml.add_bos_token"] == (["BOOL"], False)
    assert fb["general.file_type"] == (["UINT32"], 0)
    if kind in GGUF_ARCH:  # the expert keys are among those compared above: say so
        assert fa[f"{arch}.expert_count"] == (["UINT32"], 8 if kind == "qwen3_moe_norm" else 4)
        if kind == "gpt_oss":
            assert list(tb["blk.0.ffn_up_exps.bias"].shape) == [32, 4] and "blk.0.attn_sinks.weight" in tb
        assert list(tb["blk.0.ffn_down_exps.weight"].shape)[-1] == fa[f"{arch}.expert_count"][1]


def test_qk_rows_in_llama_cpps_rotary_order(folders, tmp_path):
    """Llama's q/k rows as llama.cpp keeps them: per head, the two halves of HF's rotate-half pairs
    interleaved (GGUF row 2i is HF row i, row 2i+1 is HF row d/2 + i); Qwen2 keeps HF's order."""
    from safetensors.torch import load_file

    for kind, permuted in (("llama", True), ("qwen2", False)):
        hf = folders(kind)
        convert(hf, tmp_path / f"{kind}.gguf", "F32")
        r = gguf.GGUFReader(str(tmp_path / f"{kind}.gguf"))
        got = {t.name: torch.from_numpy(np.array(t.data)) for t in r.tensors}
        w = load_file(str(hf / "model.safetensors"))
        cfg = json.loads((hf / "config.json").read_text())
        for proj, heads in (("q", cfg["num_attention_heads"]), ("k", cfg["num_key_value_heads"])):
            src = w[f"model.layers.1.self_attn.{proj}_proj.weight"]
            d = src.shape[0] // heads
            want = src.clone()
            if permuted:
                for h in range(heads):
                    for i in range(d // 2):
                        want[h * d + 2 * i] = src[h * d + i]
                        want[h * d + 2 * i + 1] = src[h * d + d // 2 + i]
            assert torch.equal(got[f"blk.1.attn_{proj}.weight"], want), (kind, proj)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind, folders, tmp_path):
    """brisk running the written file against transformers on the folder: F32 to round-off, F16 within
    its rounding, Q8_0 (brisk's kernels on its blocks) within 5% of the logits' range, greedy equal for F32."""
    from brisk.core import LLM

    hf = folders(kind)
    model = _hf_model(hf)
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0].float()
    scale = float(ref.abs().max())
    for qtype, tol in (("F32", 1e-4), ("F16", 5e-3), ("Q8_0", 5e-2)):
        out = tmp_path / f"{qtype}.gguf"
        convert(hf, out, qtype, *(["--method", "rtn"] if qtype == "Q8_0" else []))
        # Phi-3's longrope: the short factors within the pretrained context (64), as transformers takes them here
        llm = LLM.load(str(out), device="cpu", dtype="float32", quantize="none" if qtype != "Q8_0" else "auto",
                       ctx=64 if kind == "phi3" else None)
        rows = (llm.logits(IDS) - ref).abs().max(dim=-1).values
        if kind in GGUF_ARCH and qtype == "Q8_0":
            # a random router's near-tie can pick another expert once the weights are rounded, which
            # changes that token's output wholesale: the others within the tolerance
            rows = rows.sort().values[:int(0.9 * len(rows))]
        diff = float(rows.max())
        assert diff < tol * max(scale, 1.0), (qtype, diff, scale)
        if qtype == "F32":
            assert _brisk_greedy(llm, IDS, 16) == _hf_greedy(model, IDS, 16)
        types = {gguf_types.BY_ID[t.tensor_type].name for t in gguf.GGUFReader(str(out)).tensors
                 if t.name.endswith("norm.weight")}
        assert types == {"F32"}, (qtype, types)  # norms stay float32 whatever the type


def test_mixes_as_from_a_float_gguf(folders, tmp_path):
    """HF folder -> Q4_K_M (rtn) is the file llama.cpp's F32 conversion requantized by brisk gives: the
    same tensors, types and bytes (the tied token table Q6_K, as llama.cpp puts it); gptq runs too."""
    hf = folders("qwen2")  # tied embeddings: no output.weight
    ref = llama_cpp.convert(hf, tmp_path / "ref.gguf", "f32")
    convert(ref, tmp_path / "from-gguf.gguf", "Q4_K_M", "--method", "rtn")
    summary = convert(hf, tmp_path / "from-hf.gguf", "Q4_K_M", "--method", "rtn")
    assert summary["type"] == "Q4_K_M" and summary["quantized"] > 0
    a, b = gguf.GGUFReader(str(tmp_path / "from-gguf.gguf")), gguf.GGUFReader(str(tmp_path / "from-hf.gguf"))
    ta = {t.name: (t.tensor_type, np.array(t.data).tobytes()) for t in a.tensors}
    tb = {t.name: (t.tensor_type, np.array(t.data).tobytes()) for t in b.tensors}
    assert ta == tb and "output.weight" not in tb
    # the tied table is the output: Q6_K in llama.cpp's mix, Q8_0 where rows of 64 fit no 256-weight block
    assert gguf_types.BY_ID[tb["token_embd.weight"][0]].name == "Q8_0"
    g = convert(hf, tmp_path / "gptq.gguf", "Q4_K_M", "--samples", "4", "--seq-len", "32")
    assert g["method"] == "gptq" and g["errors"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serving(server: Path, model: Path, ctx: int = 256):
    """llama-server on the file, one slot, one thread: its address while the block runs."""
    port = _free_port()
    proc = subprocess.Popen([str(server), "-m", str(model), "--port", str(port), "-c", str(ctx), "-t", "1", "-np", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail(f"llama-server failed on {model.name}: {proc.stderr.read()[-2000:]}")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _llama_greedy(server: Path, model: Path, ids: list[int], steps: int, ctx: int) -> list[int]:
    with _serving(server, model, ctx) as url:
        return _post(f"{url}/completion", {"prompt": ids, "n_predict": steps, "temperature": 0, "return_tokens": True,
                                           "cache_prompt": False})["tokens"]


def _llama_tokenize(server: Path, model: Path, texts: list[str]) -> list[list[int]]:
    with _serving(server, model) as url:
        return [_post(f"{url}/tokenize", {"content": t, "add_special": False})["tokens"] for t in texts]


def llama_server() -> Path:
    path = Path(os.environ.get("BRISK_LLAMA_SERVER", llama_cpp.ROOT / ".cache" / "llama.cpp-build" / "bin" / "llama-server"))
    if not path.is_file():
        pytest.skip(f"no llama-server at {path} (make bench-llama builds it)")
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_runs_it(kind, folders, tmp_path):
    """llama.cpp's llama-server loads the file and continues the prompt with brisk's greedy tokens."""
    from brisk.core import LLM

    server = llama_server()
    out = tmp_path / "m.gguf"
    convert(folders(kind), out, "F32")
    # Phi-3: 8 + 8 tokens, within its window of 16 (llama.cpp's phi3 switches sliding windows off), and a
    # context within its pretrained 64 (both then take the short rope factors)
    n = 8 if kind == "phi3" else 12
    ctx = 64 if kind == "phi3" else 256
    llm = LLM.load(str(out), device="cpu", dtype="float32", quantize="none", ctx=ctx)
    assert _llama_greedy(server, out, IDS[:n], n, ctx) == _brisk_greedy(llm, IDS[:n], n)


def test_smollm2_tokenizer(smollm2_path, tmp_path):
    """A tiny Llama carrying SmolLM2's tokenizer (rebuilt from its GGUF): the written file holds SmolLM2's
    vocabulary, types, merges and pre-tokenizer name as its GGUF does, and tokenizes text as it does."""
    import transformers as tf

    from brisk.core.gguf_file import open_gguf
    from brisk.core.tokenizer import Tokenizer

    meta = open_gguf(smollm2_path).metadata
    tok = Tokenizer.from_gguf_metadata(meta)
    n = len(meta["tokenizer.ggml.tokens"])
    hf = tmp_path / "hf"
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=n, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, bos_token_id=meta["tokenizer.ggml.bos_token_id"],
                         eos_token_id=meta["tokenizer.ggml.eos_token_id"], tie_word_embeddings=True)
    tf.LlamaForCausalLM(cfg).save_pretrained(hf)
    tok.save(hf)
    out = tmp_path / "m.gguf"
    convert(hf, out, "Q8_0", "--method", "rtn")
    got = open_gguf(out).metadata
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.chat_template"):
        assert got.get(key) == meta.get(key), key
    same_tokens(out, tok, ["SmolLM2 counts 12345 apples, naïvely: <|im_start|>user\nhi<|im_end|>", "  a\tb\n\nc 🙂"])


def test_refusals(folders, tmp_path):
    """One line naming what is wrong, exit 1, nothing written: gpt-oss with its experts in MXFP4 (a float
    checkpoint converts), a Qwen3-MoE layer without experts or without renormalized top-k weights (which
    llama.cpp's qwen3moe always has), a sliding window llama.cpp's llama would not apply (Mistral's of 16), a
    pre-tokenizer llama.cpp has no name for, a tensor of another shape than config.json's, a float --type for a GGUF input, --method gptq or a calibration flag with a float --type."""
    import shutil

    out = tmp_path / "o.gguf"
    mxfp4, _ = write_gpt_oss_mxfp4(tmp_path / "gpt_oss", seed=4)
    dense = write_hf_checkpoint(tmp_path / "moe_dense", "qwen3_moe", seed=4)  # layer 1 without experts
    raw = shutil.copytree(folders("qwen3_moe_norm"), tmp_path / "raw")
    cfg = json.loads((raw / "config.json").read_text())
    (raw / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": False}))
    mistral = write_hf_checkpoint(tmp_path / "mistral", "mistral", seed=4)
    odd = shutil.copytree(folders("llama"), tmp_path / "odd")
    tj = json.loads((odd / "tokenizer.json").read_text())
    (odd / "tokenizer.json").write_text(json.dumps({**tj, "pre_tokenizer": {"type": "Whitespace"}}))
    narrow = shutil.copytree(folders("llama"), tmp_path / "narrow")
    cfg = json.loads((narrow / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))  # the tensors have 128
    f32 = tmp_path / "f.gguf"
    convert(folders("llama"), f32, "F32")
    cases = [([str(mxfp4), "--type", "Q8_0"], "MXFP4"), ([str(dense), "--type", "F32"], "routes every layer"),
             ([str(raw), "--type", "F32"], "norm_topk_prob"), ([str(mistral), "--type", "Q8_0"], "sliding window"),
             ([str(odd), "--type", "Q8_0"], "pre-tokenizer"), ([str(narrow), "--type", "F32"], "shape [64, 128]"), ([str(f32), "--type", "F16"], "--type"),
             ([str(folders("llama")), "--type", "F16", "--method", "gptq"], "--method"),
             ([str(folders("llama")), "--type", "F16", "--samples", "4"], "--samples")]
    for args, word in cases:
        r = runner.invoke(app, ["quantize", *args, "-o", str(out), "--format", "gguf"])
        lines = r.output.strip().splitlines()
        assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error:") and word in lines[0], r.output
        assert not out.exists()


def test_interrupted_conversion_leaves_nothing(folders, tmp_path, monkeypatch):
    """Ctrl-C while the requantization runs: neither OUT, its .partial nor the converted source is left."""
    calls = []
    real = native.quantize_rows

    def interrupt(qtype, rows):
        calls.append(qtype)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(qtype, rows)

    monkeypatch.setattr(native, "quantize_rows", interrupt)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    r = runner.invoke(app, ["quantize", str(folders("llama")), "-o", str(out), "--format", "gguf", "--type", "Q8_0",
                            "--method", "rtn"])
    assert r.exit_code == 130 and "interrupted" in r.output, r.output
    assert list(out.parent.iterdir()) == []


def _sentencepiece_folder(folder: Path) -> Path:
    """A tiny Llama with a SentencePiece-style BPE as Llama 2's tokenizer.json holds one: spaces as U+2581,
    a dummy prefix, byte fallback to <0x00>..<0xFF> in the vocabulary, <unk>/<s>/</s> added."""
    import transformers as tf
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    text = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
            "def add(a, b):\n    return a + b"] * 20
    trainer_tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    trained = json.loads(trainer_tok.to_str())
    pieces = [t for t, _ in sorted(trained["model"]["vocab"].items(), key=lambda kv: kv[1]) if t != "<unk>"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces])}
    tj = {**trained, "pre_tokenizer": None,
          "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for i, t in enumerate(["<unk>", "<s>", "</s>"])],
          "decoder": {"type": "Sequence", "decoders": [
              {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
              {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
          "model": {**trained["model"], "vocab": vocab, "byte_fallback": True, "fuse_unk": True}}
    Tokenizer.from_str(json.dumps(tj))  # a tokenizer.json the library takes
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "unk_token": "<unk>", "add_bos_token": True}))
    return folder


def test_sentencepiece_tokenizer(tmp_path):
    """A SentencePiece BPE becomes llama.cpp's "llama" tokenizer: <unk> UNKNOWN, <s>/</s> CONTROL, the byte
    tokens BYTE, scores ranking tokens as the merges do, BOS added; brisk's GGUF tokenizer and llama.cpp's
    (llama-server's /tokenize, where it is here) split text as the folder's tokenizer does, bytes outside
    the vocabulary included."""
    from brisk.core.gguf_file import open_gguf
    from brisk.core.tokenizer import Tokenizer

    hf = _sentencepiece_folder(tmp_path / "hf")
    out = tmp_path / "m.gguf"
    convert(hf, out, "F32")
    meta = open_gguf(out).metadata
    types = meta["tokenizer.ggml.token_type"]
    assert meta["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.merges" not in meta
    assert types[:3] == [2, 3, 3] and set(types[3:259]) == {6} and set(types[259:]) == {1}
    assert meta["tokenizer.ggml.add_bos_token"] is True and meta["tokenizer.ggml.add_space_prefix"] is True
    assert (meta["tokenizer.ggml.unknown_token_id"], meta["tokenizer.ggml.bos_token_id"]) == (0, 1)
    texts = ["The quick brown fox", "Paris is the capital", "  two  spaces, a tab\tand ñ, 東京 and 🙂",
             "def add(a, b):\n    return a + b"]
    same_tokens(out, Tokenizer.from_hf_folder(hf), texts)


def same_tokens(path: Path, want, texts: list[str]) -> None:
    """The file's tokenizer, as brisk builds it and as llama.cpp runs it (where llama-server is here),
    splits each text as `want` does."""
    from brisk.core.gguf_file import open_gguf
    from brisk.core.tokenizer import Tokenizer

    ours = Tokenizer.from_gguf_metadata(open_gguf(path).metadata)
    for text in texts:
        assert ours.encode(text) == want.encode(text), text
    try:
        server = llama_server()
    except pytest.skip.Exception:
        return
    assert _llama_tokenize(server, path, texts) == [want.encode(t, add_special=False) for t in texts]


def test_bfloat16_checkpoint(folders, tmp_path):
    """A bfloat16 checkpoint: --type BF16 keeps its bits (general.file_type 32, norms F32), and a mix
    requantizes from them without a rounding to float16 between (Q8_0 as from the float32 values)."""
    import transformers as tf
    from safetensors.torch import load_file

    hf = tmp_path / "bf16"
    src = folders("qwen3")
    tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(hf)
    for f in src.glob("*"):
        if f.name.startswith(("tokenizer", "chat_template")):
            (hf / f.name).write_bytes(f.read_bytes())
    convert(hf, tmp_path / "bf16.gguf", "BF16")
    r = gguf.GGUFReader(str(tmp_path / "bf16.gguf"))
    assert r.fields["general.file_type"].contents() == 32
    t = {t.name: t for t in r.tensors}
    w = load_file(str(hf / "model.safetensors"))
    assert t["blk.0.ffn_down.weight"].tensor_type.name == "BF16" and t["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    assert np.array_equal(np.array(t["blk.0.ffn_down.weight"].data).view(np.int16).reshape(-1),
                          w["model.layers.0.mlp.down_proj.weight"].view(torch.int16).reshape(-1).numpy())
    convert(hf, tmp_path / "q8.gguf", "Q8_0", "--method", "rtn")
    q = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "q8.gguf")).tensors}
    rows = w["model.layers.0.mlp.down_proj.weight"].float().numpy()
    assert np.array_equal(np.array(q["blk.0.ffn_down.weight"].data).reshape(-1),
                          native.quantize_rows(gguf_types.Q8_0, rows).reshape(-1))


@pytest.mark.slow
def test_gemma3_tokenizer(gemma_path, tmp_path):
    """A tiny Gemma 3 carrying Gemma 3's own SentencePiece vocabulary (rebuilt from its GGUF as a
    tokenizer.json): the written file holds Gemma's tokens, BOS/EOS, no space prefix, and tokenizes text
    (chat turns, bytes outside the vocabulary) as Gemma's GGUF does, in brisk and in llama.cpp."""
    import transformers as tf

    from brisk.core.gguf_file import open_gguf
    from brisk.core.tokenizer import Tokenizer

    meta = open_gguf(gemma_path).metadata
    tok = Tokenizer.from_gguf_metadata(meta)
    hf = tmp_path / "hf"
    cfg = tf.Gemma3TextConfig(vocab_size=len(meta["tokenizer.ggml.tokens"]), hidden_size=64, intermediate_size=128,
                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                              bos_token_id=meta["tokenizer.ggml.bos_token_id"],
                              eos_token_id=meta["tokenizer.ggml.eos_token_id"], query_pre_attn_scalar=32)
    tf.Gemma3ForCausalLM(cfg).save_pretrained(hf)
    tok.save(hf)
    out = tmp_path / "m.gguf"
    convert(hf, out, "BF16")
    got = open_gguf(out).metadata
    assert got["tokenizer.ggml.model"] == "llama" and got["tokenizer.ggml.add_space_prefix"] is False
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.chat_template"):
        assert got.get(key) == meta.get(key), key
    same_tokens(out, tok, ["The history of the printing press begins", "<start_of_turn>user\nHi there!<end_of_turn>\n",
                           "  two  spaces, a tab\tand ñ, 東京 and 🙂 \U0001fae8", "def add(a, b):\n    return a + b"])


def test_sharded_folder(folders, tmp_path):
    """A checkpoint in shards (model.safetensors.index.json) gives the file its single-file form gives."""
    sharded = write_hf_checkpoint(tmp_path / "sharded", "llama", seed=4, shards=True, tokens=296)
    assert (sharded / "model.safetensors.index.json").exists()
    convert(sharded, tmp_path / "a.gguf", "F32")
    convert(folders("llama"), tmp_path / "b.gguf", "F32")
    a, b = gguf.GGUFReader(str(tmp_path / "a.gguf")), gguf.GGUFReader(str(tmp_path / "b.gguf"))
    assert [(t.name, np.array(t.data).tobytes()) for t in a.tensors] == [(t.name, np.array(t.data).tobytes()) for t in b.tensors]


def test_pre_tokenizer_names():
    """tokenizer.json's pre-tokenizers as the released checkpoints write them, named as llama.cpp names
    them: SmolLM2's digits-then-GPT-2, Llama 3's and Qwen2's regex splits, GPT-2's plain byte level."""
    from brisk.core.gguf_tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT
    from brisk.core.quantize.gguf_from_hf import _pre_name

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    split = lambda r: {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}  # noqa: E731
    cases = {"smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]},
             "llama-bpe": {"type": "Sequence", "pretokenizers": [split(_LLAMA3_SPLIT), {**byte_level, "use_regex": False}]},
             "qwen2": {"type": "Sequence", "pretokenizers": [split(_QWEN2_SPLIT), {**byte_level, "use_regex": False}]},
             "gpt-2": byte_level}
    for name, pre in cases.items():
        assert _pre_name(pre, Path("tokenizer.json")) == name
