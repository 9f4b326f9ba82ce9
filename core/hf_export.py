"""Writing a model as a Hugging Face folder: config.json, safetensors shards (with an index when
there is more than one), tokenizer and generation config. Used by `brisk quantize`.

For a GGUF source there is no config.json to copy, so one is built from the ModelConfig in the
form transformers reads for its architecture (core/arch).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .arch import by_name
from .checkpoint import Checkpoint
from .config import ModelConfig
from .errors import BriskError

MAX_SHARD_BYTES = 2 * 1024**3  # what transformers' save_pretrained does by default these days
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json")


def source_config(ckpt: Checkpoint, dtype: torch.dtype) -> dict:
    """The base model's config.json (copied for an HF folder, built for a GGUF), with torch_dtype set."""
    if ckpt.kind == "hf":
        cfg = json.loads((ckpt.path / "config.json").read_text())
        cfg.pop("quantization_config", None)
    else:
        if "rope_freqs" in ckpt.extra:
            raise BriskError(f"{ckpt.name}: a GGUF with a rope_freqs tensor (llama3 rope scaling) cannot be "
                             "exported to a Hugging Face config yet; use the original HF checkpoint")
        cfg = hf_config(ckpt.config, ckpt.tokenizer)
    name = str(dtype).removeprefix("torch.")
    cfg["torch_dtype"] = name
    if "dtype" in cfg:  # the name transformers 5 writes
        cfg["dtype"] = name
    return cfg


def hf_config(c: ModelConfig, tokenizer) -> dict:
    """config.json for `c`, in the form transformers reads for its architecture (core/arch)."""
    common = {
        "vocab_size": c.vocab_size, "hidden_size": c.dim, "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.norm_eps, "max_position_embeddings": c.max_seq_len,
        "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": tokenizer.bos_id, "eos_token_id": _eos_id(tokenizer),
    }
    return by_name(c.arch).hf_config(c, common)


def _eos_id(tokenizer) -> int | None:
    if tokenizer.eos_token is not None:
        return tokenizer.backend.token_to_id(tokenizer.eos_token)
    return min(tokenizer.eos_ids) if tokenizer.eos_ids else None


def write_tokenizer(ckpt: Checkpoint, folder: Path) -> None:
    """Copy the tokenizer files of an HF source as they are; write them for a GGUF source."""
    if ckpt.kind == "hf":
        for name in TOKENIZER_FILES:
            if (ckpt.path / name).is_file():
                shutil.copyfile(ckpt.path / name, folder / name)
        return
    tok = ckpt.tokenizer
    tok.save(folder)
    if tok.add_bos:
        _bos_post_processor(folder / "tokenizer.json", tok.bos_token, tok.bos_id)


def _bos_post_processor(path: Path, bos: str, bos_id: int) -> None:
    """A GGUF says "add BOS" in its metadata; tokenizer.json says it with a post-processor, which is
    what transformers goes by (brisk reads add_bos_token from tokenizer_config.json, and adds BOS
    itself, so it is not added twice)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("post_processor") is not None:
        return
    special = {"SpecialToken": {"id": bos, "type_id": 0}}
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [special, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [special, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": bos, "type_id": 1}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def write_generation_config(ckpt: Checkpoint, folder: Path) -> None:
    gen = dict(ckpt.generation)  # a GGUF's holds only its recommended sampling: add the special ids
    tok = ckpt.tokenizer
    if (not gen or ckpt.kind == "gguf") and (tok.bos_id is not None or tok.eos_ids):
        gen = {"bos_token_id": tok.bos_id, "eos_token_id": sorted(tok.eos_ids) if len(tok.eos_ids) > 1 else _eos_id(tok),
               **gen}
    if not gen:
        return
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_shards(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Save tensors (in the dict's order) as model.safetensors, or as model-0000k-of-0000n shards of
    at most max_shard_bytes each plus model.safetensors.index.json. Returns the file names."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    umask = os.umask(0)
    os.umask(umask)
    for fname, shard in zip(names, shards):
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        os.chmod(folder / fname, 0o666 & ~umask)  # safetensors creates files 0600; others read a model
    if n > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: fname for fname, shard in zip(names, shards) for k in shard}}
        write_json(folder / "model.safetensors.index.json", index)
    return names
