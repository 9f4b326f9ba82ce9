"""The native kernels' product speed per weight format and instruction-set copy, one thread, in one
process (the copies alternate, best of 15 calls each, 3 rounds): GB/s of the weights' bytes read,
random blocks of a 2048 x 2048 matrix (L3-resident here), one activation row.

    python bench/kernel_levels.py [LEVELS] [ROWS] [FORMATS]   # e.g. 012 1 Q4_1,Q4_K,F32

LEVELS: digits, 0 plain C, 1 AVX2+FMA, 2 AVX-512 (those above the CPU's run as its best)."""
from __future__ import annotations

import os
import sys
import time

import gguf
import numpy as np
import torch

from brisk.quant import gguf_interleave, native
from bench_files import FP16_SCALES as FP16_FIELDS  # bench/, beside this script

N = K = 2048


def make(name: str, rng) -> tuple[native.NativeWeight, int]:
    """A weight of format `name` ("Q4_K x8": rows interleaved as brisk loads them; "F32") and its bytes."""
    if name == "F32":
        return native.NativeWeight(native.F32, N, K, torch.randn(N, K)), N * K * 4
    x8, name = name.endswith(" x8"), name.removesuffix(" x8")
    qt = int(gguf.GGMLQuantizationType[name])
    bw, bb = native.BLOCK[qt]
    raw = rng.integers(0, 256, (N, K // bw, bb), dtype=np.uint8)
    for off in FP16_FIELDS[name]:  # sane scales: random bytes there can be inf/nan halves
        half = rng.uniform(1e-3, 0.05, (N, K // bw)).astype(np.float16)
        raw[:, :, off:off + 2] = half.view(np.uint8).reshape(N, K // bw, 2)
    t = torch.from_numpy(raw.reshape(N, -1))
    if x8:
        return native.NativeWeight(qt, N, K, gguf_interleave.pack(t, qt), layout=native.X8), t.numel()
    return native.NativeWeight(qt, N, K, t), t.numel()


def main() -> None:
    levels = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "012")]
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else [*FP16_FIELDS, "Q4_K x8", "Q8_0 x8", "F32"]
    if not native.available():
        sys.exit("the native kernels are not available")
    native.set_threads(1)
    torch.set_num_threads(1)
    rng, x = np.random.default_rng(0), torch.randn(rows, K)
    print(f"{'GB/s':8} " + " ".join(f"{native.LEVELS[lv]:>7}" for lv in levels))
    for name in names:
        w, nbytes = make(name, rng)
        best = dict.fromkeys(levels, float("inf"))
        for _ in range(3):
            for lv in levels:
                os.environ["BRISK_NATIVE_LEVEL"] = str(lv)
                native.level.cache_clear()
                w.matmul(x)
                for _ in range(15):
                    t0 = time.perf_counter()
                    w.matmul(x)
                    best[lv] = min(best[lv], time.perf_counter() - t0)
        print(f"{name:8} " + " ".join(f"{nbytes / best[lv] / 1e9:7.1f}" for lv in levels), flush=True)


if __name__ == "__main__":
    main()
