"""Resume: each finished block is saved to OUT.partial/layers/ with a manifest keyed by a hash of
everything that decides the output. A rerun with the same arguments reloads the finished blocks
(running them to rebuild the activations), and produces the same bytes as an uninterrupted run.
The folder appears at OUT only when complete."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from .. import calibration
from ..errors import BriskError, FileError
from ..files import write_text_atomic

from .options import QuantOptions

_VERSION = 3  # bump when the output for the same arguments changes: partial runs then restart


def run_key(ckpt, opts: QuantOptions, dtype: torch.dtype, texts) -> str:
    """A hash of everything the output depends on: a partial run with another key is discarded."""
    files = [ckpt.path] if ckpt.path.is_file() else sorted(
        p for p in ckpt.path.iterdir() if p.suffix in (".safetensors", ".json", ".bin"))
    ident = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    blob = json.dumps({"v": _VERSION, "model": [str(ckpt.path.resolve()), ident], "opts": asdict(opts),
                       "calib": calibration.texts_digest(texts) if texts else None, "dtype": str(dtype)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _read_manifest(partial: Path) -> dict | None:
    try:
        return json.loads((partial / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def resume_state(partial: Path, key: str) -> dict[int, dict]:
    """The blocks a previous run with the same key finished: {index: stats} (read only)."""
    if not partial.exists():
        return {}
    info = _read_manifest(partial)
    if info is None and (not partial.is_dir() or any(partial.iterdir())):
        raise FileError("exists and is not a brisk partial run; remove it", partial)
    if info is None or info.get("key") != key:
        return {}
    return {int(i): v for i, v in info.get("layers", {}).items() if layer_path(partial, int(i)).is_file()}


def prepare_partial(partial: Path, key: str, opts: QuantOptions, done: dict, report) -> None:
    """Keep a matching partial run (resume), or start a clean one."""
    if done:
        report("resume", layers=len(done))
        return
    if partial.exists():
        if _read_manifest(partial) and _read_manifest(partial).get("layers"):
            report("restart", reason="the unfinished run there used other arguments or another model")
        shutil.rmtree(partial)
    (partial / "layers").mkdir(parents=True)
    write_text_atomic(partial / "manifest.json", json.dumps({"key": key, "options": asdict(opts), "layers": {}}))


def check_disk(out: Path, partial: Path, done: dict, estimate: int) -> None:
    """The block files and the final shards coexist for a moment: about twice the output."""
    have = sum(layer_path(partial, i).stat().st_size for i in done)
    need = int(2.05 * estimate) - have
    where = out.parent
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need:
        raise BriskError(f"not enough disk space in {where}: the output needs about {_mb(need)}, {_mb(free)} free")


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MB" if n < 2**30 else f"{n / 2**30:.2f} GB"


def layer_path(partial: Path, i: int) -> Path:
    return partial / "layers" / f"layer_{i:04d}.safetensors"


def save_layer(partial: Path, i: int, tensors: dict, seconds: float, errors: dict[str, float]) -> None:
    from safetensors.torch import save_file

    path = layer_path(partial, i)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)
    manifest = partial / "manifest.json"
    info = json.loads(manifest.read_text())
    info["layers"][str(i)] = {"seconds": seconds, "errors": errors}
    write_text_atomic(manifest, json.dumps(info))


def load_layer(partial: Path, i: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(layer_path(partial, i)))

