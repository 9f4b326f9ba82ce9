"""`brisk serve` under load: N concurrent clients (the openai package), each sending chat requests
one after another. Per concurrency: aggregate completion tok/s over the wall time, requests per
second, and each request's latency and time to first token (streamed), p50 and p95.

    python bench/serve_load.py [--model PATH] [--device cuda] [--clients 1,16,64] [--requests 4]
                               [--max-tokens 128] [--json out.json]

The server runs in its own process with --max-concurrency the largest client count and greedy
sampling; every request asks for exactly --max-tokens tokens (ignore_eos), so the rows compare.
Not a test: figures go to bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from hostile_clients import Target  # noqa: E402 (the server process, started and waited for)

TOPICS = ["a lighthouse keeper", "a lost key", "the first snow", "a broken clock", "a night train", "an old map",
          "a quiet library", "a red kite"]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_clients(port: int, clients: int, requests: int, max_tokens: int) -> dict:
    import openai

    lat, ttft, tokens, errors = [], [], [], []
    lock = threading.Lock()

    def client(i: int):
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        for r in range(requests):
            msg = f"Write a short story about {TOPICS[(i + r) % len(TOPICS)]} (reader {i}, part {r})."
            t0 = time.perf_counter()
            first, n = None, 0
            try:
                stream = c.chat.completions.create(model="m", messages=[{"role": "user", "content": msg}],
                                                   max_tokens=max_tokens, temperature=0, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
                for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter() - t0
                    if chunk.usage is not None:
                        n = chunk.usage.completion_tokens
            except Exception as e:  # counted, not fatal: the row says how many failed
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                continue
            with lock:
                lat.append(time.perf_counter() - t0)
                ttft.append(first if first is not None else float("nan"))
                tokens.append(n)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(lat), "errors": len(errors), "first_error": errors[0] if errors else None,
            "tok_s": sum(tokens) / wall, "req_s": len(lat) / wall,
            "latency_p50_s": statistics.median(lat) if lat else None, "latency_p95_s": percentile(lat, 0.95) if lat else None,
            "ttft_p50_s": statistics.median(ttft) if ttft else None, "ttft_p95_s": percentile(ttft, 0.95) if ttft else None,
            "tokens_per_request": statistics.median(tokens) if tokens else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    counts = [int(c) for c in a.clients.split(",")]
    server = Target(a.model, ["--device", a.device, "--temperature", "0"], max_concurrency=max(counts))
    rows = []
    try:
        for c in counts:  # warm-up: compiles, and on CUDA each batch size's step graph
            run_clients(server.port, c, 1, 8)
        for c in counts:
            row = run_clients(server.port, c, a.requests, a.max_tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.close()
    print("| clients | tok/s | req/s | latency p50 / p95 s | first token p50 / p95 s | errors |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        f = lambda k, d=2: "-" if r[k] is None else f"{r[k]:.{d}f}"  # noqa: E731 (no request succeeded)
        print(f"| {r['clients']} | {r['tok_s']:.0f} | {r['req_s']:.2f} | {f('latency_p50_s')} / {f('latency_p95_s')} "
              f"| {f('ttft_p50_s', 3)} / {f('ttft_p95_s', 3)} | {r['errors']} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "device": a.device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
