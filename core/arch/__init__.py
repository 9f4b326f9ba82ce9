"""The architectures brisk runs, one module each, and the registry that finds them.

An architecture module says what model.py's shared blocks cannot guess: how its config.json and
its GGUF metadata become a ModelConfig, how its checkpoint's tensor names map onto brisk's modules
(which follow Hugging Face's Llama names), and how to write its config.json back. The forward is
model.py's, switched by the ModelConfig; a new dense architecture is one module here and its tests.
"""
from __future__ import annotations

from typing import Any

from ..config import GGUF_KEY_NAMES, KEY_NAMES, ModelConfig, check_fields, shown_value
from ..errors import FileError, UnsupportedFormat
from .base import Architecture, split_gguf_table
from . import gemma3, gpt_oss, llama, mixtral, phi3, qwen3

ARCHITECTURES: tuple[Architecture, ...] = (llama.ARCH, llama.QWEN2, mixtral.ARCH, gemma3.ARCH, qwen3.DENSE, qwen3.MOE, phi3.ARCH,
                                           gpt_oss.ARCH)
SUPPORTED = sorted({t for a in ARCHITECTURES for t in a.hf_types})

__all__ = ["ARCHITECTURES", "Architecture", "SUPPORTED", "by_name", "from_gguf_metadata", "from_hf_config",
           "gguf_architecture", "split_gguf_table"]


def by_name(name: str) -> Architecture:
    """The architecture of a ModelConfig (its `arch`)."""
    for a in ARCHITECTURES:
        if a.name == name:
            return a
    raise _unsupported(name)


def gguf_architecture(meta: dict) -> Architecture:
    """The architecture a GGUF's metadata describes (Mixtral is llama.cpp's "llama" with experts)."""
    name = meta.get("general.architecture", "")
    if not isinstance(name, str):
        raise FileError(f"GGUF metadata: general.architecture must be a string, got {shown_value(name)}")
    found = [a for a in ARCHITECTURES if a.takes_gguf(name, meta)]
    if not found:
        raise _unsupported(name)
    return found[0]


def _unsupported(name: str) -> UnsupportedFormat:
    return UnsupportedFormat(f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED)}")


def from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    if not isinstance(cfg, dict):
        raise FileError(f"{source}: must be a JSON object, got {shown_value(cfg)}")
    model_type = cfg.get("model_type", "")
    if not isinstance(model_type, str):
        raise FileError(f"{source}: model_type must be a string, got {shown_value(model_type)}")
    arch = next((a for a in ARCHITECTURES if model_type in a.hf_types), None)
    if arch is None:
        raise _unsupported(model_type or str(cfg.get("architectures")))
    cfg = arch.text_config(cfg)
    for key in ("hidden_size", "num_attention_heads"):
        v = cfg.get(key)
        if key in cfg and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1 << 17):
            raise FileError(f"{source}: {key} must be an integer from 1 to {1 << 17}, got {shown_value(v)}")
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key) is not None and not isinstance(cfg.get(key), dict):
            raise FileError(f"{source}: {key} must be an object, got {shown_value(cfg.get(key))}")
    try:
        dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        common = dict(
            vocab_size=cfg["vocab_size"], dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or dim // n_heads, ffn_dim=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6), max_seq_len=cfg.get("max_position_embeddings", 4096),
            rope_theta=cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            tie_embeddings=cfg.get("tie_word_embeddings", arch.tied_by_default),
        )
    except KeyError as e:
        raise FileError(f"{source} lacks {e.args[0]!r}") from None
    check_fields(common, source, KEY_NAMES)
    return arch.config_from_hf(cfg, common, source).check(source)


def from_gguf_metadata(meta: dict[str, Any], vocab_size: int, source: str = "GGUF metadata") -> ModelConfig:
    arch = gguf_architecture(meta)
    prefix = meta["general.architecture"]

    def get(key, default=None):
        return meta.get(f"{prefix}.{key}", default)

    for key in ("embedding_length", "attention.head_count"):
        v = get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1 << 17):
            raise FileError(f"{source}: {prefix}.{key} must be an integer from 1 to {1 << 17}, got {shown_value(v)}")
    try:
        dim, n_heads, n_layers = get("embedding_length"), get("attention.head_count"), get("block_count")
        common = dict(
            vocab_size=get("vocab_size", vocab_size), dim=dim, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=get("attention.head_count_kv", n_heads),
            head_dim=get("attention.key_length", dim // n_heads), ffn_dim=get("feed_forward_length"),
            norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5), max_seq_len=get("context_length", 4096),
            rope_theta=get("rope.freq_base", arch.gguf_rope_theta),
        )
    except TypeError:
        raise FileError(f"GGUF metadata for {prefix!r} is incomplete") from None
    if common["ffn_dim"] is None and arch.ffn_optional:  # an MoE model with no dense layer
        common["ffn_dim"] = get("expert_feed_forward_length")
    if None in common.values():
        missing = [k for k, v in common.items() if v is None]
        raise FileError(f"GGUF metadata lacks {', '.join(missing)}")
    check_fields(common, source, {k: f"{prefix}.{v}" for k, v in GGUF_KEY_NAMES.items()})
    return arch.config_from_gguf(get, common, source).check(source)
