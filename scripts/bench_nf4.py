"""NF4 on the CPU: the ways plain torch can run a bitsandbytes-4-bit linear layer, against the
int4/int8 kernels and float, per layer shape and batch (M = 1: decode; M = 64: prefill).

    .venv/bin/python scripts/bench_nf4.py [--threads N]

Variants (all give the same numbers up to float32 summation order):
  brisk      NF4Linear's CPU path: byte -> two values through a 256-entry table (F.embedding),
             a slab of rows at a time (NF4Linear.SLAB weights), then F.linear
  whole      the same table, the whole weight at once
  nibbles    unpack to one code per weight, 16-entry table, whole weight
  bf16-table the 256-entry table in bf16 and a bf16 matmul
Whole-model decode speed: `brisk bench -q int4,nf4 -p 128 -n 64` (SmolLM2, default model).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from brisk.quant import nf4
from brisk.quant.linear import Int4Linear, Int8Linear

SHAPES = [(1536, 576), (576, 1536), (4096, 4096), (11008, 4096)]


def timed(fn, reps: int, clock=time.perf_counter) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = clock()
        fn()
        ts.append(clock() - t)
    return statistics.median(ts) * 1e3


def variants(layer: nf4.NF4Linear):
    N, K, bs = layer.out_features, layer.in_features, layer.blocksize
    packed, absmax, code, pairs = layer.weight.view(-1), layer.absmax, layer.code, layer._pairs

    def whole(x, table=pairs, dtype=torch.float32):
        w = (F.embedding(packed.to(torch.int32), table).view(-1, bs) * absmax[:, None].to(dtype)).view(N, K)
        return F.linear(x.to(dtype), w)

    def nibbles(x):
        q = torch.stack((packed >> 4, packed & 15), -1).view(-1).to(torch.int32)
        return F.linear(x, (F.embedding(q, code[:, None]).view(-1, bs) * absmax[:, None]).view(N, K))

    return {"brisk": layer, "whole": whole, "nibbles": nibbles,
            "bf16-table": lambda x: whole(x, pairs.to(torch.bfloat16), torch.bfloat16)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cpu-time", action="store_true", help="time with the process's CPU time (on a busy "
                    "machine, with --threads 1: less disturbed by other processes than wall time)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import warnings

    warnings.simplefilter("ignore")
    print(f"{torch.get_num_threads()} threads; median ms per call")
    print(f"{'N x K':>12} {'M':>3} " + " ".join(f"{n:>10}" for n in
                                                 ("fp32", "int8", "int4", "brisk", "whole", "nibbles", "bf16-table")))
    torch.manual_seed(0)
    for N, K in SHAPES:
        lin = torch.nn.Linear(K, N, bias=False)
        layer = nf4.NF4Linear.from_float(lin)
        i8, i4 = Int8Linear.from_float(lin), Int4Linear.from_float(lin, 64)
        for M in (1, 64):
            x = torch.randn(M, K)
            with torch.inference_mode():
                ref = layer(x)
                fns = {"fp32": lin, "int8": i8, "int4": i4, **variants(layer)}
                for name, f in variants(layer).items():
                    assert (f(x).float() - ref).abs().max() <= 0.05 * ref.abs().max(), name
                clock = time.process_time if args.cpu_time else time.perf_counter
                row = [timed(lambda f=f: f(x), args.reps, clock) for f in fns.values()]
            print(f"{f'{N} x {K}':>12} {M:>3} " + " ".join(f"{t:>10.3f}" for t in row))


if __name__ == "__main__":
    main()
