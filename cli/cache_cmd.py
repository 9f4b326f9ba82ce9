"""`brisk cache`: what brisk keeps under ~/.cache/brisk (BRISK_CACHE), and clearing it."""
from __future__ import annotations

import typer

from . import common as c
from .app import app


@app.command()
def cache(clear: bool = typer.Option(False, "--clear", help="Delete the cache (rebuilt when a model needs it).")):
    """List the converted GGUF files brisk caches (header, repacked layers, widened tensors), or clear them."""
    from ..core.checkpoint import CACHE_DIR, cache_entries, clear_cache

    with c.user_errors():
        if clear:
            print(f"freed {clear_cache() / 2**20:.0f} MiB from {CACHE_DIR}")
            return
        entries = cache_entries()
        for source, nbytes, folder in entries:
            print(f"{nbytes / 2**20:8.0f} MiB  {source}  ({folder.name})")
        print(f"{sum(b for _, b, _ in entries) / 2**20:8.0f} MiB  in {CACHE_DIR}")
