"""Single-row float32 matmuls (decode steps) on the CPU through NumPy's OpenBLAS.

A decode step multiplies each weight matrix by one vector, so its speed is memory bandwidth.
PyTorch's CPU wheel uses MKL, whose sgemv reaches about 13 GB/s on the AMD EPYC machines we
measured; the OpenBLAS that NumPy ships reaches 18-22 GB/s on the same matrices. Prefill
(many rows) stays with torch, whose sgemm is as fast and whose threads also run attention.

OpenBLAS runs on the calling thread only, by default: its worker threads spin-wait, and on a
busy machine (or beside torch's OpenMP pool) a worker that does not get a core stalls every
call: decode fell from 25 to 1.4 tok/s on our 2-core CI machine with another process running.
BRISK_BLAS_THREADS=2 (or more) trades that robustness for speed on an otherwise idle machine.
BRISK_BLAS=0 turns this path off.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from ..quant import settings

ENABLED = settings.BLAS.get()
_threads_set = False


def usable(t: torch.Tensor) -> bool:
    return ENABLED and t.device.type == "cpu" and t.dtype == torch.float32


def _set_openblas_threads(n: int) -> bool:
    """OpenBLAS has no Python API for this; find NumPy's copy among the loaded libraries."""
    try:
        maps = open("/proc/self/maps").read()
    except OSError:
        return False
    libs = {line.split()[-1] for line in maps.splitlines() if "openblas" in line and line.endswith(".so")}
    for path in libs:
        lib = ctypes.CDLL(path)
        for sym in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                return True
    return False


def gemv(x: torch.Tensor, weight_np: np.ndarray) -> torch.Tensor:
    """x: [..., in] holding one row; weight_np: [out, in], a NumPy view of the torch weight."""
    global _threads_set
    if not _threads_set:
        _set_openblas_threads(settings.BLAS_THREADS.get())
        _threads_set = True
    y = weight_np @ x.reshape(-1).numpy()
    return torch.from_numpy(y).view(*x.shape[:-1], -1)
