"""`make bench`: brisk against HF transformers on SmolLM2-135M, same process, same threads.

brisk runs the GGUF widened to float32 (as transformers does), kept as stored (the Q4_1 and Q8_0
blocks through brisk's native kernels) and quantized at load (int8, int4). llama.cpp is compared
in its own process, as its users run it: bench/llama_compare.py.

Prints a table and appends it to bench/RESULTS.md with the machine, date and commit.
Not a test: speed targets are tracked here, not asserted.
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
N_NEW, N_PREFILL, REPS = 128, 512, 5


def median_time(fn, reps=REPS):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_brisk(path, dtype, quantize="none"):
    from brisk.core import GREEDY, LLM, Session

    llm = LLM.load(str(path), device="cpu", dtype=dtype, quantize=quantize)
    ids = llm.prompt_ids(PROMPT)
    s = Session(llm)
    eos = llm.eos_ids
    llm.eos_ids = set()  # always generate N_NEW tokens, like min_new_tokens on the HF side

    def gen(n):
        s.reset()
        list(s.stream(ids, GREEDY, n))
        return s.last

    decode = []
    gen(8)
    for _ in range(REPS):
        decode.append(gen(N_NEW).decode_tps)
    llm.eos_ids = eos
    long_ids = (ids * (N_PREFILL // len(ids) + 1))[:N_PREFILL]

    def prefill():
        s.reset()
        s.prefill(long_ids)

    pp = N_PREFILL / median_time(prefill)
    return statistics.median(decode), pp, ids, llm.load_info.param_bytes


def bench_hf(path, dtype, ids):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=getattr(torch, dtype)).eval()
    x = torch.tensor([ids])

    def gen(n):
        with torch.inference_mode():
            model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    t_first = median_time(lambda: gen(1), 3)
    t_all = median_time(lambda: gen(N_NEW), 3)
    decode = (N_NEW - 1) / (t_all - t_first)
    long_ids = torch.tensor([(ids * (N_PREFILL // len(ids) + 1))[:N_PREFILL]])

    def prefill():
        with torch.inference_mode():
            model(long_ids, logits_to_keep=1)

    return decode, N_PREFILL / median_time(prefill, 3)


def warm_first_token_s() -> float:
    """Seconds from starting `brisk generate` (default model) to its first byte of output."""
    cmd = [sys.executable, "-c", "from brisk.cli.main import run; run()", "generate", "Hi", "-n", "8",
           "--temperature", "0"]
    subprocess.run(cmd, capture_output=True)  # cold run: fills the converted-weights cache
    times = []
    for _ in range(3):
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        p.stdout.read(1)
        times.append(time.perf_counter() - t)
        p.communicate()
    return statistics.median(times)


def main():
    from brisk.core.checkpoint import default_model_path

    path = default_model_path()
    threads = torch.get_num_threads()
    rows = []  # (engine, weights, decode tok/s, pp512 tok/s, model bytes)
    ids = None
    for quantize, label in (("none", "float32 (widened)"), ("auto", "Q4_1 kept (native kernels)"),
                            ("int8", "int8 at load"), ("int4", "int4 g32 at load")):
        dec, pp, ids, nbytes = bench_brisk(path, "float32", quantize)
        torch.set_num_threads(threads)
        rows.append(("brisk", label, dec, pp, nbytes))
    h_dec, h_pp = bench_hf(path, "float32", ids)
    torch.set_num_threads(threads)
    rows.append(("transformers", "float32", h_dec, h_pp, None))
    ttft = warm_first_token_s()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "?"
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    head = (f"### {datetime.date.today()} · commit {commit} · {cpu}, {os.cpu_count()} cores, "
            f"{threads} torch threads · torch {torch.__version__} · SmolLM2-135M-Instruct (Q4_1 GGUF)\n\n")
    table = ("| engine | weights | decode tok/s | vs transformers | pp512 tok/s | vs transformers | model MB |\n"
             "|---|---|---|---|---|---|---|\n")
    for engine, weights, dec, pp, nbytes in rows:
        mb = f"{nbytes / 1e6:.0f}" if nbytes else "-"
        table += f"| {engine} | {weights} | {dec:.1f} | {dec / h_dec:.2f}× | {pp:.0f} | {pp / h_pp:.2f}× | {mb} |\n"
    table += f"\nWarm `brisk generate` (default model), process start to first output byte: {ttft:.2f} s (median of 3)\n"
    print(head + table)
    with open(ROOT / "bench" / "RESULTS.md", "a") as f:
        f.write("\n" + head + table)


if __name__ == "__main__":
    main()
