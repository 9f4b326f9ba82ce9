"""`brisk list` and `brisk rm`: the models in the local Hugging Face cache (like `ollama list`/`rm`)."""
from __future__ import annotations

import json
import sys

import typer

from . import common as c
from .app import app
from .info_cmd import size


@app.command("list")
def list_models(as_json: bool = typer.Option(False, "--json", help="Print one JSON array (sizes in bytes).")):
    """The models in the local Hugging Face cache, by the name brisk takes: size, format
    (safetensors, GGUF quant type, GPTQ, AWQ, bnb), architecture, and whether brisk runs it."""
    with c.user_errors():
        from ..core.hub_cache import cached_models

        models = cached_models()
    if as_json:
        print(json.dumps([m.to_dict() for m in models], indent=1))
        return
    rows = [("NAME", "SIZE", "FORMAT", "ARCHITECTURE", "RUNS")]
    rows += [(m.name, size(m.size), m.format, m.architecture or "?", "yes" if m.runs else "no") for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


@app.command()
def rm(
    name: str = typer.Argument(..., metavar="NAME", help="A model as `brisk list` names it."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Delete without asking."),
):
    """Delete a model from the local Hugging Face cache (asks first on a terminal)."""
    with c.user_errors():
        from ..core.hub_cache import cached_models, remove

        found = [m for m in cached_models() if m.name.lower() == name.lower()]
        if found and not yes and sys.stdin.isatty() and not typer.confirm(
                f"delete {found[0].name} ({size(found[0].size)})?"):
            raise typer.Abort()
        model = remove(name)
    print(f"deleted {model.name} ({size(model.size)})")
