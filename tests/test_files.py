"""Files brisk writes for the user (`--batch -o`, chat's /save, manifests): whole or not at all,
through a temporary only the writer owns; a symlink is followed, a FIFO or a device written through
as a shell's `>` does (never replaced by a regular file), a folder refused; nobody's file is lost."""
from __future__ import annotations

import os
import stat
import threading

import pytest

from brisk.core.files import write_text_atomic


def test_a_new_file_and_a_replaced_one_keep_modes(tmp_path):
    out = tmp_path / "out.jsonl"
    write_text_atomic(out, "one\n")
    umask = os.umask(0)
    os.umask(umask)
    assert out.read_text() == "one\n" and stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask
    out.chmod(0o600)
    write_text_atomic(out, "two\n")
    assert out.read_text() == "two\n" and stat.S_IMODE(out.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temporary left


def test_a_users_partial_file_is_not_touched(tmp_path):
    mine = tmp_path / ".out.jsonl.partial"
    mine.write_text("my notes")
    write_text_atomic(tmp_path / "out.jsonl", "x")
    assert mine.read_text() == "my notes"


def test_a_symlink_is_followed(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_text_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new"


def test_a_folder_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "to-d").symlink_to(tmp_path / "d")
    for p in (tmp_path / "d", tmp_path / "to-d"):
        with pytest.raises(IsADirectoryError):
            write_text_atomic(p, "x")
    assert (tmp_path / "to-d").is_symlink() and (tmp_path / "d").is_dir()


def test_a_fifo_and_a_device_are_written_through(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()), daemon=True)
    reader.start()
    write_text_atomic(fifo, "through the pipe")
    reader.join(10)
    assert got == ["through the pipe"] and stat.S_ISFIFO(fifo.stat().st_mode)
    null = tmp_path / "null"
    null.symlink_to("/dev/null")
    write_text_atomic(null, "gone")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)  # still the device


def test_chat_save_onto_a_folder_is_one_error(tmp_path, tiny):
    from brisk.core.chat import Chat
    from brisk.core.errors import FileError

    (tmp_path / "chat.json").mkdir()
    with pytest.raises(FileError, match="folder"):
        Chat(tiny).save(tmp_path / "chat.json")
