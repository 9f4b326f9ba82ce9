"""Llama 2/3, Mistral, SmolLM and Qwen2: the plain pre-norm decoder the other architectures vary.

Mistral (and Qwen2 with use_sliding_window) adds a sliding window on every layer, Llama 3 the
llama3 rope scaling, Qwen2 q/k/v biases. llama.cpp stores Llama's q/k rows with rotary pairs
interleaved (its "rope type NORM") and Qwen2's in Hugging Face's order ("NEOX").
"""
from __future__ import annotations

from ..config import ModelConfig
from ..errors import BriskError, FileError, UnsupportedFormat
from .base import Architecture, original_context, positive_setting


def rope_scaling(cfg: dict, source, allowed: tuple[str, ...] = ("llama3",)) -> dict | None:
    """config.json's rope scaling (rope_scaling, or transformers 5's rope_parameters), checked, as
    brisk keeps it (model.rope_inv_freq reads it); None for none."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind in (None, "default"):
        return None
    if kind not in allowed:
        raise UnsupportedFormat(f"rope scaling {scaling!r} is not supported (only {', '.join(allowed)})")
    out = {"rope_type": "llama3", "original_max_position_embeddings": original_context(scaling, source)}
    for key, default in (("factor", None), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0)):
        out[key] = positive_setting(scaling, key, default, source)
    if out["high_freq_factor"] <= out["low_freq_factor"]:  # the blend between them divides by the difference
        raise FileError(f"{source}: rope_scaling.high_freq_factor must exceed low_freq_factor, got "
                        f"{out['high_freq_factor']:g} and {out['low_freq_factor']:g}")
    return out


def sliding_window(cfg: dict, default: bool = False) -> int | None:
    return cfg.get("sliding_window") if cfg.get("use_sliding_window", default) else None


class Llama(Architecture):
    name = "llama"
    hf_types = ("llama", "mistral", "smollm")
    gguf_names = ("llama",)
    gguf_permuted_qk = True
    qkv_bias = False

    def takes_gguf(self, name, meta):
        return name in self.gguf_names and not meta.get(f"{name}.expert_count")  # with experts: Mixtral

    def config_from_hf(self, cfg, common, source):
        window = sliding_window(cfg, cfg.get("model_type") == "mistral")
        return ModelConfig(arch=self.name, rope_scaling=rope_scaling(cfg, source), qkv_bias=self.qkv_bias,
                           sliding_window=window, layer_types=["sliding" if window else "full"] * common["n_layers"],
                           **common)

    def config_from_gguf(self, get, common, source):
        if get("rope.scaling.type") not in (None, "none"):
            raise UnsupportedFormat(f"GGUF rope scaling {get('rope.scaling.type')!r} is not supported")
        return ModelConfig(arch=self.name, qkv_bias=self.qkv_bias, **common)

    def hf_config(self, c, common):
        if abs(c.attn_scale - c.head_dim ** -0.5) > 1e-9:
            raise BriskError("this model's attention scale has no Hugging Face Llama config equivalent")
        model_type = "mistral" if c.sliding_window else "llama"
        cfg = {"architectures": ["MistralForCausalLM" if c.sliding_window else "LlamaForCausalLM"],
               "model_type": model_type, **common, "hidden_act": "silu", "rope_scaling": c.rope_scaling}
        if model_type == "llama":  # Llama has no sliding window: Mistral has
            cfg.update(attention_bias=False, mlp_bias=False)
        else:
            cfg.update(sliding_window=c.sliding_window)
        return cfg


class Qwen2(Llama):
    name = "qwen2"
    hf_types = ("qwen2",)
    gguf_names = ("qwen2",)
    gguf_permuted_qk = False
    qkv_bias = True

    def hf_config(self, c, common):
        return qwen_config("Qwen2ForCausalLM", c, common)


def qwen_config(hf_class: str, c: ModelConfig, common: dict, **extra) -> dict:
    """config.json of a Qwen model (Qwen2, Qwen3, Qwen3-MoE), whose window is switched on apart."""
    cfg = {"architectures": [hf_class], "model_type": hf_class.removesuffix("ForCausalLM").lower().replace(
        "moe", "_moe"), **common, "hidden_act": "silu", "rope_scaling": c.rope_scaling, **extra}
    if c.sliding_window:
        cfg.update(sliding_window=c.sliding_window, use_sliding_window=True)
    return cfg


ARCH, QWEN2 = Llama(), Qwen2()
