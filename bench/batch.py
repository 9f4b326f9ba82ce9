"""Continuous batching on SmolLM2-135M: aggregate throughput at 1, 4 and 16 concurrent sequences,
against sequential single-stream generation (Session, one request after another) of the same
requests. Greedy, so every configuration must produce the same answers (checked and reported).

Reported per configuration: end-to-end generated tok/s (all tokens / wall time, prefill
included), aggregate decode tok/s (tokens / time of decode-only steps), mean and p95 latency,
and the KV pool: its size, the peak bytes of the blocks in use, and what the tokens held at that
moment need (the difference is the partly filled last block of each sequence). The pool is sized
to the requests. Prints a markdown section and appends it to bench/RESULTS.md. Not a test.

    python bench/batch.py [--requests 16] [--max-tokens 128] [--device cpu|cuda] [--quantize none|auto]
                          [--concurrency 1,4,16] [--threads N] [--no-save]
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [
    "Write a story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle stays upright, step by step.",
    "Describe a busy market in a coastal town at dawn.",
    "Write a letter from a cat to the dog next door.",
    "Explain why the sky is blue to a ten-year-old.",
    "Tell me a story about a robot learning to paint.",
    "List ten ideas for a rainy Sunday afternoon and explain each one.",
    "Write a short essay about why people keep diaries.",
    "Describe how bread is made, from flour to loaf.",
    "Tell a story about a child who befriends a cloud.",
    "Explain the rules of chess to a complete beginner.",
    "Write a travel guide entry for an imaginary mountain village.",
    "Describe the life cycle of a butterfly in detail.",
    "Write a dialogue between a teacher and a curious student about volcanoes.",
    "Tell me a story about an old clockmaker and a broken watch.",
    "Explain how a library decides which books to buy.",
]


def sequential(llm, ids, max_tokens):
    from brisk.core import GREEDY, Session

    out, t0 = [], time.perf_counter()
    for p in ids:
        s = Session(llm)
        list(s.stream(p, GREEDY, max_tokens))
        out.append(s.last)
    wall = time.perf_counter() - t0
    n = sum(len(r.tokens) for r in out)
    decode = sum(len(r.tokens) - 1 for r in out) / sum(r.decode_s for r in out)
    lat = [r.ttft_s + r.decode_s for r in out]
    # latency as a client sees it: each request also waits for those before it
    waited = [sum(lat[:i + 1]) for i in range(len(lat))]
    return [r.tokens for r in out], dict(wall=wall, tokens=n, e2e=n / wall, decode=decode, lat=waited)


def batched(llm, ids, max_tokens, concurrency):
    from brisk.core import GREEDY
    from brisk.core.jobs import percentile, summary
    from brisk.core.kv.paged import BLOCK_SIZE
    from brisk.core.batching import Engine, Request

    bs = BLOCK_SIZE
    kv = sum(-(-(len(p) + max_tokens) // bs) * bs for p in ids[:concurrency])  # what `concurrency` sequences need
    engine = Engine(llm, max_batch=concurrency, kv_tokens=kv)
    t0 = time.perf_counter()
    seqs = engine.run([Request(p, GREEDY, max_tokens) for p in ids])
    wall = time.perf_counter() - t0
    s = summary(seqs, wall, engine)
    st = engine.stats
    return [q.result.tokens for q in seqs], dict(
        wall=wall, tokens=s["generated_tokens"], e2e=s["generated_tokens"] / wall,
        decode=st.decode_tokens / st.decode_s, lat=[q.latency_s for q in seqs], pool=s["kv_pool_bytes"],
        used=s["kv_peak_used_bytes"], needed=s["kv_peak_needed_bytes"], shared=st.shared_tokens,
        p95=percentile([q.latency_s for q in seqs], 95))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantize", default="none", help="none: float weights; auto: the GGUF's Q4_1 as int4 kernels")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from brisk.core import LLM
    from brisk.core.jobs import percentile

    # a context just long enough, so the pool (never smaller than one full context) can be sized to the requests
    llm = LLM.load(None, device=args.device, dtype=args.dtype, quantize=args.quantize, ctx=args.max_tokens + 96)
    ids = [llm.prompt_ids(PROMPTS[i % len(PROMPTS)]) for i in range(args.requests)]
    sequential(llm, ids[:1], 8)  # warm-up
    t_start = time.time()
    ref, seq = sequential(llm, ids, args.max_tokens)
    print(f"sequential: {seq['e2e']:.1f} tok/s end to end, {seq['decode']:.1f} decode", flush=True)
    results = {}
    for c in [int(x) for x in args.concurrency.split(",")]:
        batched(llm, ids[:c], 4, c)  # warm-up at this batch size
        toks, r = batched(llm, ids, args.max_tokens, c)
        r["same"] = sum(a == b for a, b in zip(toks, ref))
        results[c] = r
        print(f"concurrency {c}: {r['e2e']:.1f} tok/s end to end, {r['decode']:.1f} decode, "
              f"{r['same']}/{len(ids)} same answers", flush=True)

    mib = 1 / 2**20
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "?"
    if llm.device.type == "cuda":
        machine = torch.cuda.get_device_name(llm.device)
    else:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), "?")
        machine = f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    dtype = str(llm.dtype).removeprefix("torch.")
    head = (f"### Continuous batching · {datetime.date.today()} · commit {commit} · {machine} · torch "
            f"{torch.__version__} · SmolLM2-135M-Instruct {dtype}, weights {llm.quantization}\n\n"
            f"{len(ids)} chat requests (different prompts), greedy, up to {args.max_tokens} tokens each, "
            f"{seq['tokens']} tokens in all; every configuration runs all of them. Sequential: one Session "
            f"after another (its latency includes waiting for the requests before it). Batched: the "
            f"continuous-batching engine with that many sequences at once, the pool sized to them. "
            f"Load average at the end: {os.getloadavg()[0]:.1f}. Took {time.time() - t_start:.0f} s.\n\n")
    table = ("| mode | end-to-end tok/s | speedup | decode tok/s | speedup | latency mean / p95 (s) | KV pool MiB "
             "| peak in use / needed MiB | same answers |\n|---|---|---|---|---|---|---|---|---|\n")
    table += (f"| sequential | {seq['e2e']:.1f} | 1.00× | {seq['decode']:.1f} | 1.00× | "
              f"{sum(seq['lat']) / len(seq['lat']):.1f} / {percentile(seq['lat'], 95):.1f} | – | – | – |\n")
    for c, r in results.items():
        table += (f"| {c} at once | {r['e2e']:.1f} | {r['e2e'] / seq['e2e']:.2f}× | {r['decode']:.1f} | "
                  f"{r['decode'] / seq['decode']:.2f}× | {sum(r['lat']) / len(r['lat']):.1f} / {r['p95']:.1f} | "
                  f"{r['pool'] * mib:.1f} | {r['used'] * mib:.1f} / {r['needed'] * mib:.1f} "
                  f"({r['used'] / max(r['needed'], 1) - 1:+.0%}) | {r['same']}/{len(ids)} |\n")
    print("\n" + head + table)
    if not args.no_save:
        with open(ROOT / "bench" / "RESULTS.md", "a") as f:
            f.write("\n" + head + table)


if __name__ == "__main__":
    main()
