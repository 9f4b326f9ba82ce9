"""GGUF files from brisk against llama.cpp's own, measured by llama.cpp's own tool: KL to the float model
from `llama-perplexity --kl-divergence` on a held-out text (issue 36).

For each model, an off-grid float32 base (bench/quant.py's offgrid_gguf: a file widened from a quantized
one sits on that file's grid), then at each type:
- llama.cpp:  `llama-quantize BASE OUT TYPE`
- imatrix:    `llama-imatrix` on the calibration text, then `llama-quantize --imatrix`
- brisk rtn:  `brisk quantize BASE -o OUT --format gguf --type TYPE --method rtn`
- brisk gptq: the same with --method gptq, calibrated on the same text as the imatrix
and `llama-perplexity --kl-divergence-base` on the base, `--kl-divergence` for each file: mean KL, p99
KL, same top token, file size. The calibration text is brisk's built-in set written out as one file;
the held-out text (bench/heldout.txt by default) is not in it.

    python bench/gguf_kl.py [--models smollm2,gemma3] [--types Q4_K_M,Q6_K] [--work DIR] [-t 2]
        [--rows llama,imatrix,rtn,gptq] [--tag NAME] [--ctx 512] [--chunks N]

Files are kept in --work and reused when present (the base, the imatrix, each quantized file), so a
rerun measures only what is new; --tag names the gptq files (gptq-NAME), to compare variants of the
algorithm on the same base. llama.cpp's tools: $LLAMA_QUANTIZE, $LLAMA_IMATRIX, $LLAMA_PERPLEXITY, else
the ones `make bench-llama` builds (bench_files.llama_tool).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_files import llama_tool  # noqa: E402  (bench/, beside this script)

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "bench" / "heldout.txt"


def run(cmd: list[str]) -> str:
    """cmd's stdout and stderr together; its failure ends the bench with its output."""
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def base_gguf(name: str, work: Path) -> Path:
    from bench_files import model_path
    from quant import offgrid_gguf, widened_gguf

    src = model_path(name)
    return offgrid_gguf(widened_gguf(src, work / f"{name}-F32.gguf"), work / f"{name}-offgrid.gguf")


def calibration_file(work: Path) -> Path:
    """brisk's built-in calibration set as one text file: what llama-imatrix and brisk --calib both read."""
    from brisk.core.calibration import builtin_texts

    path = work / "calibration.txt"
    path.write_text("\n\n".join(builtin_texts()) + "\n")
    return path


def llama_quantize(base: Path, out: Path, qtype: str, threads: int, imatrix: Path | None = None) -> None:
    extra = ["--imatrix", imatrix] if imatrix else []
    tmp = out.with_suffix(".part")
    run([llama_tool("llama-quantize"), *extra, base, tmp, qtype, threads])
    os.replace(tmp, out)


def brisk_quantize(base: Path, out: Path, qtype: str, method: str, threads: int, calib: Path, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "brisk.cli.main", "quantize", base, "-o", out, "--format", "gguf", "--type", qtype,
           "--method", method, "--threads", threads, "--force"]
    run(cmd + (["--calib", calib, *extra] if method == "gptq" else []))


def kl(model: Path, logits: Path, text: Path, ctx: int, chunks: int, threads: int) -> dict:
    """llama-perplexity --kl-divergence against the base's saved logits: mean and p99 KL, same top token."""
    out = run([llama_tool("llama-perplexity"), "-m", model, "-f", text, "-c", ctx, "--chunks", chunks, "-t", threads,
               "--kl-divergence-base", logits, "--kl-divergence"])

    def num(pattern):
        m = re.search(pattern, out)
        if m is None:
            raise SystemExit(f"no {pattern!r} in llama-perplexity's output:\n{out[-2000:]}")
        return float(m.group(1))

    return {"kl_mean": num(r"Mean\s+KLD:\s+([-\d.]+)"), "kl_p99": num(r"99\.0%\s+KLD:\s+([-\d.]+)"),
            "same_top": num(r"Same top p:\s+([-\d.]+)") / 100}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--types", default="Q4_K_M")
    ap.add_argument("--rows", default="llama,imatrix,rtn,gptq")
    ap.add_argument("--tag", default="", help="suffix of the gptq files (a variant of the algorithm)")
    ap.add_argument("--work", default=str(ROOT / ".cache" / "gguf-kl"))
    ap.add_argument("--text", default=str(HELDOUT), help="the held-out text KL is measured on")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=-1)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--brisk-args", default="", help="more `brisk quantize` flags for gptq (e.g. '--samples 16')")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    calib, text, rows = calibration_file(work), Path(args.text), args.rows.split(",")
    gptq_name = "gptq" + (f"-{args.tag}" if args.tag else "")
    print(f"KL by llama-perplexity --kl-divergence, -c {args.ctx}, text {text.name}, -t {args.threads}; "
          f"calibration {calib} for imatrix and gptq", flush=True)
    for name in args.models.split(","):
        base = base_gguf(name, work)
        logits = work / f"{name}-base-c{args.ctx}-{text.stem}.kld"
        if not logits.exists():
            run([llama_tool("llama-perplexity"), "-m", base, "-f", text, "-c", args.ctx, "--chunks", args.chunks,
                 "-t", args.threads, "--kl-divergence-base", logits])
        imatrix = work / f"{name}-imatrix.gguf"
        if "imatrix" in rows and not imatrix.exists():
            run([llama_tool("llama-imatrix"), "-m", base, "-f", calib, "-o", imatrix, "-c", args.ctx, "-t", args.threads])
        print(f"\n{name} (off-grid float32 base, {base.stat().st_size / 1e6:.1f} MB)\n"
              f"| type | method | MB | KL mean | KL p99 | same top | quantize s |\n|---|---|---|---|---|---|---|", flush=True)
        for qtype in args.types.split(","):
            for row in rows:
                label = gptq_name if row == "gptq" else row
                out = work / f"{name}-{qtype}-{label}.gguf"
                seconds = float("nan")
                if not out.exists():
                    t0 = time.perf_counter()
                    if row in ("llama", "imatrix"):
                        llama_quantize(base, out, qtype, args.threads, imatrix if row == "imatrix" else None)
                    else:
                        brisk_quantize(base, out, qtype, row, args.threads, calib, args.brisk_args.split())
                    seconds = time.perf_counter() - t0
                r = kl(out, logits, text, args.ctx, args.chunks, args.threads)
                print(f"| {qtype} | {label} | {out.stat().st_size / 1e6:.2f} | {r['kl_mean']:.4f} | {r['kl_p99']:.3f} "
                      f"| {100 * r['same_top']:.1f}% | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
