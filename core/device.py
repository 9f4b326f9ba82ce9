"""Choosing device and dtype."""
from __future__ import annotations

import contextlib

import torch

from .errors import InvalidValue
from .load_options import check_device, check_dtype, check_threads

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidValue("device", name, "needs a CUDA GPU, and torch sees none",
                           template="{option} cuda: no CUDA GPU is available (torch sees none)")
    check_device(name)
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # GPU: bf16 halves the bytes per token. CPU: float32 where brisk's native kernels run (they
        # take and return float32, and float32 everywhere keeps a row's result independent of its
        # batch); without them fp32 measured fastest on AVX2 machines without native bf16 matmul
        # (see bench/RESULTS.md), bf16 only wins with AMX/avx512_bf16.
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        from ..quant import native

        return torch.bfloat16 if cpu_has_fast_bf16() and not native.available() else torch.float32
    check_dtype(name)
    if device.type == "cpu" and DTYPES[name] != torch.float32 and not cpu_has_fast_bf16():
        import warnings

        warnings.warn(f"this CPU has no native bfloat16/float16 arithmetic (no avx512_bf16 or AMX): {name} is "
                      "emulated, several times slower than float32 (--dtype auto picks float32 here)")
    return DTYPES[name]


def cpu_has_fast_bf16() -> bool:
    from ..quant.native import cpu_flags

    return bool({"amx_bf16", "avx512_bf16"} & (cpu_flags() or set()))


# The CPU threads brisk computes with (--threads; default torch's, the physical cores).
_threads = torch.get_num_threads()
_chosen = False  # --threads given


def set_cpu_threads(n: int | None) -> None:
    """--threads N: the threads brisk's kernels and torch use from now on (None: leave the default)."""
    global _threads, _chosen
    if n is None:
        return
    check_threads(n)
    _threads, _chosen = n, True
    torch.set_num_threads(n)


def share_cpu_threads(ranks: int) -> None:
    """--tp: without --threads, the host's ranks share its physical cores (each keeps max(1, cores //
    ranks)): every rank on every core spins for cores the others hold (bench/RESULTS.md)."""
    global _threads
    if not _chosen and ranks > 1:
        _threads = max(1, _threads // ranks)
        torch.set_num_threads(_threads)


def cpu_threads() -> int:
    return _threads


@contextlib.contextmanager
def torch_gets_the_threads():
    """Torch computes with all of brisk's threads inside (use_one_thread_pool gives it one): the
    passes of a float model that go to torch's sgemm (prefill) rather than the native kernels."""
    n = torch.get_num_threads()
    if n == _threads:
        yield
        return
    torch.set_num_threads(_threads)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def use_one_thread_pool(native_layers: bool) -> None:
    """With brisk's native kernels doing a model's products, they get the threads and the small torch
    ops between them run on one: two pools spinning on the same cores slowed both (measured on 2
    cores, SmolLM2 Q4_1: prefill 302 -> 452 tok/s, decode 47.5 -> 49.8 tok/s). Otherwise torch gets them."""
    from ..quant import native

    if native_layers:
        native.set_threads(_threads)
        torch.set_num_threads(1)
    else:
        torch.set_num_threads(_threads)
