"""ModelConfig: one description of every supported architecture, from config.json or GGUF."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, asdict
from typing import Any

from .errors import FileError, UnsupportedFormat

# HF `architectures` / `model_type` and GGUF `general.architecture` names we run.
LLAMA_FAMILY = {"llama", "mistral", "qwen2", "smollm"}
SUPPORTED = sorted(LLAMA_FAMILY | {"gemma3", "gemma3_text"})


@dataclass
class ModelConfig:
    arch: str  # "llama" (Llama/Mistral/Qwen2/SmolLM) or "gemma3"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float = 1e-5
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_scaling dict (llama3 supported)
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    # Gemma 3 specifics; defaults give the Llama family.
    act: str = "silu"  # or "gelu_tanh" (GeGLU)
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + w)
    qk_norm: bool = False
    sandwich_norm: bool = False  # extra post-attention / post-ffn norms
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(dim)
    attn_scale: float | None = None  # None -> head_dim ** -0.5
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "full" | "sliding" per layer
    rope_local_theta: float | None = None  # rope base for sliding layers
    final_softcap: float | None = None

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full"] * self.n_layers
        if self.attn_scale is None:
            self.attn_scale = self.head_dim ** -0.5

    def to_dict(self) -> dict:
        return asdict(self)



def _unsupported(name: str) -> UnsupportedFormat:
    return UnsupportedFormat(f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED)}")


def _gemma3_layer_types(n_layers: int, pattern: int = 6) -> list[str]:
    # Gemma 3 interleaves 5 sliding-window layers with 1 global layer.
    return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers)]


def from_hf_config(cfg: dict[str, Any]) -> ModelConfig:
    model_type = cfg.get("model_type", "")
    if model_type == "gemma3":  # multimodal wrapper: the text model is nested
        cfg = {**cfg, **cfg.get("text_config", {})}
        model_type = "gemma3_text"
    if model_type not in LLAMA_FAMILY and model_type != "gemma3_text":
        raise _unsupported(model_type or str(cfg.get("architectures")))
    try:
        dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        common = dict(
            vocab_size=cfg["vocab_size"], dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or dim // n_heads, ffn_dim=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6), max_seq_len=cfg.get("max_position_embeddings", 4096),
            rope_theta=cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            tie_embeddings=cfg.get("tie_word_embeddings", model_type == "gemma3_text"),
        )
    except KeyError as e:
        raise FileError(f"config.json lacks {e.args[0]!r}") from None
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    if model_type != "gemma3_text":
        if scaling and scaling.get("rope_type", scaling.get("type")) != "llama3":
            raise UnsupportedFormat(f"rope scaling {scaling!r} is not supported (only llama3)")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        return ModelConfig(arch="llama", rope_scaling=scaling, qkv_bias=model_type == "qwen2",
                           sliding_window=window,
                           layer_types=["sliding" if window else "full"] * common["n_layers"], **common)
    rope_params = cfg.get("rope_parameters") or {}
    local_theta = cfg.get("rope_local_base_freq") or (rope_params.get("sliding_attention") or {}).get("rope_theta", 10000.0)
    if "rope_theta" not in cfg and "full_attention" in rope_params:
        common["rope_theta"] = rope_params["full_attention"].get("rope_theta", 1e6)
    types = cfg.get("layer_types")
    types = [("sliding" if t == "sliding_attention" else "full") for t in types] if types else \
        _gemma3_layer_types(common["n_layers"], cfg.get("sliding_window_pattern", 6))
    if (cfg.get("rope_scaling") or {}).get("rope_type", "default") not in ("default", None):
        raise UnsupportedFormat("Gemma 3 rope scaling (the 4B+ long-context variants) is not supported yet")
    return ModelConfig(
        arch="gemma3", act="gelu_tanh", norm_offset=1.0, qk_norm=True, sandwich_norm=True,
        embed_scale=math.sqrt(dim), attn_scale=cfg.get("query_pre_attn_scalar", common["head_dim"]) ** -0.5,
        sliding_window=cfg.get("sliding_window", 512), layer_types=types, rope_local_theta=local_theta,
        final_softcap=cfg.get("final_logit_softcapping"), **common)


def from_gguf_metadata(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    arch = meta.get("general.architecture", "")
    if arch not in ("llama", "qwen2", "gemma3"):
        raise _unsupported(arch)

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    try:
        dim, n_heads, n_layers = get("embedding_length"), get("attention.head_count"), get("block_count")
        common = dict(
            vocab_size=get("vocab_size", vocab_size), dim=dim, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=get("attention.head_count_kv", n_heads),
            head_dim=get("attention.key_length", dim // n_heads), ffn_dim=get("feed_forward_length"),
            norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5), max_seq_len=get("context_length", 4096),
            rope_theta=get("rope.freq_base", 10000.0 if arch != "gemma3" else 1e6),
        )
    except TypeError:
        raise FileError(f"GGUF metadata for {arch!r} is incomplete") from None
    if None in common.values():
        missing = [k for k, v in common.items() if v is None]
        raise FileError(f"GGUF metadata lacks {', '.join(missing)}")
    if arch == "gemma3":
        window = get("attention.sliding_window", 512)
        return ModelConfig(
            arch="gemma3", act="gelu_tanh", norm_offset=1.0, qk_norm=True, sandwich_norm=True,
            embed_scale=math.sqrt(dim), tie_embeddings=True, sliding_window=window,
            layer_types=_gemma3_layer_types(n_layers), rope_local_theta=10000.0, **common)
    scaling = None
    if get("rope.scaling.type") not in (None, "none"):
        raise UnsupportedFormat(f"GGUF rope scaling {get('rope.scaling.type')!r} is not supported")
    return ModelConfig(arch="llama", qkv_bias=arch == "qwen2", rope_scaling=scaling, **common)
