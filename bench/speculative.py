"""Speculative decoding on SmolLM2-135M (float32, CPU): speed and acceptance per drafter.

Two kinds of prompts: input-grounded ones (rewrite, summarize, edit code: the answer copies much
of the prompt) and open-ended ones (stories: little to copy). Every configuration decodes the same
prompts greedily, right after plain decoding of the same prompt, so each speedup compares runs
made minutes apart on the same machine. Prints a markdown table and appends it to
bench/RESULTS.md with the date, machine and commit. Not a test: targets are tracked, not asserted.

    python bench/speculative.py [--max-tokens 128] [--k 4] [--quick] [--no-save]
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import time
from pathlib import Path

import torch

from brisk.core.kv import ContiguousKV

ROOT = Path(__file__).resolve().parent.parent

PASSAGE = ("The lighthouse on Gull Point was built in 1871 from granite quarried on the island itself. "
           "For ninety years a keeper and his family lived in the cottage at its foot, trimming the wick "
           "every four hours and winding the clockwork that turned the lens. In 1961 the light was "
           "automated, the family moved to the mainland, and the cottage became a small museum that "
           "opens every summer.")
TYPOS = ("The lighthouse on Gull Point was built in 1871 from granit quarried on the iland itself. For ninety "
         "years a keeper and his famly lived in the cottage at its foot, triming the wick every four hours and "
         "winding the clockwork that turned the lens. In 1961 the light was automated, the family moved to the "
         "mainland, and the cottage became a smal museum that opens every sumer.")
COUNCIL = ("The municipal council convened on Tuesday evening to deliberate upon the proposed expansion of the "
           "northern bus depot. After considerable debate, the councillors resolved by a narrow majority to "
           "defer the decision until the transport committee has submitted its revised cost estimates.")
CODE = '''def average(values):
    total = 0
    count = 0
    for v in values:
        total = total + v
        count = count + 1
    return total / count


def largest(values):
    best = values[0]
    for v in values:
        if v > best:
            best = v
    return best
'''
GROUNDED = [
    f"Fix the spelling mistakes in the following text and return the corrected text:\n\n{TYPOS}",
    f"Rewrite the following passage in plain English, keeping every fact:\n\n{COUNCIL}",
    f"Summarize this passage in one paragraph:\n\n{PASSAGE}",
    f"Rename the variable `values` to `numbers` everywhere in this code and show the result:\n\n{CODE}",
    f"Convert this Python code to use while loops instead of for loops:\n\n{CODE}",
]
OPEN = [
    "Tell me a story about a dragon who is afraid of the dark.",
    "Write a short story about two friends who get lost in a forest.",
    "Tell me a bedtime story about a brave little mouse.",
]


def decode(llm, ids, speculator, max_tokens):
    from brisk.core import GREEDY, Session

    s = Session(llm, speculator=speculator)
    list(s.stream(ids, GREEDY, max_tokens))
    r = s.last
    return r.tokens, len(r.tokens) - 1, r.decode_s, r.spec  # the first token comes from prefill


def bench(llm, configs, prompts, max_tokens):
    """configs: name -> speculator factory (None: plain). Returns rows per (config, kind)."""
    from brisk.core.speculative import make_speculator

    specs = {name: (make_speculator(llm, d, k) if d else None) for name, (d, k) in configs.items()}
    decode(llm, llm.prompt_ids("Hi"), None, 8)  # warm-up
    acc = {}
    for kind, texts in prompts.items():
        for text in texts:
            ids = llm.prompt_ids(text)
            plain_tokens, n0, t0, _ = decode(llm, ids, None, max_tokens)
            for name, sp in specs.items():
                if sp is None:
                    toks, n, t, st = plain_tokens, n0, t0, None
                else:
                    toks, n, t, st = decode(llm, ids, sp, max_tokens)
                a = acc.setdefault((name, kind), {"n": 0, "t": 0.0, "n0": 0, "t0": 0.0, "drafted": 0,
                                                  "accepted": 0, "rounds": 0, "same": True, "each": []})
                a["n"] += n
                a["t"] += t
                a["n0"] += n0
                a["t0"] += t0
                a["same"] &= toks == plain_tokens
                a["each"].append((n / t) / (n0 / t0))
                if st:
                    for key in ("drafted", "accepted", "rounds"):
                        a[key] += st[key]
                print(f"  {kind:8} {name:16} {n / t:6.1f} tok/s  x{(n / t) / (n0 / t0):.2f}", flush=True)
    return acc


def costs(llm, draft_models):
    """Milliseconds of one target pass over 1, 2, 5 and 9 tokens, and of one draft step."""
    out = {}
    cache = llm.new_cache()
    ids = torch.tensor([llm.prompt_ids("Tell me a story.")])

    def timed(model, c, n, reps=9):
        ts = []
        for _ in range(reps):  # at the positions after the prompt, written over each time
            t = time.perf_counter()
            model(ids[:, :n], ids.shape[1], c)
            ts.append(time.perf_counter() - t)
        return sorted(ts)[reps // 2] * 1e3

    with torch.inference_mode():
        llm.model(ids, 0, cache)
        for n in (1, 2, 5, 9):
            out[f"target pass, {n} token{'s' * (n > 1)}"] = timed(llm.model, cache, n)
        for name, model in draft_models.items():
            c = ContiguousKV.for_model(model, 64)
            model(ids, 0, c)
            out[f"{name} draft step"] = timed(model, c, 1)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="the fixed K compared with auto")
    ap.add_argument("--quick", action="store_true", help="one prompt of each kind")
    ap.add_argument("--no-save", action="store_true", help="print only, do not append to RESULTS.md")
    args = ap.parse_args()

    from brisk.core import LLM
    from brisk.core.speculative import quantized_copy

    prompts = {"grounded": GROUNDED[:1] if args.quick else GROUNDED, "open": OPEN[:1] if args.quick else OPEN}
    configs = {"none": (None, None)}
    for d in ("self:int8", "self:int4", "ngram"):
        configs[f"{d} K=auto"] = (d, "auto")
        configs[f"{d} K={args.k}"] = (d, args.k)

    llm = LLM.load(None, device="cpu", dtype="float32")
    cost = costs(llm, {m: quantized_copy(llm.model, m, 64) for m in ("int8", "int4")})
    print("costs (ms):", {k: round(v, 1) for k, v in cost.items()})
    t_start = time.time()
    acc = bench(llm, configs, prompts, args.max_tokens)

    auto = LLM.load(None, device="cpu", dtype="auto")
    auto_dtype = str(auto.dtype).removeprefix("torch.")
    extra = {}
    if auto.dtype != torch.float32:  # the default dtype differs from float32 on this machine
        extra = bench(auto, {"none": (None, None), "ngram K=auto": ("ngram", "auto")}, prompts, args.max_tokens)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "?"
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    load = os.getloadavg()[0]
    head = (f"### Speculative decoding · {datetime.date.today()} · commit {commit} · {cpu}, {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} torch threads · torch {torch.__version__} · SmolLM2-135M-Instruct\n\n"
            f"Greedy, up to {args.max_tokens} tokens per prompt; {sum(map(len, prompts.values()))} prompts "
            f"({len(prompts['grounded'])} input-grounded, {len(prompts['open'])} open-ended); tok/s counts "
            f"decode steps after the first token. Speedup: against plain decoding of the same prompts in the "
            f"same run (overall: total tokens / total time; then each prompt's). Load average at the end: "
            f"{load:.1f}. Took {time.time() - t_start:.0f} s.\n\n")
    table = ("| dtype | drafter | K | prompts | tok/s | speedup | per prompt | acceptance | accepted/round "
             "| same output |\n|---|---|---|---|---|---|---|---|---|---|\n")

    def rows(acc, dtype):
        out = ""
        for (name, kind), a in acc.items():
            drafter, _, k = name.partition(" K=")
            tps, base = a["n"] / a["t"], a["n0"] / a["t0"]
            rate = f"{a['accepted'] / a['drafted']:.2f}" if a["drafted"] else "–"
            per = f"{a['accepted'] / a['rounds']:.2f}" if a["rounds"] else "–"
            each = " ".join(f"{x:.2f}" for x in a["each"])
            out += (f"| {dtype} | {drafter} | {k or '–'} | {kind} | {tps:.1f} | {tps / base:.2f}× | {each} | {rate} "
                    f"| {per} | {'yes' if a['same'] else 'NO'} |\n")
        return out

    table += rows(acc, "float32") + rows(extra, auto_dtype)
    if not extra:
        table += f"\nThe default dtype on this CPU is {auto_dtype}: the float32 ngram rows above are its rows.\n"
    table += "\nCosts (median ms): " + ", ".join(f"{k} {v:.1f}" for k, v in cost.items()) + "\n"
    print("\n" + head + table)
    if args.no_save:
        return
    with open(ROOT / "bench" / "RESULTS.md", "a") as f:
        f.write("\n" + head + table)


if __name__ == "__main__":
    main()
