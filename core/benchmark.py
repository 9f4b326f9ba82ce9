"""llama-bench-style measurements: prompt processing and token generation speed, memory."""
from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass

import torch

from .cuda_graph import decode_step
from .model import LAST
from .progress import track


@dataclass
class BenchRow:
    model: str
    device: str
    dtype: str
    test: str  # "pp512", "tg128"
    tok_s: float
    spread: float  # half the range of the repetitions, tok/s
    ttft_s: float
    model_bytes: int
    gb_s: float  # bytes the step reads per second (weights for tg, approx.; an MoE's routed experts only)
    peak_mem_bytes: int
    quant: str = "none"  # the weight formats in use, e.g. "int4+int8"
    acceptance: float | None = None  # speculative decoding rows: drafts accepted / drafted
    kv_type: str = "f32"  # how the KV cache stores its values (--kv-type)

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def reset_peak_memory(device) -> None:
    """Each row reports its own peak on CUDA; the CPU's peak RSS is the process's so far."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@torch.inference_mode()
def fill_context(llm, cache, depth: int, gen: torch.Generator) -> None:
    """depth random tokens into positions 0..depth-1 of cache (llama-bench's -d: the timed tokens
    come after them, attending over them). Prefill and decode only write past depth, so one fill
    serves every repetition."""
    ids = torch.randint(0, llm.config.vocab_size, (1, depth), generator=gen).to(llm.device)
    for s in range(0, depth, 512):
        llm.model(ids[:, s:s + 512], s, cache, logit_rows=LAST)


@torch.inference_mode()
def time_prefill(llm, n_prompt: int, gen: torch.Generator, cache, depth: int = 0) -> float:
    ids = torch.randint(0, llm.config.vocab_size, (1, n_prompt), generator=gen).to(llm.device)
    _sync(llm.device)
    t = time.perf_counter()
    for s in range(0, n_prompt, 512):
        llm.model(ids[:, s:s + 512], depth + s, cache, logit_rows=LAST)
    _sync(llm.device)
    return time.perf_counter() - t


@torch.inference_mode()
def time_decode(llm, n_gen: int, step, depth: int = 0) -> float:
    """n_gen greedy steps after one token at position depth, as generation runs them (graph
    replays on CUDA; the argmax's .item() is the one host sync per step, as in generation).
    `step`: a decode_step() reused across calls (its captured graphs with it)."""
    tok = llm.tokenizer.bos_id or 1
    step(tok, depth)
    _sync(llm.device)
    t = time.perf_counter()
    for pos in range(depth + 1, depth + n_gen + 1):
        tok = int(step(tok, pos).argmax())
    _sync(llm.device)
    return time.perf_counter() - t


def run(llm, n_prompt: int, n_gen: int, reps: int, depth: int = 0) -> list[BenchRow]:
    """pp{n_prompt} and tg{n_gen} rows (0 skips one), each after `depth` tokens of context."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    model_bytes = llm.load_info.param_bytes
    common = dict(model=llm.name, device=str(llm.device), dtype=str(llm.dtype).removeprefix("torch."),
                  model_bytes=model_bytes, quant=llm.quantization, kv_type=llm.kv_type.name)
    at = f" @ d{depth}" if depth else ""  # as llama-bench names its rows
    reset_peak_memory(llm.device)
    if n_prompt:
        cache = llm.new_cache(depth + n_prompt + 1)
        fill_context(llm, cache, depth, gen)
        time_prefill(llm, min(n_prompt, 64), gen, cache, depth)  # warm-up
        speeds = [n_prompt / time_prefill(llm, n_prompt, gen, cache, depth)
                  for _ in track(range(reps), f"pp{n_prompt}{at}", reps)]
        med = statistics.median(speeds)
        rows.append(BenchRow(test=f"pp{n_prompt}{at}", tok_s=med, spread=(max(speeds) - min(speeds)) / 2,
                             ttft_s=n_prompt / med, gb_s=model_bytes * med / n_prompt / 1e9,
                             peak_mem_bytes=peak_memory(llm.device), **common))
        del cache
    if n_gen:
        cache = llm.new_cache(depth + n_gen + 1)
        fill_context(llm, cache, depth, gen)
        step = decode_step(llm.model, cache)
        time_decode(llm, n_gen, step, depth)  # warm-up (captures the CUDA graphs)
        speeds = [n_gen / time_decode(llm, n_gen, step, depth) for _ in track(range(reps), f"tg{n_gen}{at}", reps)]
        med = statistics.median(speeds)
        rows.append(BenchRow(test=f"tg{n_gen}{at}", tok_s=med, spread=(max(speeds) - min(speeds)) / 2,
                             ttft_s=1 / med, gb_s=llm.load_info.step_bytes * med / 1e9,
                             peak_mem_bytes=peak_memory(llm.device), **common))
    return rows


BATCH_PROMPT = 32  # prompt tokens per sequence in the --batch rows: the rows measure decoding


@torch.inference_mode()
def time_batch(engine, concurrency: int, n_gen: int, gen: torch.Generator):
    """`concurrency` sequences of BATCH_PROMPT random tokens, each generating n_gen tokens, all at
    once through the continuous-batching engine. Returns the engine's stats for this run (they
    time its decode steps) and the sequences."""
    from .batching import Request
    from .batching.engine import EngineStats

    llm = engine.llm
    engine.stats = EngineStats()
    prompts = torch.randint(0, llm.config.vocab_size, (concurrency, BATCH_PROMPT), generator=gen).tolist()
    _sync(llm.device)
    seqs = [engine.add(Request(p, max_tokens=n_gen, ignore_eos=True)) for p in prompts]
    while engine.has_work():
        engine.step()
    _sync(llm.device)
    return engine.stats, seqs


def run_batch(llm, concurrencies: list[int], n_gen: int, reps: int) -> list[BenchRow]:
    """One row per concurrency: aggregate decode tok/s (tokens of all sequences per second of
    decode steps), the median of reps runs; ttft is the mean first-token time of the sequences.
    One engine per concurrency, its pool just what the sequences need, warmed up first (on CUDA
    that captures its step graphs)."""
    from .batching import Engine

    gen = torch.Generator().manual_seed(0)
    model_bytes = llm.load_info.param_bytes
    common = dict(model=llm.name, device=str(llm.device), dtype=str(llm.dtype).removeprefix("torch."),
                  model_bytes=model_bytes, quant=llm.quantization, kv_type=llm.kv_type.name)
    rows = []
    for c in concurrencies:
        engine = Engine(llm, max_batch=c, kv_tokens=c * (BATCH_PROMPT + n_gen))
        time_batch(engine, c, min(n_gen, 4), gen)  # warm-up
        reset_peak_memory(llm.device)
        runs = [time_batch(engine, c, n_gen, gen) for _ in track(range(reps), f"tg{n_gen} x{c}", reps)]
        speeds = [st.decode_tokens / st.decode_s for st, _ in runs]
        med = statistics.median(speeds)
        ttft = statistics.mean(s.result.ttft_s for _, seqs in runs for s in seqs)
        rows.append(BenchRow(test=f"tg{n_gen} x{c}", tok_s=med, spread=(max(speeds) - min(speeds)) / 2,
                             ttft_s=ttft, gb_s=model_bytes * med / c / 1e9,
                             peak_mem_bytes=peak_memory(llm.device), **common))
        del engine
    return rows


# ---------------------------------------------------------------- `brisk bench --draft`

BENCH_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def run_speculative(llm, speculator, n_gen: int, reps: int) -> list[BenchRow]:
    """Greedy generation of up to n_gen tokens from one chat prompt, plain then speculative:
    speculation's speed depends on the text, so both rows decode real text (the tg row of
    `brisk bench` feeds back argmaxes of random context)."""
    from .generate import Session
    from .sampling import GREEDY

    ids = llm.prompt_ids(BENCH_PROMPT)
    rows = []
    for sp in (None, speculator):
        s = Session(llm, speculator=sp)
        results = []
        for i in range(reps + 1):  # the first run warms up (and lets --draft-k auto learn the costs)
            list(s.stream(ids, GREEDY, n_gen))
            results.append(s.last)
        results = results[1:]
        speeds = [r.decode_tps for r in results]
        med = statistics.median(speeds)
        test, acc = f"tg{n_gen} text", None
        if sp is not None:
            drafted = sum(r.spec["drafted"] for r in results)
            acc = sum(r.spec["accepted"] for r in results) / drafted if drafted else 0.0
            test = f"tg{n_gen} {sp.describe()}, {acc:.0%} acc."
        rows.append(BenchRow(model=llm.name, device=str(llm.device), dtype=str(llm.dtype).removeprefix("torch."),
                             quant=llm.quantization, kv_type=llm.kv_type.name,
                             test=test, tok_s=med, spread=(max(speeds) - min(speeds)) / 2,
                             ttft_s=statistics.median(r.ttft_s for r in results),
                             model_bytes=llm.load_info.param_bytes, gb_s=llm.load_info.param_bytes * med / 1e9,
                             peak_mem_bytes=peak_memory(llm.device), acceptance=acc))
    return rows
