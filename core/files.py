"""Files the user names or brisk writes: read as text with one-line errors; written whole or not at
all (a temporary sibling, then a rename)."""
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


def read_user_text(path: Path) -> str:
    """A text file the user named (calibration text, prompts), as UTF-8; a missing or unreadable one
    is a one-line FileError."""
    from .errors import FileError

    if not path.is_file():
        raise FileError("no such file", path)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FileError(f"cannot read it ({getattr(e, 'strerror', None) or e})", path) from None
