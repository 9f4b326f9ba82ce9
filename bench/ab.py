"""A/B the CPU speed of two versions of brisk in one process: the working tree against another
checkout (e.g. `git worktree add /tmp/old <commit>`), imported side by side under another package
name, on the same model, the two versions alternating call by call (so a busy moment of the
machine hits both alike), medians reported.

    python bench/ab.py /tmp/old [--model PATH] [--threads N] [--quantize auto|none] [--dtype float32] [--reps 30]

Rows: prefill of 128 tokens (one call each), one batch-1 decode step (400 steps, positions
0-399), and one decode step of 16 sequences in the batching engine (aggregate tok/s).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def import_other(checkout: Path):
    """The other checkout's core as `brisk_b.core` (its quant and cli beside it)."""
    root = Path(tempfile.mkdtemp()) / "brisk_b"
    root.mkdir()
    for pkg in ("core", "quant", "cli"):
        (root / pkg).symlink_to(checkout.resolve() / pkg)
    sys.path.insert(0, str(root.parent))
    return importlib.import_module("brisk_b.core")


def api(core):
    """What each version calls its LLM, single-step decoder and batching engine, and how it makes
    a contiguous cache of n slots (before the one-engine-path change: model.new_cache, the LLM in
    core/engine.py, the engine in core/scheduler.py)."""
    def module(*names):
        for n in names:
            if importlib.util.find_spec(f"{core.__name__}.{n}") is not None:
                return importlib.import_module(f"{core.__name__}.{n}")
    llm = module("llm", "engine")
    batching = module("batching", "scheduler")
    graph = module("cuda_graph")
    if "max_len" in llm.LLM.new_cache.__code__.co_varnames:
        new_cache = lambda l, n: l.new_cache(n)  # noqa: E731
    else:
        new_cache = lambda l, n: l.model.new_cache(n)  # noqa: E731
    return llm.LLM, graph.decode_step, batching.Engine, batching.Request, new_cache


def alternate(fns: dict, n: int) -> dict:
    """Each function n times, alternating (the order flipped every round); their timings."""
    out = {k: [] for k in fns}
    items = list(fns.items())
    for i in range(n):
        for name, fn in items if i % 2 == 0 else items[::-1]:
            t = time.perf_counter()
            fn(i)
            out[name].append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("other", type=Path)
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--model", default=None, help="a model path (default: the embedded default model)")
    ap.add_argument("--threads", type=int, default=None, help="torch's and the native kernels' threads")
    a = ap.parse_args()
    if a.threads:
        import os
        os.environ["BRISK_THREADS"] = str(a.threads)  # both versions' kernel libraries read it at load
        torch.set_num_threads(a.threads)
    import brisk.core as core_a

    versions = {"this tree": api(core_a), str(a.other): api(import_other(a.other))}
    loaded = {}
    for name, (LLM, decode_step, Engine, Request, new_cache) in versions.items():
        llm = LLM.load(a.model, device="cpu", dtype=a.dtype, quantize=a.quantize)
        cache = (lambda n, llm=llm, nc=new_cache: nc(llm, n))
        loaded[name] = llm, cache
    ids = torch.randint(0, 40000, (1, 128), generator=torch.Generator().manual_seed(0)).tolist()[0]
    ids = [i % loaded["this tree"][0].config.vocab_size for i in ids]
    rows = {}
    with torch.inference_mode():
        # prefill: the same 128 tokens from position 0, each version through its own Session
        sessions = {}
        for name, (llm, _) in loaded.items():
            gen = importlib.import_module(type(llm).__module__.rsplit(".", 1)[0] + ".generate")
            sessions[name] = gen.Session(llm)

        def prefill(s):
            def run(i):
                s.ids = []
                s.prefill(ids)
            return run
        t = alternate({n: prefill(s) for n, s in sessions.items()}, a.reps)
        rows["pp128"] = {n: 128 / statistics.median(v) for n, v in t.items()}
        # batch-1 decode steps
        steps = {n: versions[n][1](llm.model, cache(512)) for n, (llm, cache) in loaded.items()}
        t = alternate({n: (lambda i, s=s: s(5, i)) for n, s in steps.items()}, 400)
        rows["tg step"] = {n: 1 / statistics.median(v) for n, v in t.items()}
        # 16 sequences decoding in the batching engine: engine steps alternating
        engines = {}
        for n, (llm, _) in loaded.items():
            Engine, Request = versions[n][2], versions[n][3]
            e = Engine(llm, max_batch=16, kv_tokens=16 * 200)
            for j in range(16):
                e.add(Request(ids[j:j + 32], max_tokens=150, ignore_eos=True))
            for _ in range(4):  # the prompts' prefill, then a few decode steps to warm up
                e.step()
            engines[n] = e
        t = alternate({n: (lambda i, e=e: e.step()) for n, e in engines.items()}, 120)
        rows["tg x16 step"] = {n: 16 / statistics.median(v) for n, v in t.items()}
    print(f"quantize={a.quantize} dtype={a.dtype} threads={torch.get_num_threads()}")
    names = list(versions)
    for row, v in rows.items():
        print(f"{row:12s} " + "  ".join(f"{n}: {v[n]:8.1f} tok/s" for n in names) + f"   ratio {v[names[0]] / v[names[1]]:.3f}")


if __name__ == "__main__":
    main()
