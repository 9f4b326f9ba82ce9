"""What a model is and what running it would take, read from its headers only (`brisk info`).

Nothing here reads tensor data: a GGUF's header (through checkpoint._gguf_header, cached beside the
file's other load caches) and a Hugging Face folder's config.json, tokenizer files and the JSON
header of each safetensors file. Memory figures follow what the loader does on each device
(checkpoint.load_gguf, llm.build_model, kv.ContiguousKV): which weights stay quantized, in which
layout, and the dtype everything else and the KV cache are widened to.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config import DEFAULT_CTX, ModelConfig
from .errors import BriskError, FileError, InvalidValue
from .safetensors_header import tensor_entries


# Layers the loader may keep quantized (checkpoint.load_gguf): projections, the head, the embedding.
_QUANTIZED_LAYERS = ("_proj.weight", "lm_head.weight", "embed_tokens.weight")
_INT_DTYPES = {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"}  # safetensors: held as stored
_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "do_sample")


@dataclass
class TypeUsage:
    """The tensors of one stored type: a GGUF type (Q4_K, F32...) or a safetensors dtype (BF16, I32...)."""
    type: str
    tensors: int
    bytes: int
    elements: int


@dataclass
class MemoryFit:
    """Whether the model would fit on one device: its weights as brisk holds them there, plus the
    KV cache for the chosen context, against the memory free now."""
    device: str  # "cpu" or "cuda:N"
    dtype: str  # the float dtype weights are widened to and the KV cache is kept in
    weights_bytes: int
    kv_bytes: int
    needed_bytes: int  # weights + KV cache (activations and the runtime itself come on top)
    available_bytes: int | None  # MemAvailable for the CPU, free memory for a GPU; None: unknown
    total_bytes: int | None
    fits: bool | None
    approximate: bool  # weights_bytes is an estimate rather than the loader's exact layout


@dataclass
class ModelInfo:
    name: str
    path: str
    format: str  # "gguf" or "hf"
    architecture: str  # GGUF general.architecture or config.json model_type
    parameters: int
    file_bytes: int
    quantization: list[TypeUsage]  # by stored type, most bytes first
    quant_method: str | None  # an HF folder's quantization_config, in words
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    ffn_dim: int
    context_length: int  # the model's maximum
    ctx: int  # the context the KV figures are for
    vocab_size: int
    tie_embeddings: bool
    sliding_window: int | None
    sliding_layers: int
    chat_template: bool
    sampling: dict  # the model's recommended settings (generation_config.json, general.sampling.*)
    kv_dtype: str  # of the CPU cache
    kv_bytes_per_token: int  # on the CPU
    kv_bytes: int  # on the CPU, for ctx tokens
    experts: int = 0  # a mixture of experts' experts per MoE layer (0: dense)
    experts_used: int = 0  # routed per token
    active_parameters: int = 0  # a token's share: all but the experts it is not routed to
    read_bytes_per_token: int = 0  # weight bytes as stored that a decode step reads (one embedding row)
    memory: list[MemoryFit] = field(default_factory=list)  # the CPU, then each GPU torch sees
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def model_info(model: str | None = None, ctx: int | None = None, kv_type: str = "auto") -> ModelInfo:
    """Describe `model` (a .gguf file, an HF folder, a hub id already in the local cache, or None for
    the default) without loading its weights. ctx: the context for the KV-cache figures (default,
    as the loader: min(4096, the model's maximum)); kv_type: the CPU cache's type (--kv-type; a GPU's
    is its activations' dtype). Raises FileError for anything unreadable."""
    from .load_options import check_kv_type

    kv_type = check_kv_type(kv_type)
    name, path = _locate(model)
    info = _gguf_info(name, path, ctx) if path.is_file() else _hf_info(name, path, ctx)
    if kv_type != "auto":  # the CPU's figures for that type
        cpu = _kv_type("cpu", kv_type)
        cpu.check_head_dim(info.head_dim)
        info.kv_dtype = cpu.name
        info.kv_bytes_per_token = round(2 * info.layers * info.kv_heads * info.head_dim * cpu.bytes_per_value())
        info.kv_bytes = info.kv_bytes_per_token * info.ctx
        for m in info.memory:
            if m.device == "cpu":
                m.kv_bytes = info.kv_bytes
                m.needed_bytes = m.weights_bytes + m.kv_bytes
                m.fits = None if m.available_bytes is None else m.needed_bytes <= m.available_bytes
    return info


def _kv_type(device: str, kv_type: str):
    import torch

    from .kv.kv_type import resolve

    return resolve(kv_type, _auto_dtype(device), torch.device(device))


def has_chat_template(model: str | None) -> bool | None:
    """Whether `model` has a chat template, from its header or tokenizer files alone (a chat on a base
    model is refused before a long load); None when that cannot be told without downloading or
    loading (a hub id not in the cache, an unreadable file: the load then says what is wrong)."""
    try:
        name, path = _locate(model)
        if path.is_file():
            from .checkpoint import gguf_has_chat_template

            return gguf_has_chat_template(path)
        from .tokenizer import chat_template_in

        return chat_template_in(path) is not None
    except BriskError:
        return None


# ---------------------------------------------------------------- finding the model

def _locate(model: str | None) -> tuple[str, Path]:
    """model_path.resolve, except that a hub id is only looked up in the local cache: info never
    downloads a model."""
    from . import model_path

    if model is None or not model_path.is_hub_id(model):
        return model_path.resolve_local(model)
    from . import hub

    try:
        return model, hub.cached(model)
    except hub.NotCached:
        raise FileError("no such file or folder, and not in the local Hugging Face cache (info never "
                        "downloads: `brisk pull` fetches a hub model)", model) from None


# ---------------------------------------------------------------- GGUF

def _gguf_info(name: str, path: Path, ctx: int | None) -> ModelInfo:
    import gguf

    from .checkpoint import _gguf_header, gguf_to_hf_name

    if path.suffix in (".safetensors", ".bin", ".pt"):
        raise FileError("pass the checkpoint folder (with config.json), not a weights file", name)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise FileError(f"cannot read ({e.strerror or e})", name) from None
    if magic != b"GGUF":
        raise FileError(f"not a GGUF file (bad magic {magic!r})", name)
    try:
        cfg, tok, table, arch, *rest = _gguf_header(path)
    except BriskError:
        raise
    except (KeyError, ValueError, TypeError, IndexError, OSError) as e:  # metadata of the wrong shape
        raise FileError(f"unreadable GGUF metadata ({type(e).__name__}: {e})", name) from None
    generation = rest[0] if rest else {}

    usage: dict[str, TypeUsage] = {}
    for t in table:
        kind = _gguf_type_name(gguf, t.qtype)
        u = usage.setdefault(kind, TypeUsage(kind, 0, 0, 0))
        stacked = re.search(r"_exps\.(\d+)\.", t.name)  # one expert's slice of a file tensor: counted once
        u.tensors += not stacked or stacked.group(1) == "0"
        u.bytes, u.elements = u.bytes + t.nbytes, u.elements + math.prod(t.shape)
    info = _common(name, path, "gguf", arch.name, cfg, ctx, tok.has_chat_template, generation,
                   sorted(usage.values(), key=lambda u: -u.bytes), None,
                   parameters=sum(u.elements for u in usage.values()), file_bytes=path.stat().st_size)
    _active(info, cfg, [(gguf_to_hf_name(t.name, arch) or t.name, math.prod(t.shape), t.nbytes) for t in table])
    widened = set()
    info.memory = _fits(info, cfg, lambda device, size: _gguf_weight_bytes(
        table, arch, cfg, device, size, widened if device == "cpu" else set()))
    if widened:
        info.notes.append(f"{', '.join(sorted(_gguf_type_name(gguf, q) for q in widened))} weights have no "
                          "quantized kernel in brisk yet: widened to float at load (counted so above)")
    return info


def _gguf_type_name(gguf, qtype: int) -> str:
    try:
        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def _gguf_weight_bytes(table, arch, cfg: ModelConfig, device: str, float_size: int,
                       widened: set) -> tuple[int, bool]:
    """Bytes of weights as load_gguf and build_model would hold them on `device`, and whether that is
    an estimate. On the CPU with brisk's native kernels, every type they read stays in the file's
    blocks; without them (and on a GPU) Q4_0/Q4_1/Q4_K/Q8_0 are repacked (gguf_blocks), an untied
    quantized embedding is widened, and everything else is widened to the float dtype."""
    from ..quant import gguf_blocks, gguf_types, native
    from .checkpoint import gguf_to_hf_name

    native_on = device == "cpu" and native.available()
    total, approximate = 0, device != "cpu"
    for t in table:
        hf = gguf_to_hf_name(t.name, arch)
        if hf is None:
            continue  # the loader skips tensors it has no use for
        n = math.prod(t.shape)
        matrix = len(t.shape) == 2 and hf.endswith(_QUANTIZED_LAYERS)
        untied_embedding = hf == "model.embed_tokens.weight" and not cfg.tie_embeddings
        if native_on and matrix and native.takes(t.qtype, t.shape[1]):
            total += t.nbytes  # read in place from the memory-mapped file
        elif not native_on and matrix and not untied_embedding and gguf_blocks.fits(t.qtype, t.shape[1]):
            total += _repacked_bytes(t.qtype, *t.shape)
        else:
            total += n * (4 if hf == "rope_freqs" else float_size)
            if matrix and hf.endswith("_proj.weight") and t.qtype not in gguf_types.FLOAT_IDS:
                widened.add(t.qtype)
    return total, approximate


def _repacked_bytes(qtype: int, rows: int, cols: int) -> int:
    """A GGUF weight repacked by gguf_blocks.to_layer: Int8Linear (int8 codes, a bf16 scale per row)
    for Q8_0; Int4Linear (4-bit codes, bf16 scale and zero per 32 weights) for the 4-bit types, which
    also holds the scales and zeros again in its kernel's layout where that kernel takes the shape."""
    from ..quant import gguf_blocks

    if qtype == gguf_blocks.Q8_0:
        return rows * cols + 2 * rows
    groups = rows * cols // gguf_blocks.BLOCK
    codes, scales_zeros = rows * cols // 2, groups * 2 * 2
    return codes + scales_zeros * (2 if rows % 32 == 0 else 1)


# ---------------------------------------------------------------- Hugging Face folders

def _hf_info(name: str, folder: Path, ctx: int | None) -> ModelInfo:
    from .arch import from_hf_config
    from .checkpoint import _read_json

    cfg_json = _read_json(folder / "config.json")
    if not cfg_json:
        raise FileError("missing or empty config.json", folder)
    cfg = from_hf_config(cfg_json)
    files = _weight_files(folder)
    tensors: dict[str, tuple[str, tuple[int, ...], int]] = {}
    for f in files:
        tensors.update(tensor_entries(f))
    qcfg = cfg_json.get("quantization_config") or {}

    usage: dict[str, TypeUsage] = {}
    for dtype, shape, nbytes in tensors.values():
        u = usage.setdefault(dtype, TypeUsage(dtype, 0, 0, 0))
        u.tensors, u.bytes, u.elements = u.tensors + 1, u.bytes + nbytes, u.elements + math.prod(shape)
    # a quantized checkpoint packs several weights into each stored element: count the model's own
    parameters = _logical_parameters(cfg) if qcfg else sum(u.elements for u in usage.values())

    notes, has_template = [], False
    try:
        from .tokenizer import Tokenizer

        has_template = Tokenizer.from_hf_folder(folder).has_chat_template
    except BriskError as e:
        notes.append(f"the tokenizer would not load: {e}")
    generation = _read_json(folder / "generation_config.json")
    sampling = {k: generation[k] for k in _SAMPLING_KEYS if k in generation}
    quant = _describe_quant(qcfg) if qcfg else None
    if "brisk_embedding" in cfg_json:  # quant/embedding_format.py
        quant = (quant + ", " if quant else "") + "8-bit embedding"
        notes.append("the embedding is in brisk's 8-bit format: transformers and vLLM cannot load this folder")
    info = _common(name, folder, "hf", cfg_json.get("model_type") or cfg.arch, cfg, ctx, has_template, sampling,
                   sorted(usage.values(), key=lambda u: -u.bytes), quant,
                   parameters=parameters, file_bytes=sum(f.stat().st_size for f in files))
    info.notes.extend(notes)
    _active(info, cfg, [(k, math.prod(shape), nbytes) for k, (_, shape, nbytes) in tensors.items()],
            parameters / max(1, sum(u.elements for u in usage.values())))
    info.memory = _fits(info, cfg, lambda device, size: _hf_weight_bytes(tensors, cfg, size, bool(qcfg), device))
    return info


def _weight_files(folder: Path) -> list[Path]:
    from .checkpoint import safetensors_files

    files = safetensors_files(folder)
    if files:
        return files
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise FileError("weights are PyTorch pickles (*.bin/*.pt): info reads safetensors headers only", folder)
    raise FileError("no *.safetensors weights found", folder)


def _logical_parameters(cfg: ModelConfig) -> int:
    """The parameters of the model itself (the float model a quantized checkpoint was made from),
    counted on the meta device: no memory."""
    import torch

    from .model import Transformer

    with torch.device("meta"):
        net = Transformer(cfg)
    n = sum(p.numel() for p in net.parameters())
    return n - net.lm_head.weight.numel() if cfg.tie_embeddings else n


def _hf_weight_bytes(tensors: dict, cfg: ModelConfig, float_size: int, quantized: bool,
                     device: str) -> tuple[int, bool]:
    """Float tensors widened to the device's dtype; a quantized checkpoint's integer tensors (packed
    weights, zero points, indices) as stored, which approximates the layers its format loads into."""
    names = {k.removeprefix("language_model.") for k in tensors}
    total = 0
    for name, (dtype, shape, nbytes) in tensors.items():
        name = name.removeprefix("language_model.")
        if cfg.tie_embeddings and name == "lm_head.weight" and "model.embed_tokens.weight" in names:
            continue  # the head is the embedding
        total += nbytes if dtype in _INT_DTYPES else math.prod(shape) * float_size
    return total, quantized or device != "cpu"


def _describe_quant(q: dict) -> str:
    """A quantization_config in words: "gptq 4-bit, group 128", "bitsandbytes nf4 (double quant)"."""
    method = str(q.get("quant_method") or "unknown")
    if method == "bitsandbytes" or q.get("load_in_4bit") or q.get("load_in_8bit"):
        if q.get("load_in_8bit"):
            return "bitsandbytes int8"
        kind = q.get("bnb_4bit_quant_type", "fp4")
        return f"bitsandbytes {kind}" + (" (double quant)" if q.get("bnb_4bit_use_double_quant") else "")
    words = [method]
    if q.get("bits"):
        words.append(f"{q['bits']}-bit")
    text = " ".join(words)
    group = q.get("group_size", q.get("q_group_size"))
    if isinstance(group, int) and group > 0:
        text += f", group {group}"
    if q.get("desc_act"):
        text += ", act-order"
    if q.get("sym") is False:
        text += ", asymmetric"
    return text


# ---------------------------------------------------------------- shared

def _common(name, path, fmt, arch, cfg: ModelConfig, ctx, chat_template, sampling, usage, quant_method,
            parameters: int, file_bytes: int) -> ModelInfo:
    notes = []
    chosen = min(ctx or DEFAULT_CTX, cfg.max_seq_len)
    if chosen < 16:  # as LLM.load
        raise InvalidValue("ctx", chosen, "", template=f"{{option}} {chosen}: too small")
    if ctx is not None and ctx > cfg.max_seq_len:
        notes.append(f"ctx {ctx} is more than the model's {cfg.max_seq_len}: brisk caps it there")
    sliding = sum(t == "sliding" for t in cfg.layer_types) if cfg.sliding_window else 0
    if sliding:
        notes.append(f"{sliding} of {cfg.n_layers} layers attend over a sliding window of {cfg.sliding_window} "
                     "tokens; brisk's KV cache still holds every position for them (counted so)")
    size = _float_size("cpu")
    per_token = kv_bytes_per_token(cfg, size)
    return ModelInfo(
        name=name, path=str(path), format=fmt, architecture=arch, parameters=parameters, file_bytes=file_bytes,
        quantization=usage, quant_method=quant_method, layers=cfg.n_layers, heads=cfg.n_heads,
        kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden_size=cfg.dim, ffn_dim=cfg.ffn_dim,
        context_length=cfg.max_seq_len, ctx=chosen, vocab_size=cfg.vocab_size, tie_embeddings=cfg.tie_embeddings,
        sliding_window=cfg.sliding_window if sliding else None, sliding_layers=sliding,
        chat_template=bool(chat_template), sampling=dict(sampling), kv_dtype=_dtype_name("cpu"),
        kv_bytes_per_token=per_token, kv_bytes=per_token * chosen, notes=notes)


def _active(info: ModelInfo, cfg: ModelConfig, tensors: list[tuple[str, int, int]], per_element: float = 1.0) -> None:
    """A token's share of the weights: parameters (tensors: name, stored elements, bytes; stored
    elements times per_element are parameters, for packed quantized checkpoints) and the bytes a
    decode step reads. An MoE layer's experts count for experts_used of n_experts; an untied
    embedding for one row."""
    expert_n = expert_b = embed_b = 0
    for name, n, nbytes in tensors:
        if ".experts." in name or "_exps." in name:
            expert_n, expert_b = expert_n + n, expert_b + nbytes
        elif "embed_tokens" in name and not cfg.tie_embeddings:
            embed_b += nbytes
    idle = 1 - cfg.n_experts_used / cfg.n_experts if cfg.n_experts else 0.0
    total_b = sum(b for _, _, b in tensors)
    info.experts, info.experts_used = cfg.n_experts, cfg.n_experts_used
    info.active_parameters = info.parameters - round(expert_n * per_element * idle)
    info.read_bytes_per_token = round(total_b - expert_b * idle - embed_b * (1 - 1 / cfg.vocab_size))


def kv_bytes_per_token(cfg: ModelConfig, element_size: int) -> int:
    """The KV cache per token: K and V for every layer, [kv_heads, head_dim] each, in the activations'
    dtype (kv.ContiguousKV.for_model; the paged cache is laid out the same)."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * element_size


def _auto_dtype(device: str):
    import torch

    from .device import pick_dtype

    return pick_dtype("auto", torch.device(device))


def _float_size(device: str) -> int:
    return _auto_dtype(device).itemsize


def _dtype_name(device: str) -> str:
    return str(_auto_dtype(device)).removeprefix("torch.")


def _fits(info: ModelInfo, cfg: ModelConfig, weight_bytes) -> list[MemoryFit]:
    """The CPU, then each GPU torch sees: weights there plus the KV cache for info.ctx, against the
    memory available now. weight_bytes(device, float element size) -> (bytes, approximate)."""
    out = []
    devices = [("cpu", "cpu")] + [(f"cuda:{i}", "cuda") for i in range(_cuda_count())]
    for name, kind in devices:
        size = _float_size(kind)
        weights, approximate = weight_bytes(kind, size)
        kv = kv_bytes_per_token(cfg, size) * info.ctx
        available, total = memory_available() if kind == "cpu" else _cuda_memory(name)
        needed = weights + kv
        out.append(MemoryFit(name, _dtype_name(kind), weights, kv, needed, available, total,
                             None if available is None else needed <= available, approximate))
    return out


def _cuda_count() -> int:
    import torch

    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver reads as no GPU, as pick_device does
        return 0


def _cuda_memory(device: str) -> tuple[int | None, int | None]:
    import torch

    try:
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), int(total)
    except Exception:
        return None, None


def memory_available(meminfo: str = "/proc/meminfo") -> tuple[int | None, int | None]:
    """(MemAvailable, MemTotal) in bytes from /proc/meminfo; None where it cannot be read."""
    values = {}
    try:
        with open(meminfo) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    values[key] = int(rest.split()[0]) * 1024  # given in kB
    except (OSError, ValueError, IndexError):
        pass
    return values.get("MemAvailable"), values.get("MemTotal")
