"""brisk's native kernels as a user gets them: the build works wherever a C compiler is (the other
native tests skip where the library is missing, so a broken build must fail here, not hide), and a
plain `pip install` carries every source file the build compiles."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from brisk.quant import native


def test_library_builds_where_there_is_a_compiler(tmp_path):
    try:
        cc = native._compiler()
    except RuntimeError:
        pytest.skip("no C compiler here: brisk runs torch's kernels")
    lib = native.build(tmp_path)  # raises with the compiler's first error line
    assert lib.exists() and lib.parent == tmp_path, cc


def test_wheel_ships_every_kernel_source(tmp_path):
    """A plain (non-editable) `pip install` must carry every .c and .h the build compiles: the headers
    were once left out, and every such install silently fell back to torch's kernels."""
    pytest.importorskip("setuptools")  # the build backend, built without isolation (no download)
    root, src = Path(__file__).resolve().parent.parent, tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "cli", "core", "quant"):  # a copy: no stale build/ reused
        (shutil.copytree if (root / name).is_dir() else shutil.copy)(root / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                    "-w", str(tmp_path)], check=True, capture_output=True)
    names = set(zipfile.ZipFile(next(tmp_path.glob("brisk-*.whl"))).namelist())
    sources = {f"brisk/quant/kernels/{f.name}" for f in native.KERNELS.iterdir() if f.suffix in (".c", ".h")}
    assert sources and sources <= names, sorted(sources - names)
