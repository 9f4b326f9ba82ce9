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
