"""brisk's native CPU kernels (kernels/*.c, *.h): built on first use with the platform's C
compiler (20-40 s with GCC on 2 cores), cached, loaded with ctypes; None where that cannot be done, and brisk
then runs torch's kernels, saying so once.

One product for every weight format (GGUF's Q4_0..Q8_0, K-quants and MXFP4, brisk's int4 groups and int8
rows), read in place from the blocks. The integer-code types (INT_DOT_TYPES) multiply their codes
with the activations quantized to 16 bits per block of 32, exact int32 sums scaled in float
(kernels/int_dot.h), except the K-quants Q2_K..Q6_K (ACT8_TYPES), whose activations are 8-bit
per super-block of 256 as llama.cpp's (kernels/int8_dot.h; BRISK_ACT8=0: 16-bit ones, per 256, or float32 for Q2_K/Q3_K); the
others dequantize tiles of rows to float32 and multiply float32 activations (kernels/tiles.c). Either way a row's bits do not depend on
how many rows share the call (batch-invariant), which keeps greedy speculative and batched decoding
equal to plain decoding. The library is plain C (no Python or torch headers), so one build serves
every Python and torch version; it picks AVX-512, AVX2+FMA or plain C (NEON on ARM through the
compiler) at run time; BRISK_NATIVE_LEVEL=0|1|2 caps the path for tests. ctypes releases the GIL
during a call. BRISK_NATIVE=0 turns the kernels off (torch's kernels then run).
"""
from __future__ import annotations

import ctypes
import functools
import contextlib
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
import weakref
from pathlib import Path

import torch

from . import gguf_types, settings

KERNELS = Path(__file__).with_name("kernels")
SOURCE = KERNELS / "brisk_kernels.c"
QB = 32  # every format's rows are whole blocks of 32 (or 256) weights
LEVELS = ("plain", "avx2", "avx512")
ENABLED = settings.NATIVE.get()  # layers built while it is on use the kernels
F32 = gguf_types.F32  # GGUF's id for plain float32 rows: a float model's weights, read in place
# Float rows take products with up to this many activation rows here (decode, verification, batched
# steps: bandwidth-bound, faster than MKL's sgemv); longer ones (prefill) go to torch's sgemm, which
# outruns the kernels' 4x4 register tiles there (compute-bound).
F32_MAX_ROWS = 64
I4G, I8R = 1000, 1001  # brisk's int4 groups and int8 rows, beside GGUF's type ids
# the types whose products take quantized activations (gguf_types.py's grids; BRISK_INT_DOT=0: float32 for all)
INT_DOT_TYPES = {t.id for t in gguf_types.NATIVE if t.grid != gguf_types.FLOAT} | {I8R, I4G}  # I4G: groups of 32, 64, 128...
SUPER_TYPES = {t.id for t in gguf_types.NATIVE if t.grid[1] == 256}  # of those, the ones quantized per 256 (the K-quants)
INT_DOT = settings.INT_DOT.get()
# of those, the ones whose activations are 8-bit (kernels/int8_dot.h: llama.cpp's grid, faster than 16-bit
# ones); BRISK_ACT8=0 gives them their grid_act8_off
ACT8_TYPES = {t.id for t in gguf_types.NATIVE if t.grid[0] == 8}
X8 = 8  # bk_weight's layout of rows interleaved by 8 (gguf_types.py's `interleave` types: gguf_interleave.py): the kernels' fastest
ACT8 = settings.ACT8.get()
# The 8-bit activations' remedies for coarse rounding (brisk_kernels.c split_err, outlier_err) and the
# outliers' column cache (bk_columns): settings.py says what each does, bench/RESULTS.md what it costs
ACT8_SPLIT = settings.ACT8_SPLIT.get()
DEFAULT_ACT8_OUTLIERS = settings.ACT8_OUTLIERS.default
ACT8_OUTLIERS = settings.ACT8_OUTLIERS.get()
OUTLIER_CACHE = settings.OUTLIER_CACHE.get()
GGUF_TYPES = {t.id: t.name for t in gguf_types.NATIVE}  # the quantized GGUF types the kernels read
BLOCK = {t.id: (t.block_weights, t.block_bytes) for t in gguf_types.NATIVE}  # (weights, bytes) per block
BLOCK_OF_WRITTEN = {t.id: (t.block_weights, t.block_bytes) for t in gguf_types.WRITTEN}  # quantize_rows' types


def _cache_dir() -> Path:
    root = settings.CACHE.get() or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                "brisk")
    return Path(root) / "native"


# tiles.c and decoder.c once per instruction set (function names suffixed), dispatched at run time
# by brisk_kernels.c
PER_LEVEL = ("tiles", "decoder")
# plain x86-64 (SSE2 only: the last resort) at -O2: GCC 12 at -O3 takes minutes and gigabytes to
# compile tiles.c's 64-byte vector code lowered to SSE2 (Q3_K/Q2_K's kernels)
X86_LEVELS = {"plain": ["-O2"], "avx2": ["-mavx2", "-mfma", "-mf16c"],
              "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma",
                         "-mf16c", "-mprefer-vector-width=512"]}
# gnu11, not c11: strict ISO C turns off contracting a * b + c into one fused multiply-add
FLAGS = ["-O3", "-fPIC", "-std=gnu11", "-ffp-contract=fast", "-Wno-psabi", "-pthread", "-Werror=implicit-function-declaration"]


def _compiler() -> list[str]:
    """CC (a command, e.g. "zig cc"), else clang, else cc or gcc. clang first: GCC 12 compiles the AVX2
    copy's 64-byte vectors through the stack, and that copy runs 4-10x slower than clang's build of
    the same code; AVX-512 and NEON builds are fine either way."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    cc = shutil.which("clang") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install clang or gcc)")
    return [cc]


def _is_clang(cc: list[str]) -> bool:
    """By the command's name (no process started: build() decides this on every start)."""
    return any("clang" in Path(a).name or a == "ziglang" or Path(a).name == "zig" for a in cc)


def _avx2_compiler(cc: list[str]) -> list[str]:
    """The compiler for the AVX2 copy: cc, unless cc is not clang and zig's clang is installed (the
    ziglang package: `pip install ziglang`, or brisk's `fast-avx2` extra), which compiles the copy
    GCC makes 4-10x slow. x86-64 Linux only; objects only (linked
    by cc, so the library uses the system's C runtime)."""
    if _is_clang(cc) or platform.system() != "Linux":
        return cc
    import importlib.util

    if importlib.util.find_spec("ziglang") is None:
        return cc
    return [sys.executable, "-m", "ziglang", "cc", "-target", "x86_64-linux-gnu", "-mcpu=x86_64"]


# the CPU flags each level's copy needs (Linux's /proc/cpuinfo names; bk_cpu_level checks the same)
LEVEL_FLAGS = {"avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}}


def _runnable_levels(flags: set[str] | None) -> tuple[str, ...]:
    """The x86 levels worth compiling for a CPU with these flags: a copy it cannot run is only build
    time (a third of it on a CPU without AVX-512, the one GCC takes longest over). Unknown flags: all."""
    if flags is None:
        return tuple(X86_LEVELS)
    levels = ["plain"]
    for name in ("avx2", "avx512"):
        if not LEVEL_FLAGS[name] <= flags:
            break
        levels.append(name)
    return tuple(levels)


def cpu_flags() -> set[str] | None:
    """This CPU's feature flags from /proc/cpuinfo (None where there is none to read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _level_flags(name: str, level_cc: list[str], top: str) -> list[str]:
    """A level's flags. GCC spends most of a build optimising tiles.c (clang a fraction of that), so
    under GCC a copy the CPU only runs when BRISK_NATIVE_LEVEL caps it compiles at -O1, and the AVX2
    copy at -O2: GCC's -O3 takes several times as long there for no faster code (bench/RESULTS.md)."""
    flags = X86_LEVELS[name]
    if _is_clang(level_cc):
        return flags
    if name != top:
        return [*flags, "-O1"]
    return [*flags, "-O2"] if name == "avx2" else flags


def _compile_commands(cc: list[str], out_dir: Path, x86: bool, avx2_cc: list[str] | None = None,
                      levels: tuple[str, ...] | None = None) -> tuple[list[list[str]], list[Path]]:
    levels = (levels or tuple(X86_LEVELS)) if x86 else ("plain",)
    cmds, objs = [], []
    for name in levels:
        level_cc = avx2_cc if name == "avx2" and avx2_cc else cc
        flags = _level_flags(name, level_cc, levels[-1]) if x86 else []
        for src in PER_LEVEL:
            obj = out_dir / f"{src}_{name}.o"
            cmds.append([*level_cc, *FLAGS, *flags, f"-DBK_SUFFIX=_{name}", "-c", str(KERNELS / f"{src}.c"), "-o", str(obj)])
            objs.append(obj)
    obj = out_dir / "brisk_kernels.o"
    cmds.append([*cc, *FLAGS, f"-DBK_LEVELS={len(levels)}", "-c", str(SOURCE), "-o", str(obj)])
    return cmds, objs + [obj]


def _first_error(stderr: str, code: int) -> str:
    """The compiler's first error line (its last line is often only "compilation terminated.")."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln), lines[-1] if lines else f"exit status {code}")


def build(out_dir: Path | None = None) -> Path:
    """Compile the library (if its sources changed since the last build); returns its path."""
    cc = _compiler()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    avx2_cc = _avx2_compiler(cc) if x86 else cc
    levels = _runnable_levels(cpu_flags()) if x86 else ("plain",)
    src = b"".join(f.read_bytes() for f in sorted(KERNELS.glob("*.[ch]")))
    commands = _compile_commands(cc, Path(), x86, avx2_cc, levels)[0]  # every compiler and flag
    tag = hashlib.sha256(src + repr(commands).encode()).hexdigest()[:16]
    out_dir = out_dir or _cache_dir()
    lib = out_dir / f"libbrisk_kernels-{tag}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(out_dir):  # one build at a time: a second process waits, then finds it built
        if lib.exists():
            return lib
        _remove_stale_builds(out_dir)
        warnings.warn(BuildNotice(f"compiling brisk's CPU kernels for this machine (first run only; a minute or "
                                  f"more on a small or busy CPU) into {out_dir}"))
        _compile(cc, avx2_cc, x86, levels, lib, out_dir)
    return lib


class BuildNotice(UserWarning):
    """Said when the kernels are compiled: the first command can otherwise look hung for minutes."""


@contextlib.contextmanager
def _build_lock(out_dir: Path):
    """An exclusive lock on the cache folder's build, across processes (released if one dies)."""
    import fcntl

    with open(out_dir / "build.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale_builds(out_dir: Path) -> None:
    """Temporary build folders a killed build left (it holds the lock while it builds, so under the
    lock none is in use)."""
    for d in out_dir.glob(f"{BUILD_PREFIX}*"):
        shutil.rmtree(d, ignore_errors=True)


BUILD_PREFIX = "building-"


def _compile(cc: list[str], avx2_cc: list[str], x86: bool, levels: tuple[str, ...], lib: Path, out_dir: Path
             ) -> None:
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=BUILD_PREFIX) as tmp:  # built aside, then moved in whole
        tmp_lib = Path(tmp) / lib.name
        cmds, objs = _compile_commands(cc, Path(tmp), x86, avx2_cc, levels)
        try:
            done = _run_all(cmds)
            if avx2_cc != cc and any(p.returncode != 0 for p, _ in done if p.args[:len(avx2_cc)] == avx2_cc):
                avx2_cc = cc  # zig could not (e.g. no cache directory it can write): the platform's compiler then
                cmds = _compile_commands(cc, Path(tmp), x86, levels=levels)[0]
                done = _run_all(cmds)
            for p, err in done:
                if p.returncode != 0:
                    raise RuntimeError(f"{cc[0]} failed: {_first_error(err, p.returncode)}")
            r = subprocess.run([*cc, "-shared", "-pthread", "-o", str(tmp_lib), *map(str, objs), "-lm"],
                               capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"cannot run {cc[0]}: {e}") from None
        if r.returncode != 0:
            raise RuntimeError(f"{cc[0]} failed: {_first_error(r.stderr, r.returncode)}")
        try:  # which compiler built the AVX2 copy (library() warns about GCC's)
            version = subprocess.run([*avx2_cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            version = ""
        lib.with_suffix(".compiler").write_text(version.splitlines()[0] if version else "")
        os.replace(tmp_lib, lib)


def _run_all(cmds: list[list[str]]) -> list[tuple[subprocess.Popen, str]]:
    """The compile commands in parallel: (process, stderr) each."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
             for c in cmds]
    return [(p, p.communicate(timeout=900)[1]) for p in procs]  # ~40 s of CPU in all; far more on a busy machine


def _die_with_parent() -> None:
    """In a compiler's process: end it when brisk ends (killed by a timeout, say), not run on as an
    orphan holding hundreds of MB (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import signal

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def slow_avx2_build(lib: Path) -> bool:
    """Whether this library's AVX2 copy was built by a compiler other than clang (GCC's runs 4-10x
    slower: see _avx2_compiler)."""
    marker = lib.with_suffix(".compiler")
    return marker.exists() and "clang" not in marker.read_text().lower()


class Weight(ctypes.Structure):
    """bk_weight in brisk_kernels.c: one weight matrix as the kernels see it."""
    _fields_ = [("type", ctypes.c_int), ("N", ctypes.c_int), ("K", ctypes.c_int), ("group", ctypes.c_int),
                ("data", ctypes.c_void_p), ("row_bytes", ctypes.c_int64), ("scales", ctypes.c_void_p),
                ("zeros", ctypes.c_void_p), ("row_scales", ctypes.c_void_p), ("layout", ctypes.c_int)]
    # row_scales holds the column cache for the 8-bit activation types (a union in C: they have no row scales)


class Arch(ctypes.Structure):
    """bk_arch (kernels/bk_decoder.h): a model's block shapes and flags."""
    _fields_ = [(n, ctypes.c_int) for n in ("dim", "n_heads", "n_kv", "head_dim", "ffn")] + \
               [("eps", ctypes.c_float), ("attn_scale", ctypes.c_float)] + \
               [(n, ctypes.c_int) for n in ("qk_norm", "sandwich", "act", "n_used", "norm_topk", "expert_ffn", "rope_dim",
                                            "topk_softmax")] + \
               [("swiglu_limit", ctypes.c_float), ("swiglu_alpha", ctypes.c_float)]
    ACTS = {"silu": 0, "gelu_tanh": 1, "swiglu_clamp": 2}  # the act field's values (BK_SILU, ...)


class Layer(ctypes.Structure):
    """bk_layer: one block's weights, norms and rope tables."""
    _fields_ = [("qkv", Weight * 3), ("o", Weight), ("gate_up", Weight * 2), ("down", Weight)] + \
               [(n, ctypes.c_void_p) for n in ("q_bias", "k_bias", "v_bias", "o_bias", "attn_in", "post_attn", "pre_ffn",
                                                 "post_ffn", "q_norm", "k_norm", "cos", "sin")] + \
               [("window", ctypes.c_int), ("sinks", ctypes.c_void_p), ("n_experts", ctypes.c_int),
                ("router", ctypes.c_void_p), ("experts", ctypes.c_void_p), ("router_bias", ctypes.c_void_p),
                ("expert_bias", ctypes.c_void_p)]


class Cache(ctypes.Structure):
    """bk_cache: where each position's K/V sit in a layer's cache."""
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("tables", ctypes.c_void_p),
                ("block_size", ctypes.c_int), ("block_stride", ctypes.c_int64), ("pos_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64), ("type", ctypes.c_int)]


class TP(ctypes.Structure):
    """bk_tp: a tensor-parallel rank's same-host collectives (core/tp_shm.py's segment)."""
    _fields_ = [("base", ctypes.c_void_p), ("seq", ctypes.POINTER(ctypes.c_int64)), ("rank", ctypes.c_int),
                ("world", ctypes.c_int), ("line", ctypes.c_int64), ("data", ctypes.c_int64), ("slot", ctypes.c_int64),
                ("check", ctypes.c_double), ("timeout", ctypes.c_double)]
    GONE, TIMEOUT = -3, -4  # bk_tp_all_reduce's failures (BK_TP_GONE, BK_TP_TIMEOUT)


@functools.cache
def library():
    """The loaded library, or None (said once) where it cannot be built or loaded."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError) as e:
        warnings.warn(f"brisk's native CPU kernels are not available ({e}); using torch's kernels (slower)")
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.bk_cpu_level.restype = i
    lib.bk_threads.argtypes, lib.bk_threads.restype = [i], None
    lib.bk_matmul.argtypes, lib.bk_matmul.restype = [ctypes.POINTER(Weight), i, p, p, i], i
    lib.bk_matmul_many.argtypes, lib.bk_matmul_many.restype = [ctypes.POINTER(Weight), i, i, p, p, i], i
    lib.bk_dequant_rows.argtypes, lib.bk_dequant_rows.restype = [ctypes.POINTER(Weight), p, i, p, i], i
    lib.bk_decoder.argtypes = [ctypes.POINTER(Arch), ctypes.POINTER(Layer), i, ctypes.POINTER(Cache), i, p, p, p,
                               ctypes.POINTER(TP), i]
    lib.bk_decoder.restype = i
    lib.bk_int_dot.argtypes, lib.bk_int_dot.restype = [i], None
    lib.bk_int_dot(int(INT_DOT))
    lib.bk_act8.argtypes, lib.bk_act8.restype = [i], None
    lib.bk_act8(int(ACT8))
    lib.bk_act8_outliers.argtypes, lib.bk_act8_outliers.restype = [ctypes.c_float], None
    lib.bk_act8_outliers(ACT8_OUTLIERS)
    lib.bk_columns_new.argtypes, lib.bk_columns_new.restype = [i, i, i], p
    lib.bk_columns_free.argtypes, lib.bk_columns_free.restype = [p], None
    lib.bk_columns_count.argtypes, lib.bk_columns_count.restype = [p, i], ctypes.c_longlong
    lib.bk_act8_split.argtypes, lib.bk_act8_split.restype = [ctypes.c_float], None
    lib.bk_act8_split(ACT8_SPLIT)
    lib.bk_read_probe.argtypes, lib.bk_read_probe.restype = [p, ctypes.c_size_t], ctypes.c_uint64
    i64 = ctypes.c_int64
    lib.bk_pack_groups.argtypes, lib.bk_pack_groups.restype = [p, p, i64, i64, i, p, i, p], None
    lib.bk_pack_x8.argtypes, lib.bk_pack_x8.restype = [p, p, i64, i64, i], ctypes.c_int
    lib.bk_quantize_rows.argtypes, lib.bk_quantize_rows.restype = [i, p, p, i, ctypes.c_int64], i
    lib.bk_shm_post.argtypes, lib.bk_shm_post.restype = [p, i64], None
    lib.bk_shm_wait.argtypes, lib.bk_shm_wait.restype = [p, i, i64, i64, ctypes.c_double], i
    lib.bk_tp_all_reduce.argtypes, lib.bk_tp_all_reduce.restype = [ctypes.POINTER(TP), p, i64], i
    lib.bk_threads(settings.THREADS.get() or torch.get_num_threads())
    if lib.bk_cpu_level() == 1 and slow_avx2_build(Path(lib._name)):
        warnings.warn("brisk's native kernels for this CPU (AVX2) were built with GCC, whose code for them runs "
                      "4-10x slower than clang's: `pip install ziglang` (a clang brisk then uses) or install clang "
                      "for full speed")
    return lib


def quantize_rows(qtype: int, rows) -> "numpy.ndarray":
    """Float32 rows [n, k] (a NumPy array) as GGUF blocks of `qtype` (kernels/gguf_quantize.h: llama.cpp's
    rounding without an importance matrix), [n, row bytes] uint8. RuntimeError without the kernels."""
    import numpy as np

    lib = library()
    if lib is None:
        raise RuntimeError("brisk's native CPU kernels are not available; GGUF quantization needs them")
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    n, k = rows.shape
    weights, nbytes = BLOCK_OF_WRITTEN[qtype]
    out = np.empty((n, k // weights * nbytes), dtype=np.uint8)
    if lib.bk_quantize_rows(qtype, rows.ctypes.data, out.ctypes.data, n, k) != 0:
        raise ValueError(f"cannot write {gguf_types.BY_ID[qtype].name} rows of {k} weights")
    return out


def set_int_dot(on: bool) -> None:
    """Whether the INT_DOT_TYPES take 16-bit activations (tests and benchmarks compare both)."""
    global INT_DOT
    INT_DOT = on
    if available():
        library().bk_int_dot(int(on))


def set_act8(on: bool) -> None:
    """Whether the ACT8_TYPES take 8-bit activations (else 16-bit ones, as the other integer types)."""
    global ACT8
    ACT8 = on
    if available():
        library().bk_act8(int(on))


def set_act8_outliers(err: float) -> None:
    """BRISK_ACT8_OUTLIERS for this process from now on (tests and benchmarks A/B it)."""
    global ACT8_OUTLIERS
    ACT8_OUTLIERS = err
    if available():
        library().bk_act8_outliers(err)


def set_act8_split(err: float) -> None:
    """The rounding error above which an 8-bit activation row also runs its remainder (0: never)."""
    global ACT8_SPLIT
    ACT8_SPLIT = err
    if available():
        library().bk_act8_split(err)


def set_threads(n: int) -> None:
    """Threads the kernels split rows across (default: torch's, i.e. the physical cores)."""
    if available():
        library().bk_threads(max(1, n))


def read_bandwidth(threads: int, n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s at which the kernels' threads stream through n_bytes of memory (the machine's read
    bandwidth at that thread count, the ceiling of a decode step that reads every weight once),
    median of `repeats` passes after one that faults the pages in."""
    import statistics
    import time

    lib = library()
    set_threads(threads)
    buf = torch.ones(n_bytes // 4)
    lib.bk_read_probe(buf.data_ptr(), n_bytes)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        lib.bk_read_probe(buf.data_ptr(), n_bytes)
        times.append(time.perf_counter() - t)
    return n_bytes / statistics.median(times) / 1e9


def available() -> bool:
    """Whether the kernels are on (BRISK_NATIVE is not 0) and built."""
    return ENABLED and library() is not None


@functools.cache
def level() -> int:
    """The instruction set the kernels use: 0 plain C, 1 AVX2+FMA, 2 AVX-512 with VNNI (level.cache_clear()
    after changing BRISK_NATIVE_LEVEL)."""
    best = library().bk_cpu_level()
    cap = settings.NATIVE_LEVEL.get()
    return best if cap is None else min(best, cap)


def usable(K: int, group_size: int | None = None) -> bool:
    """Whether the native kernels are here and take rows of K inputs (groups of group_size)."""
    return K % QB == 0 and (group_size is None or group_size % 2 == 0 and K % group_size == 0) and available()


def takes(qtype: int, K: int) -> bool:
    """Whether the kernels read GGUF type qtype with rows of K weights."""
    return qtype in BLOCK and K % BLOCK[qtype][0] == 0 and usable(K)


def interleaves(qtype: int, rows: int, cols: int) -> bool:
    """Whether a kept GGUF weight of this type and shape is loaded with its rows interleaved by 8
    (X8: the faster layout, gguf_interleave.py). BRISK_INTERLEAVE=0 keeps the file's layout (A/B runs)."""
    return (gguf_types.interleavable(qtype, rows, cols) and (ACT8 or qtype not in ACT8_TYPES)
            and settings.INTERLEAVE.get())


def outlier_columns(row_bytes: int) -> int:
    """How many float columns a weight's outlier cache keeps: OUTLIER_CACHE of the weight's bytes."""
    return min(1 << 30, max(16, int(OUTLIER_CACHE * row_bytes / 4)))  # the C side caps it at K


class NativeWeight:
    """A weight matrix the kernels read in place: the tensors (kept alive here) and their description."""

    def __init__(self, kind: int, N: int, K: int, data: torch.Tensor, scales: torch.Tensor | None = None,
                 zeros: torch.Tensor | None = None, group: int = 0, row_scales: torch.Tensor | None = None,
                 layout: int = 0):
        """layout: 0, the rows as the format stores them, or X8 (rows interleaved by 8, for the types
        gguf_types.py gives a layout: quant/gguf_interleave.py)."""
        if layout not in (0, X8) or layout == X8 and kind not in {t.id for t in gguf_types.INTERLEAVED}:
            raise ValueError(f"layout {layout} for a weight of kind {kind}")
        if kind in BLOCK:
            row_bytes = K // BLOCK[kind][0] * BLOCK[kind][1]
        else:
            row_bytes = {I4G: K // 2, I8R: K, F32: 4 * K}[kind]
        if not data.is_contiguous() or data.numel() * data.element_size() != N * row_bytes:
            raise ValueError(f"{data.numel() * data.element_size()} bytes for a [{N}, {K}] weight of kind {kind}")
        if kind == I4G and (scales.dtype != torch.bfloat16 or zeros.dtype != torch.bfloat16):
            scales, zeros = scales.to(torch.bfloat16), zeros.to(torch.bfloat16)
        self.tensors = [t.contiguous() if t is not None else None for t in (data, scales, zeros, row_scales)]
        self.tensors[3] = None if row_scales is None else self.tensors[3].float().contiguous()
        ptr = [t.data_ptr() if t is not None else None for t in self.tensors]
        # the exact outlier inputs' dequantized columns, filled on first need (8-bit activation types)
        self._columns = library().bk_columns_new(N, K, outlier_columns(row_bytes)) \
            if kind in ACT8_TYPES and available() else None
        if self._columns:  # freed with this object (also at exit, while the library is still loaded)
            weakref.finalize(self, library().bk_columns_free, self._columns)
        self.desc = Weight(kind, N, K, group, ptr[0], row_bytes, ptr[1], ptr[2], self._columns or ptr[3], layout)
        self.N, self.K = N, K

    def cached_columns(self, which: str = "now") -> int:
        """The outlier inputs' dequantized columns: how many are cached ("now"), the most that can be
        ("cap"), how many were dequantized so far ("filled")."""
        return library().bk_columns_count(self._columns, ("now", "cap", "filled").index(which)) if self._columns else 0

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) times the weight's transpose: float32 [M, N]."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        y = torch.empty(x.shape[0], self.N, dtype=torch.float32)
        if library().bk_matmul(self.desc, x.shape[0], x.data_ptr(), y.data_ptr(), level()):
            raise ValueError(f"the native kernels do not take this weight (kind {self.desc.type}, K {self.K})")
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized: float32 [*ids.shape, K]."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.K, dtype=torch.float32)
        if library().bk_dequant_rows(self.desc, flat.data_ptr(), flat.numel(), out.data_ptr(), level()):
            raise IndexError(f"row ids outside 0..{self.N - 1}")
        return out.view(*ids.shape, self.K)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.N))


class JoinedWeights:
    """Weights on the same input (q/k/v, gate/up) multiplied in one call, outputs side by side: one
    call instead of several, one thread split over all their rows, and no copy of their tensors."""

    MAX = 32  # MAX_JOINED in brisk_kernels.c

    def __init__(self, weights: list[NativeWeight]):
        if not 1 <= len(weights) <= self.MAX or len({w.K for w in weights}) != 1:
            raise ValueError(f"joined weights need the same input size (and at most {self.MAX} of them)")
        self.weights = weights  # keeps their tensors alive
        self.descs = (Weight * len(weights))(*[w.desc for w in weights])
        self.N, self.K = sum(w.N for w in weights), weights[0].K

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> float32 [M, N1 + N2 + ...]."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        y = torch.empty(x.shape[0], self.N, dtype=torch.float32)
        if library().bk_matmul_many(self.descs, len(self.weights), x.shape[0], x.data_ptr(), y.data_ptr(), level()):
            raise ValueError("the native kernels do not take these weights")
        return y


if __name__ == "__main__":  # `python -m brisk.quant.native`: build now (make install does), say where
    warnings.showwarning = lambda message, *_, **__: print(message, file=sys.stderr, flush=True)
    print(build(), LEVELS[library().bk_cpu_level()] if library() else "not loadable")
