"""Qwen3 and Qwen3-MoE: Qwen2's decoder with RMS norms on each head's queries and keys and no
q/k/v biases; the MoE variant routes each token to its top-k of many small experts (softmax over
the router's logits, then the top k, renormalized when norm_topk_prob says so)."""
from __future__ import annotations

from ..config import ModelConfig, shown_value
from ..errors import FileError
from .base import Architecture, check_experts, experts_by_module
from .llama import qwen_config, rope_scaling, sliding_window


class Qwen3(Architecture):
    name = "qwen3"
    hf_types = ("qwen3",)
    gguf_names = ("qwen3",)
    gguf_rope_theta = 1e6

    def config_from_hf(self, cfg, common, source):
        window = sliding_window(cfg)
        return ModelConfig(arch=self.name, qk_norm=True, qkv_bias=bool(cfg.get("attention_bias", False)),
                           rope_scaling=rope_scaling(cfg, source), sliding_window=window,
                           layer_types=["sliding" if window else "full"] * common["n_layers"],
                           **self.moe_hf(cfg, common, source), **common)

    def config_from_gguf(self, get, common, source):
        return ModelConfig(arch=self.name, qk_norm=True, **self.moe_gguf(get, common), **common)

    def moe_hf(self, cfg, common, source) -> dict:
        return {}

    def moe_gguf(self, get, common) -> dict:
        return {}

    def hf_config(self, c, common):
        return qwen_config("Qwen3ForCausalLM", c, common, attention_bias=c.qkv_bias)


class Qwen3Moe(Qwen3):
    name = "qwen3_moe"
    hf_types = ("qwen3_moe",)
    gguf_names = ("qwen3moe",)
    ffn_optional = True

    def moe_hf(self, cfg, common, source):
        try:  # transformers 5 writes num_local_experts, the released checkpoints num_experts
            n = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
            used, ffn = cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
        except KeyError as e:
            raise FileError(f"{source} lacks {e.args[0]!r}") from None
        step = cfg.get("decoder_sparse_step", 1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise FileError(f"{source}: decoder_sparse_step must be a positive integer, got {shown_value(step)}")
        if not isinstance(only, list):
            raise FileError(f"{source}: mlp_only_layers must be a list, got {shown_value(only)}")
        dense = sorted(set(only) | {i for i in range(common["n_layers"]) if (i + 1) % step})
        return dict(n_experts=n, n_experts_used=used, expert_ffn_dim=ffn,
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)

    def moe_gguf(self, get, common):
        return dict(n_experts=get("expert_count"), n_experts_used=get("expert_used_count"),
                    expert_ffn_dim=get("expert_feed_forward_length"),
                    norm_topk_prob=bool(get("expert_weights_norm", True)))  # llama.cpp's qwen3moe renormalizes

    def hf_tensors(self, tensors, cfg, source):
        tensors = experts_by_module(tensors, cfg, source)
        check_experts(tensors, cfg, source)
        return tensors

    def hf_config(self, c, common):
        return qwen_config("Qwen3MoeForCausalLM", c, common, attention_bias=c.qkv_bias, num_experts=c.n_experts,
                           num_experts_per_tok=c.n_experts_used, moe_intermediate_size=c.expert_ffn_dim,
                           norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=c.dense_layers)


DENSE, MOE = Qwen3(), Qwen3Moe()
