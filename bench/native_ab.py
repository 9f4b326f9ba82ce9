"""brisk's native CPU kernels against torch's on the same model, in one process: the default
model loaded twice (native kernels on, then off), single decode steps alternating between the
two, medians; also prefill of 128 tokens. Float32 and bfloat16 activations.

    python bench/native_ab.py [--threads N]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from brisk.core.cuda_graph import decode_step
from brisk.core.generate import Session
from brisk.core.llm import LLM
from brisk.quant import native


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    for dtype in a.dtypes.split(","):
        llms = {}
        for on in (True, False):
            native.ENABLED = on
            llms["native" if on else "torch"] = LLM.load(None, device="cpu", dtype=dtype)
        steps = {k: decode_step(v.model, v.new_cache(a.steps + 1)) for k, v in llms.items()}
        times = {k: [] for k in llms}
        ids = llms["native"].prompt_ids("Write a short story about a lighthouse keeper. " * 8)[:128]
        pp = {k: [] for k in llms}
        with torch.inference_mode():
            for i in range(a.steps):
                for k in (list(llms) if i % 2 == 0 else list(llms)[::-1]):
                    native.ENABLED = k == "native"
                    t = time.perf_counter()
                    steps[k](5, i)
                    times[k].append(time.perf_counter() - t)
                    if i < 20:
                        s = Session(llms[k])
                        t = time.perf_counter()
                        s.prefill(ids)
                        pp[k].append(time.perf_counter() - t)
        native.ENABLED = True
        tg = {k: 1 / statistics.median(v) for k, v in times.items()}
        p = {k: len(ids) / statistics.median(v) for k, v in pp.items()}
        print(f"{dtype:9s} threads={a.threads}  decode: native {tg['native']:.1f} tok/s, torch {tg['torch']:.1f} "
              f"(x{tg['native'] / tg['torch']:.2f})   prefill {len(ids)}: native {p['native']:.0f} tok/s, "
              f"torch {p['torch']:.0f} (x{p['native'] / p['torch']:.2f})")


if __name__ == "__main__":
    main()
