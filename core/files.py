"""Writing a file whole or not at all: a temporary sibling, then a rename."""
from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` (UTF-8) via a hidden `.NAME.partial` sibling renamed into place, so an
    interruption never leaves half a file. Raises OSError (the temporary is removed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        if tmp.exists():
            tmp.unlink()
        raise
