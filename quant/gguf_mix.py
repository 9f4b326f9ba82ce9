"""llama.cpp's quantization mixes: which GGUF type each tensor of a model gets for a file type such as
Q4_K_M, as `llama-quantize` chooses without an importance matrix (its llama-quant.cpp), so that a file
brisk writes holds the same tensor types as llama.cpp's at that name.

MIXES is the one table: per mix, general.file_type, the base type, and the rules that raise the more
sensitive tensors (attention V, FFN down, attention output) by layer. tensor_types() applies it to a
model's tensors, with llama.cpp's other choices: which tensors stay as they are, the output (and a
tied token table) at Q6_K, and a type that does not divide a row falling back to a 32-weight one.
Not followed (refused by the caller): Falcon's own rules.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from .gguf_types import BY_ID, F16, Q2_K, Q3_K, Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0

QUANTIZATION_VERSION = 2  # general.quantization_version: ggml's block formats since 2023


def more_bits(i: int, n: int) -> bool:
    """The layers llama.cpp gives more bits in its _M mixes: the first and last eighth, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# A rule: (layer index, layer count, model) -> the tensor's type, or None to keep the mix's base type.
Rule = Callable[[int, int, "ModelShape"], "int | None"]


@dataclass(frozen=True)
class ModelShape:
    """What the rules read of a model (its GGUF metadata)."""
    n_layer: int
    gqa: int  # query heads per K/V head
    n_expert: int = 0
    is_70b: bool = False  # llama.cpp's 70B size class (seventy_b()): attention V gets Q5_K for Q3_K/Q4_K


# The architectures and layer counts llama.cpp calls 70B (its per-architecture size tables)
_70B_LAYERS = {"llama": 80, "qwen2": 80, "deci": 80, "olmo": 80, "jais2": 68}


def seventy_b(arch: str, n_layer: int, n_head: int, n_head_kv: int, n_expert: int) -> bool:
    """Whether llama.cpp's loader sizes this model 70B (a Llama of 80 layers with as many K/V heads as
    query heads is its 65B, and one of 8 experts is 8x7B or 8x22B instead)."""
    if arch == "llama" and (n_expert == 8 or n_head == n_head_kv):
        return False
    return _70B_LAYERS.get(arch) == n_layer


@dataclass(frozen=True)
class Mix:
    name: str
    file_type: int  # general.file_type (llama.cpp's LLAMA_FTYPE_MOSTLY_*)
    base: int  # the type of every quantized tensor no rule raises
    attn_v: Rule | None = None
    ffn_down: Rule | None = None
    attn_output: int | None = None  # attention output's type (models without 8 experts)
    moe_attn_output: bool = False  # Q5_K for attention output in 8-expert models


_Q6_WHERE_MORE = lambda i, n, m: Q6_K if more_bits(i, n) else None  # noqa: E731

MIXES = {m.name: m for m in (
    Mix("Q4_0", 2, Q4_0),
    Mix("Q8_0", 7, Q8_0),
    Mix("Q2_K", 10, Q2_K, attn_v=lambda i, n, m: Q4_K if m.gqa >= 4 else Q3_K, ffn_down=lambda i, n, m: Q3_K,
        attn_output=Q3_K, moe_attn_output=True),
    Mix("Q3_K_M", 12, Q3_K, attn_v=lambda i, n, m: Q5_K if i < 2 else Q4_K,
        ffn_down=lambda i, n, m: Q5_K if i < n // 16 else Q4_K, attn_output=Q4_K,
        moe_attn_output=True),
    Mix("Q4_K_M", 15, Q4_K, attn_v=_Q6_WHERE_MORE, ffn_down=_Q6_WHERE_MORE, moe_attn_output=True),
    Mix("Q5_K_M", 17, Q5_K, attn_v=_Q6_WHERE_MORE, ffn_down=_Q6_WHERE_MORE),
    Mix("Q6_K", 18, Q6_K),
)}

# a type whose block does not divide a tensor's rows: the 32-weight type llama.cpp puts there instead
FALLBACK = {Q2_K: Q4_0, Q3_K: Q4_0, Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}

# tensors llama.cpp keeps as they are, besides norms and 1-D ones (by a part of their name)
_KEPT_PARTS = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
               "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
               "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight",
               "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight",
               "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
               "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight",
               "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
               "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd")
_KEPT_NAMES = ("position_embd.weight", "token_types.weight")
_TOKEN_TABLES = ("token_embd.weight", "per_layer_token_embd.weight")


def category(name: str) -> str:
    """llama.cpp's tensor category, from the name (the first match, in its order)."""
    if name == "output.weight":
        return "output"
    if name in _TOKEN_TABLES:
        return "token_embd"
    for part, cat in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
                      ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                      ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if part in name:  # the fused QKV and MLA's kv_b count as attention V, as there
            return cat
    return "other"


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama.cpp quantizes this tensor (shape in PyTorch order, rows first)."""
    return (len(shape) >= 2 and name.endswith("weight") and name not in _KEPT_NAMES
            and not any(p in name for p in _KEPT_PARTS))


def _layer(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def file_order(names) -> list[str]:
    """llama.cpp's order of a model's tensors (by layer, the others first, then by name): the order its
    per-layer counters run in, and the order of the tensors in the file it writes."""
    return sorted(names, key=lambda n: (_layer(n), n))


def tensor_types(tensors: dict[str, tuple[tuple[int, ...], int]], mix: Mix, model: ModelShape) -> dict[str, int]:
    """{name: (shape, current type)} -> {name: the type llama-quantize writes it as} for this mix."""
    names = file_order(tensors)
    tied = "output.weight" not in tensors
    n_attn_v = sum(category(n) == "attn_v" for n in names)
    i_attn_v = i_ffn_down = 0
    out = {}
    for name in names:
        shape, current = tensors[name]
        if not quantizable(name, shape):
            out[name] = current
            continue
        cat, cols, t = category(name), shape[-1], mix.base
        if cat == "output" or (tied and cat == "token_embd"):
            t = Q8_0 if cols % BY_ID[t].block_weights else t if t == Q8_0 else Q6_K
        elif cat == "attn_v":
            t = (mix.attn_v and mix.attn_v(i_attn_v, n_attn_v, model)) or t
            if model.is_70b and t in (Q3_K, Q4_K):  # 8 query heads share each V: cheap to give it more bits
                t = Q5_K
            if model.n_expert == 8:
                t = Q8_0
            i_attn_v += 1
        elif cat == "attn_k" and model.n_expert == 8:
            t = Q8_0
        elif cat == "ffn_down":
            i = _layer(name) if model.n_expert > 1 else i_ffn_down
            t = (mix.ffn_down and mix.ffn_down(i, model.n_layer, model)) or t
            i_ffn_down += 1
        elif cat == "attn_output":
            if model.n_expert == 8:
                t = Q5_K if mix.moe_attn_output else t
            else:
                t = mix.attn_output or t
        out[name] = _fitting(t, cols)
    return out


def _fitting(t: int, cols: int) -> int:
    """t, or llama.cpp's fallback where t's block does not divide the rows (F16 where none does)."""
    if cols % BY_ID[t].block_weights == 0:
        return t
    t = FALLBACK.get(t, t)
    return t if cols % BY_ID[t].block_weights == 0 else F16

