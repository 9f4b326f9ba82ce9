"""Finding and reading checkpoints: a local HF folder, a hub id, a GGUF file, or the default.

Everything returns plain HF-named float tensors plus a ModelConfig; nothing here unpickles
untrusted data or runs code shipped with a model.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import arch as arch_mod
from . import config as config_mod
from . import progress
from .anonymous_memory import anonymous_bytes
from .config import ModelConfig
from .errors import FileError, shown
from .files import exists as files_exists, named_inside, read_json, regular_file
from .model_path import DEFAULT_MODEL_DIST, HUB_ID, default_model_path, resolve  # noqa: F401  (also imported from here)
from .safetensors_header import check_unique_names
from ..quant import settings

CACHE_DIR = Path(_cache if (_cache := settings.CACHE.get()) is not None else Path.home() / ".cache" / "brisk")


@dataclass
class Checkpoint:
    name: str  # what the user called it, for messages and tables
    kind: str  # "hf" or "gguf"
    path: Path
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # HF names, float
    tokenizer: Any  # brisk.core.tokenizer.Tokenizer
    generation: dict = field(default_factory=dict)  # generation_config.json (eos, sampling defaults)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. rope_freqs
    # Layers that arrive quantized, by module name: GGUF blocks repacked at load (quant/gguf_blocks.py)
    modules: dict[str, Any] = field(default_factory=dict)
    quant_config: dict = field(default_factory=dict)  # config.json's quantization_config, if any

    @property
    def file_bytes(self) -> int:
        if self.path.is_file():
            return self.path.stat().st_size
        return sum(p.stat().st_size for p in self.path.glob("*.safetensors") if p.is_file())  # not a dangling link


# ---------------------------------------------------------------- HF folders


def _read_json(path: Path) -> dict:
    data = read_json(path)
    if not isinstance(data, dict):
        raise FileError(f"must be a JSON object, not {type(data).__name__}", path)
    return data


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    check_unique_names(path)
    try:
        return load_file(str(path))  # memory-mapped; no copy until the tensors are converted
    except Exception as e:
        raise FileError(f"unreadable safetensors file ({str(e).splitlines()[0]})", path) from None


def safetensors_files(folder: Path) -> list[Path]:
    """A folder's safetensors weights, chosen as transformers chooses them: the index's shards (each
    must exist), else model.safetensors, else every *.safetensors file."""
    index = folder / "model.safetensors.index.json"
    if not files_exists(index):
        if files_exists(folder / "model.safetensors"):  # a stale copy or a reference beside it is not read
            return [regular_file(folder / "model.safetensors")]
        return [regular_file(f) for f in sorted(folder.glob("*.safetensors"))]
    weight_map = _read_json(index).get("weight_map", {})
    if not isinstance(weight_map, dict):
        raise FileError("weight_map must map tensor names to files", index)
    shards = sorted(set(named_inside(folder, s, index) for s in weight_map.values()))
    if not shards:
        raise FileError("empty weight_map", index)
    for f in shards:
        if not files_exists(f):
            # named by the index, the name cut short: a long one (past the system's limit) is missing too
            raise FileError(f"shard listed in the index is missing: {shown(str(f.relative_to(folder)))}", index)
        regular_file(f)
    return shards


def load_hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = safetensors_files(folder)
    if not files:
        pickles = [regular_file(f) for f in sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt"))]
        if pickles:
            return _load_pickled(pickles)
        raise FileError("no *.safetensors weights found", folder)
    tensors: dict[str, torch.Tensor] = {}
    source: dict[str, Path] = {}
    for f in files:
        for name, t in _load_safetensors(f).items():
            if name in source:  # two versions of one weight: which one is right cannot be told
                raise FileError(f"tensor {name} is in both {source[name].name} and {f.name}", folder)
            tensors[name], source[name] = t, f
    return tensors


def _load_pickled(files: list[Path]) -> dict[str, torch.Tensor]:
    # weights_only=True refuses arbitrary objects: a pickle can only hold tensors here.
    tensors = {}
    for f in files:
        try:
            tensors.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        except Exception as e:
            raise FileError("refused (only plain tensor pickles load, with weights_only=True): "
                            f"{str(e).splitlines()[0]}", f) from None
    return tensors


def load_hf_folder(name: str, folder: Path, native_blocks: bool = False) -> Checkpoint:
    from ..quant import embedding_format
    from .tokenizer import Tokenizer

    cfg_json = _read_json(folder / "config.json")
    if not cfg_json:
        raise FileError("missing or empty config.json", folder)
    cfg = arch_mod.from_hf_config(cfg_json, str(folder / "config.json"))
    tensors = {k.removeprefix("language_model."): v for k, v in load_hf_tensors(folder).items()}
    tensors = arch_mod.by_name(cfg.arch).hf_tensors(tensors, cfg, folder)
    quant = cfg_json.get("quantization_config") or {}
    if not isinstance(quant, dict):
        raise FileError(f"quantization_config must be an object, got {shown(quant)}", folder / "config.json")
    modules, extra = {}, {}
    if embedding_format.CONFIG_KEY in cfg_json:  # brisk's 8-bit table (quant/embedding_format.py)
        try:
            raw = embedding_format.q8_0_blocks(tensors, cfg_json[embedding_format.CONFIG_KEY], cfg.vocab_size, cfg.dim)
        except embedding_format.EmbeddingFormatError as e:
            raise FileError(str(e), folder) from None
        if native_blocks:
            table = kept_layer(torch.from_numpy(raw), embedding_format.Q8_0, cfg.vocab_size, cfg.dim)
        else:  # torch's kernels: int8 rows
            from ..quant import gguf_blocks

            table = gguf_blocks.to_layer(raw, cfg.vocab_size, cfg.dim, embedding_format.Q8_0)
        if cfg.tie_embeddings:
            modules["lm_head"] = table  # the embedding then reads its rows (build_model)
        else:
            extra["embed_layer"] = table
    tok = Tokenizer.from_hf_folder(folder)
    return Checkpoint(name, "hf", folder, cfg, tensors, tok,
                      checked_generation(_read_json(folder / "generation_config.json"), folder / "generation_config.json"),
                      extra=extra, modules=modules, quant_config=quant)


# the sampling settings a model may recommend, and the values each may take
_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def checked_generation(gen, path) -> dict:
    """generation_config.json with its sampling settings checked: one that is not a number in its
    range is ignored with a warning (the model still runs, with brisk's default for it)."""
    if not isinstance(gen, dict):
        warnings.warn(f"{path}: not a JSON object (ignored)")
        return {}
    from dataclasses import replace

    from .errors import InvalidValue
    from .sampling import SamplingParams

    out = dict(gen)
    for key in _SAMPLING_KEYS:  # checked by the rule the flags and the API are checked by
        if key not in gen:
            continue
        v = gen[key]
        try:
            if not config_mod.number(v) or (key == "top_k" and v != int(v)):
                raise InvalidValue(key, v, "must be a number")
            replace(SamplingParams(), **{key: int(v) if key == "top_k" else float(v)}).validate()
        except InvalidValue:
            warnings.warn(f"{path}: {key} {shown(v)} is not a valid setting (ignored)")
            del out[key]
    if "do_sample" in out and not isinstance(out["do_sample"], bool):
        del out["do_sample"]
    return out


# ---------------------------------------------------------------- GGUF

def gguf_to_hf_name(name: str, arch: "arch_mod.Architecture") -> str | None:
    """A GGUF tensor's Hugging Face name ("rope_freqs" for llama3's rope factors), None if unused."""
    return "rope_freqs" if name == "rope_freqs.weight" else arch.gguf_to_hf_name(name)


def _gguf_cache_dir(path: Path) -> Path:
    st = regular_file(path).stat()  # (a FIFO or a device named as a model: refused here)
    # v3: core/arch's configs, and Qwen2's q/k rows no longer reordered (a v2 cache holds them reordered)
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v3".encode()).hexdigest()[:24]
    return CACHE_DIR / "gguf" / key


# a GGUF's recommended sampling (llama.cpp's general.sampling.* keys) -> generation_config.json's names
_GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                  "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                  "general.sampling.penalty_repeat": "repetition_penalty"}


def gguf_generation(meta: dict) -> dict:
    """The sampling settings a GGUF recommends, where its metadata holds them as valid numbers."""
    given = {name: meta[key] for key, name in _GGUF_SAMPLING.items() if key in meta}
    with warnings.catch_warnings():  # an invalid one is left out, as it always was here, quietly
        warnings.simplefilter("ignore")
        return checked_generation(given, "GGUF metadata")


def _gguf_header(path: Path):
    """(config, tokenizer, tensor table, arch, recommended sampling), from the cache when this file
    was seen before: parsing a big vocabulary is the slow part of opening a GGUF."""
    from .gguf_file import GGUFFile, TensorInfo
    from .tokenizer import Tokenizer

    cached = _gguf_cache_dir(path)
    info = _cached_header(cached)
    if info:
        table = [TensorInfo(n, tuple(shape), q, off, nb) for n, shape, q, off, nb in info["tensors"]]
        cfg = ModelConfig(**info["config"])
        return (cfg, Tokenizer.from_hf_folder(cached), arch_mod.split_gguf_table(table, cfg, path),
                arch_mod.by_name(cfg.arch), info["generation"])
    reader = GGUFFile(path)
    meta = reader.metadata
    tok = Tokenizer.from_gguf_metadata(meta)
    cfg = arch_mod.from_gguf_metadata(meta, tok.vocab_size, str(path))
    if not any(t.name == "output.weight" for t in reader.tensors):
        cfg.tie_embeddings = True
    if cfg.n_experts:  # layers without a router have a plain MLP (Qwen3-MoE's mlp_only_layers)
        names = {t.name for t in reader.tensors}
        cfg.dense_layers = [i for i in range(cfg.n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    info = {"config": cfg.to_dict(), "arch": cfg.arch, "source": str(path.resolve()),
            "generation": gguf_generation(meta),
            "tensors": [[t.name, list(t.shape), t.qtype, t.offset, t.nbytes] for t in reader.tensors]}
    table = arch_mod.split_gguf_table(reader.tensors, cfg, path)  # before the cache: a bad table is refused
    _save_cache(cached, info, tok)
    return cfg, tok, table, arch_mod.by_name(cfg.arch), info["generation"]


def _cached_header(cached: Path) -> dict:
    """The header cache's brisk.json where it is complete, else {} (a cache from before brisk read
    sampling keys is redone)."""
    info = _read_json(cached / "brisk.json") if (cached / "brisk.json").exists() else {}
    return info if "tensors" in info and "generation" in info else {}


def gguf_has_chat_template(path: Path) -> bool:
    """Whether the GGUF has a chat template: from the header's cache without building its tokenizer
    (the load builds it), else from the header, which fills the cache for the load."""
    from .tokenizer import chat_template_in

    cached = _gguf_cache_dir(path)
    if _cached_header(cached):
        return chat_template_in(cached) is not None
    return _gguf_header(path)[1].has_chat_template


def load_gguf(name: str, path: Path, keep_quantized: bool = True, native_blocks: bool = False,
              interleave: bool = True) -> Checkpoint:
    """A GGUF checkpoint. With keep_quantized, weight matrices stay quantized: with native_blocks (the
    CPU with brisk's native kernels) every type those read stays in the file's own blocks, memory-mapped
    (quant/gguf_linear.py); otherwise Q4_0/Q4_1/Q4_K/Q8_0 are repacked for torch's kernels
    (quant/gguf_blocks.py, cached beside the header). Every other tensor is widened to float; float
    tensors of quantized types come from a converted copy cached beside the header (safetensors,
    memory-mapped), so the slow dequantization happens once per file. interleave False: kept blocks
    stay in the file's layout (a tensor-parallel rank cuts its shard first, then interleaves it)."""
    import numpy as np

    from ..quant import gguf_blocks, gguf_types, native
    from .gguf_file import dequantize_tensor

    cfg, tok, table, arch, generation = _gguf_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    native_blocks = native_blocks and keep_quantized
    layers = _repacked_cache(path) if keep_quantized and not native_blocks else None
    modules, tensors, extra, need_cache, fresh, widened = {}, {}, {}, [], {}, set()
    repacking = keep_quantized and not native_blocks and not layers  # the first load this way: slow
    steps = progress.track(table, f"repacking {path.name} for torch's kernels (once)", len(table)) if repacking else table
    for t in steps:
        if t.name in arch.gguf_rope_factors:  # Phi-3's longrope factor lists: part of the config
            factors = dequantize_tensor(data, t)
            if cfg.rope_scaling is None or factors.shape != (cfg.rotary_dim // 2,):
                raise FileError(f"tensor {t.name} has shape {list(t.shape)} without a longrope config that "
                                f"takes {cfg.rotary_dim // 2} factors", path)
            cfg.rope_scaling[arch.gguf_rope_factors[t.name]] = factors.tolist()
            continue
        hf = gguf_to_hf_name(t.name, arch)
        if hf is None:
            continue
        if len(t.shape) != (2 if hf.endswith(_MATRICES) else 1):
            raise FileError(f"tensor {t.name} has shape {list(t.shape)}: the model needs a "
                            f"{'matrix' if hf.endswith('.weight') and 'norm' not in hf else 'vector'} there", path)
        layer = hf.removesuffix(".weight")
        if layers is not None and layer in layers:
            modules[layer] = layers[layer]
        elif (native_blocks and len(t.shape) == 2 and native.takes(t.qtype, t.shape[1])
                and hf.endswith(("_proj.weight", "lm_head.weight", "embed_tokens.weight"))):
            modules[layer] = _native_layer(data, t, arch.gguf_row_order(hf, t.shape[0], cfg), interleave)
        elif (keep_quantized and len(t.shape) == 2 and gguf_blocks.fits(t.qtype, t.shape[1])
                and hf.endswith(("_proj.weight", "lm_head.weight", "embed_tokens.weight"))):
            raw = data[t.offset:t.offset + t.nbytes]
            order = arch.gguf_row_order(hf, t.shape[0], cfg)
            if order is not None:
                raw = gguf_blocks.permute_rows(raw, t.shape[0], order)
            modules[layer] = fresh[layer] = gguf_blocks.to_layer(raw, *t.shape, t.qtype)
        elif t.qtype in gguf_types.FLOAT_IDS:  # cheap to widen here
            tensors[hf] = arch.convert_gguf_tensor(dequantize_tensor(data, t), hf, cfg)
        else:
            need_cache.append(hf)
            if keep_quantized and len(t.shape) == 2 and hf.endswith("_proj.weight"):
                widened.add(t.qtype)
    if widened:
        import gguf

        names = ", ".join(sorted(gguf.GGMLQuantizationType(q).name for q in widened))
        kept = gguf_types.names(gguf_types.NATIVE if native_blocks else gguf_types.REPACKED)
        warnings.warn(f"{names} weights have no quantized kernel in brisk yet: widened to float ({kept} stay quantized)")
    if fresh:  # every repacked layer, not just the new ones: a cache from an older brisk may lack some
        _save_repacked(path, modules)
    if need_cache:
        tensors.update(_float_cache(path, table, arch, cfg, need_cache))
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") == "longrope" and not {
            "short_factor", "long_factor"} <= cfg.rope_scaling.keys():
        raise FileError("a longrope model without its rope_factors_short/long tensors", path)
    for layer, module in modules.items():  # a kept layer's bias (Qwen2's q/k/v) goes with it
        bias = tensors.pop(f"{layer}.bias", None)
        if bias is not None:
            module.bias = torch.nn.Parameter(bias, requires_grad=False)
    if "rope_freqs" in tensors:
        extra["rope_freqs"] = tensors.pop("rope_freqs")
    if "model.embed_tokens" in modules:
        if not cfg.tie_embeddings and native_blocks:
            extra["embed_layer"] = modules.pop("model.embed_tokens")  # looked up row by row, never widened
        elif not cfg.tie_embeddings:
            # An untied quantized embedding table is only ever gathered from: widen it.
            tensors["model.embed_tokens.weight"] = modules.pop("model.embed_tokens").dequantize()
        else:
            modules["lm_head"] = modules.pop("model.embed_tokens")
    return Checkpoint(name, "gguf", path, cfg, tensors, tok, generation, extra, modules=modules)


# the GGUF tensors that are matrices (projections, the output layer, the embedding, a router)
_MATRICES = ("_proj.weight", "lm_head.weight", "embed_tokens.weight", "mlp.gate.weight")


def _native_layer(data, t, order: torch.Tensor | None, interleave: bool = True):
    """A GGUF weight as a GGUFLinear over the file's bytes (a copy only where rows must be reordered)."""
    rows = t.shape[0]
    raw = data[t.offset:t.offset + t.nbytes].reshape(rows, -1)
    if order is not None:
        blocks = torch.from_numpy(raw[order.numpy()])
    else:
        with warnings.catch_warnings():  # read-only memory map: the kernels never write to it
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(raw)
    if not interleave:
        from ..quant.gguf_linear import GGUFLinear

        layer = GGUFLinear(blocks, t.qtype, rows, t.shape[1])
        layer.__dict__["_file_bytes"] = raw if order is None else None  # release_file_pages' to drop
        return layer
    return kept_layer(blocks, t.qtype, rows, t.shape[1], raw if order is None else None)


def kept_layer(blocks: torch.Tensor, qtype: int, rows: int, cols: int, source=None):
    """GGUF blocks [rows, bytes per row] as a GGUFLinear, interleaved where the kernels have that
    layout; source: the memory-mapped file bytes blocks reads, handed back as they are packed."""
    from ..quant import gguf_interleave, native
    from ..quant.gguf_linear import GGUFLinear

    if native.interleaves(qtype, rows, cols):
        # K-quant, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 rows interleaved for the kernels (one core's GEMV: Q4_K 2x,
        # Q5_K 2.1x, Q6_K 1.3x, Q8_0 2.1x, Q4_0/Q4_1 2x, Q3_K/Q2_K ~2-4x; Q5_0 prefill 1.6x); the file's pages it was read from are handed back chunk by chunk, else memory
        # would hold the weight twice (at the peak: Gemma 3's 178 MB table, +120 MB of peak RSS).
        release = (lambda a, b: _release_pages(source[a:b])) if source is not None else None
        # the kernels stream the packed weights: on 4 KB pages (TLB misses) they decode slower than on 2 MB ones
        out = anonymous_bytes(blocks.numel(), huge_pages=True).view(blocks.shape)
        packed = gguf_interleave.pack(blocks, qtype, out=out, done=release)
        _trim_heap(packed.numel())
        return GGUFLinear(packed, qtype, rows, cols, layout=native.X8)
    return GGUFLinear(blocks, qtype, rows, cols)


@functools.cache
def _libc():
    """The C library's functions (Linux), loaded once; None elsewhere."""
    import ctypes

    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_untrimmed = 0  # bytes packed since the C heap was last trimmed
TRIM_EVERY = 64 << 20


def trim_heap() -> None:
    """Hand the C heap's free memory back to the system now (after a load's last temporaries)."""
    _trim_heap(TRIM_EVERY)


def _trim_heap(nbytes: int) -> None:
    """Hand the C heap's free memory back to the system once every TRIM_EVERY bytes packed: packing
    leaves its temporaries there (glibc keeps freed blocks below its adaptive mmap threshold), and
    over a 1.1B model's 154 matrices that held ~300 MB, peak RSS 1.5x the file. (Each call costs
    about a millisecond: after every matrix it was 0.2 s of SmolLM2's load.)"""
    global _untrimmed
    _untrimmed += nbytes
    trim = getattr(_libc(), "malloc_trim", None)  # glibc's; other C libraries: nothing to do
    if trim is not None and _untrimmed >= TRIM_EVERY:
        trim(0)
        _untrimmed = 0


def release_file_pages(layer) -> None:
    """Drop the file's pages a layer kept in the file's layout was read from (once it has been cut
    into a shard and is no longer read): the rank's memory then holds its shard, not the file."""
    raw = layer.__dict__.get("_file_bytes")
    if raw is not None:
        _release_pages(raw)


def _release_pages(view) -> None:
    """Drop a read-only file mapping's pages under `view` from this process's memory (they stay in
    the page cache; touching them again reads them back). Linux; elsewhere nothing happens."""
    _release_range(view.ctypes.data, view.ctypes.data + view.nbytes)


def _release_range(first: int, last: int) -> None:
    """_release_pages of the whole pages within addresses first..last."""
    libc = _libc()
    if libc is None:
        return
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = -(-first // page) * page
    end = last // page * page
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED


def release_mapped_tensors(tensors) -> None:
    """Drop the pages of memory-mapped checkpoint tensors no longer read (a tensor-parallel rank's
    whole quantized layers once its part is copied out) from this process's memory. Only tensors
    inside a file mapping: dropped pages of memory that is not a file's would read back as zeros.
    Linux (/proc/self/maps); elsewhere nothing happens."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    files = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[4] != "0" and fields[5].startswith("/"):  # an inode and a path: a file
            lo, hi = fields[0].split("-")
            files.append((int(lo, 16), int(hi, 16)))
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            continue
        first = t.data_ptr()
        last = first + t.numel() * t.element_size()
        if any(lo <= first and last <= hi for lo, hi in files):
            _release_range(first, last)


def _repacked_file(path: Path) -> Path:
    # torch.save, not safetensors: torch aligns every tensor to 64 bytes, safetensors to 8 only, and
    # torch's int8 CPU kernel crashes (SIGSEGV) on a memory-mapped weight that is not 16-byte aligned.
    from ..quant import native  # its layout is pack_int4's codes; torch's kernel has its own

    kernels = "native" if native.available() else f"torch{torch.__version__.split('+')[0]}"
    return _gguf_cache_dir(path) / f"repacked-{kernels}.pt"


def _repacked_cache(path: Path) -> dict:
    """Layers repacked by an earlier load of this file, by module name ({} if none)."""
    from ..quant import gguf_blocks

    file = _repacked_file(path)
    if not file.exists():
        return {}
    try:
        saved = torch.load(file, mmap=True, weights_only=True)  # memory-mapped, aligned
        return {name: gguf_blocks.restore_layer(name, saved["tensors"], d) for name, d in saved["layers"].items()}
    except Exception:  # a stale or damaged cache is rebuilt, never trusted
        return {}


def _save_repacked(path: Path, layers: dict) -> None:
    from ..quant import gguf_blocks

    tensors, descs = {}, {}
    for name, layer in layers.items():
        data, descs[name] = gguf_blocks.layer_state(name, layer)
        tensors.update(data)
    file = _repacked_file(path)
    tmp = file.with_name(f"{file.name}.tmp{os.getpid()}")
    try:  # a temporary sibling, then rename, as _save_tensors; a failure only costs speed next time
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"layers": descs, "tensors": tensors}, tmp)
        os.replace(tmp, file)
    except OSError:
        tmp.unlink(missing_ok=True)


def _float_cache(path: Path, table, arch: "arch_mod.Architecture", cfg: ModelConfig, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of the GGUF widened to float32 in HF conventions, from a cache beside the
    header. The cache holds what loads have needed so far (only the types without a quantized
    layer, for the default load); a load that needs more widens the rest once, and says so first."""
    import numpy as np

    from .gguf_file import dequantize_tensor

    file = _gguf_cache_dir(path) / "model.safetensors"
    cached = _load_safetensors(file) if file.exists() else {}
    missing = [t for t in table if gguf_to_hf_name(t.name, arch) in set(names) - cached.keys()]
    if not missing:
        return {k: cached[k] for k in names}
    nbytes = sum(4 * math.prod(t.shape) for t in missing)
    warnings.warn(f"first load of {path.name}{' this way' if cached else ''}: widening {len(missing)} tensors to "
                  f"float32 once ({nbytes / 2**20:.0f} MiB cached under {CACHE_DIR}; `brisk cache --clear` frees it)")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = dict(cached)
    for t in progress.track(missing, f"widening {path.name} to float32 (once)", len(missing)):
        hf = gguf_to_hf_name(t.name, arch)
        tensors[hf] = arch.convert_gguf_tensor(dequantize_tensor(data, t), hf, cfg)
    _save_tensors(file, tensors)
    return {k: tensors[k] for k in names}


def cache_entries() -> list[tuple[str, int, Path]]:
    """(the GGUF file a cache entry was made from, bytes, folder) for each entry, largest first."""
    root = CACHE_DIR / "gguf"
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        info = d / "source.txt"
        source = info.read_text().strip() if info.exists() else "(unknown: made by an older brisk)"
        out.append((source, sum(f.stat().st_size for f in d.rglob("*") if f.is_file()), d))
    return sorted(out, key=lambda e: -e[1])


def clear_cache() -> int:
    """Delete the cache; returns the bytes freed. Everything in it is rebuilt on demand."""
    import shutil

    freed = sum(b for _, b, _ in cache_entries())
    shutil.rmtree(CACHE_DIR / "gguf", ignore_errors=True)
    return freed


def _save_tensors(file: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """Write a cache file to a temporary sibling, then rename; a failure only costs speed next time."""
    from safetensors.torch import save_file

    tmp = file.with_name(f"{file.name}.tmp{os.getpid()}")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata)
        os.replace(tmp, file)
    except OSError:
        tmp.unlink(missing_ok=True)


def _save_cache(dest: Path, info: dict, tok) -> None:
    """Write the header's cache (config, tensor table, tokenizer files) to a temporary sibling, then
    rename: never half a cache. A failure here (read-only home, full disk) only costs speed next time."""
    import shutil

    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        tok.save(tmp)
        (tmp / "brisk.json").write_text(json.dumps(info))
        (tmp / "source.txt").write_text(str(info.get("source", "")))
        if not dest.exists():
            os.replace(tmp, dest)
            return
        # the folder is there (an older header beside the float and repacked caches): replace the
        # header's files one by one, brisk.json last, since it is what says the header is complete
        names = sorted(f.name for f in tmp.iterdir())
        for name in [n for n in names if n != "brisk.json"] + ["brisk.json"]:
            os.replace(tmp / name, dest / name)
        tmp.rmdir()
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def load_checkpoint(name: str | None, keep_quantized: bool = True, native_blocks: bool = False,
                    interleave: bool = True) -> Checkpoint:
    display, path = resolve(name)
    if not path.is_dir():  # a model file: it must be a regular one (a FIFO would block the read below)
        regular_file(path)
        if path.suffix in (".safetensors", ".bin", ".pt"):
            raise FileError("pass the checkpoint folder (with config.json), not a weights file", name)
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise FileError(f"not a GGUF file (bad magic {magic!r})", name)
        return load_gguf(display, path, keep_quantized, native_blocks, interleave)
    return load_hf_folder(display, path, native_blocks)
