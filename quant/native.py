"""brisk's native CPU kernels (kernels/brisk_kernels.c): built on first use with the platform's C
compiler (about a second), cached, loaded with ctypes; None where that cannot be done, and brisk
then runs torch's kernels, saying so once.

Opt-in for now (BRISK_NATIVE=1): measured on our 2-core EPYC (bench/native_ab.py, RESULTS.md) they
are exact (float32 activations: the dequantized model's products up to float32 round-off) and
batch-invariant (a row's bits do not depend on its batch, which keeps greedy speculative and
batched decoding equal to plain decoding), but single-threaded and row-by-row: decode 0.66-0.81x
and prefill 0.2-0.33x of torch's int4 kernel. A thread split and a GEMM tile for prefill come next.

The library is plain C (no Python or torch headers), so one build serves every Python and torch
version; it picks AVX-512 VNNI, AVX2+FMA or plain C at run time. ctypes releases the GIL during a
call. BRISK_NATIVE_LEVEL=0|1|2 caps the path (scalar, AVX2, VNNI) for tests.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels") / "brisk_kernels.c"
QB = 32  # the activations' block: K must be a multiple of it
LEVELS = ("scalar", "avx2", "avx512-vnni")
ENABLED = os.environ.get("BRISK_NATIVE", "0") == "1"  # layers built while it is on use the kernels


def _cache_dir() -> Path:
    root = os.environ.get("BRISK_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                        os.path.expanduser("~/.cache"), "brisk")
    return Path(root) / "native"


def build(out_dir: Path | None = None) -> Path:
    """Compile the library (if its source changed since the last build); returns its path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    src = SOURCE.read_bytes()
    flags = ["-O3", "-shared", "-fPIC", "-std=c11", "-pthread"]
    tag = hashlib.sha256(src + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    out_dir = out_dir or _cache_dir()
    lib = out_dir / f"libbrisk_kernels-{tag}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # built aside, then moved in whole
        tmp_lib = Path(tmp) / lib.name
        try:
            r = subprocess.run([cc, *flags, "-o", str(tmp_lib), str(SOURCE), "-lm"], capture_output=True, text=True,
                               timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"cannot run {cc}: {e}") from None
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
        os.replace(tmp_lib, lib)
    return lib


@functools.cache
def library():
    """The loaded library, or None (said once) where it cannot be built or loaded."""
    if not ENABLED:
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError) as e:
        warnings.warn(f"brisk's native CPU kernels are not available ({e}); using torch's kernels (slower)")
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.bk_cpu_level.restype = i
    lib.bk_q4_quantize_x.argtypes = lib.bk_q8_quantize_x.argtypes = [p, i, i, p]
    lib.bk_q4_rows.argtypes = [p, p, p, i, i, i, i, p, p, i, i, i]
    lib.bk_threads.argtypes = [i]
    lib.bk_q8f_matmul.argtypes = [p, p, i, i, i, p, p, i]
    lib.bk_q4f_linear.argtypes = [p, p, p, i, i, i, i, p, p, i]
    lib.bk_q8_rows.argtypes = [p, p, i, i, i, p, p, i, i, i]
    for f in (lib.bk_q4_quantize_x, lib.bk_q8_quantize_x, lib.bk_q4_rows, lib.bk_q8_rows, lib.bk_threads,
              lib.bk_q8f_matmul, lib.bk_q4f_linear):
        f.restype = None
    lib.bk_threads(int(os.environ.get("BRISK_THREADS", 0)) or torch.get_num_threads())
    return lib


def set_threads(n: int) -> None:
    """Threads the kernels split rows across (default: torch's, i.e. the physical cores)."""
    if library() is not None:
        library().bk_threads(max(1, n))


def available() -> bool:
    return library() is not None


@functools.cache
def level() -> int:
    """The instruction set the kernels use: 0 scalar, 1 AVX2+FMA, 2 AVX-512 VNNI (level.cache_clear()
    after changing BRISK_NATIVE_LEVEL)."""
    best = library().bk_cpu_level()
    cap = os.environ.get("BRISK_NATIVE_LEVEL")
    return best if cap is None else min(best, int(cap))


def usable(K: int, group_size: int | None = None) -> bool:
    """Whether the native kernels are here and take rows of K inputs (groups of group_size)."""
    return ENABLED and K % QB == 0 and (group_size is None or group_size % QB == 0) and available()


def _scratch(M: int, K: int) -> torch.Tensor:
    return torch.empty(M * K + 8 * M * (K // QB), dtype=torch.uint8)


def int4_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, int8_activations: bool = False) -> torch.Tensor:
    """x [M, K] (float) times an int4 weight (codes uint8 [N, K/2], bf16 scales/zeros [N, K/G]):
    float32 [M, N]. The activations stay float32 unless int8_activations (faster integer dot
    products, but on a 135M model KL 0.02 to the float model instead of 0.004: not the default)."""
    lib = library()
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    M, K = x.shape
    N = codes.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    if not (codes.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        codes, scales, zeros = codes.contiguous(), scales.contiguous(), zeros.contiguous()
    if not int8_activations:  # one call: few microseconds of Python per layer
        lib.bk_q4f_linear(codes.data_ptr(), scales.data_ptr(), zeros.data_ptr(), N, K, group_size, M,
                          x.data_ptr(), y.data_ptr(), level())
        return y
    scratch = _scratch(M, K)
    lib.bk_q4_quantize_x(x.data_ptr(), M, K, scratch.data_ptr())
    lib.bk_q4_rows(codes.data_ptr(), scales.data_ptr(), zeros.data_ptr(), N, K, group_size, M,
                   scratch.data_ptr(), y.data_ptr(), 0, N, level())
    return y


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, row_scales: torch.Tensor,
                int8_activations: bool = False) -> torch.Tensor:
    """x [M, K] (float) times an int8 weight (codes int8 [N, K], float32 scales [N]): float32 [M, N],
    activations in float32 (or, int8_activations, quantized per block of 32)."""
    lib = library()
    x = x.float().contiguous()
    codes, row_scales = codes.contiguous(), row_scales.float().contiguous()
    M, K = x.shape
    N = codes.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    if not int8_activations:
        lib.bk_q8f_matmul(codes.data_ptr(), row_scales.data_ptr(), N, K, M, x.data_ptr(), y.data_ptr(), level())
        return y
    scratch = _scratch(M, K)
    lib.bk_q8_quantize_x(x.data_ptr(), M, K, scratch.data_ptr())
    lib.bk_q8_rows(codes.data_ptr(), row_scales.data_ptr(), N, K, M, scratch.data_ptr(), y.data_ptr(), 0, N, level())
    return y


if __name__ == "__main__":  # `python -m brisk.quant.native`: build now (make install does), say where
    print(build(), LEVELS[library().bk_cpu_level()] if library() else "not loadable")
