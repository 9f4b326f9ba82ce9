"""The models in the local Hugging Face cache, as brisk names them (`brisk list`, `brisk rm`): one
entry per HF checkpoint and per GGUF quant type of each cached revision."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import hub
from .errors import FileError

# config.json's quantization_config quant_method -> the format brisk lists
_QUANT_FORMATS = {"gptq": "GPTQ", "awq": "AWQ", "bitsandbytes": "bnb"}


@dataclass
class CachedModel:
    name: str  # as brisk takes it: org/name[@revision][:QUANT]
    size: int  # bytes on disk
    format: str  # safetensors, GGUF Q4_K_M, GPTQ, AWQ, bnb
    architecture: str | None  # config.json's model_type, a GGUF's general.architecture
    runs: bool  # an architecture brisk supports
    path: str  # the snapshot folder or the GGUF file
    repo: str
    revision: str  # the commit
    snapshot: str  # the revision's folder in the cache
    files: list[str] = field(default_factory=list)  # inside the snapshot

    def to_dict(self) -> dict:
        return asdict(self)


def cached_models() -> list[CachedModel]:
    """Every model in the HF cache, by name."""
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir()
    except Exception:  # no cache folder yet
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            out.extend(_revision_models(repo.repo_id, rev))
    return sorted(out, key=lambda m: m.name.lower())


def remove(name: str) -> CachedModel:
    """Delete a cached model named as cached_models() names it: its whole revision through
    huggingface_hub's deletion strategy, or where the revision holds other models too (several GGUF
    types), only its own files. FileError if no cached model has that name."""
    models = cached_models()
    model = next((m for m in models if m.name.lower() == name.lower()), None)
    if model is None:
        raise FileError("no such model in the local Hugging Face cache (`brisk list` shows them)", name)
    together = [m for m in models if (m.repo, m.revision) == (model.repo, model.revision)]
    if len(together) == 1:
        from dataclasses import replace

        from huggingface_hub import scan_cache_dir

        cache = scan_cache_dir()
        # this repo alone: a commit can be in several repos (a copy of a repo keeps its history)
        own = frozenset(r for r in cache.repos if (r.repo_id, r.repo_type) == (model.repo, "model"))
        replace(cache, repos=own).delete_revisions(model.revision).execute()
        return model
    snapshot = Path(model.snapshot)
    kept = {(snapshot / f).resolve() for m in together if m.name != model.name for f in m.files}
    for f in model.files:
        pointer = snapshot / f
        blob = pointer.resolve()
        pointer.unlink(missing_ok=True)
        if blob != pointer and blob not in kept:
            blob.unlink(missing_ok=True)
    return model


def _revision_models(repo: str, rev) -> list[CachedModel]:
    refs = sorted(rev.refs)
    at = "" if "main" in refs else f"@{refs[0]}" if refs else f"@{rev.commit_hash}"
    snapshot = Path(rev.snapshot_path)
    files = {str(f.file_path.relative_to(snapshot)): f.size_on_disk for f in rev.files}
    out = []
    if "config.json" in files:
        hf = sorted(f for f in files if not f.lower().endswith(".gguf"))
        fmt, arch = _hf_format(snapshot / "config.json")
        out.append(CachedModel(repo + at, sum(files[f] for f in hf), fmt, arch, _hf_runs(arch), str(snapshot),
                               repo, rev.commit_hash, str(snapshot), hf))
    by_model: dict[str, list[str]] = {}
    for f in sorted(f for f in files if f.lower().endswith(".gguf")):
        by_model.setdefault(hub.quant_of(f) or Path(f).name.removesuffix(".gguf"), []).append(f)
    for quant, parts in by_model.items():
        arch, runs = _gguf_architecture(snapshot / parts[0])
        out.append(CachedModel(f"{repo}{at}:{quant}", sum(files[f] for f in parts), f"GGUF {quant}", arch,
                               runs and len(parts) == 1, str(snapshot / parts[0]), repo, rev.commit_hash,
                               str(snapshot), parts))
    return out


def _hf_format(config: Path) -> tuple[str, str | None]:
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError):
        return "safetensors", None
    if not isinstance(cfg, dict):
        return "safetensors", None
    quant = cfg.get("quantization_config")
    method = str(quant.get("quant_method") or "") if isinstance(quant, dict) else ""
    fmt = _QUANT_FORMATS.get(method, "safetensors") if not (isinstance(quant, dict) and (
        quant.get("load_in_4bit") or quant.get("load_in_8bit"))) else "bnb"
    arch = cfg.get("model_type")
    return fmt, arch if isinstance(arch, str) else None


def _hf_runs(model_type: str | None) -> bool:
    from .arch import SUPPORTED

    return model_type in SUPPORTED


def _gguf_architecture(path: Path) -> tuple[str | None, bool]:
    """(general.architecture, whether brisk runs it), from the GGUF's header."""
    from .arch import gguf_architecture
    from .errors import BriskError
    from .gguf_file import GGUFFile

    try:
        meta = GGUFFile(path).metadata
    except (BriskError, OSError, ValueError, KeyError, IndexError):
        return None, False
    name = meta.get("general.architecture")
    try:
        gguf_architecture(meta)
        return (name if isinstance(name, str) else None), True
    except BriskError:
        return (name if isinstance(name, str) else None), False
