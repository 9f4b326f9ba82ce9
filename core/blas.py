"""Single-token matmuls on the CPU through NumPy's BLAS.

Decoding multiplies each weight matrix by one vector, so its speed is memory bandwidth. PyTorch's
CPU build uses MKL, whose sgemv reaches about 13 GB/s on the AMD EPYC machines we run on, while
the OpenBLAS that NumPy ships reaches about 22 GB/s on the same matrices (bench/RESULTS.md). The
two thread pools must not both spin, so decode runs torch's own ops on one thread.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch


def usable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def gemv(x: torch.Tensor, weight_np: np.ndarray) -> torch.Tensor:
    """x: [..., in] holding one row; weight_np: [out, in] (a view of the torch weight)."""
    y = weight_np @ x.reshape(-1).numpy()
    return torch.from_numpy(y).view(*x.shape[:-1], -1)


@contextlib.contextmanager
def torch_threads(n: int):
    old = torch.get_num_threads()
    if n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != old:
            torch.set_num_threads(old)
