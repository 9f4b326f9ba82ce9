"""Phi-3, Phi-3.5-mini and Phi-4-mini: Llama's decoder with q/k/v in one projection and gate/up in
another (split at load into Llama's modules), "longrope" rope scaling (per-frequency factors, short
ones within the pretrained context, long ones past it, and a constant attention scale), a sliding
window on every layer where the config gives one, and partial rotary (Phi-4-mini rotates 3/4 of
each head)."""
from __future__ import annotations

import math

from ..config import ModelConfig, number, shown_value
from ..errors import BriskError, FileError, UnsupportedFormat
from .base import Architecture, attention_factor, split_rows


def longrope(scaling: dict | None, max_pos: int, original: int | None, rope_dim: int, source) -> dict | None:
    """The longrope settings as brisk keeps them (both factor lists, the pretrained context, the
    attention scale), checked; None for plain rope."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ("longrope", "su"):
        raise UnsupportedFormat(f"rope scaling {kind!r} is not supported for Phi-3 models (only longrope)")
    original = scaling.get("original_max_position_embeddings") or original
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise FileError(f"{source}: original_max_position_embeddings must be a positive integer, "
                        f"got {shown_value(original)}")
    out = {"rope_type": "longrope", "original_max_position_embeddings": original}
    for key in ("short_factor", "long_factor"):
        v = scaling.get(key)
        if not isinstance(v, list) or len(v) != rope_dim // 2 or not all(number(f) and f > 0 for f in v):
            raise FileError(f"{source}: rope_scaling.{key} must list {rope_dim // 2} positive numbers")
        out[key] = [float(f) for f in v]
    factor = max_pos / original
    out["attention_factor"] = attention_factor(
        scaling, math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0, source)
    return out


class Phi3(Architecture):
    name = "phi3"
    hf_types = ("phi3",)
    gguf_names = ("phi3",)
    gguf_rope_factors = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}

    def config_from_hf(self, cfg, common, source):
        partial = cfg.get("partial_rotary_factor", 1.0)
        if not number(partial) or not 0 < partial <= 1:
            raise FileError(f"{source}: partial_rotary_factor must be in (0, 1], got {shown_value(partial)}")
        rope_dim = int(common["head_dim"] * partial)
        scaling = longrope(cfg.get("rope_scaling") or cfg.get("rope_parameters"), common["max_seq_len"],
                           cfg.get("original_max_position_embeddings"), rope_dim, source)
        window = cfg.get("sliding_window")
        return ModelConfig(arch=self.name, rope_scaling=scaling, qkv_bias=bool(cfg.get("attention_bias", False)),
                           rope_dim=rope_dim if rope_dim != common["head_dim"] else None, sliding_window=window,
                           layer_types=["sliding" if window else "full"] * common["n_layers"], **common)

    def config_from_gguf(self, get, common, source):
        rope_dim = get("rope.dimension_count", common["head_dim"])
        window = get("attention.sliding_window") or None  # 0: none (Phi-4)
        scaling = None
        if get("rope.scaling.original_context_length") and get("rope.scaling.attn_factor") is not None:
            # the factor lists are tensors (rope_factors_short/long), read at load: see gguf_rope_factors
            scaling = {"rope_type": "longrope", "original_max_position_embeddings":
                       get("rope.scaling.original_context_length"), "attention_factor": get("rope.scaling.attn_factor")}
        return ModelConfig(arch=self.name, rope_scaling=scaling, sliding_window=window,
                           rope_dim=rope_dim if rope_dim != common["head_dim"] else None,
                           layer_types=["sliding" if window else "full"] * common["n_layers"], **common)

    def hf_tensors(self, tensors, cfg, source):
        out = {}
        q, kv, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
        for k, v in tensors.items():
            if k.endswith("self_attn.qkv_proj.weight"):
                for part, w in zip("qkv", split_rows(v, [q, kv, kv], k, source)):
                    out[k.replace("qkv_proj", f"{part}_proj")] = w
            elif k.endswith("mlp.gate_up_proj.weight"):  # gate first, as Phi3MLP's chunk(2) reads it
                out[k.replace("gate_up_proj", "gate_proj")], out[k.replace("gate_up_proj", "up_proj")] = \
                    split_rows(v, [f, f], k, source)
            else:
                out[k] = v
        return out

    def hf_config(self, c, common):
        if c.rope_scaling and not {"short_factor", "long_factor"} <= c.rope_scaling.keys():
            raise BriskError("this Phi-3 file's rope factors are not in its config")
        cfg = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", **common, "hidden_act": "silu",
               "sliding_window": c.sliding_window, "partial_rotary_factor": c.rotary_dim / c.head_dim}
        if c.rope_scaling:
            s = c.rope_scaling
            cfg.update(original_max_position_embeddings=s["original_max_position_embeddings"],
                       rope_scaling={"type": "longrope", "short_factor": s["short_factor"],
                                     "long_factor": s["long_factor"]})
        return cfg


ARCH = Phi3()
