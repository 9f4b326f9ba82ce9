"""How brisk's CPU decode and prefill scale with threads, next to what the memory allows (issue 10:
2 threads >= 1.6x on an idle machine). Not a test; needs no llama.cpp, so it also runs on machines
that only have brisk (e.g. the GPU host's CPU, through bench/gpu_check.sh).

Model: a TinyLlama-1.1B-shaped llama whose matrices are random Q4_K blocks (output Q6_K), written
directly (no quantizer; ~640 MB, built once under ~/.cache/brisk/bench/), or any GGUF given with
--model. Per thread count, alternating the order each round: a memory read-bandwidth probe (sum of a
1 GB float32 tensor, torch's threads), decode tg64 and prefill pp128; medians.

    python bench/cpu_threads.py [--threads 1,2,4] [--reps 3] [--model X.gguf] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from llama_compare import BENCH_CACHE, LLAMA1B, PROMPT, Brisk, machine, write_random_llama  # bench/

BLOCKS = {"*": "Q4_K", "output.weight": "Q6_K"}


def random_model() -> Path:
    path = BENCH_CACHE / f"llama-{LLAMA1B['layers']}x{LLAMA1B['dim']}-randomblocks-Q4_K.gguf"
    if not path.exists():
        BENCH_CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_random_llama(tmp, LLAMA1B, BLOCKS)
        tmp.replace(path)
    return path


def read_gbs(big: torch.Tensor, threads: int) -> float:
    torch.set_num_threads(threads)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t)
    return big.numel() * big.element_size() / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", help="a GGUF file (default: the random-block 1.1B Q4_K llama)")
    ap.add_argument("--torch-threads", type=int, help="torch's threads fixed at this (default: as many as "
                    "the kernels'): does an idle, spinning OpenMP team slow the kernels' pool?")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    path = Path(args.model) if args.model else random_model()
    b = Brisk(path)
    if args.torch_threads:
        set_threads = b.set_threads
        b.set_threads = lambda t: (set_threads(t), torch.set_num_threads(args.torch_threads))
    ids = b.llm.prompt_ids(PROMPT)
    long_ids = (ids * (128 // len(ids) + 1))[:128]
    big = torch.ones(256 * 1024 * 1024)  # 1 GB: far past any cache
    res = {(t, k): [] for t in threads for k in ("read", "tg", "pp")}
    for t in threads:  # warm-up
        b.set_threads(t)
        b.decode(ids, 4)
    for rep in range(args.reps):
        for t in (threads if rep % 2 == 0 else threads[::-1]):
            res[t, "read"].append(read_gbs(big, t))
            b.set_threads(t)
            res[t, "tg"].append(b.decode(ids, 64))
            res[t, "pp"].append(b.prefill(long_ids))
    med = {k: statistics.median(v) for k, v in res.items()}
    t0 = threads[0]
    print(f"{path.name} ({path.stat().st_size / 1e6:.0f} MB) on {machine()}, median of {args.reps}"
          + (f", torch's threads {args.torch_threads}" if args.torch_threads else ""))
    print(f"| threads | read GB/s (x) | decode tg64 tok/s (x) | weights GB/s in decode | prefill pp128 tok/s (x) |")
    print("|---|---|---|---|---|")
    size = path.stat().st_size
    for t in threads:
        print(f"| {t} | {med[t, 'read']:.1f} ({med[t, 'read'] / med[t0, 'read']:.2f}) "
              f"| {med[t, 'tg']:.1f} ({med[t, 'tg'] / med[t0, 'tg']:.2f}) | {size * med[t, 'tg'] / 1e9:.1f} "
              f"| {med[t, 'pp']:.1f} ({med[t, 'pp'] / med[t0, 'pp']:.2f}) |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "model": path.name, "bytes": size,
                                               "torch_threads": args.torch_threads,
                                               "runs": {f"{t} {k}": v for (t, k), v in res.items()}}, indent=1))


if __name__ == "__main__":
    main()
