"""A/B the CPU speed of two versions of brisk in one process: the working tree against another
checkout (e.g. `git worktree add /tmp/old <commit>`), imported side by side under another package
name, timed in alternating rounds on the same loaded weights' kinds, medians reported.

    python bench/ab.py /tmp/old [--rounds 7] [--quantize auto|none] [--dtype float32]

Rows: prefill of 128 tokens, batch-1 decode of 64 tokens, and 16 sequences decoding at once
through the batching engine (aggregate tok/s), each with each version's own benchmark functions.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
from pathlib import Path

import torch


def import_other(checkout: Path):
    """The other checkout's packages as `brisk_b.core`, `brisk_b.quant`, `brisk_b.cli`."""
    root = Path(tempfile.mkdtemp()) / "brisk_b"
    root.mkdir()
    for pkg in ("core", "quant", "cli"):
        (root / pkg).symlink_to(checkout.resolve() / pkg)
    sys.path.insert(0, str(root.parent))
    return importlib.import_module("brisk_b.core.llm" if (checkout / "core/llm.py").exists() else "brisk_b.core.engine"), \
        importlib.import_module("brisk_b.core.benchmark")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("other", type=Path)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    from brisk.core import benchmark as bench_a
    from brisk.core.llm import LLM as LLM_A
    llm_mod_b, bench_b = import_other(a.other)
    versions = {"this tree": (LLM_A.load(None, device="cpu", dtype=a.dtype, quantize=a.quantize), bench_a),
                str(a.other): (llm_mod_b.LLM.load(None, device="cpu", dtype=a.dtype, quantize=a.quantize), bench_b)}
    tests = {
        "pp128": lambda llm, b: 128 / b.time_prefill(llm, 128, torch.Generator().manual_seed(0)),
        "tg64": lambda llm, b: 64 / b.time_decode(llm, 64),
        "tg32 x16": lambda llm, b: (lambda e: e.stats.decode_tokens / e.stats.decode_s)(
            b.time_batch(llm, 16, 32, torch.Generator().manual_seed(0))[0]),
    }
    results = {(v, t): [] for v in versions for t in tests}
    for name, (llm, b) in versions.items():  # warm-up
        for fn in tests.values():
            fn(llm, b)
    for r in range(a.rounds):
        order = list(versions.items()) if r % 2 == 0 else list(versions.items())[::-1]
        for t, fn in tests.items():
            for name, (llm, b) in order:
                with torch.inference_mode():
                    results[(name, t)].append(fn(llm, b))
    print(f"quantize={a.quantize} dtype={a.dtype} rounds={a.rounds} threads={torch.get_num_threads()}")
    names = list(versions)
    for t in tests:
        meds = [statistics.median(results[(v, t)]) for v in names]
        print(f"{t:10s} " + "  ".join(f"{v}: {m:8.1f} tok/s" for v, m in zip(names, meds))
              + f"   ratio {meds[0] / meds[1]:.3f}")


if __name__ == "__main__":
    main()
