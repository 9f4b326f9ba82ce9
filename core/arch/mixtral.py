"""Mixtral: Mistral's decoder with each MLP replaced by 8 experts, 2 routed per token (softmax over
the router's logits, the top 2 renormalized). llama.cpp writes it as "llama" with expert counts."""
from __future__ import annotations

import re

from ..config import ModelConfig
from ..errors import FileError
from .base import check_experts, experts_by_module
from .llama import Llama, rope_scaling, sliding_window


_W = {"gate": "w1", "down": "w2", "up": "w3"}  # Mixtral's names for an expert's projections


class Mixtral(Llama):
    name = "mixtral"
    hf_types = ("mixtral",)
    gguf_names = ("llama",)

    def takes_gguf(self, name, meta):
        return name in self.gguf_names and bool(meta.get(f"{name}.expert_count"))

    def config_from_hf(self, cfg, common, source):
        try:
            n, used = cfg["num_local_experts"], cfg["num_experts_per_tok"]
        except KeyError as e:
            raise FileError(f"{source} lacks {e.args[0]!r}") from None
        window = sliding_window(cfg, True)
        return ModelConfig(arch=self.name, rope_scaling=rope_scaling(cfg, source), sliding_window=window,
                           layer_types=["sliding" if window else "full"] * common["n_layers"],
                           n_experts=n, n_experts_used=used, expert_ffn_dim=common["ffn_dim"], **common)

    def config_from_gguf(self, get, common, source):
        return ModelConfig(arch=self.name, n_experts=get("expert_count"), n_experts_used=get("expert_used_count"),
                           expert_ffn_dim=common["ffn_dim"], **common)

    def hf_tensors(self, tensors, cfg, source):
        renamed = {}
        for k, v in tensors.items():  # the original checkpoints' names -> Qwen3-MoE's, which brisk uses
            k = k.replace(".block_sparse_moe.", ".mlp.")
            renamed[k.replace(".w1.", ".gate_proj.").replace(".w3.", ".up_proj.").replace(".w2.", ".down_proj.")
                    if ".experts." in k else k] = v
        tensors = experts_by_module(renamed, cfg, source)
        check_experts(tensors, cfg, source)
        return tensors

    def export_tensors(self, tensors):
        out = {}
        for k, v in tensors.items():
            m = re.match(r"(model\.layers\.\d+)\.mlp\.(experts\.\d+\.(gate|up|down)_proj|gate)\.(.+)$", k)
            if m:
                layer, part, proj, rest = m.groups()
                part = f"experts.{part.split('.')[1]}.{_W[proj]}" if proj else "gate"
                k = f"{layer}.block_sparse_moe.{part}.{rest}"
            out[k] = v
        return out

    def hf_config(self, c, common):
        cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common, "hidden_act": "silu",
               "rope_scaling": c.rope_scaling, "num_local_experts": c.n_experts,
               "num_experts_per_tok": c.n_experts_used, "sliding_window": c.sliding_window}
        cfg["intermediate_size"] = c.expert_ffn_dim
        return cfg


ARCH = Mixtral()
