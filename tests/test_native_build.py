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


def test_only_the_levels_the_cpu_runs_are_compiled():
    """A copy the CPU cannot run is only build time: an AVX2 CPU gets plain + AVX2, a CPU without
    AVX2 (or with AVX-512 but no AVX2+FMA) plain only; flags that cannot be read build all three."""
    avx2 = {"sse2", "avx", "avx2", "fma", "f16c"}
    full = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
    assert native._runnable_levels(full) == ("plain", "avx2", "avx512")
    assert native._runnable_levels(avx2 | {"avx512f", "avx512bw"}) == ("plain", "avx2")  # no VNNI: bk_cpu_level's rule
    assert native._runnable_levels({"sse2", "avx", "avx512f"}) == ("plain",)
    assert native._runnable_levels(None) == ("plain", "avx2", "avx512")
    cmds, objs = native._compile_commands(["cc"], Path("/tmp"), x86=True, levels=("plain", "avx2"))
    assert not any("avx512" in str(o) for o in objs) and len(objs) == 2 * len(native.PER_LEVEL) + 1
    assert "-DBK_LEVELS=2" in cmds[-1]


def test_gcc_spends_its_time_on_the_copy_the_cpu_runs():
    """GCC's -O3 on tiles.c takes minutes: a copy only BRISK_NATIVE_LEVEL selects compiles at -O1,
    GCC's AVX2 copy at -O2; clang's copies keep -O3 (it compiles them quickly)."""
    def opt(cmd):  # the last -O flag wins
        return [a for a in cmd if a.startswith("-O")][-1]

    def opts(cc, avx2_cc, levels):
        cmds = native._compile_commands(cc, Path("/tmp"), x86=True, avx2_cc=avx2_cc, levels=levels)[0]
        return {c[c.index("-c") + 1].split("/")[-1] + a.split("=")[1]: opt(c)
                for c in cmds[:-1] for a in c if a.startswith("-DBK_SUFFIX")}

    gcc_avx512 = opts(["gcc"], ["gcc"], ("plain", "avx2", "avx512"))
    assert gcc_avx512["tiles.c_plain"] == gcc_avx512["tiles.c_avx2"] == "-O1" and gcc_avx512["tiles.c_avx512"] == "-O3"
    gcc_avx2 = opts(["gcc"], ["gcc"], ("plain", "avx2"))
    assert gcc_avx2["tiles.c_plain"] == "-O1" and gcc_avx2["tiles.c_avx2"] == "-O2"
    zig = [sys.executable, "-m", "ziglang", "cc"]
    assert opts(["gcc"], zig, ("plain", "avx2"))["tiles.c_avx2"] == "-O3"  # zig's clang: full optimisation
    assert opts(["gcc"], ["gcc"], ("plain",))["tiles.c_plain"] == "-O2"  # the copy that runs
    assert set(opts(["clang"], ["clang"], ("plain", "avx2", "avx512")).values()) == {"-O2", "-O3"}


def test_a_failing_avx2_compiler_falls_back_to_the_platform_one(tmp_path, monkeypatch):
    """If zig cannot compile (no writable cache, a broken wheel), the build still succeeds with the
    platform's compiler for every copy, and says which compiler built the AVX2 copy. Built as for an
    AVX2 CPU without AVX-512 (plain and AVX2 copies only), whose library never picks AVX-512."""
    try:
        cc = native._compiler()
    except RuntimeError:
        pytest.skip("no C compiler here")
    if native.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the AVX2 copy exists on x86-64 only")
    broken = [sys.executable, "-c", "import sys; sys.exit('zig: cannot write its cache')", "--"]
    monkeypatch.setattr(native, "_avx2_compiler", lambda cc: broken)
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx", "avx2", "fma", "f16c"})
    lib = native.build(tmp_path)
    assert lib.exists()
    import ctypes

    level = ctypes.CDLL(str(lib)).bk_cpu_level()
    real = native.library().bk_cpu_level() if native.library() is not None else level
    assert level == min(real, 1)
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    assert lib.with_suffix(".compiler").read_text() == version


def _cc_or_skip() -> list[str]:
    try:
        return native._compiler()
    except RuntimeError:
        pytest.skip("no C compiler here")


@pytest.mark.parametrize("header", sorted(f.name for f in native.KERNELS.glob("*.h")))
def test_each_kernel_header_compiles_alone(header, tmp_path):
    """Every header brings its own includes and guards (none works only mid-file inside another), at
    every instruction-set level the build compiles."""
    cc = _cc_or_skip()
    x86 = native.platform.machine().lower() in ("x86_64", "amd64")
    src = tmp_path / "one.c"
    src.write_text(f'#include "{header}"\n#include "{header}"\n')  # twice: the guard holds
    for level, flags in (native.X86_LEVELS if x86 else {"plain": []}).items():
        r = subprocess.run([*cc, *native.FLAGS, *flags, f"-DBK_SUFFIX=_{level}", "-fsyntax-only",
                            f"-I{native.KERNELS}", str(src)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{header} ({level}): {native._first_error(r.stderr, r.returncode)}"


def test_c_type_traits_agree_with_the_python_table(tmp_path):
    """kernels/gguf_types.h's traits table and quant/gguf_types.py say the same of every type id."""
    from brisk.quant import gguf_types

    cc = _cc_or_skip()
    src, exe = tmp_path / "traits.c", tmp_path / "traits"
    src.write_text('#include <stdio.h>\n#include "gguf_types.h"\nint main(void) {\n'
                   '    for (int t = -1; t <= 64; t++) printf("%d %d %d %d\\n", t, bk_block_weights(t), '
                   'bk_block_bytes(t), bk_type_flags(t));\n    return 0;\n}\n')
    subprocess.run([*cc, *native.FLAGS, f"-I{native.KERNELS}", str(src), "-o", str(exe)], check=True, timeout=300)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    flags = {"BK_INT": 1, "BK_SUPER": 2, "BK_ACT8": 4, "BK_MIN": 8, "BK_FIFTH": 16}
    for line in out.splitlines():
        tid, weights, nbytes, f = map(int, line.split())
        t = gguf_types.BY_ID.get(tid)
        if t is None or not t.quantized or not t.native:
            assert (weights, nbytes, f) == (0, 0, 0), line
            continue
        assert (weights, nbytes) == (t.block_weights, t.block_bytes), t.name
        sixteen = t.grid == gguf_types.INT16_32 or t.grid_act8_off == gguf_types.INT16_256
        assert bool(f & flags["BK_INT"]) == sixteen, t.name
        assert bool(f & flags["BK_SUPER"]) == (t.grid_act8_off == gguf_types.INT16_256), t.name
        assert bool(f & flags["BK_ACT8"]) == (t.grid[0] == 8), t.name


def test_two_first_runs_build_once_and_clean_what_a_killed_build_left(tmp_path):
    """Two processes that need the kernels at once: one compiles (and says so), the other waits
    for it and loads the same library; a temporary folder a killed build left is removed."""
    _cc_or_skip()
    stale = tmp_path / f"{native.BUILD_PREFIX}killed"
    (stale / "sub").mkdir(parents=True)
    code = ("import sys, warnings; from pathlib import Path; from brisk.quant import native; "
            "warnings.simplefilter('always'); "
            "warnings.showwarning = lambda m, c, *a, **k: print('NOTICE' if c is native.BuildNotice else 'OTHER', m); "
            "print(native.build(Path(sys.argv[1])))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    libs = {o.strip().splitlines()[-1] for o in outs}
    assert len(libs) == 1 and Path(libs.pop()).exists(), outs
    notices = [o for o in outs if "NOTICE compiling brisk's CPU kernels" in o]
    assert len(notices) == 1, outs  # the other found it built
    assert not stale.exists() and not list(tmp_path.glob(f"{native.BUILD_PREFIX}*"))
