"""ModelConfig: one description of every supported architecture, from config.json or GGUF."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, asdict
from typing import Any

from .errors import FileError, UnsupportedFormat

# HF `architectures` / `model_type` and GGUF `general.architecture` names we run.
LLAMA_FAMILY = {"llama", "mistral", "qwen2", "smollm"}
SUPPORTED = sorted(LLAMA_FAMILY | {"gemma3", "gemma3_text"})
DEFAULT_CTX = 4096  # the context allocated unless --ctx says otherwise (at most the model's)


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

    def check(self, source: str = "config") -> "ModelConfig":
        """Refuse values no real model has, before anything is allocated from them: a corrupt or
        hostile config must fail with a message, not a huge allocation or a deep traceback.
        source: where the values came from, for the message ("config.json", "GGUF metadata")."""
        def bad(name, value, rule):
            raise FileError(f"{source}: {name} {rule}, got {_shown(value)}")

        for name, hi in _INT_LIMITS.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
                bad(_KEY_NAMES.get(name, name), v, f"must be an integer from 1 to {hi}")
        if self.n_heads % self.n_kv_heads:
            bad(_KEY_NAMES["n_kv_heads"], self.n_kv_heads, f"must divide the head count ({self.n_heads})")
        if self.head_dim % 2:
            bad(_KEY_NAMES["head_dim"], self.head_dim, "must be even (rotary embeddings pair dimensions)")
        for name in ("norm_eps", "rope_theta", "embed_scale", "attn_scale"):
            v = getattr(self, name)
            if not _number(v) or not 0 < v < 1e30:
                bad(_KEY_NAMES.get(name, name), v, "must be a positive number")
        if self.rope_local_theta is not None and (not _number(self.rope_local_theta) or self.rope_local_theta <= 0):
            bad("rope_local_base_freq", self.rope_local_theta, "must be a positive number")
        if self.final_softcap is not None and (not _number(self.final_softcap) or self.final_softcap <= 0):
            bad("final_logit_softcapping", self.final_softcap, "must be a positive number")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            bad("sliding_window", self.sliding_window, "must be a positive integer")
        if not isinstance(self.tie_embeddings, bool):
            bad("tie_word_embeddings", self.tie_embeddings, "must be true or false")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            bad("rope_scaling", self.rope_scaling, "must be an object")
        if (not isinstance(self.layer_types, list) or len(self.layer_types) != self.n_layers
                or any(t not in ("full", "sliding") for t in self.layer_types)):
            bad("layer_types", self.layer_types, f"must list {self.n_layers} attention types")
        return self


# Far above any real model, far below what a hostile file could make brisk allocate.
_INT_LIMITS = {"vocab_size": 1 << 24, "dim": 1 << 17, "n_layers": 1024, "n_heads": 1024, "n_kv_heads": 1024,
               "head_dim": 4096, "ffn_dim": 1 << 20, "max_seq_len": 1 << 27}
_KEY_NAMES = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
              "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
              "ffn_dim": "intermediate_size", "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps",
              "rope_theta": "rope_theta", "attn_scale": "query_pre_attn_scalar", "embed_scale": "hidden_size"}
_GGUF_KEY_NAMES = {"vocab_size": "vocab_size", "dim": "embedding_length", "n_layers": "block_count",
                   "n_heads": "attention.head_count", "n_kv_heads": "attention.head_count_kv",
                   "head_dim": "attention.key_length", "ffn_dim": "feed_forward_length",
                   "max_seq_len": "context_length", "norm_eps": "attention.layer_norm_rms_epsilon",
                   "rope_theta": "rope.freq_base"}


def _number(v) -> bool:
    """A finite number (an integer too big for a float is not: math.isfinite would overflow on it)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return abs(v) < 10**300 if isinstance(v, int) else math.isfinite(v)


def _shown(v) -> str:
    from .errors import shown

    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**20:
        return f"a {len(str(abs(v)))}-digit number"
    return shown(v)


def _check_fields(common: dict, source: str, names: dict) -> None:
    """The raw values, before any arithmetic on them (dim // n_heads, sqrt(dim)) can fail."""
    for name, hi in _INT_LIMITS.items():
        v = common.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
            raise FileError(f"{source}: {names.get(name, name)} must be an integer from 1 to {hi}, got {_shown(v)}")
    for name in ("norm_eps", "rope_theta"):
        v = common.get(name)
        if not _number(v) or not 0 < v < 1e30:
            raise FileError(f"{source}: {names.get(name, name)} must be a positive number, got {_shown(v)}")



def _unsupported(name: str) -> UnsupportedFormat:
    return UnsupportedFormat(f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED)}")


def _gemma3_layer_types(n_layers: int, pattern: int = 6) -> list[str]:
    # Gemma 3 interleaves 5 sliding-window layers with 1 global layer.
    return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers)]


def from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    if not isinstance(cfg, dict):
        raise FileError(f"{source}: must be a JSON object, got {_shown(cfg)}")
    model_type = cfg.get("model_type", "")
    if not isinstance(model_type, str):
        raise FileError(f"{source}: model_type must be a string, got {_shown(model_type)}")
    if model_type == "gemma3":  # multimodal wrapper: the text model is nested
        text = cfg.get("text_config", {})
        cfg = {**cfg, **(text if isinstance(text, dict) else {})}
        model_type = "gemma3_text"
    if model_type not in LLAMA_FAMILY and model_type != "gemma3_text":
        raise _unsupported(model_type or str(cfg.get("architectures")))
    for key in ("hidden_size", "num_attention_heads"):
        v = cfg.get(key)
        if key in cfg and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1 << 17):
            raise FileError(f"{source}: {key} must be an integer from 1 to {1 << 17}, got {_shown(v)}")
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key) is not None and not isinstance(cfg.get(key), dict):
            raise FileError(f"{source}: {key} must be an object, got {_shown(cfg.get(key))}")
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
        raise FileError(f"{source} lacks {e.args[0]!r}") from None
    _check_fields(common, source, _KEY_NAMES)
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    if model_type != "gemma3_text":
        if scaling and scaling.get("rope_type", scaling.get("type")) != "llama3":
            raise UnsupportedFormat(f"rope scaling {scaling!r} is not supported (only llama3)")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        return ModelConfig(arch="llama", rope_scaling=scaling, qkv_bias=model_type == "qwen2",
                           sliding_window=window,
                           layer_types=["sliding" if window else "full"] * common["n_layers"], **common).check(source)
    rope_params = cfg.get("rope_parameters") or {}
    local_theta = cfg.get("rope_local_base_freq") or (rope_params.get("sliding_attention") or {}).get("rope_theta", 10000.0)
    if "rope_theta" not in cfg and "full_attention" in rope_params:
        common["rope_theta"] = rope_params["full_attention"].get("rope_theta", 1e6)
    types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern", 6)
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise FileError(f"{source}: sliding_window_pattern must be a positive integer, got {_shown(pattern)}")
    if types is not None and not isinstance(types, list):
        raise FileError(f"{source}: layer_types must be a list, got {_shown(types)}")
    types = [("sliding" if t == "sliding_attention" else "full") for t in types] if types else \
        _gemma3_layer_types(common["n_layers"], pattern)
    scalar = cfg.get("query_pre_attn_scalar", common["head_dim"])
    if not _number(scalar) or scalar <= 0:
        raise FileError(f"{source}: query_pre_attn_scalar must be a positive number, got {_shown(scalar)}")
    if (cfg.get("rope_scaling") or {}).get("rope_type", "default") not in ("default", None):
        raise UnsupportedFormat("Gemma 3 rope scaling (the 4B+ long-context variants) is not supported yet")
    return ModelConfig(
        arch="gemma3", act="gelu_tanh", norm_offset=1.0, qk_norm=True, sandwich_norm=True,
        embed_scale=math.sqrt(dim), attn_scale=cfg.get("query_pre_attn_scalar", common["head_dim"]) ** -0.5,
        sliding_window=cfg.get("sliding_window", 512), layer_types=types, rope_local_theta=local_theta,
        final_softcap=cfg.get("final_logit_softcapping"), **common).check(source)


def from_gguf_metadata(meta: dict[str, Any], vocab_size: int, source: str = "GGUF metadata") -> ModelConfig:
    arch = meta.get("general.architecture", "")
    if not isinstance(arch, str):
        raise FileError(f"{source}: general.architecture must be a string, got {_shown(arch)}")
    if arch not in ("llama", "qwen2", "gemma3"):
        raise _unsupported(arch)

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    for key in ("embedding_length", "attention.head_count"):
        v = get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1 << 17):
            raise FileError(f"{source}: {arch}.{key} must be an integer from 1 to {1 << 17}, got {_shown(v)}")
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
    _check_fields(common, source, {k: f"{arch}.{v}" for k, v in _GGUF_KEY_NAMES.items()})
    if arch == "gemma3":
        window = get("attention.sliding_window", 512)
        cfg = ModelConfig(
            arch="gemma3", act="gelu_tanh", norm_offset=1.0, qk_norm=True, sandwich_norm=True,
            embed_scale=math.sqrt(dim), tie_embeddings=True, sliding_window=window,
            layer_types=_gemma3_layer_types(n_layers), rope_local_theta=10000.0, **common)
        return cfg.check(source)
    scaling = None
    if get("rope.scaling.type") not in (None, "none"):
        raise UnsupportedFormat(f"GGUF rope scaling {get('rope.scaling.type')!r} is not supported")
    return ModelConfig(arch="llama", qkv_bias=arch == "qwen2", rope_scaling=scaling, **common).check(source)
