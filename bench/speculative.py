"""Speculative decoding on SmolLM2-135M (CPU): speed and acceptance per drafter, float32 and the
default load (the Q4_1 GGUF kept quantized).

Two kinds of prompts: input-grounded ones (rewrite, summarize, edit code: the answer copies much
of the prompt) and open-ended ones (stories: little to copy). Each prompt is decoded greedily by
plain decoding and then by every configuration, alternating, --reps times; each configuration's
time on a prompt is the median of its reps (another process may share the CPU), and its speedup
compares with plain decoding's median on the same prompt in the same run; a second plain row
("none again", decoded last in each rep) shows how far the machine's noise alone moves a
speedup. Also measured: the cost of one target pass over T tokens (a verification pass, chain or
tree) relative to a 1-token step, per T, which bounds what any drafter can gain on this machine.
Prints markdown and appends it to bench/RESULTS.md with the date, machine and commit. Not a test:
targets are tracked, not asserted.

    python bench/speculative.py [--max-tokens 128] [--reps 3] [--drafters ngram,lookahead,self:int8,self:int4]
                                [--k 4] [--lookahead 5,3,2] [--loads float32,default] [--quick] [--no-save]
"""
from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch

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
    made = len(r.tokens) - 1 + (r.finish_reason == "eos")  # by decode passes: an EOS is made too, not kept
    passes = r.spec["passes"] if r.spec else made
    return r.tokens, len(r.tokens) - 1, r.decode_s, r.spec, (made, passes)  # the first token: from prefill


def bench(llm, configs, prompts, max_tokens, reps):
    """configs: name -> (draft, k, lookahead) or None (plain). Returns per (config, kind) totals."""
    from brisk.core.spec.build import make_speculator

    specs = {name: (make_speculator(llm, *c) if c else None) for name, c in configs.items()}
    decode(llm, llm.prompt_ids("Hi"), None, 8)  # warm-up
    acc = {}
    for kind, texts in prompts.items():
        for text in texts:
            ids = llm.prompt_ids(text)
            runs = {name: [] for name in specs}
            for _ in range(reps):  # alternate: a slow spell of the machine hits every configuration
                for name, sp in specs.items():
                    runs[name].append(decode(llm, ids, sp, max_tokens))
            plain_tokens, n0 = runs["none"][0][0], runs["none"][0][1]
            t0 = statistics.median(r[2] for r in runs["none"])
            for name, rs in runs.items():
                toks, n, _, st, (made, passes) = rs[0]
                t = statistics.median(r[2] for r in rs)
                a = acc.setdefault((name, kind), {"n": 0, "t": 0.0, "n0": 0, "t0": 0.0, "drafted": 0, "accepted": 0,
                                                  "rounds": 0, "made": 0, "passes": 0, "same": True, "each": [],
                                                  "options": {}})
                a["n"] += n
                a["t"] += t
                a["n0"] += n0
                a["t0"] += t0
                a["made"] += made
                a["passes"] += passes
                a["same"] &= all(r[0] == plain_tokens for r in rs)
                a["each"].append((n / t) / (n0 / t0))
                for r in rs:
                    for key, v in ((r[3] or {}).get("options") or {}).items():
                        a["options"][key] = a["options"].get(key, 0) + v
                if st:
                    for key in ("drafted", "accepted", "rounds"):
                        a[key] += st[key]
                print(f"  {kind:8} {name:18} {n / t:6.1f} tok/s  x{(n / t) / (n0 / t0):.2f}  "
                      f"{made / passes:.2f} tok/pass", flush=True)
    return acc


PASS_SIZES = list(range(1, 17)) + [20, 24, 32, 48, 64]


def pass_costs(llm, reps=9):
    """Median milliseconds of one target pass over T tokens after a ~100-token prompt, T in
    PASS_SIZES, sizes in a new random order each rep. T > 1 runs as a tree step (a chain-shaped
    tree: the same work as any tree of T nodes, and as a chain verification)."""
    from brisk.core.kv.base import ancestor_mask

    cache = llm.new_cache()
    ids = torch.tensor([llm.prompt_ids(OPEN[0] + " " + PASSAGE)])
    toks = torch.randint(100, 1000, (1, max(PASS_SIZES)), generator=torch.Generator().manual_seed(0))
    times = {T: [] for T in PASS_SIZES}
    order = list(PASS_SIZES)
    with torch.inference_mode():
        llm.model(ids, 0, cache)
        for _ in range(reps):
            random.shuffle(order)
            for T in order:
                tree = ancestor_mask(list(range(-1, T - 2))) if T > 1 else None
                t = time.perf_counter()
                llm.model(toks[:, :T], ids.shape[1], cache, tree=tree)
                times[T].append(time.perf_counter() - t)
    return {T: statistics.median(v) * 1e3 for T, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="decodes of each prompt per configuration (median)")
    ap.add_argument("--drafters", default="ngram,lookahead,self:int8,self:int4")
    ap.add_argument("--k", type=int, default=4, help="the fixed K compared with auto (chain drafters)")
    ap.add_argument("--lookahead", default="5,3,2", help="the fixed W,N,G compared with auto")
    ap.add_argument("--loads", default="float32,default", help="float32 (quantize none) and/or default (as stored)")
    ap.add_argument("--quick", action="store_true", help="one prompt of each kind")
    ap.add_argument("--threads", type=int, help="CPU threads (default: brisk's, the physical cores)")
    ap.add_argument("--no-save", action="store_true", help="print only, do not append to RESULTS.md")
    args = ap.parse_args()

    from brisk.core import LLM
    from brisk.core.device import set_cpu_threads

    set_cpu_threads(args.threads)

    prompts = {"grounded": GROUNDED[:1] if args.quick else GROUNDED, "open": OPEN[:1] if args.quick else OPEN}
    drafters = args.drafters.split(",")
    t_start = time.time()
    sections, costs = [], {}
    for load in args.loads.split(","):
        llm = LLM.load(None, device="cpu", dtype="float32", quantize="none" if load == "float32" else "auto")
        configs = {"none": None}
        for d in drafters:
            if d == "lookahead":
                configs["lookahead auto"] = ("lookahead", "auto", None)
                configs[f"lookahead {args.lookahead}"] = ("lookahead", "auto", args.lookahead)
            elif d.startswith("self:") and llm.quantization != "none":
                continue  # refused: a quantized copy of a quantized model would not be faster
            else:
                configs[f"{d} K=auto"] = (d, "auto", None)
                configs[f"{d} K={args.k}"] = (d, args.k, None)
        configs["none again"] = None  # plain decoding once more, last in each rep: the noise floor
        costs[load] = pass_costs(llm)
        print(load, llm.quantization, "pass ms:", {T: round(v, 1) for T, v in costs[load].items()}, flush=True)
        sections.append((load, llm.quantization, bench(llm, configs, prompts, args.max_tokens, args.reps)))
        del llm

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "?"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?")
    from brisk.core.device import cpu_threads

    head = (f"### Speculative decoding · {datetime.date.today()} · commit {commit} · {cpu}, {os.cpu_count()} cores, "
            f"{cpu_threads()} threads · "
            f"torch {torch.__version__} · SmolLM2-135M-Instruct\n\n"
            f"Greedy, up to {args.max_tokens} tokens per prompt; {sum(map(len, prompts.values()))} prompts "
            f"({len(prompts['grounded'])} input-grounded, {len(prompts['open'])} open-ended), each decoded "
            f"{args.reps}x per configuration, alternating; tok/s counts decode steps after the first token, "
            f"from the median time per prompt. Speedup: against plain decoding of the same prompts in the same "
            f"run (overall: total tokens / total time; then each prompt's). tok/pass: generated tokens per "
            f"target pass. Load average at the end: {os.getloadavg()[0]:.1f}. Took {time.time() - t_start:.0f} s."
            f"\n\n")
    table = ("| load | drafter | setting | prompts | tok/s | speedup | per prompt | tok/pass | acceptance "
             "| accepted/round | same output |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    notes = ""
    for load, quant, acc in sections:
        for (name, kind), a in acc.items():
            drafter, _, setting = name.partition(" ")
            tps, base = a["n"] / a["t"], a["n0"] / a["t0"]
            rate = f"{a['accepted'] / a['drafted']:.2f}" if a["drafted"] else "–"
            per = f"{a['accepted'] / a['rounds']:.2f}" if a["rounds"] else "–"
            each = " ".join(f"{x:.2f}" for x in a["each"])
            table += (f"| {load} ({quant}) | {drafter} | {setting or '–'} | {kind} | {tps:.1f} | {tps / base:.2f}× "
                      f"| {each} | {a['made'] / a['passes']:.2f} | {rate} | {per} | {'yes' if a['same'] else 'NO'} |\n")
            if a["options"]:
                total = sum(a["options"].values())
                notes += (f"- {load}, {name}, {kind}: rounds by choice " + ", ".join(
                    f"{k} {v / total:.0%}" for k, v in sorted(a["options"].items(), key=lambda kv: -kv[1])) + "\n")
    cost_table = "| T | " + " | ".join(str(T) for T in PASS_SIZES) + " |\n|---|" + "---|" * len(PASS_SIZES) + "\n"
    for load, cost in costs.items():
        cost_table += f"| {load} ms | " + " | ".join(f"{cost[T]:.1f}" for T in PASS_SIZES) + " |\n"
        cost_table += f"| {load} ÷ T=1 | " + " | ".join(f"{cost[T] / cost[1]:.2f}" for T in PASS_SIZES) + " |\n"
    text = (head + table + ("\nTree drafters' rounds (auto: plain steps where drafting did not pay):\n\n" + notes
                            if notes else "")
            + "\nOne target pass over T tokens (median of 9, after a 100-token prompt):\n\n" + cost_table)
    print("\n" + text)
    if not args.no_save:
        with open(ROOT / "bench" / "RESULTS.md", "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
