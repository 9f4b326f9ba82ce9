"""brisk against llama.cpp's own llama-bench on the same GGUF files, each tool in its own process.

Each tool runs as its users run it: `llama-bench -m FILE -t T -p 512 -n 128 -r R -o json` and
`brisk bench FILE --threads T -p 512 -n 128 -r R --json`, alternating, who goes first flipped each
round; the table gives medians over --rounds rounds (each a mean over R repetitions) ± half their
range, and each process's peak RSS (its own, from wait4). Beside every decode figure: the bytes of
weights a decode step reads (`brisk info --json`) times brisk's tok/s, as a share of the machine's
read bandwidth at that thread count (brisk's native read probe, a streaming read of 1 GiB, in its own
process, once per round).

Files (bench/bench_files.py): smollm2, gemma3, smollm2:FTYPE / gemma3:FTYPE (requantized by
llama-quantize), llama1b, qwen3moe, gpt-oss. llama-bench and llama-quantize: $LLAMA_BENCH /
$LLAMA_QUANTIZE, else those `make bench-llama` builds from the llama-cpp-python sdist.

    python bench/llama_compare.py --models smollm2,gemma3 [--threads 1,2] [--rounds 4] [-r 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_files import commit, llama_tool, machine, model_label, model_path  # noqa: E402

BRISK = str(Path(sys.executable).parent / "brisk")


def run(cmd: list[str]) -> tuple[str, int]:
    """(stdout, peak RSS bytes) of cmd run to completion in its own process: wait4's rusage is the
    child's own (RUSAGE_CHILDREN would be the maximum over every child so far)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if p.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}): {err.read().decode()[-500:].strip()}")
        return out.read().decode(), usage.ru_maxrss * 1024


def llama_bench(path: Path, threads: int, pp: int, tg: int, reps: int, depth: int) -> tuple[dict, int]:
    out, rss = run([llama_tool("llama-bench"), "-m", str(path), "-t", str(threads), "-p", str(pp), "-n", str(tg),
                    "-d", str(depth), "-r", str(reps), "-o", "json"])
    return {("pp" if row["n_prompt"] else "tg"): row["avg_ts"] for row in json.loads(out)}, rss


def brisk_bench(path: Path, threads: int, pp: int, tg: int, reps: int, depth: int) -> tuple[dict, int]:
    out, rss = run([BRISK, "bench", str(path), "--threads", str(threads), "-p", str(pp), "-n", str(tg),
                    "-d", str(depth), "-r", str(reps), "--json"])
    return {row["test"][:2]: row["tok_s"] for row in json.loads(out)}, rss


def read_bandwidth(threads: int) -> float:
    code = f"from brisk.quant import native; print(native.read_bandwidth({threads}))"
    return float(run([sys.executable, "-c", code])[0].split()[-1])


def median_spread(xs: list[float]) -> tuple[float, float]:
    return statistics.median(xs), (max(xs) - min(xs)) / 2


def compare(name: str, threads: list[int], rounds: int, reps: int, pp: int, tg: int, depths: list[int]) -> list[dict]:
    path = model_path(name)
    info = json.loads(run([BRISK, "info", str(path), "--json"])[0])
    step = info["read_bytes_per_token"]
    print(f"{name}: {path.name}, {path.stat().st_size / 2**20:.0f} MiB, {step / 2**20:.1f} MiB read per decode step",
          file=sys.stderr, flush=True)
    rows = []
    for t, depth in [(t, d) for t in threads for d in depths]:
        got = {k: [] for k in ("brisk_pp", "brisk_tg", "llama_pp", "llama_tg", "read")}
        rss = {"brisk": 0, "llama": 0}
        for r in range(rounds):
            order = ("brisk", "llama") if r % 2 == 0 else ("llama", "brisk")
            for tool in order:
                speeds, peak = (brisk_bench if tool == "brisk" else llama_bench)(path, t, pp, tg, reps, depth)
                rss[tool] = max(rss[tool], peak)
                got[f"{tool}_pp"].append(speeds["pp"])
                got[f"{tool}_tg"].append(speeds["tg"])
            got["read"].append(read_bandwidth(t))
        row = {"model": name, "label": model_label(name), "threads": t, "depth": depth, "file_bytes": path.stat().st_size,
               "read_bytes_per_token": step, "rss_brisk": rss["brisk"], "rss_llama": rss["llama"],
               **{k: median_spread(v) for k, v in got.items()}}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict], pp: int, tg: int) -> str:
    out = [f"| file | threads | depth | decode tg{tg}, tok/s: brisk / llama-bench | brisk decode: GB/s of weights, "
           f"share of the read probe | prefill pp{pp}, tok/s: brisk / llama-bench | peak RSS brisk / "
           "llama-bench / file, MiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        (bt, bts), (lt, lts), (bp, bps), (lp, lps) = r["brisk_tg"], r["llama_tg"], r["brisk_pp"], r["llama_pp"]
        gbs, probe = r["read_bytes_per_token"] * bt / 1e9, r["read"][0]
        out.append(f"| {r['label']} | {r['threads']} | {r['depth']} | {bt:.1f} ± {bts:.1f} / {lt:.1f} ± {lts:.1f} ({bt / lt:.2f}x) | "
                   f"{gbs:.1f} of {probe:.1f} ({gbs / probe:.0%}) | {bp:.0f} ± {bps:.0f} / {lp:.0f} ± {lps:.0f} "
                   f"({bp / lp:.2f}x) | {r['rss_brisk'] / 2**20:.0f} / {r['rss_llama'] / 2**20:.0f} / "
                   f"{r['file_bytes'] / 2**20:.0f} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3,smollm2:Q4_K_M,llama1b")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("-r", "--repetitions", type=int, default=2)
    ap.add_argument("-p", type=int, default=512, help="prompt tokens (pp)")
    ap.add_argument("-n", type=int, default=128, help="generated tokens (tg)")
    ap.add_argument("-d", "--depths", default="0", help="context depths (both tools' -d), comma list")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    rows = []
    for name in args.models.split(","):
        rows += compare(name.strip(), threads, args.rounds, args.repetitions, args.p, args.n,
                        [int(d) for d in args.depths.split(",")])
    head = (f"{machine()}; commit {commit()}; {args.rounds} rounds of -r {args.repetitions}, medians ± half the range")
    print(head + "\n\n" + table(rows, args.p, args.n))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "commit": commit(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
