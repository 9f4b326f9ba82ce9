"""A model folder is a boundary, and only regular files are read (issue 39): an index naming a
shard outside the folder (../x, sub/../../x, an absolute path) is refused before anything is
opened there; a FIFO, a device or a folder where a file should be is refused by name instead of
blocking, never ending or failing inside a library; JSON is bounded in nesting and size. Symlinks
inside a folder to regular files elsewhere (how the Hugging Face cache is built) still load."""
from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
import torch

from brisk.core import LLM
from brisk.core.errors import FileError


def load_within(path, seconds: float = 60):
    """LLM.load(path) on a thread: its outcome, or a failure when it hangs."""
    out = {}

    def run():
        try:
            out["llm"] = LLM.load(str(path), device="cpu", dtype="float32")
        except BaseException as e:  # noqa: BLE001 (the test reports what came out)
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"loading {path} hangs"
    return out


@pytest.fixture
def folder(tiny_llama_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, d)
    return d


def refused(path, *words):
    out = load_within(path)
    e = out.get("error")
    assert isinstance(e, FileError), out
    assert all(w in str(e) for w in words), str(e)
    return str(e)


def sharded(folder, names: dict):
    """Make the folder's weights a one-shard index naming `names` (tensor -> file name)."""
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))


@pytest.mark.parametrize("name", ["../outside/model.safetensors", "sub/../../model.safetensors",
                                  "/etc/passwd", "a\\..\\b.safetensors"])
def test_index_names_outside_the_folder_are_refused(folder, tmp_path, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(folder / "model.safetensors", outside / "model.safetensors")
    sharded(folder, {"model.embed_tokens.weight": name})
    msg = refused(folder, "model.safetensors.index.json")
    assert "outside the model folder" in msg or "not a file name" in msg


def test_symlinked_shards_inside_the_folder_load(folder, tmp_path):
    """The Hugging Face cache: a snapshot folder of symlinks into a blobs folder beside it."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for f in ("model.safetensors", "config.json", "tokenizer.json"):
        shutil.move(folder / f, blobs / f)
        (folder / f).symlink_to(blobs / f)
    assert "llm" in load_within(folder)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json",
                                  "tokenizer.json", "model.safetensors", "model.safetensors.index.json",
                                  "special_tokens_map.json", "chat_template.jinja"])
@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_special_files_are_refused_by_name(folder, name, kind):
    path = folder / name
    if path.exists():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    if name == "model.safetensors.index.json":  # the index is read first; the weights file stays
        pass
    what = {"fifo": "a FIFO", "device": "a device", "folder": "a folder"}[kind]
    refused(folder, name, what, "not a regular file")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json",
                                  "special_tokens_map.json", "model.safetensors.index.json"])
def test_deeply_nested_json_is_refused(folder, name):
    (folder / name).write_text("[" * 100_000 + "]" * 100_000)
    msg = refused(folder, name)
    assert "nested too deeply" in msg or "must be a JSON object" in msg


def test_json_that_is_not_an_object_or_not_utf8(folder):
    (folder / "generation_config.json").write_text("[1, 2]")
    refused(folder, "generation_config.json", "must be a JSON object")
    (folder / "generation_config.json").write_bytes(b'{"temperature": "\xff"}')
    refused(folder, "generation_config.json", "not UTF-8")


def test_a_gguf_that_is_a_fifo_or_a_device(tmp_path):
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    refused(fifo, "a FIFO")
    dev = tmp_path / "z.gguf"
    dev.symlink_to("/dev/zero")
    refused(dev, "a device")


def test_generation_config_values_that_would_break_sampling(folder):
    """generation_config.json values are checked by the rule the flags are: out-of-range ones are
    ignored with a warning naming the file; the model samples without error."""
    from brisk.core import Session
    from brisk.core.sampling import SamplingParams

    (folder / "generation_config.json").write_text(json.dumps(
        {"repetition_penalty": 1e-45, "top_p": 1e-300, "min_p": 1, "top_k": 0, "temperature": 0.7}))
    with pytest.warns(UserWarning) as caught:
        llm = LLM.load(str(folder), device="cpu", dtype="float32")
    said = " ".join(str(w.message) for w in caught)
    assert "generation_config.json" in said and "repetition_penalty" in said and "min_p" in said
    gen = llm.checkpoint.generation
    assert "repetition_penalty" not in gen and "min_p" not in gen and gen["top_k"] == 0
    for params in (SamplingParams(temperature=0.7, top_p=gen["top_p"], seed=1),
                   SamplingParams(temperature=0.7, repetition_penalty=1e-3, seed=1)):
        s = Session(llm)
        list(s.stream(llm.prompt_ids("hello", raw=True), params, 8))
        assert len(s.last.tokens) > 0


# ---------------------------------------------------------------- silent inconsistencies

def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _save(tensors, path):
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def test_one_tensor_in_two_shards_is_refused(folder):
    """Two versions of one weight: which one runs cannot be told (it was the later shard's)."""
    t = _weights(folder)
    names = sorted(t)
    first, second = {k: t[k] for k in names[:6]}, {k: t[k] for k in names[5:]}
    second[names[5]] = second[names[5]] + 1  # different data under the same name
    (folder / "model.safetensors").unlink()
    _save(first, folder / "a.safetensors")
    _save(second, folder / "b.safetensors")
    sharded(folder, {**{k: "a.safetensors" for k in first}, **{k: "b.safetensors" for k in second}})
    refused(folder, names[5], "a.safetensors", "b.safetensors")


def test_one_tensor_twice_in_a_header_is_refused(folder):
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    text = json.dumps(header)[:-1] + ', "model.norm.weight": ' + json.dumps(header["model.norm.weight"]) + "}"
    text += " " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text.encode() + raw[8 + n:])
    refused(folder, "model.safetensors", "model.norm.weight twice")


def test_weights_files_beside_model_safetensors_are_not_read(folder):
    """Without an index, model.safetensors alone is the model (as transformers reads a folder): a
    stale copy beside it with other values is not mixed in."""
    good = load_within(folder)["llm"]
    stale = {k: v + 1 for k, v in _weights(folder).items()}
    _save(stale, folder / "model-old.safetensors")
    again = load_within(folder)["llm"]
    for (k, a), (_, b) in zip(good.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(a, b), k


def test_a_missing_head_with_untied_embeddings_is_refused(folder):
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg.get("tie_word_embeddings") is False
    t = _weights(folder)
    del t["lm_head.weight"]
    _save(t, folder / "model.safetensors")
    refused(folder, "lm_head.weight", "tie_word_embeddings")


def test_tensors_the_architecture_does_not_use_are_named_in_one_warning(folder):
    t = _weights(folder)
    t["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    t["lm_head.bias"] = torch.zeros(300)
    _save(t, folder / "model.safetensors")
    with pytest.warns(UserWarning) as caught:
        LLM.load(str(folder), device="cpu", dtype="float32")
    said = [str(w.message) for w in caught if "not used" in str(w.message)]
    assert len(said) == 1 and "2 tensors" in said[0]
    assert "lm_head.bias" in said[0] and "q_proj.bias" in said[0]


def _scaling(folder) -> tuple[str, dict]:
    """config.json's rope scaling and its key (transformers 5 writes rope_parameters)."""
    cfg = json.loads((folder / "config.json").read_text())
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    return key, cfg[key]


def _config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("change", [{"factor": 0}, {"factor": -2}, {"factor": float("nan")}, {"factor": float("inf")},
                                    {"factor": 1e308}, {"factor": "8"}, {"factor": None}, {"low_freq_factor": 4.0},
                                    {"original_max_position_embeddings": 0}, {"original_max_position_embeddings": 64.5}])
def test_rope_scaling_values_are_checked(folder, change):
    """llama3 rope scaling: a factor of 0, NaN or inf gave rope tables of inf/NaN without a word."""
    key, scaling = _scaling(folder)
    _config(folder, **{key: {**scaling, **change}})
    refused(folder, "config.json", "rope_scaling.")


def test_rope_scaling_without_its_factor_is_refused(folder):
    key, scaling = _scaling(folder)
    del scaling["factor"]
    _config(folder, **{key: scaling})
    refused(folder, "config.json", "rope_scaling.factor")


def test_token_ids_beyond_the_embedding_are_refused_when_met(folder):
    """An added token past the model's 300 rows: the prompt holding it is refused by name (it was an
    IndexError inside the model); prompts without it run."""
    from brisk.core.errors import BriskError
    from brisk.core.sampling import SamplingParams

    tj = json.loads((folder / "tokenizer.json").read_text())
    tj["added_tokens"].append({"id": 300, "content": "<beyond>", "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    llm = LLM.load(str(folder), device="cpu", dtype="float32")
    assert llm.generate("hello", SamplingParams(temperature=0), max_tokens=2).tokens
    with pytest.raises(BriskError, match="<beyond>.*id 300.*300 embedding rows"):
        llm.prompt_ids("hello <beyond>", raw=True)


def test_a_backtracking_pre_tokenizer_regex_is_an_error_not_a_panic(folder):
    """The Rust tokenizer panics (PanicException derives from BaseException, past every `except
    Exception`) when its regex engine gives up on a backtracking pattern."""
    from brisk.core.errors import BriskError

    tj = json.loads((folder / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated", "invert": False}
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    llm = LLM.load(str(folder), device="cpu", dtype="float32")
    with pytest.raises(BriskError, match="tokenizer failed"):
        llm.prompt_ids("a" * 30 + "!", raw=True)


# ---------------------------------------------------------------- quantization_config values

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures"


def _quantized(tmp_path, name, **changes):
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("change", [{"bits": 4.0}, {"bits": "4"}, {"bits": None}, {"bits": [4]}, {"bits": True},
                                    {"group_size": 0}, {"group_size": -2}, {"group_size": "64"}, {"group_size": 64.0}])
def test_gptq_settings_of_the_wrong_type_or_range(tmp_path, change):
    """They raised TypeError (4.0 << ...) or were taken as another group size (0 as -1)."""
    refused(_quantized(tmp_path, "gptq_4bit_g64_asym", **change), "GPTQ", "not supported")


@pytest.mark.parametrize("change", [{"bits": "x"}, {"bits": None}, {"bits": [4]}, {"bits": 4.0}, {"group_size": 0},
                                    {"group_size": 7}, {"group_size": "128"}, {"group_size": -1}])
def test_awq_settings_of_the_wrong_type_or_not_the_tensors(tmp_path, change):
    """bits "x" raised ValueError from int(); a group_size the tensors do not have was ignored."""
    refused(_quantized(tmp_path, "awq_gemm_4bit_g128", **change), "AWQ" if "bits" in change else "group_size")


@pytest.mark.parametrize("pattern, ends", [("-:(\\w|.)*!", "loads"), ("-:^((\\w|.)+)*\\1\\1\\1$", "backtracks")])
def test_a_backtracking_dynamic_regex_ends_in_time(tmp_path, pattern, ends):
    """GPTQModel's `dynamic` rules are regexes from the model file. Python's re spends ~14 s on the
    first over one layer name (nested quantifiers, no match); brisk's engine rules it out at once,
    and a pattern that still backtracks (a backreference) is stopped within its time bound."""
    d = _quantized(tmp_path, "gptq_4bit_g64_asym", dynamic={pattern: {}})
    out = load_within(d, seconds=20)
    if ends == "loads":
        assert "llm" in out, out
    else:
        assert isinstance(out.get("error"), FileError) and "backtracks" in str(out["error"]), out


# ---------------------------------------------------------------- quantized tensors of the wrong type (make fuzz)

def _retyped(tmp_path, name, change):
    """A copy of fixture `name` whose tensors `change` maps to new tensors (None: removed)."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    t = load_file(str(d / "model.safetensors"))
    for k, f in change.items():
        if f is None:
            del t[k]
        else:
            t[k] = f(t[k])
    save_file(t, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("name, tensor, dtype", [
    ("gptq_4bit_g64_asym", "model.layers.0.self_attn.q_proj.qzeros", torch.float32),
    ("gptq_4bit_g64_asym", "model.layers.0.mlp.down_proj.scales", torch.int16),
    ("gptq_4bit_g32_desc_act", "model.layers.1.self_attn.v_proj.g_idx", torch.float32),
    ("gptq_4bit_g64_asym", "model.layers.0.mlp.up_proj.g_idx", torch.uint32),  # (torch has no min() for it)
    ("awq_gemm_4bit_g128", "model.layers.0.self_attn.q_proj.scales", torch.int16),
    ("awq_gemm_4bit_g128", "model.layers.0.self_attn.q_proj.qzeros", torch.float32),
])
def test_gptq_awq_tensors_of_another_type_are_refused(tmp_path, name, tensor, dtype):
    """The same bytes under another type (qzeros as floats, scales as integers) loaded as if they
    were the right ones: the model then ran on garbage weights without a word."""
    refused(_retyped(tmp_path, name, {tensor: lambda t: t.view(dtype)}), tensor.rsplit(".", 2)[0], "wrong types")


def test_act_order_gptq_without_g_idx_is_refused(tmp_path):
    """With desc_act the input columns' groups are only in g_idx; k // group_size in its place was wrong."""
    refused(_retyped(tmp_path, "gptq_4bit_g32_desc_act", {"model.layers.1.self_attn.v_proj.g_idx": None}),
            "v_proj", "desc_act", "g_idx")


@pytest.mark.parametrize("name, tensor, dtype", [
    ("bnb_nf4", "model.layers.0.self_attn.q_proj.weight.quant_map", torch.int32),
    ("bnb_nf4_dq", "model.layers.0.mlp.gate_proj.weight.nested_quant_map", torch.int32),
    ("bnb_nf4", "model.layers.0.self_attn.q_proj.weight.absmax", torch.int32),
    ("bnb_int8", "model.layers.0.self_attn.q_proj.SCB", torch.int32),
])
def test_bitsandbytes_scales_and_code_books_of_another_type_are_refused(tmp_path, name, tensor, dtype):
    refused(_retyped(tmp_path, name, {tensor: lambda t: t.view(dtype)}), tensor, "not a floating-point tensor")


def test_a_tokenizer_json_that_makes_the_reader_panic(folder):
    """A malformed Precompiled normalizer: the Rust reader panics (a BaseException) at load."""
    tj = json.loads((folder / "tokenizer.json").read_text())
    tj["normalizer"] = {"type": "Precompiled", "precompiled_charsmap": "!!"}
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    refused(folder, "tokenizer.json", "unreadable tokenizer")


def test_a_dangling_link_beside_the_weights_does_not_stop_a_load(folder):
    """A *.safetensors link to nothing beside model.safetensors (not read): counting the folder's
    weight bytes for the load's summary stat()ed it and failed with a raw FileNotFoundError."""
    (folder / "reference.safetensors").symlink_to(folder / "gone.safetensors")
    assert "llm" in load_within(folder)


@pytest.mark.parametrize("name, tensor", [("awq_gemm_4bit_g128", "model.layers.0.self_attn.k_proj.scales"),
                                          ("awq_gemm_4bit_g128", "model.layers.0.self_attn.k_proj.qweight"),
                                          ("gptq_4bit_g64_asym", "model.layers.0.self_attn.k_proj.scales"),
                                          ("gptq_4bit_g64_asym", "model.layers.0.self_attn.k_proj.qzeros")])
def test_quantized_tensors_that_are_not_matrices(tmp_path, name, tensor):
    """A flattened scales or qweight: its second dimension was read anyway (IndexError)."""
    refused(_retyped(tmp_path, name, {tensor: lambda t: t.reshape(-1)}), "k_proj", "inconsistent shapes")


@pytest.mark.parametrize("name, tensor", [("gptq_4bit_g64_asym", "model.layers.0.self_attn.k_proj.scales"),
                                          ("gptq_4bit_g32_desc_act", "model.layers.0.self_attn.q_proj.qzeros"),
                                          ("awq_gemm_4bit_g128", "model.layers.1.mlp.up_proj.scales")])
def test_a_quantized_layer_without_its_scales_or_zeros(tmp_path, name, tensor):
    """It was a KeyError naming the tensor, raw."""
    refused(_retyped(tmp_path, name, {tensor: None}), "lacks", tensor)


def test_bitsandbytes_vectors_with_a_unit_dimension_load(tmp_path):
    """A code book stored [1, 16] (the same 16 values) failed inside the layer's setup (RuntimeError)."""
    d = _retyped(tmp_path, "bnb_nf4_dq", {"model.layers.1.mlp.up_proj.weight.quant_map": lambda t: t.reshape(1, -1),
                                          "model.layers.1.mlp.up_proj.weight.absmax": lambda t: t.reshape(-1, 1)})
    assert "llm" in load_within(d)


@pytest.mark.parametrize("tensor, change", [("nested_absmax", lambda t: torch.cat([t, t])),
                                            ("nested_quant_map", lambda t: t[:16])])
def test_double_quantization_tensors_of_the_wrong_size(tmp_path, tensor, change):
    """A nested absmax with a value too many was ignored; a nested code book too short read past its end."""
    d = _retyped(tmp_path, "bnb_nf4_dq", {f"model.layers.1.mlp.down_proj.weight.{tensor}": change})
    refused(d, "down_proj", "double-quantization tensors do not match")


@pytest.mark.parametrize("shard", ["gone.safetensors", "x" * 5000 + ".safetensors"])
def test_a_missing_shard_is_named_short_by_its_index(folder, shard):
    """A 5000-character shard name (missing: past the system's limit) made a 5 kB error line."""
    sharded(folder, {"model.embed_tokens.weight": shard})
    msg = refused(folder, "model.safetensors.index.json", "shard listed in the index is missing", shard[:10])
    assert len(msg) < 300


def test_double_quantized_absmax_of_another_integer_type(tmp_path):
    """int16 absmax codes indexed the 256-entry nested code book out of range (IndexError)."""
    d = _retyped(tmp_path, "bnb_nf4_dq", {"model.layers.1.self_attn.v_proj.weight.absmax": lambda t: t.to(torch.int16)})
    refused(d, "v_proj.weight.absmax", "uint8")


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8])
def test_a_float_weight_stored_as_integers_is_refused(folder, dtype):
    """The bytes of a float32 weight declared I32 (or codes declared U8) were converted to floats
    as integers: the model ran on garbage without a word."""
    t = _weights(folder)
    w = t["model.layers.1.mlp.down_proj.weight"]
    t["model.layers.1.mlp.down_proj.weight"] = w.view(torch.int32) if dtype == torch.int32 else w.to(torch.uint8)
    _save(t, folder / "model.safetensors")
    refused(folder, "model.layers.1.mlp.down_proj.weight", "not a floating-point type")
