"""Files the user names or brisk writes: read as text with one-line errors; written whole or not at
all (a temporary sibling, then a rename). And the rules for a model's own files: only regular files
are read (a FIFO would block for ever, /dev/zero never ends), JSON is bounded in size and depth,
and a name a model folder's index gives stays inside that folder."""
from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path, PurePosixPath

# A model folder's JSON files: tokenizer.json of a 262k vocabulary is ~35 MB, configs a few kB
MAX_JSON_BYTES = 128 << 20


def regular_file(path: Path) -> Path:
    """path, when it is a regular file (a symlink to one counts: the Hugging Face cache is made of
    them); a FileError naming it otherwise."""
    from .errors import FileError

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileError("no such file", path) from None
    except OSError as e:
        raise FileError(f"cannot read it ({e.strerror or e})", path) from None
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a file")
        raise FileError(f"is {kind}, not a regular file", path)
    return path


def exists(path: Path) -> bool:
    """Whether anything is at path (a FIFO or a folder too, which then fail as not regular files)."""
    try:
        os.stat(path)
        return True
    except OSError:
        return False


def named_inside(folder: Path, name, source: Path) -> Path:
    """The file a model folder's own index (`source`) names: a relative path that stays below the
    folder (no absolute path, no '..'); where a symlink there leads is the cache's business."""
    from .errors import FileError

    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise FileError(f"names {name!r}, which is not a file name", source)
    parts = PurePosixPath(name)
    if parts.is_absolute() or ".." in parts.parts:
        raise FileError(f"names {name!r}, outside the model folder", source)
    return folder / parts


def read_bounded(path: Path, limit: int = MAX_JSON_BYTES) -> bytes:
    """A regular file's bytes, refused over `limit`."""
    from .errors import FileError

    regular_file(path)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise FileError(f"cannot read it ({e.strerror or e})", path) from None
    if len(data) > limit:
        raise FileError(f"is over {limit >> 20} MiB", path)
    return data


def read_json(path: Path, missing_ok: bool = True, limit: int = MAX_JSON_BYTES):
    """A model file's JSON ({} when missing and missing_ok): a regular file, bounded in size and
    nesting, valid UTF-8; one-line FileErrors naming it."""
    from .errors import FileError

    if missing_ok and not exists(path):
        return {}
    data = read_bounded(path, limit)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise FileError(f"not UTF-8 ({e.reason} at byte {e.start})", path) from None
    except RecursionError:
        raise FileError("its JSON is nested too deeply", path) from None
    except ValueError as e:
        raise FileError(f"invalid JSON ({e})", path) from None


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` (UTF-8) whole or not at all: through a temporary sibling that only
    this call owns (mkstemp), renamed into place. A symlink is followed (its target is replaced,
    the link stays); a FIFO or a device is written through, as a shell's `>` does (renaming over
    /dev/null would replace it with a file); a folder is refused. Raises OSError (IsADirectoryError
    for a folder); the temporary never outlives a failure."""
    import tempfile

    path = Path(path)
    try:
        mode = os.stat(path).st_mode  # follows a symlink
    except FileNotFoundError:
        mode = None
    except OSError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(21, "is a folder", str(path))
    if mode is not None and not stat.S_ISREG(mode):  # a FIFO, a device: written through
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    target = path.resolve() if path.is_symlink() else path
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        if mode is not None:  # keep the permissions the file had
            os.chmod(tmp, stat.S_IMODE(mode))
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # as a new file would get (mkstemp makes it 0600)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
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
