"""`brisk bench`: prompt-processing and generation speed, like llama-bench."""
from __future__ import annotations

import contextlib
import csv
import json
import sys
from typing import Optional

import typer

from . import common as c
from .app import app


def _list(value: str, cast=str) -> list:
    from ..core.errors import BriskError

    try:
        return [cast(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        raise BriskError(f"bad list {value!r}") from None


@app.command()
def bench(
    model_pos: Optional[str] = typer.Argument(None, metavar="[MODEL]", help="Model (default: embedded SmolLM2)."),
    model: Optional[str] = c.ModelArg,
    n_prompt: str = typer.Option("512", "-p", "--n-prompt", help="Prompt lengths to time (comma list; 0 skips)."),
    n_gen: str = typer.Option("128", "-n", "--n-gen", help="Generated token counts to time (comma list; 0 skips)."),
    n_depth: str = typer.Option("0", "-d", "--n-depth", help="Comma list of context depths, as llama-bench's: "
                                "each pp/tg row runs after that many tokens already in the KV cache."),
    reps: int = typer.Option(5, "-r", "--repetitions", help="Timed repetitions after a warm-up.", min=1),
    device: str = typer.Option("auto", "--device", help="Comma list of devices."),
    dtype: str = typer.Option("auto", "--dtype", help="Comma list of dtypes, one row each."),
    quantize: str = typer.Option("auto", "--quantize", "-q", help="Comma list, one row each: auto (as stored), "
                                 "none (float), int8, int4, nf4."),
    kv_type: str = typer.Option("auto", "--kv-type", "-ctk", "--cache-type-k", help="Comma list of KV cache "
                                "types, one row each: auto | f32 | f16 | bf16 | q8_0 (as generate's --kv-type)."),
    threads: Optional[int] = c.ThreadsOpt,
    tp: int = c.TpOpt,
    draft: Optional[str] = c.DraftOpt,
    draft_k: str = c.DraftKOpt,
    lookahead: Optional[str] = c.LookaheadOpt,
    batch: Optional[str] = typer.Option(None, "--batch", help="Comma list of concurrencies, e.g. 1,4,16: instead "
                                        "of the pp/tg rows, the aggregate decode tok/s of that many sequences "
                                        "generating -n tokens each together (continuous batching, paged KV)."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
    as_csv: bool = typer.Option(False, "--csv", help="Print the rows as CSV."),
):
    """Measure prompt processing (pp) and token generation (tg) speed, first-token time and memory.

    Each tok/s is the median over -r runs ± half their range; GB/s is the weight bytes a decode
    step reads (of a mixture of experts, the routed experts only) x tg tok/s.
    """
    with c.user_errors():
        from ..core.errors import BriskError
        from ..core.load_options import check_load_options

        if model and model_pos:
            raise BriskError("model given twice (positional and --model)")
        for dev, dt, quant in [(v, d, q) for v in _list(device) for d in _list(dtype) for q in _list(quantize)]:
            check_load_options(model or model_pos, dev, dt, quant, threads, tp)
        from ..core import benchmark
        from ..core.device import set_cpu_threads

        set_cpu_threads(threads)
        draft_options = c.check_draft(draft, draft_k, lookahead)
        out = _Rows("json" if as_json else "csv" if as_csv else "table", tp)
        pps, tgs, depths = _list(n_prompt, int), _list(n_gen, int), _list(n_depth, int)
        from ..core.load_options import check_kv_type

        kv_types = [check_kv_type(k) for k in _list(kv_type)] or ["auto"]
        batches = _list(batch, int) if batch else []
        if batch and (draft or not batches or min(batches) < 1):
            raise BriskError("--batch takes concurrencies >= 1 (e.g. 1,4,16) and does not combine with --draft")
        if tp != 1 and len(_list(device)) * len(_list(dtype)) * len(_list(quantize)) * len(kv_types) > 1:
            # the followers load the model once, at the start
            raise BriskError("--tp runs one model (one --device, --dtype, --quantize, --kv-type)")
        if not depths or min(depths) < 0:
            raise BriskError(f"-d/--n-depth {n_depth!r}: use depths >= 0, e.g. 0,2048")
        if max(depths) and (batches or draft):
            raise BriskError("-d/--n-depth does not combine with --batch or --draft")
        if batches:
            pps = [benchmark.BATCH_PROMPT + max(tgs + [0])]  # sets the context: what one sequence needs
        for dev in _list(device):
            for dt, quant, kv in [(d, q, k) for d in _list(dtype) for q in _list(quantize) for k in kv_types]:
                llm = c.load_llm(model or model_pos, dev, dt,
                                 max(depths) + max(pps + tgs + [16]) + 1 + (128 if draft else 0),
                                 quiet=as_json or as_csv, quantize=quant, kv_type=kv, tp=tp)  # --draft: room for its prompt
                need = max(depths) + max(pps + tgs + [0]) + 1
                if need > llm.ctx:  # the load caps the context at the model's positions
                    raise BriskError(f"-d/--n-depth {max(depths)}: with {max(pps + tgs + [0])} tokens timed it needs "
                                     f"{need} positions; {llm.name} holds {llm.ctx}")
                for d in depths:
                    at = f" after {d} tokens" if d else ""
                    for p in ([] if batches else pps):
                        with _measuring(f"prefill of {p} tokens{at}", out.form):
                            rows = benchmark.run(llm, p, 0, reps, d)
                        out.add(rows)  # after the spinner is gone: the row goes to stdout
                    for n in tgs:
                        with _measuring(f"decode of {n} tokens{at}", out.form):
                            rows = (benchmark.run_batch(llm, batches, n, reps) if batches
                                    else benchmark.run(llm, 0, n, reps, d))
                        out.add(rows)
                if draft:  # plain and speculative decoding of real text, one pair of rows per -n
                    speculator = c.load_speculator(llm, draft_options, quiet=True)
                    for n in tgs:
                        out.add(benchmark.run_speculative(llm, speculator, n, reps) if n else [])
                del llm
    out.finish()


def _measuring(what: str, form: str):
    """A transient spinner on a terminal while a row is measured (a pp512 row takes tens of seconds
    on a small CPU), with the repetitions done; nothing in JSON/CSV form or off a terminal."""
    if form != "table" or not sys.stderr.isatty():
        return contextlib.nullcontext()
    return c.loading_bar(f"measuring {what}")


class _Rows:
    """The rows, printed as each is measured (as llama-bench does) in table and CSV form; JSON
    at the end (one document)."""

    COLUMNS = ("model", "device", "dtype", "quant", "kv", "test", "tok/s", "ttft (s)", "model MB", "GB/s", "peak mem MB")

    def __init__(self, form: str, ranks: int = 1):
        self.form, self.ranks, self.rows = form, ranks, []

    def add(self, rows) -> None:
        for r in rows:
            if not self.rows:
                self._header(r)
            self.rows.append(r)
            if self.form == "table":
                cells = (r.model, r.device, r.dtype, r.quant, r.kv_type, r.test, f"{r.tok_s:.1f} ± {r.spread:.1f}",
                         f"{r.ttft_s:.3f}", f"{r.model_bytes / 1e6:.0f}", f"{r.gb_s:.1f}", f"{r.peak_mem_bytes / 1e6:.0f}")
                print("| " + " | ".join(cells) + " |", flush=True)
            elif self.form == "csv":
                self.csv.writerow(r.to_dict())
                sys.stdout.flush()

    def _header(self, first) -> None:
        if self.form == "table":
            peak = "peak mem MB" if first.device.startswith("cuda") else "peak RSS MB (process)"
            ranks = f" x {self.ranks} ranks (--tp: model MB, GB/s and memory are rank 0's)" if self.ranks > 1 else ""
            from ..core.device import cpu_threads  # read after the load: --tp shares the cores out

            print(f"brisk bench · {cpu_threads()} threads{ranks}", flush=True)
            print("| " + " | ".join(self.COLUMNS[:-1] + (peak,)) + " |")
            print("|" + "---|" * len(self.COLUMNS), flush=True)
        elif self.form == "csv":
            self.csv = csv.DictWriter(sys.stdout, fieldnames=list(first.to_dict()))
            self.csv.writeheader()

    def finish(self) -> None:
        if self.form == "json":
            print(json.dumps([r.to_dict() for r in self.rows], indent=1))
