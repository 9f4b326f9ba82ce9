"""ModelConfig: one description of every supported architecture, and the checks its values pass.
Each architecture's module (core/arch/) builds one from a config.json or a GGUF's metadata."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, asdict
from typing import Any

from .errors import FileError, UnsupportedFormat

DEFAULT_CTX = 4096  # the context allocated unless --ctx says otherwise (at most the model's)


@dataclass
class ModelConfig:
    arch: str  # the core/arch module's name: "llama" (Llama/Mistral/Qwen2/SmolLM), "gemma3", "qwen3", ...
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
    rope_scaling: dict | None = None  # HF rope_scaling dict (llama3, longrope)
    rope_dim: int | None = None  # rotary dimensions per head (Phi-4-mini's partial rotary); None: all
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    # Gemma 3 specifics; defaults give the Llama family.
    act: str = "silu"  # or "gelu_tanh" (GeGLU), "swiglu_clamp" (gpt-oss)
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + w)
    qk_norm: bool = False
    sandwich_norm: bool = False  # extra post-attention / post-ffn norms
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(dim)
    attn_scale: float | None = None  # None -> head_dim ** -0.5
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "full" | "sliding" per layer
    rope_local_theta: float | None = None  # rope base for sliding layers
    final_softcap: float | None = None
    # Mixture of experts; n_experts 0 is a dense model.
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalized to sum to 1
    dense_layers: list[int] = field(default_factory=list)  # layers with a plain MLP (Qwen3-MoE's mlp_only_layers)
    routing: str = "softmax_topk"  # or "topk_softmax": a softmax over the top k logits only (gpt-oss)
    router_bias: bool = False
    expert_bias: bool = False  # biases on every expert's gate, up and down projections
    # gpt-oss specifics
    o_bias: bool = False  # a bias on the attention's output projection
    attn_sinks: bool = False  # a learned logit per head in each softmax, its value vector zero
    swiglu_limit: float = 7.0  # act "swiglu_clamp": gate clamped above, up clamped both sides
    swiglu_alpha: float = 1.702  # ... and gate * sigmoid(alpha * gate) * (up + 1)

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full"] * self.n_layers
        if self.attn_scale is None:
            self.attn_scale = self.head_dim ** -0.5

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and layer not in self.dense_layers

    def to_dict(self) -> dict:
        return asdict(self)

    def check(self, source: str = "config") -> "ModelConfig":
        """Refuse values no real model has, before anything is allocated from them: a corrupt or
        hostile config must fail with a message, not a huge allocation or a deep traceback.
        source: where the values came from, for the message ("config.json", "GGUF metadata")."""
        def bad(name, value, rule):
            raise FileError(f"{source}: {name} {rule}, got {shown_value(value)}")

        for name, hi in INT_LIMITS.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
                bad(KEY_NAMES.get(name, name), v, f"must be an integer from 1 to {hi}")
        if self.n_heads % self.n_kv_heads:
            bad(KEY_NAMES["n_kv_heads"], self.n_kv_heads, f"must divide the head count ({self.n_heads})")
        if self.head_dim % 2:
            bad(KEY_NAMES["head_dim"], self.head_dim, "must be even (rotary embeddings pair dimensions)")
        for name in ("norm_eps", "rope_theta", "embed_scale", "attn_scale"):
            v = getattr(self, name)
            if not number(v) or not 0 < v < 1e30:
                bad(KEY_NAMES.get(name, name), v, "must be a positive number")
        if self.rope_local_theta is not None and (not number(self.rope_local_theta) or self.rope_local_theta <= 0):
            bad("rope_local_base_freq", self.rope_local_theta, "must be a positive number")
        if self.final_softcap is not None and (not number(self.final_softcap) or self.final_softcap <= 0):
            bad("final_logit_softcapping", self.final_softcap, "must be a positive number")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            bad("sliding_window", self.sliding_window, "must be a positive integer")
        if self.rope_dim is not None and (not isinstance(self.rope_dim, int) or isinstance(self.rope_dim, bool)
                                          or not 2 <= self.rope_dim <= self.head_dim or self.rope_dim % 2):
            bad("partial_rotary_factor", self.rope_dim, f"must give an even rotary size up to head_dim ({self.head_dim})")
        if self.n_experts:
            for name, v, hi in (("num_experts", self.n_experts, 4096), ("num_experts_per_tok", self.n_experts_used,
                                                                        self.n_experts),
                                ("moe_intermediate_size", self.expert_ffn_dim, 1 << 20)):
                if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
                    bad(name, v, f"must be an integer from 1 to {hi}")
            if not isinstance(self.dense_layers, list) or any(
                    not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.n_layers for i in self.dense_layers):
                bad("mlp_only_layers", self.dense_layers, f"must list layer numbers below {self.n_layers}")
        if self.act not in ("silu", "gelu_tanh", "swiglu_clamp"):
            bad("hidden_act", self.act, "must be silu, gelu_pytorch_tanh or gpt-oss's clamped SwiGLU")
        if self.routing not in ("softmax_topk", "topk_softmax"):
            bad("routing", self.routing, "must be softmax_topk or topk_softmax")
        for name in ("swiglu_limit", "swiglu_alpha"):
            v = getattr(self, name)
            if not number(v) or not 0 < v < 1e30:
                bad(name, v, "must be a positive number")
        if not isinstance(self.tie_embeddings, bool):
            bad("tie_word_embeddings", self.tie_embeddings, "must be true or false")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            bad("rope_scaling", self.rope_scaling, "must be an object")
        if (not isinstance(self.layer_types, list) or len(self.layer_types) != self.n_layers
                or any(t not in ("full", "sliding") for t in self.layer_types)):
            bad("layer_types", self.layer_types, f"must list {self.n_layers} attention types")
        return self


# Far above any real model, far below what a hostile file could make brisk allocate.
INT_LIMITS = {"vocab_size": 1 << 24, "dim": 1 << 17, "n_layers": 1024, "n_heads": 1024, "n_kv_heads": 1024,
               "head_dim": 4096, "ffn_dim": 1 << 20, "max_seq_len": 1 << 27}
KEY_NAMES = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
              "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
              "ffn_dim": "intermediate_size", "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps",
              "rope_theta": "rope_theta", "attn_scale": "query_pre_attn_scalar", "embed_scale": "hidden_size"}
GGUF_KEY_NAMES = {"vocab_size": "vocab_size", "dim": "embedding_length", "n_layers": "block_count",
                   "n_heads": "attention.head_count", "n_kv_heads": "attention.head_count_kv",
                   "head_dim": "attention.key_length", "ffn_dim": "feed_forward_length",
                   "max_seq_len": "context_length", "norm_eps": "attention.layer_norm_rms_epsilon",
                   "rope_theta": "rope.freq_base"}


def number(v) -> bool:
    """A finite number (an integer too big for a float is not: math.isfinite would overflow on it)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return abs(v) < 10**300 if isinstance(v, int) else math.isfinite(v)


def shown_value(v) -> str:
    from .errors import shown

    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**20:
        return f"a {len(str(abs(v)))}-digit number"
    return shown(v)


def check_fields(common: dict, source: str, names: dict) -> None:
    """The raw values, before any arithmetic on them (dim // n_heads, sqrt(dim)) can fail."""
    for name, hi in INT_LIMITS.items():
        v = common.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
            raise FileError(f"{source}: {names.get(name, name)} must be an integer from 1 to {hi}, got {shown_value(v)}")
    for name in ("norm_eps", "rope_theta"):
        v = common.get(name)
        if not number(v) or not 0 < v < 1e30:
            raise FileError(f"{source}: {names.get(name, name)} must be a positive number, got {shown_value(v)}")
