"""Triton, imported only where its kernels can run: a CUDA GPU, or TRITON_INTERPRET=1 (how the tests
run them on CPU tensors). On a CPU-only run it stays unimported: its import alone costs a good part
of brisk's start for kernels that would never run."""
from __future__ import annotations

import os

import torch


def load_triton():
    """The triton module, or None: not installed, or no GPU and not interpreting."""
    if not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()):
        return None
    try:
        import triton
    except ImportError:  # a CPU-only install: callers take the torch path
        return None
    return triton
