"""A Hugging Face folder (config.json, safetensors, tokenizer.json) as a float GGUF file laid out as
llama.cpp's convert_hf_to_gguf.py lays it out, so that llama.cpp, ollama and brisk run it.

LAYOUTS is the one table, per architecture brisk loads and llama.cpp runs the same way: its
general.architecture, the block tensors llama.cpp names, which of them it stores fused, and the
`<arch>.*` hyperparameter keys. Tensor names go through core/arch's GGUF -> Hugging Face map (the
one the loader reads GGUF files with), and each tensor the other way round from the loader's
conventions: Llama's q/k rows interleaved again (llama.cpp's "rope type NORM"), Gemma's norms with
their 1 added back. Norms and 1-D tensors are F32, the others the type asked for (or the
checkpoint's own float type). The tokenizer becomes llama.cpp's `tokenizer.ggml.*` description:
"gpt2" (byte-level BPE with its merges and pre-tokenizer name) or "llama" (SentencePiece's BPE,
scores from the merge ranks, byte tokens <0xNN>).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import FileError, UnsupportedFormat

# tokenizer.ggml.token_type values (SentencePiece's numbers)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# general.file_type of a float file (llama.cpp's LLAMA_FTYPE_ALL_F32, MOSTLY_F16, MOSTLY_BF16)
FLOAT_FILE_TYPES = {"F32": 0, "F16": 1, "BF16": 32}

_ATTN_PARTS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm")
_LLAMA_PARTS = _ATTN_PARTS + ("ffn_gate", "ffn_up", "ffn_down")
# an MoE layer: its router, and each expert projection stacked over the experts [n_expert, rows, cols]
_MOE_PARTS = _ATTN_PARTS + ("ffn_gate_inp",)
EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class Layout:
    """How llama.cpp stores one architecture."""
    gguf: str  # general.architecture
    parts: tuple[str, ...]  # block tensors (weight, and bias where the checkpoint has one)
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)  # a GGUF tensor: the parts stacked in it
    keys: Callable | None = None  # (ModelConfig, config.json) -> this architecture's own keys {suffix: value}
    experts: tuple[str, ...] = ()  # stacked expert tensors, each [n_expert, rows, cols]


def _window_refused(c, cfg: dict, arch: str) -> dict:
    # llama.cpp's llama and qwen2 attend to the whole context: a narrower window would run differently
    if c.sliding_window and c.sliding_window < c.max_seq_len:
        raise UnsupportedFormat(f"config.json: a sliding window of {c.sliding_window} tokens; llama.cpp's {arch} "
                                "has none, so this model cannot be written as GGUF")
    return {}


def _gemma3_keys(c, cfg: dict) -> dict:
    from ..arch.gemma3 import layer_pattern

    # llama.cpp's gemma3 fixes what its config.json could vary: the layer pattern, the sliding layers'
    # rope base, and the query scale (1/sqrt(head_dim))
    if [t for t in c.layer_types] != layer_pattern(c.n_layers):
        raise UnsupportedFormat("config.json: Gemma 3 layers other than five sliding, one global: llama.cpp's "
                                "gemma3 does not run them")
    if c.rope_local_theta != 10000.0:
        raise UnsupportedFormat(f"config.json: rope_local_base_freq {c.rope_local_theta:g}; llama.cpp's gemma3 "
                                "runs its sliding layers at 10000")
    if abs(c.attn_scale - c.head_dim ** -0.5) > 1e-9:
        raise UnsupportedFormat("config.json: query_pre_attn_scalar other than head_dim; llama.cpp's gemma3 "
                                "scales queries by 1/sqrt(head_dim)")
    if c.final_softcap:
        raise UnsupportedFormat("config.json: final_logit_softcapping; llama.cpp's gemma3 has none")
    return {"attention.sliding_window": ("u32", c.sliding_window), "rope.freq_base_swa": ("f32", c.rope_local_theta)}


def _phi3_keys(c, cfg: dict) -> dict:
    out = {"attention.sliding_window": ("u32", c.sliding_window or 0)}
    if c.rope_scaling:
        s = c.rope_scaling
        out.update({"rope.scaling.original_context_length": ("u32", s["original_max_position_embeddings"]),
                    "rope.scaling.attn_factor": ("f32", s["attention_factor"])})
    return out


def _expert_counts(c) -> dict:
    return {"expert_count": ("u32", c.n_experts), "expert_used_count": ("u32", c.n_experts_used)}


def _mixtral_keys(c, cfg: dict) -> dict:
    # llama.cpp's llama with experts: its feed_forward_length is each expert's width
    return {**_window_refused(c, cfg, "llama"), **_expert_counts(c)}


def _qwen3_moe_keys(c, cfg: dict) -> dict:
    # llama.cpp's qwen3moe has a router in every layer and always renormalizes the top-k weights
    if c.dense_layers:
        raise UnsupportedFormat(f"config.json: layers {c.dense_layers} without experts (mlp_only_layers or "
                                "decoder_sparse_step); llama.cpp's qwen3moe routes every layer")
    if not c.norm_topk_prob:
        raise UnsupportedFormat("config.json: norm_topk_prob false; llama.cpp's qwen3moe renormalizes the "
                                "chosen experts' weights")
    return {**_window_refused(c, cfg, "qwen3moe"), **_expert_counts(c),
            "expert_feed_forward_length": ("u32", c.expert_ffn_dim)}


def _gpt_oss_keys(c, cfg: dict) -> dict:
    # llama.cpp's gpt-oss fixes what config.json could vary: even layers sliding, its SwiGLU's clamp
    # and slope, YaRN's ramp ends not rounded
    want = ["sliding" if i % 2 == 0 else "full" for i in range(c.n_layers)]
    if list(c.layer_types) != want:
        raise UnsupportedFormat("config.json: layer_types other than sliding, full, ...; llama.cpp's gpt-oss "
                                "slides the even layers")
    if (c.swiglu_limit, c.swiglu_alpha) != (7.0, 1.702):
        raise UnsupportedFormat("config.json: swiglu_limit/swiglu_alpha other than 7 and 1.702; llama.cpp's "
                                "gpt-oss fixes them")
    out = {**_expert_counts(c), "expert_feed_forward_length": ("u32", c.expert_ffn_dim),
           "attention.sliding_window": ("u32", c.sliding_window)}
    y = c.rope_scaling
    if y:
        if y.get("truncate"):
            raise UnsupportedFormat("config.json: YaRN with truncate; llama.cpp's gpt-oss does not round the "
                                    "ramp's ends")
        out.update({"rope.scaling.type": ("str", "yarn"), "rope.scaling.factor": ("f32", y["factor"]),
                    "rope.scaling.original_context_length": ("u32", y["original_max_position_embeddings"]),
                    "rope.scaling.yarn_beta_fast": ("f32", y["beta_fast"]),
                    "rope.scaling.yarn_beta_slow": ("f32", y["beta_slow"])})
        given = (cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        factor = given.get("attention_factor", given.get("attn_factor"))
        if factor is not None:  # llama.cpp's converter writes it only where config.json says it
            out["rope.scaling.yarn_attn_factor"] = ("f32", factor)
    return out


LAYOUTS = {
    "llama": Layout("llama", _LLAMA_PARTS, keys=lambda c, cfg: _window_refused(c, cfg, "llama")),
    "qwen2": Layout("qwen2", _LLAMA_PARTS, keys=lambda c, cfg: _window_refused(c, cfg, "qwen2")),
    "qwen3": Layout("qwen3", _LLAMA_PARTS + ("attn_q_norm", "attn_k_norm"),
                    keys=lambda c, cfg: _window_refused(c, cfg, "qwen3")),
    "gemma3": Layout("gemma3", _LLAMA_PARTS + ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"),
                     keys=_gemma3_keys),
    # Phi-3's q/k/v and gate/up stay fused, as llama.cpp's phi3 reads them
    "phi3": Layout("phi3", _LLAMA_PARTS, fused={"attn_qkv": ("attn_q", "attn_k", "attn_v"),
                                                  "ffn_up": ("ffn_gate", "ffn_up")}, keys=_phi3_keys),
    "mixtral": Layout("llama", _MOE_PARTS, keys=_mixtral_keys, experts=EXPERT_PARTS),
    "gpt_oss": Layout("gpt-oss", ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_sinks",
                                  "post_attention_norm", "ffn_gate_inp"), keys=_gpt_oss_keys, experts=EXPERT_PARTS),
    "qwen3_moe": Layout("qwen3moe", _MOE_PARTS + ("attn_q_norm", "attn_k_norm"), keys=_qwen3_moe_keys,
                        experts=EXPERT_PARTS),
}
# ignored where a checkpoint has them: tables transformers recomputes, a multimodal model's other towers
_IGNORED = ("rotary_emb.inv_freq", "vision_tower.", "multi_modal_projector.")


@dataclass
class FloatGGUF:
    """What write() wrote."""
    arch: str
    tensors: int
    out_bytes: int


def layout_for(folder: Path):
    """(ModelConfig, its Layout, config.json) for the folder, or a one-line error for an architecture
    that is not covered."""
    from .. import arch as arch_mod
    from ..checkpoint import _read_json

    cfg_json = _read_json(folder / "config.json")
    if not cfg_json:
        raise FileError("missing or empty config.json", folder)
    cfg = arch_mod.from_hf_config(cfg_json, str(folder / "config.json"))
    qcfg = cfg_json.get("quantization_config")
    if isinstance(qcfg, dict) and qcfg.get("quant_method") == "mxfp4":
        raise UnsupportedFormat("config.json: MXFP4 experts; --format gguf from a Hugging Face folder converts "
                                "float checkpoints (a bfloat16 gpt-oss)")
    layout = LAYOUTS.get(cfg.arch)
    if layout is None:
        raise UnsupportedFormat(f"--format gguf from a Hugging Face folder covers {', '.join(LAYOUTS)}; this "
                                f"model is {cfg.arch} (convert it with llama.cpp's convert_hf_to_gguf.py first)")
    return cfg, layout, arch_mod.by_name(cfg.arch).text_config(cfg_json)


def write(folder: Path, out: Path, float_type: str | None = None, name: str | None = None,
          report=lambda event, **info: None) -> FloatGGUF:
    """The folder as the GGUF file `out` (atomically). float_type: F32, F16 or BF16 for the 2-D
    tensors; None keeps the checkpoint's own (float32, float16 or bfloat16: no rounding)."""
    from .. import arch as arch_mod
    from .. import gguf_writer
    from ...quant import gguf_types
    from ...quant.gguf_mix import QUANTIZATION_VERSION, file_order
    from ..checkpoint import load_hf_tensors

    folder = Path(folder)
    cfg, layout, cfg_json = layout_for(folder)
    arch = arch_mod.by_name(cfg.arch)
    records = _metadata(folder, cfg, layout, cfg_json, name or folder.name)
    tensors = {k.removeprefix("language_model."): v for k, v in load_hf_tensors(folder).items()}
    tensors = arch.hf_tensors(tensors, cfg, folder)
    sources = _tensor_sources(tensors, cfg, layout, arch, folder)
    types = {}
    for gname, (parts, _) in sources.items():
        dtype = tensors[parts[0]].dtype if parts else torch.float32
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise UnsupportedFormat(f"{parts[0]} is {dtype}: --format gguf converts float32, float16 and bfloat16 "
                                    "checkpoints", folder)
        if _is_vector(gname, [tensors[p] for p in parts]):  # norms, biases, rope factors: float32, as llama.cpp keeps them
            kind = "F32"
        else:
            kind = float_type or {torch.float16: "F16", torch.bfloat16: "BF16"}.get(dtype, "F32")
        types[gname] = getattr(gguf_types, kind)
    # the token table's type names the file, as llama.cpp's converter names it by its --outtype
    file_type = FLOAT_FILE_TYPES[gguf_types.BY_ID[types["token_embd.weight"]].name]
    records += [gguf_writer.u32_record("general.file_type", file_type),
                gguf_writer.u32_record("general.quantization_version", QUANTIZATION_VERSION)]
    order = file_order(sources)
    shapes = {n: _shape(sources[n], tensors) for n in order}
    entries = [gguf_writer.TensorEntry(n, shapes[n], types[n], int(np.prod(shapes[n])) * _item_bytes(types[n]))
               for n in order]
    report("converting", total=len(order), type=float_type or "float")

    def data():
        for i, n in enumerate(order):
            parts, make = sources[n]
            w = make([tensors[p] for p in parts])
            report("converted", index=i, name=n, type=gguf_types.BY_ID[types[n]].name)
            yield _bytes(w, types[n])

    size = gguf_writer.write(out, records, entries, data())
    return FloatGGUF(arch=layout.gguf, tensors=len(order), out_bytes=size)


def _is_vector(gname: str, ws: list) -> bool:
    return not ws or ws[0].dim() == 1 or gname.endswith("_norm.weight")


def _item_bytes(qtype: int) -> int:
    from ...quant import gguf_types

    return 4 if qtype == gguf_types.F32 else 2


def _shape(source, tensors) -> tuple[int, ...]:
    parts, make = source
    if not parts:
        return tuple(make([]).shape)
    ws = [tensors[p] for p in parts]
    if _is_stacked(parts):
        return (len(ws), *ws[0].shape)
    return (sum(w.shape[0] for w in ws), *ws[0].shape[1:]) if len(ws) > 1 else tuple(ws[0].shape)


def _is_stacked(parts: list[str]) -> bool:
    return ".mlp.experts." in parts[0]


def _bytes(w: torch.Tensor, qtype: int) -> np.ndarray:
    from ...quant import gguf_types

    w = w.detach().contiguous()
    if qtype == gguf_types.BF16:  # numpy has no bfloat16: its bits as they are
        return w.to(torch.bfloat16).view(torch.int16).numpy()
    return w.to(torch.float16 if qtype == gguf_types.F16 else torch.float32).numpy()


def _tensor_sources(tensors: dict, cfg, layout: Layout, arch, folder: Path) -> dict:
    """{GGUF name: (the brisk tensor names it is made of, a function of those tensors -> its values)}.
    Every checkpoint tensor must land somewhere: one left over is an error, not a silent drop."""
    from ..model import rope_inv_freq

    used: set[str] = set()
    out: dict = {}

    def take(gname: str, hf: str, required: bool) -> None:
        if hf not in tensors:
            if required:
                raise FileError(f"no tensor {hf} (llama.cpp's {gname})", folder)
            return
        used.add(hf)
        out[gname] = ([hf], lambda ws, hf=hf: _to_gguf(ws[0], hf, arch, cfg))

    take("token_embd.weight", "model.embed_tokens.weight", True)
    take("output_norm.weight", "model.norm.weight", True)
    if cfg.tie_embeddings:
        used.add("lm_head.weight")  # the same values as the token table: llama.cpp reads that one
    else:
        take("output.weight", "lm_head.weight", True)
    for i in range(cfg.n_layers):
        for part in layout.parts:
            for kind in ("weight", "bias"):
                gname = f"blk.{i}.{part}.{kind}"
                take(gname, arch.gguf_to_hf_name(gname), kind == "weight")
        for fused, parts in layout.fused.items():
            for kind in ("weight", "bias"):
                names = [f"blk.{i}.{p}.{kind}" for p in parts]
                if not all(n in out for n in names):
                    continue
                pieces = [out.pop(n) for n in names]
                hfs = [p[0][0] for p in pieces]
                out[f"blk.{i}.{fused}.{kind}"] = (hfs, lambda ws, hfs=hfs: torch.cat(
                    [_to_gguf(w, h, arch, cfg) for w, h in zip(ws, hfs)]))
        for part in layout.experts:
            for kind in ("weight", "bias"):  # gpt-oss's experts have biases: stacked [n_expert, rows]
                gname = f"blk.{i}.{part}.{kind}"
                hfs = [arch.gguf_to_hf_name(f"blk.{i}.{part}.{e}.{kind}") for e in range(cfg.n_experts)]
                missing = [h for h in hfs if h not in tensors]
                if kind == "bias" and len(missing) == len(hfs):
                    continue
                if missing:
                    raise FileError(f"no tensor {missing[0]} (an expert of llama.cpp's {gname})", folder)
                used.update(hfs)
                out[gname] = (hfs, lambda ws: torch.stack(ws))
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") == "llama3":
        # llama.cpp divides each rotary frequency by this factor
        plain = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, None)
        factors = (plain / rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)).float()
        out["rope_freqs.weight"] = ([], lambda ws, f=factors: f)
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") == "longrope":
        for gname, key in (("rope_factors_long.weight", "long_factor"), ("rope_factors_short.weight", "short_factor")):
            out[gname] = ([], lambda ws, f=cfg.rope_scaling[key]: torch.tensor(f, dtype=torch.float32))
    _check_shapes(tensors, used, cfg, folder)
    left = sorted(k for k in tensors if k not in used and not any(p in k for p in _IGNORED))
    if left:
        raise UnsupportedFormat(f"tensor {left[0]} has no place in llama.cpp's {layout.gguf} layout"
                                + (f" ({len(left) - 1} more)" if len(left) > 1 else ""), folder)
    return out


def _check_shapes(tensors: dict, used: set[str], cfg, folder: Path) -> None:
    """Each tensor the shape brisk's model of this config has: a file llama.cpp would refuse at load is
    not written."""
    from ..model import Transformer

    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    for k in sorted(used):
        if k in tensors and k in want and tuple(tensors[k].shape) != want[k]:
            raise FileError(f"tensor {k} has shape {list(tensors[k].shape)}; config.json makes it {list(want[k])}",
                            folder)


def _to_gguf(w: torch.Tensor, hf: str, arch, cfg) -> torch.Tensor:
    """One tensor from the loader's conventions into llama.cpp's (Architecture.convert_gguf_tensor's inverse)."""
    order = arch.gguf_row_order(hf, w.shape[0], cfg)
    if order is not None:  # the loader reads row order[j] into row j: put it back
        return w[torch.argsort(order)]
    if arch.gguf_norm_offset and hf.endswith("norm.weight"):
        return w.float() + arch.gguf_norm_offset
    return w


# ---------------------------------------------------------------- metadata

def _metadata(folder: Path, c, layout: Layout, cfg_json: dict, name: str) -> list[bytes]:
    from .. import gguf_writer as gw

    a = layout.gguf
    keys = {"context_length": ("u32", c.max_seq_len), "embedding_length": ("u32", c.dim),
            "block_count": ("u32", c.n_layers), "feed_forward_length": ("u32", c.ffn_dim),
            "attention.head_count": ("u32", c.n_heads), "attention.head_count_kv": ("u32", c.n_kv_heads),
            "rope.freq_base": ("f32", c.rope_theta), "attention.layer_norm_rms_epsilon": ("f32", c.norm_eps),
            "attention.key_length": ("u32", c.head_dim), "attention.value_length": ("u32", c.head_dim),
            "rope.dimension_count": ("u32", c.rotary_dim), "vocab_size": ("u32", c.vocab_size)}
    if layout.keys:
        keys.update(layout.keys(c, cfg_json))
    records = [gw.string_record("general.architecture", a), gw.string_record("general.type", "model"),
               gw.string_record("general.name", name)]
    for k, (kind, v) in keys.items():
        records.append(gw.u32_record(f"{a}.{k}", int(v)) if kind == "u32" else
                       gw.string_record(f"{a}.{k}", v) if kind == "str" else gw.f32_record(f"{a}.{k}", float(v)))
    records += tokenizer_records(folder, c.vocab_size)
    return records


def tokenizer_records(folder: Path, n_vocab: int) -> list[bytes]:
    """llama.cpp's tokenizer.* keys for the folder's tokenizer.json (and its special tokens, add_bos
    and chat template as brisk reads them for the folder)."""
    from .. import gguf_writer as gw
    from ..files import read_json
    from ..tokenizer import Tokenizer

    tok = Tokenizer.from_hf_folder(folder)
    tj = read_json(folder / "tokenizer.json")
    model = tj.get("model") if isinstance(tj, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        kind = model.get("type") if isinstance(model, dict) else None
        raise UnsupportedFormat(f"a {kind or 'unknown'} tokenizer: --format gguf writes BPE tokenizers "
                                "(byte-level, or SentencePiece's with byte fallback)", folder / "tokenizer.json")
    tokens: list[str | None] = [None] * n_vocab
    types = [NORMAL] * n_vocab

    def place(text, i, ty):
        if not isinstance(i, int) or not 0 <= i < n_vocab:
            raise FileError(f"token {text!r:.40} has id {i}: the model has {n_vocab} embeddings",
                            folder / "tokenizer.json")
        tokens[i], types[i] = text, ty

    for text, i in model["vocab"].items():
        place(text, i, NORMAL)
    for t in tj.get("added_tokens") or []:
        place(t.get("content"), t.get("id"), CONTROL if t.get("special") else USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    spm = bool(model.get("byte_fallback"))
    records = [gw.string_record("tokenizer.ggml.model", "llama" if spm else "gpt2")]
    if spm:
        scores = _spm_scores(tokens, merges)
        for i, t in enumerate(tokens):
            if t is not None and types[i] == NORMAL and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                types[i] = BYTE
        unk = model.get("unk_token")
        if isinstance(unk, str) and unk in model["vocab"]:
            types[model["vocab"][unk]] = UNKNOWN
            records.append(gw.u32_record("tokenizer.ggml.unknown_token_id", model["vocab"][unk]))
        records.append(gw.bool_record("tokenizer.ggml.add_space_prefix", _adds_space_prefix(tj)))
    else:
        records.append(gw.string_record("tokenizer.ggml.pre", _pre_name(tj.get("pre_tokenizer"), folder)))
    for i, t in enumerate(tokens):
        if t is None:  # embeddings past the tokenizer's ids: llama.cpp's converter names them so
            tokens[i], types[i] = f"[PAD{i}]", UNUSED
    records += [gw.array_record("tokenizer.ggml.tokens", "str", tokens),
                gw.array_record("tokenizer.ggml.token_type", "i32", types)]
    records.append(gw.array_record("tokenizer.ggml.scores", "f32", scores) if spm else
                   gw.array_record("tokenizer.ggml.merges", "str", merges))
    eos = tok.backend.token_to_id(tok.eos_token) if tok.eos_token is not None else None
    specials = {"bos": tok.bos_id, "eos": eos, "padding": _pad_id(folder, tok)}
    for key, i in specials.items():
        if i is not None and 0 <= i < n_vocab:
            records.append(gw.u32_record(f"tokenizer.ggml.{key}_token_id", i))
    # said always: llama.cpp's default differs by tokenizer model, brisk's reading of the folder is the truth
    records.append(gw.bool_record("tokenizer.ggml.add_bos_token", tok.add_bos))
    if tok.chat_template:
        records.append(gw.string_record("tokenizer.chat_template", tok.chat_template))
    return records


def _pad_id(folder: Path, tok) -> int | None:
    from ..files import read_json

    cfg = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").exists() else {}
    pad = cfg.get("pad_token") if isinstance(cfg, dict) else None
    pad = pad.get("content") if isinstance(pad, dict) else pad
    if isinstance(pad, str):
        return tok.backend.token_to_id(pad)
    model_cfg = read_json(folder / "config.json")
    v = model_cfg.get("pad_token_id") if isinstance(model_cfg, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _spm_scores(tokens: list, merges: list[str]) -> list[float]:
    """SentencePiece scores that rank the tokens as the merges do: llama.cpp (and brisk's GGUF
    tokenizer) join the pair whose result scores best, so the first merge's result scores highest.
    Tokens no merge makes (single pieces, specials) score below every merged one."""
    rank = {}
    for r, m in enumerate(merges):
        left, _, right = m.partition(" ")
        rank.setdefault(left + right, r)
    floor = -float(len(merges) + 1)
    return [-float(rank[t]) if t in rank else floor for t in tokens]


def _adds_space_prefix(tj: dict) -> bool:
    """Whether the tokenizer puts a U+2581 before the text (SentencePiece's add_dummy_prefix)."""
    def walk(node) -> bool:
        if isinstance(node, dict):
            if node.get("type") == "Prepend" and node.get("prepend") == "\u2581":
                return True
            if node.get("type") == "Metaspace":
                return node.get("prepend_scheme", "always" if node.get("add_prefix_space", True) else "never") != "never"
            return any(walk(v) for v in node.values())
        return isinstance(node, list) and any(walk(v) for v in node)

    return walk(tj.get("normalizer")) or walk(tj.get("pre_tokenizer"))


def _pre_name(pre, folder: Path) -> str:
    """llama.cpp's name (tokenizer.ggml.pre) for a byte-level tokenizer's pre-tokenizer, read from
    the splits it makes: those brisk's GGUF tokenizer rebuilds from each name."""
    from ..gguf_tokenizer import _PRE_SPLITS

    splits = _splits(pre)
    for name, known in _PRE_SPLITS.items():  # the table's first name for a split is llama.cpp's usual one
        if splits == known:
            return name
    raise UnsupportedFormat("its pre-tokenizer splits text as none of the ones llama.cpp names "
                            f"({', '.join(sorted(_PRE_SPLITS))})", folder / "tokenizer.json")


def _splits(node) -> list[str] | None:
    """The regexes a pre-tokenizer splits by, in order (None: a step that is not a plain split)."""
    from ..gguf_tokenizer import _GPT2_SPLIT

    if not isinstance(node, dict):
        return None
    kind = node.get("type")
    if kind == "Sequence":
        out = []
        for step in node.get("pretokenizers") or []:
            s = _splits(step)
            if s is None:
                return None
            out += s
        return out
    if kind == "ByteLevel":
        return [_GPT2_SPLIT] if node.get("use_regex", True) else []
    if kind == "Digits" and node.get("individual_digits"):
        return [r"\p{N}"]
    if kind == "Split" and node.get("behavior") == "Isolated" and not node.get("invert"):
        pattern = node.get("pattern") or {}
        return [pattern["Regex"]] if isinstance(pattern.get("Regex"), str) else None
    return None
