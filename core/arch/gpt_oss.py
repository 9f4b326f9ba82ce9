"""gpt-oss (20b, 120b): a mixture of experts with biases everywhere (q/k/v/o, the router, every
expert), a learned attention sink per head, sliding-window attention on every other layer (the
first one sliding), YaRN rope, and a clamped SwiGLU (gate * sigmoid(1.702 gate) * (up + 1)). The
router takes the top k of its logits and softmaxes over those k alone.

Hugging Face stores each layer's experts stacked and transposed: gate_up_proj [experts, dim,
2 x ffn] with gate and up interleaved column by column, down_proj [experts, ffn, dim]. The released
checkpoints hold them as MXFP4 (`*_blocks`, `*_scales`); llama.cpp's GGUF as MXFP4 too
(`ffn_*_exps`, gate and up apart, biases stacked [experts, rows])."""
from __future__ import annotations

import math
import re

from ..config import ModelConfig, shown_value
from ..errors import FileError, UnsupportedFormat
from ...quant import mxfp4_format
from .base import Architecture, attention_factor, check_experts, original_context, positive_setting


def yarn(params: dict | None, source, truncate: bool = True) -> dict | None:
    """YaRN rope settings as brisk keeps them (model.rope_inv_freq reads them), checked; None for
    plain rope. truncate: round the ramp's ends to whole dimensions (gpt-oss says false)."""
    params = params or {}
    kind = params.get("rope_type", params.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise UnsupportedFormat(f"rope scaling {kind!r} is not supported for this architecture (only yarn)")
    out = {"rope_type": "yarn", "truncate": bool(params.get("truncate", truncate))}
    for key, default in (("factor", None), ("beta_fast", 32.0), ("beta_slow", 1.0)):
        out[key] = positive_setting(params, key, default, source)
    out["original_max_position_embeddings"] = original_context(params, source)
    # by default the paper's suggestion, as transformers computes it
    out["attention_factor"] = attention_factor(
        params, 0.1 * math.log(out["factor"]) + 1.0 if out["factor"] > 1 else 1.0, source)
    return out


class GptOss(Architecture):
    name = "gpt_oss"
    hf_types = ("gpt_oss",)
    gguf_names = ("gpt-oss",)
    gguf_rope_theta = 150000.0
    ffn_optional = True
    gguf_names_here = {"attn_sinks": "self_attn.sinks"}

    def _config(self, common, **kw) -> ModelConfig:
        return ModelConfig(arch=self.name, qkv_bias=True, o_bias=True, attn_sinks=True, routing="topk_softmax",
                           router_bias=True, expert_bias=True, act="swiglu_clamp", **kw, **common)

    def config_from_hf(self, cfg, common, source):
        try:
            n = cfg["num_local_experts"]
            used = cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
            window = cfg["sliding_window"]
        except KeyError as e:
            raise FileError(f"{source} lacks {e.args[0]!r}") from None
        layers = common["n_layers"]
        types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                           for i in range(layers)]
        if not isinstance(types, list) or any(t not in ("sliding_attention", "full_attention") for t in types):
            raise FileError(f"{source}: layer_types must list sliding_attention or full_attention, got {shown_value(types)}")
        if cfg.get("attention_bias", True) is not True:
            raise UnsupportedFormat("gpt-oss without attention biases is not supported")
        scaling = yarn(cfg.get("rope_scaling") or cfg.get("rope_parameters"), source, truncate=False)
        return self._config(common, n_experts=n, n_experts_used=used, expert_ffn_dim=common["ffn_dim"],
                            sliding_window=window, rope_scaling=scaling,
                            layer_types=[t.split("_")[0] for t in types],
                            swiglu_limit=cfg.get("swiglu_limit", 7.0), swiglu_alpha=cfg.get("swiglu_alpha", 1.702))

    def config_from_gguf(self, get, common, source):
        kind = get("rope.scaling.type")
        scaling = None
        if kind not in (None, "none"):
            scaling = yarn({"rope_type": kind, "factor": get("rope.scaling.factor"),
                            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
                            "beta_fast": get("rope.scaling.yarn_beta_fast"),
                            "beta_slow": get("rope.scaling.yarn_beta_slow")}, source, truncate=False)
        window = get("attention.sliding_window")
        # llama.cpp's gpt-oss: even layers slide (as the released config's layer_types)
        return self._config(common, n_experts=get("expert_count"), n_experts_used=get("expert_used_count"),
                            expert_ffn_dim=get("expert_feed_forward_length"), sliding_window=window,
                            rope_scaling=scaling,
                            layer_types=["sliding" if i % 2 == 0 else "full" for i in range(common["n_layers"])])

    def gguf_to_hf_name(self, name):
        hf = super().gguf_to_hf_name(name)
        return hf.removesuffix(".weight") if hf and hf.endswith(".self_attn.sinks.weight") else hf

    def hf_tensors(self, tensors, cfg, source):
        out = {}
        for k in [k for k in tensors if k.endswith("_blocks")]:  # MXFP4 experts, kept so
            scales = tensors.pop(k.removesuffix("_blocks") + "_scales", None)
            out.update(self.mxfp4_experts(k, tensors.pop(k), scales, cfg, source))
        for k, v in tensors.items():
            m = re.match(r"(model\.layers\.\d+\.mlp)\.(router|experts)\.(\w+)$", k)
            if not m:
                out[k] = v
                continue
            prefix, part, rest = m.groups()
            if part == "router":
                out[f"{prefix}.gate.{rest}"] = v
                continue
            if rest.endswith("_scales"):
                raise FileError(f"{k} has no {rest.removesuffix('_scales')}_blocks beside it", source)
            f, d = cfg.expert_ffn_dim, cfg.dim
            shape = {"gate_up_proj": (d, 2 * f), "gate_up_proj_bias": (2 * f,), "down_proj": (f, d),
                     "down_proj_bias": (d,)}.get(rest)
            if shape is None:
                raise FileError(f"{k}: not a gpt-oss expert tensor", source)
            if tuple(v.shape) != (cfg.n_experts, *shape):
                raise FileError(f"{k} has shape {list(v.shape)}: this model's experts need {[cfg.n_experts, *shape]}",
                                source)
            for e, w in enumerate(v.unbind(0)):
                at = f"{prefix}.experts.{e}"
                if rest == "gate_up_proj":  # columns alternate gate, up; Linear keeps [out, in], row-major
                    out[f"{at}.gate_proj.weight"] = w[:, 0::2].t().contiguous()
                    out[f"{at}.up_proj.weight"] = w[:, 1::2].t().contiguous()
                elif rest == "gate_up_proj_bias":
                    out[f"{at}.gate_proj.bias"], out[f"{at}.up_proj.bias"] = w[0::2], w[1::2]
                elif rest == "down_proj":
                    out[f"{at}.down_proj.weight"] = w.t().contiguous()
                else:
                    out[f"{at}.down_proj.bias"] = w
        check_experts(out, cfg, source)
        return out

    def mxfp4_experts(self, name, blocks, scales, cfg, source) -> dict:
        """A layer's stacked MXFP4 experts (`gate_up_proj_blocks` [experts, 2 x ffn, dim / 32, 16]
        with gate and up rows alternating, or `down_proj_blocks`) as each expert's GGUF MXFP4 rows,
        under the names quant/mxfp4_format.py loads."""
        m = re.match(r"(model\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)_blocks$", name)
        f, d = cfg.expert_ffn_dim, cfg.dim
        rows, cols = (2 * f, d) if m and m.group(2) == "gate_up_proj" else (d, f)
        want = (cfg.n_experts, rows, cols // 32, 16)
        if m is None or scales is None or tuple(blocks.shape) != want or tuple(scales.shape) != want[:3]:
            raise FileError(f"{name} has shape {list(blocks.shape)}" + ("" if scales is None else
                            f" (scales {list(scales.shape)})") + f": this model's experts need {list(want)}", source)
        try:
            packed = mxfp4_format.gguf_blocks(blocks, scales)  # [experts, rows, bytes]
        except ValueError as e:
            raise FileError(f"{name}: {e}", source) from None
        out, prefix = {}, m.group(1)
        for e in range(cfg.n_experts):
            at = f"{prefix}.experts.{e}"
            if m.group(2) == "down_proj":
                out[f"{at}.down_proj{mxfp4_format.SUFFIX}"] = packed[e]
            else:
                out[f"{at}.gate_proj{mxfp4_format.SUFFIX}"] = packed[e, 0::2].contiguous()
                out[f"{at}.up_proj{mxfp4_format.SUFFIX}"] = packed[e, 1::2].contiguous()
        return out


ARCH = GptOss()
