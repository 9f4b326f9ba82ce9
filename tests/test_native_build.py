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


@pytest.mark.skipif(sys.platform != "linux", reason="zig builds the AVX2 copy on x86-64 Linux only")
def test_avx2_copy_goes_to_clang_where_the_compiler_is_gcc(monkeypatch):
    """GCC's AVX2 code for the kernels' 64-byte vectors runs 4-10x slow: with zig's clang installed
    (the ziglang package) that copy is compiled by it, unless the compiler is clang already."""
    import importlib.util

    have_zig = importlib.util.find_spec("ziglang") is not None
    lib = native.library()
    if have_zig and lib is not None and not native._is_clang(native._compiler()):
        assert not native.slow_avx2_build(Path(lib._name))  # its sidecar names zig's clang
    zig = native._avx2_compiler(["gcc"])
    assert (zig[1:4] == ["-m", "ziglang", "cc"]) == have_zig and (zig == ["gcc"]) == (not have_zig)
    assert native._avx2_compiler(["/usr/bin/clang-18"]) == ["/usr/bin/clang-18"]
    assert native._avx2_compiler(["zig", "cc"]) == ["zig", "cc"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert native._avx2_compiler(["cc"]) == ["cc"]
    cmds, _ = native._compile_commands(["cc"], Path("/tmp"), x86=True, avx2_cc=["zcc"])
    assert {c[0] for c in cmds if "-DBK_SUFFIX=_avx2" in c} == {"zcc"}
    assert {c[0] for c in cmds if "-DBK_SUFFIX=_avx2" not in c} == {"cc"}


def test_a_failing_avx2_compiler_falls_back_to_the_platform_one(tmp_path, monkeypatch):
    """If zig cannot compile (no writable cache, a broken wheel), the build still succeeds with the
    platform's compiler for every copy, and says which compiler built the AVX2 copy."""
    try:
        cc = native._compiler()
    except RuntimeError:
        pytest.skip("no C compiler here")
    if native.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the AVX2 copy exists on x86-64 only")
    broken = [sys.executable, "-c", "import sys; sys.exit('zig: cannot write its cache')", "--"]
    monkeypatch.setattr(native, "_avx2_compiler", lambda cc: broken)
    lib = native.build(tmp_path)
    assert lib.exists()
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    assert lib.with_suffix(".compiler").read_text() == version
