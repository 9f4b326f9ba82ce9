"""What every architecture module defines, with the Llama family's answers as the defaults."""
from __future__ import annotations

import dataclasses
import re

import torch

from ..config import ModelConfig, number, shown_value
from ..errors import FileError, UnsupportedFormat

# GGUF tensor names (llama.cpp's) -> brisk's module names inside a block (Hugging Face's)
GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",  # Llama's pre-MLP norm
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate",  # an MoE layer's router
    "ffn_gate_exps": "mlp.experts.{}.gate_proj", "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)$")


class Architecture:
    name = "llama"  # ModelConfig.arch
    hf_types: tuple[str, ...] = ()  # config.json model_type values
    gguf_names: tuple[str, ...] = ()  # GGUF general.architecture values
    tied_by_default = False  # tie_word_embeddings when config.json does not say
    gguf_rope_theta = 10000.0
    gguf_permuted_qk = False  # llama.cpp interleaves rotary pairs in q/k rows ("rope type NORM" archs)
    gguf_norm_offset = 0.0  # llama.cpp bakes Gemma's (1 + w) into the norm weights
    gguf_names_here: dict[str, str] = {}  # this architecture's own GGUF name overrides
    gguf_rope_factors: dict[str, str] = {}  # GGUF tensors that hold rope_scaling lists (Phi-3's longrope)
    ffn_optional = False  # GGUF metadata may lack feed_forward_length (MoE models with no dense layer)

    # ---------------------------------------------------------------- configs
    def takes_gguf(self, name: str, meta: dict) -> bool:
        return name in self.gguf_names

    def text_config(self, cfg: dict) -> dict:
        """config.json's text model settings (a multimodal wrapper nests them)."""
        return cfg

    def config_from_hf(self, cfg: dict, common: dict, source: str) -> ModelConfig:
        raise NotImplementedError

    def config_from_gguf(self, get, common: dict, source: str) -> ModelConfig:
        raise NotImplementedError

    def hf_config(self, c: ModelConfig, common: dict) -> dict:
        """The config.json transformers reads for `c` (common: the keys every architecture shares)."""
        raise UnsupportedFormat(f"writing a Hugging Face config for {self.name} models is not supported yet")

    # ---------------------------------------------------------------- tensors
    def hf_tensors(self, tensors: dict[str, torch.Tensor], cfg: ModelConfig, source) -> dict[str, torch.Tensor]:
        """A Hugging Face checkpoint's tensors under brisk's module names (fused ones split)."""
        return tensors

    def export_tensors(self, tensors: dict) -> dict:
        """brisk's tensor names -> the architecture's own checkpoint names (hf_tensors' inverse, for
        the folders brisk quantize writes)."""
        return tensors

    def gguf_to_hf_name(self, name: str) -> str | None:
        """A GGUF tensor's module name, for a 2-D (or split, see split_gguf_table) tensor."""
        if name in GGUF_TOP:
            return GGUF_TOP[name]
        m = _BLOCK_TENSOR.match(name)
        if not m:
            return None
        layer, part, expert, kind = m.groups()
        hf = self.gguf_names_here.get(part) or GGUF_NAMES.get(part)
        if hf is None or ("{}" in hf) != (expert is not None):
            return None
        return f"model.layers.{layer}.{hf.format(expert)}.{kind}"

    def convert_gguf_tensor(self, w: torch.Tensor, hf: str, cfg: ModelConfig) -> torch.Tensor:
        """GGUF conventions -> Hugging Face ones, for one float tensor."""
        order = self.gguf_row_order(hf, w.shape[0], cfg)
        if order is not None:
            return w[order]
        if self.gguf_norm_offset and hf.endswith("norm.weight"):
            return w - self.gguf_norm_offset
        return w

    def gguf_row_order(self, hf: str, rows: int, cfg: ModelConfig) -> torch.Tensor | None:
        """The rows of a q/k weight in rotate-half order, where llama.cpp interleaved them (rows move
        whole, so quantized weights are reordered the same way)."""
        if not self.gguf_permuted_qk or not hf.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                                          "k_proj.bias")):
            return None
        heads = cfg.n_heads if ".q_proj." in hf else cfg.n_kv_heads
        if rows % (2 * heads):
            raise FileError(f"a q/k projection of {rows} rows does not fit {heads} attention heads")
        return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def positive_setting(params: dict, key: str, default, source, most: float = 1e6) -> float:
    """A rope_scaling number that must be positive and finite (0, NaN or 1e308 would silently give
    rope tables of zeros, NaN or inf): the value, else the default, checked."""
    v = params.get(key) if params.get(key) is not None else default
    if not number(v) or not 0 < v <= most:
        raise FileError(f"{source}: rope_scaling.{key} must be a positive number up to {most:g}, got {shown_value(v)}")
    return float(v)


def original_context(params: dict, source) -> int:
    v = params.get("original_max_position_embeddings")
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1 << 24:
        raise FileError(f"{source}: rope_scaling.original_max_position_embeddings must be a positive integer, "
                        f"got {shown_value(v)}")
    return v


def attention_factor(scaling: dict, default: float, source) -> float:
    """rope_scaling's attention_factor (what scales cos and sin), else the scheme's default, checked."""
    v = scaling.get("attention_factor")
    v = default if v is None else v
    if not number(v) or v <= 0:
        raise FileError(f"{source}: rope_scaling.attention_factor must be a positive number, got {shown_value(v)}")
    return float(v)


# ---------------------------------------------------------------- GGUF tensor tables

def rows_of(t, name: str, start: int, count: int, shape_tail: tuple[int, ...]):
    """The TensorInfo of rows start..start+count of t (rows of its last dimension), renamed."""
    rows = t.nbytes // _row_count(t)
    return dataclasses.replace(t, name=name, shape=(count, *shape_tail), offset=t.offset + start * rows,
                               nbytes=count * rows)


def _row_count(t) -> int:
    n = 1
    for d in t.shape[:-1]:
        n *= d
    return n


def split_gguf_table(table: list, cfg: ModelConfig, source) -> list:
    """The tensor table with llama.cpp's stacked and fused tensors as 2-D slices of the same bytes,
    named as their parts: an MoE layer's 3-D expert tensors (`ffn_gate_exps` [experts, rows, cols])
    one per expert (`ffn_gate_exps.E`), a fused `attn_qkv` as attn_q/k/v, a fused gate+up `ffn_up`
    (Phi-3's, twice the feed-forward rows) as ffn_gate and ffn_up. Nothing is copied: a slice is an
    offset and a size in the file, so each part can stay quantized."""
    out = []
    for t in table:
        m = _BLOCK_TENSOR.match(t.name)
        part = m.group(2) if m else None
        if part and part.endswith("_exps") and m.group(4) == "bias":  # gpt-oss: [experts, rows], a row each
            if len(t.shape) != 2 or t.shape[0] != cfg.n_experts:
                raise FileError(f"tensor {t.name} has shape {list(t.shape)}: the model needs "
                                f"{cfg.n_experts or 'no'} experts' biases there", source)
            row = t.nbytes // t.shape[0]
            for e in range(t.shape[0]):
                out.append(dataclasses.replace(t, name=t.name.replace(f".{part}.", f".{part}.{e}."),
                                               shape=(t.shape[1],), offset=t.offset + e * row, nbytes=row))
        elif part and part.endswith("_exps"):
            if len(t.shape) != 3 or t.shape[0] != cfg.n_experts:
                raise FileError(f"tensor {t.name} has shape {list(t.shape)}: the model needs "
                                f"{cfg.n_experts or 'no'} experts of [rows, columns] there", source)
            for e in range(t.shape[0]):
                out.append(rows_of(t, t.name.replace(f".{part}.", f".{part}.{e}."), e * t.shape[1], t.shape[1],
                                   (t.shape[2],)))
        elif part == "attn_qkv" and m.group(4) == "weight" and len(t.shape) == 2:
            q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
            if t.shape[0] != q + 2 * kv:
                raise FileError(f"tensor {t.name} has {t.shape[0]} rows: q/k/v of this model need {q + 2 * kv}", source)
            for name, start, n in (("attn_q", 0, q), ("attn_k", q, kv), ("attn_v", q + kv, kv)):
                out.append(rows_of(t, t.name.replace("attn_qkv", name), start, n, (t.shape[1],)))
        elif part == "ffn_up" and len(t.shape) == 2 and t.shape[0] == 2 * cfg.ffn_dim:
            f = cfg.ffn_dim
            out.append(rows_of(t, t.name.replace("ffn_up", "ffn_gate"), 0, f, (t.shape[1],)))
            out.append(rows_of(t, t.name, f, f, (t.shape[1],)))
        else:
            out.append(t)
    return out


# ---------------------------------------------------------------- Hugging Face tensors

def split_rows(w: torch.Tensor, sizes: list[int], name: str, source) -> list[torch.Tensor]:
    """A fused weight's row blocks (views, no copy), or one clear error if its rows do not add up."""
    if w.shape[0] != sum(sizes):
        raise FileError(f"{name} has {w.shape[0]} rows; this model's config needs {sum(sizes)}", source)
    return list(w.split(sizes, dim=0))


def check_experts(tensors: dict, cfg: ModelConfig, source) -> None:
    """Every MoE layer holds exactly cfg.n_experts experts: more or fewer is an inconsistent file."""
    found: dict[int, set[int]] = {}
    for k in tensors:
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.", k)
        if m:
            found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    for layer, experts in sorted(found.items()):
        if experts != set(range(cfg.n_experts)):
            extra = sorted(experts - set(range(cfg.n_experts)))
            raise FileError(f"layer {layer} holds experts {min(experts)}..{max(experts)} ({len(experts)}), but the "
                            f"config says {cfg.n_experts}" + (f" (e.g. expert {extra[0]} has no place)" if extra else ""),
                            source)


def experts_by_module(tensors: dict, cfg: ModelConfig, source) -> dict:
    """An MoE checkpoint's experts one module each (`mlp.experts.E.gate_proj.weight`), as the
    original checkpoints store them; transformers 5 saves each layer's experts stacked instead
    (`mlp.experts.gate_up_proj` [experts, 2 x ffn, dim], `mlp.experts.down_proj` [experts, dim, ffn])."""
    out = {}
    for k, v in tensors.items():
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?$", k)
        if not m:
            out[k] = v
            continue
        if v.dim() != 3 or v.shape[0] != cfg.n_experts:
            raise FileError(f"{k} has shape {list(v.shape)}: the config says {cfg.n_experts} experts", source)
        prefix, part = m.groups()
        for e, w in enumerate(v.unbind(0)):
            if part == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = w
            else:
                gate, up = split_rows(w, [cfg.expert_ffn_dim] * 2, k, source)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
    return out
