"""Gemma 3 (text): GeGLU, q/k norms, sandwich norms around attention and MLP, (1 + w) norm scales,
embeddings scaled by sqrt(dim), and five sliding-window layers (own rope base) per global one."""
from __future__ import annotations

import math

from ..config import ModelConfig, number, shown_value
from ..errors import FileError, UnsupportedFormat
from .base import Architecture


def layer_pattern(n_layers: int, pattern: int = 6) -> list[str]:
    # Gemma 3 interleaves 5 sliding-window layers with 1 global layer.
    return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers)]


class Gemma3(Architecture):
    name = "gemma3"
    hf_types = ("gemma3", "gemma3_text")
    gguf_names = ("gemma3",)
    tied_by_default = True
    gguf_rope_theta = 1e6
    gguf_norm_offset = 1.0
    gguf_names_here = {"ffn_norm": "pre_feedforward_layernorm"}

    def text_config(self, cfg):
        if cfg.get("model_type") == "gemma3":  # the multimodal wrapper: the text model is nested
            text = cfg.get("text_config", {})
            cfg = {**cfg, **(text if isinstance(text, dict) else {}), "model_type": "gemma3_text"}
        return cfg

    def config_from_hf(self, cfg, common, source):
        rope_params = cfg.get("rope_parameters") or {}
        local_theta = cfg.get("rope_local_base_freq") or (rope_params.get("sliding_attention") or {}).get("rope_theta", 10000.0)
        if "rope_theta" not in cfg and "full_attention" in rope_params:
            common["rope_theta"] = rope_params["full_attention"].get("rope_theta", 1e6)
        types = cfg.get("layer_types")
        pattern = cfg.get("sliding_window_pattern", 6)
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise FileError(f"{source}: sliding_window_pattern must be a positive integer, got {shown_value(pattern)}")
        if types is not None and not isinstance(types, list):
            raise FileError(f"{source}: layer_types must be a list, got {shown_value(types)}")
        types = [("sliding" if t == "sliding_attention" else "full") for t in types] if types else \
            layer_pattern(common["n_layers"], pattern)
        scalar = cfg.get("query_pre_attn_scalar", common["head_dim"])
        if not number(scalar) or scalar <= 0:
            raise FileError(f"{source}: query_pre_attn_scalar must be a positive number, got {shown_value(scalar)}")
        if (cfg.get("rope_scaling") or {}).get("rope_type", "default") not in ("default", None):
            raise UnsupportedFormat("Gemma 3 rope scaling (the 4B+ long-context variants) is not supported yet")
        return ModelConfig(
            arch=self.name, act="gelu_tanh", norm_offset=1.0, qk_norm=True, sandwich_norm=True,
            embed_scale=math.sqrt(common["dim"]), attn_scale=scalar ** -0.5,
            sliding_window=cfg.get("sliding_window", 512), layer_types=types, rope_local_theta=local_theta,
            final_softcap=cfg.get("final_logit_softcapping"), **common)

    def config_from_gguf(self, get, common, source):
        return ModelConfig(
            arch=self.name, act="gelu_tanh", norm_offset=1.0, qk_norm=True, sandwich_norm=True,
            embed_scale=math.sqrt(common["dim"]), tie_embeddings=True,
            sliding_window=get("attention.sliding_window", 512), layer_types=layer_pattern(common["n_layers"]),
            rope_local_theta=10000.0, **common)

    def hf_config(self, c, common):
        return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **common,
                "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": round(c.attn_scale ** -2),
                "sliding_window": c.sliding_window, "rope_local_base_freq": c.rope_local_theta,
                "layer_types": [("sliding_attention" if t == "sliding" else "full_attention") for t in c.layer_types],
                "final_logit_softcapping": c.final_softcap, "attn_logit_softcapping": None}


ARCH = Gemma3()
