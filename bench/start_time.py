"""Start time of the command line, measured from outside: each case runs as a fresh process, the
versions given alternating run by run (a busy moment of the machine hits all alike), medians
reported.

    python bench/start_time.py [CHECKOUT ...] [--reps 5] [--phases]

A CHECKOUT is a folder with cli/, core/ and quant/ (this working tree when none is given; e.g. an
older commit's `git archive COMMIT cli core quant | tar -x -C /tmp/old`). Cases: `brisk --help`,
`brisk generate --help`, a bad flag, a missing model file, a bad value, and `brisk generate "Hi"
-n 8` on the default model (warm: its GGUF header cache and native kernels built by a first,
untimed run): the time to the first byte of the answer on stdout and to the exit.

--phases: where the first token's time goes, in fresh processes (versions alternating), the
steps `brisk generate` takes timed in turn (interpreter start, the CLI's import, torch's, the
rest of the stack, the GGUF header, the load, the template, prefill and the first token).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = "import sys; from brisk.cli.main import run; sys.argv[0] = 'brisk'; run()"

CASES = {  # name -> the command's arguments
    "--help": ["--help"],
    "generate --help": ["generate", "--help"],
    "bad flag": ["generate", "--bogus"],
    "missing model": ["generate", "-m", "/nonexistent/model.gguf", "Hi"],
    "bad value": ["generate", "--temperature", "-1", "Hi"],
    "generate -n 8": ["generate", "Hi", "-n", "8", "--temperature", "0"],
}

# The phases of `brisk generate "Hi" -n 8 --temperature 0`, as cli/generate_cmd.py runs them
PHASES = r"""
import sys, time, json
t = {"start": time.perf_counter()}
import brisk.cli.main
t["cli imported"] = time.perf_counter()
import torch
t["torch imported"] = time.perf_counter()
from brisk.core.llm import LLM
from brisk.core.generate import Session
from brisk.core import checkpoint
from brisk.core.sampling import SamplingParams
t["stack imported"] = time.perf_counter()
_, path = checkpoint.resolve(None)
checkpoint._gguf_header(path)
t["GGUF header (cached)"] = time.perf_counter()
llm = LLM.load(None)
t["LLM.load (header again, mapping, model, kernels)"] = time.perf_counter()
ids = llm.prompt_ids("Hi")
t["chat template"] = time.perf_counter()
first = next(Session(llm).stream(ids, SamplingParams(temperature=0.0), 8))
t["prefill + first token"] = time.perf_counter()
print(json.dumps(t))
"""


def package_root(checkout: Path) -> Path:
    """A folder holding `brisk` -> the checkout's cli, core and quant (for PYTHONPATH)."""
    for pkg in ("cli", "core", "quant"):  # else the installed brisk would answer in its place
        if not (checkout / pkg / "__init__.py").is_file():
            sys.exit(f"error: {checkout}: no {pkg}/ package (give the folder holding cli/, core/ and quant/)")
    root = Path(tempfile.mkdtemp(prefix="brisk-start-"))
    (root / "brisk").mkdir()
    for pkg in ("cli", "core", "quant"):
        (root / "brisk" / pkg).symlink_to(checkout.resolve() / pkg)
    return root


def env_for(root: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "100"}


def timed(args: list[str], env: dict) -> tuple[float, float]:
    """(seconds to the first byte on stdout, seconds to the exit) of one run."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", RUN, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         stdin=subprocess.DEVNULL, env=env)
    first = p.stdout.read(1)
    t1 = time.perf_counter()
    p.stdout.read()
    p.wait()
    t2 = time.perf_counter()
    return (t1 - t0 if first else t2 - t0), t2 - t0


def interpreter(env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkouts", nargs="*", type=Path, default=[ROOT])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--phases", action="store_true")
    ap.add_argument("--case", action="append", choices=list(CASES), help="only these cases (repeatable)")
    a = ap.parse_args()
    roots = {str(c): package_root(c) for c in a.checkouts}
    try:
        measure(a, roots)
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)  # the symlinks only, never the checkouts


def measure(a, roots: dict) -> None:
    for root in roots.values():  # untimed: builds the header cache and native kernels if missing
        timed(CASES["generate -n 8"], env_for(root))
    if a.phases:
        runs = {name: [] for name in roots}
        for _ in range(a.reps):
            for name, root in roots.items():  # alternating
                t0 = time.perf_counter()
                r = subprocess.run([sys.executable, "-c", PHASES], env=env_for(root), capture_output=True, text=True,
                                   stdin=subprocess.DEVNULL, check=True)
                spawn = time.perf_counter() - t0
                t = json.loads(r.stdout.strip().splitlines()[-1])
                runs[name].append((interpreter(env_for(root)), spawn, t))
        for name, stamps in runs.items():
            print(f"\n{name}: phases (medians of {a.reps}, s)")
            print(f"  {'interpreter start (python -c pass)':50s} {statistics.median(s[0] for s in stamps):.3f}")
            keys = list(stamps[0][2])
            for prev, key in zip(keys, keys[1:]):
                print(f"  {key:50s} {statistics.median(s[2][key] - s[2][prev] for s in stamps):.3f}")
            print(f"  {'(whole process)':50s} {statistics.median(s[1] for s in stamps):.3f}")
        return
    cases = {case: CASES[case] for case in a.case or CASES}
    results = {name: {case: [] for case in cases} for name in roots}
    for _ in range(a.reps):
        for case, args in cases.items():
            for name, root in roots.items():  # alternating: A, B, A, B, ...
                results[name][case].append(timed(args, env_for(root)))
    print(f"medians of {a.reps} runs, s (first byte on stdout / exit)")
    print("| case | " + " | ".join(roots) + " |")
    print("|---|" + "---|" * len(roots))
    for case in cases:
        cells = []
        for name in roots:
            runs = results[name][case]
            first, end = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            cells.append(f"{first:.2f} / {end:.2f}" if case.startswith("generate -n") else f"{end:.2f}")
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
