"""How brisk's CPU decode and prefill scale with threads, next to what the memory allows (issue 10:
2 threads >= 1.6x on an idle machine). Not a test; needs no llama.cpp, so it also runs on machines
that only have brisk (e.g. the GPU host's CPU, through bench/gpu_check.sh).

Model: a TinyLlama-1.1B-shaped llama whose matrices are random Q4_K blocks (output Q6_K), written
directly (no quantizer; ~640 MB, built once under ~/.cache/brisk/bench/), or any GGUF given with
--model. Per thread count, alternating the order each round: the native kernels' read probe (a
streaming read of 1 GiB, quant/native.read_bandwidth), decode tg64 and prefill pp128; medians.

    python bench/cpu_threads.py [--threads 1,2,4] [--reps 3] [--model X.gguf] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from brisk.quant import native
from bench_files import BENCH_CACHE, LLAMA1B, machine, write_random_llama  # bench/

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
N_CTX = 1024
BLOCKS = {"*": "Q4_K", "output.weight": "Q6_K"}


class Brisk:
    name = "brisk"

    def __init__(self, path: Path):
        from brisk.core import LLM, Session

        self.llm = LLM.load(str(path), ctx=N_CTX, device="cpu")  # the default load: quantized blocks, native kernels
        self.llm.eos_ids = set()  # always generate the full count
        self.session = Session(self.llm)

    def set_threads(self, t: int):
        torch.set_num_threads(t)
        native.set_threads(t)

    def decode(self, ids: list[int], n: int) -> float:
        from brisk.core import GREEDY

        self.session.reset()
        list(self.session.stream(ids, GREEDY, n))
        assert len(self.session.last.tokens) == n
        return self.session.last.decode_tps  # the n - 1 steps after the first (prefill's) token

    def prefill(self, ids: list[int]) -> float:
        self.session.reset()
        t = time.perf_counter()
        self.session.prefill(ids)
        return len(ids) / (time.perf_counter() - t)

    def close(self):
        del self.session, self.llm


def random_model() -> Path:
    path = BENCH_CACHE / f"llama-{LLAMA1B['layers']}x{LLAMA1B['dim']}-randomblocks-Q4_K.gguf"
    if not path.exists():
        BENCH_CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_random_llama(tmp, LLAMA1B, BLOCKS)
        tmp.replace(path)
    return path


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
    res = {(t, k): [] for t in threads for k in ("read", "tg", "pp")}
    for t in threads:  # warm-up
        b.set_threads(t)
        b.decode(ids, 4)
    for rep in range(args.reps):
        for t in (threads if rep % 2 == 0 else threads[::-1]):
            res[t, "read"].append(native.read_bandwidth(t))
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
