"""The KV cache's types (--kv-type) side by side on one model, in one process: decode tok/s at a
short position and at depth (after a prompt of --depth tokens), each type's mean KL to the float32
cache over a held-out text (brisk eval's windows), and the peak RSS of a 32-token `brisk generate`
(a fresh process per type). Types alternate step by step, so a busy moment hits them alike; medians.

    python bench/kv_types.py [--model PATH] [--threads 1] [--depth 2048] [--steps 32] [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

TYPES = ("f32", "f16", "bf16", "q8_0")


def peak_rss_of_generate(model: str | None, kv_type: str, threads: int) -> int:
    """Peak RSS (bytes) of `brisk generate -n 32` in a fresh process (its own ru_maxrss)."""
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    cmd = [sys.executable, "-c", "from brisk.cli.main import run; run()", "generate", *(["-m", model] if model else []),
           "Tell me about the sea.", "-n", "32", "-t", "0", "--kv-type", kv_type, "--threads", str(threads)]
    out = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--depth", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--text", default=str(Path(__file__).with_name("heldout.txt")))
    ap.add_argument("--no-rss", action="store_true")
    args = ap.parse_args()

    from brisk.core import LLM
    from brisk.core.device import set_cpu_threads
    from brisk.core.evaluate import evaluate

    set_cpu_threads(args.threads)
    ctx = args.depth + args.steps + 8
    llms = {t: LLM.load(args.model, device="cpu", kv_type=t, ctx=max(ctx, 512)) for t in TYPES}
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, llms["f32"].config.vocab_size, (1, args.depth), generator=gen)
    caches, speeds = {}, {(t, w): [] for t in TYPES for w in ("short", "depth")}
    with torch.inference_mode():
        for t, llm in llms.items():
            caches[t] = (llm.new_cache(64), llm.new_cache(ctx))
            llm.model(prompt[:, :16], 0, caches[t][0])
            for s in range(0, args.depth, 512):
                llm.model(prompt[:, s:s + 512], s, caches[t][1])
        for _ in range(args.reps):
            for where, start in (("short", 16), ("depth", args.depth)):
                for t, llm in llms.items():
                    cache = caches[t][where == "depth"]
                    t0 = time.perf_counter()
                    for i in range(args.steps):  # rewritten each rep: the same positions every time
                        llm.model(torch.tensor([[5 + i]]), start + i, cache)
                    speeds[t, where].append(args.steps / (time.perf_counter() - t0))
    ids = llms["f32"].tokenizer.encode(Path(args.text).read_text(), add_special=True)
    rows = []
    for t, llm in llms.items():
        kl = evaluate(llm, ids, 512, 256, llms["f32"]) if t != "f32" else None
        rows.append({"kv_type": t, "tg_short": statistics.median(speeds[t, "short"]),
                     f"tg_at_{args.depth}": statistics.median(speeds[t, "depth"]),
                     "kl_mean": kl.kl_mean if kl else 0.0, "kl_max": kl.kl_max if kl else 0.0,
                     "top1": kl.top1_agreement if kl else 1.0,
                     "peak_rss_mb": None if args.no_rss else peak_rss_of_generate(args.model, t, args.threads) / 1e6})
    for r in rows:
        print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}))


if __name__ == "__main__":
    main()
