"""Options and helpers shared by the subcommands."""
from __future__ import annotations

import contextlib
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from ..core.errors import BriskError
from ..quant.settings import SettingError

err_console = Console(stderr=True, highlight=False)

ModelArg = typer.Option(None, "--model", "-m", help="Model: HF folder, hub id, .gguf file (default: embedded SmolLM2).")
DeviceOpt = typer.Option("auto", "--device", help="auto | cpu | cuda")
ThreadsOpt = typer.Option(None, "--threads", help="CPU threads to compute with (default: the physical cores).")
DtypeOpt = typer.Option("auto", "--dtype", help="auto | float32 | bfloat16 | float16 (auto: bf16 on GPU, fastest on CPU)")
QuantizeOpt = typer.Option("auto", "--quantize", "-q", help="auto: run the checkpoint as stored (a GGUF's weights stay in "
                           "their blocks on the CPU: README, \"What it runs\" lists the types; GPTQ/AWQ/bitsandbytes stay in "
                           "their formats) | none: widen to --dtype | "
                           "int8 | int4 | nf4: quantize float weights at load.")
KvTypeOpt = typer.Option("auto", "--kv-type", "-ctk", "--cache-type-k", help="How the KV cache stores keys and "
                         "values: auto (the activations' dtype) | f32 | f16 | bf16 | q8_0 (GGUF's 8-bit blocks, about "
                         "a quarter of f32). Other than auto: CPU only. -ctk/--cache-type-k as llama.cpp's (one "
                         "type for keys and values).")
TpOpt = typer.Option(1, "--tp", help="Tensor parallelism: split the model over N ranks (processes brisk starts on "
                     "this machine; NCCL on GPUs, gloo on the CPU), each holding 1/N of the weights. Float weights; "
                     "under torchrun, the ranks it starts (docs/usage.md).")
CtxOpt = typer.Option(None, "--ctx", "-c", "--ctx-size", help="Context length to allocate (default: min(4096, model's)).", min=16)
TempOpt = typer.Option(None, "--temperature", "-t", help="0 = greedy. Default: the model's recommended setting, else 0.3.")
TopKOpt = typer.Option(None, "--top-k", help="Keep the k most likely tokens (0 = off). Default: the model's, else 40.")
TopPOpt = typer.Option(None, "--top-p", help="Nucleus sampling mass (1 = off). Default: the model's, else 0.9.")
MinPOpt = typer.Option(None, "--min-p", help="Drop tokens below min-p x the top probability (0 = off). Default: the model's, else 0.1.")
RepOpt = typer.Option(None, "--repetition-penalty", help="> 1 discourages repeats (1 = off). Default: the model's "
                      "generation config, else 1.")
PresenceOpt = typer.Option(None, "--presence-penalty", help="In [-2, 2]: subtracted once from the logit of every "
                           "token the answer already holds (OpenAI's). Default 0.")
FrequencyOpt = typer.Option(None, "--frequency-penalty", help="In [-2, 2]: subtracted from a token's logit per time "
                            "the answer already holds it (OpenAI's). Default 0.")
LoopOpt = typer.Option(True, "--loop-stop/--no-loop-stop", help="End an answer that has fallen into a word-for-word "
                       "loop (small models do). Off for output that repeats on purpose.")
SeedOpt = typer.Option(None, "--seed", help="Random seed; the same seed gives the same output.")
MaxTokOpt = typer.Option(256, "--max-tokens", "-n", "--n-predict", help="Most tokens to generate.", min=1)
StopOpt = typer.Option(None, "--stop", help="Stop when this text appears (repeatable); it is not printed.")
DraftOpt = typer.Option(None, "--draft", help="Speculative decoding. The draft: a smaller model with the same "
                        "tokenizer, self:int8 | self:int4 (a quantized copy of the model), ngram (continues text "
                        "seen earlier in the prompt or answer: fast when the answer copies its input), "
                        "lookahead (no draft model: a Jacobi window of guesses and an n-gram pool, verified as a "
                        "tree in one pass; falls back to plain decoding where it does not pay), or heads:PATH "
                        "(draft heads made for this model by `brisk distill -o PATH`: a tree of their guesses, "
                        "verified in one pass). Output is unchanged.")
DraftKOpt = typer.Option("auto", "--draft-k", help="Tokens drafted per round: a number, or auto (adapts to how many "
                         "get accepted and what a draft costs). heads:PATH: a fixed tree of that many nodes "
                         "(auto: sized by measured speed). Not for --draft lookahead.")
LookaheadOpt = typer.Option(None, "--lookahead", help="--draft lookahead's size W,N,G: window W (0: none), n-gram "
                            "size N, n-grams verified per round G, e.g. 5,3,2. Default: auto (measured as it runs; "
                            "plain steps where lookahead does not pay).")


@contextlib.contextmanager
def user_errors():
    """BriskError, or a BRISK_ setting brisk cannot read -> 'error: ...' on stderr (options named as
    flags) and exit 1, never a traceback."""
    try:
        yield
    except (BriskError, SettingError) as e:
        message = e.cli_message() if isinstance(e, BriskError) else str(e)
        err_console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True, markup=True) \
            if sys.stderr.isatty() else print(f"error: {message}", file=sys.stderr)
        raise typer.Exit(1)


def sampling_params(llm, temperature, top_k, top_p, min_p, repetition_penalty, seed, stop_loops: bool = False,
                    presence_penalty=None, frequency_penalty=None):
    """Flags override the model's own settings (generation_config.json, a GGUF's general.sampling.*),
    which override brisk's defaults (core/sampling.py)."""
    from ..core.sampling_params import SamplingParams

    gen = llm.checkpoint.generation if llm is not None else {}
    d = SamplingParams()
    pick = lambda flag, key, default: flag if flag is not None else gen.get(key, default)  # noqa: E731
    if llm is not None and gen.get("do_sample") is False and temperature is None:
        temperature = 0.0
    return SamplingParams(
        temperature=float(pick(temperature, "temperature", d.temperature)),
        top_k=int(pick(top_k, "top_k", d.top_k)), top_p=float(pick(top_p, "top_p", d.top_p)),
        min_p=float(pick(min_p, "min_p", d.min_p)),
        repetition_penalty=float(pick(repetition_penalty, "repetition_penalty", d.repetition_penalty)),
        seed=seed, stop_loops=stop_loops, presence_penalty=float(presence_penalty or 0.0),
        frequency_penalty=float(frequency_penalty or 0.0)).validate()


def sampling_summary(p) -> dict:
    """The settings an answer was sampled with, for --json and /stats."""
    extra = {k: getattr(p, k) for k in ("presence_penalty", "frequency_penalty") if getattr(p, k)}
    if p.logit_bias:
        extra["logit_bias"] = {str(t): b for t, b in p.logit_bias.items()}
    if p.greedy:
        return {"temperature": 0.0, "repetition_penalty": p.repetition_penalty, **extra, "stop_loops": p.stop_loops}
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
            "repetition_penalty": p.repetition_penalty, **extra, "seed": p.seed, "stop_loops": p.stop_loops}


LOOP_NOTE = "(stopped: the answer repeats itself word for word; --no-loop-stop lets it run)"


def warning_line(message, category) -> str:
    """A warning as one line on stderr; the kernels' first-run build is a note, not a warning."""
    from ..quant.native import BuildNotice

    return f"{'note' if issubclass(category, BuildNotice) else 'warning'}: {message}"


def load_llm(model: Optional[str], device: str, dtype: str, ctx: Optional[int], quiet: bool = False,
             quantize: str = "auto", threads: Optional[int] = None, kv_type: str = "auto", tp: int = 1):
    """LLM.load with a spinner on a terminal; the loader's warnings (e.g. a weight type without a
    quantized kernel) become one 'warning:' line each."""
    import warnings

    from ..core.load_options import check_load_options

    check_load_options(model, device, dtype, quantize, threads, tp)  # a wrong value fails before torch loads
    from ..core.device import set_cpu_threads
    from ..core.llm import LLM

    set_cpu_threads(threads)

    def say(message, category, *_, **__):  # at once, above the spinner: some say a long wait follows
        if not quiet and issubclass(category, UserWarning):  # not libraries' Resource/Deprecation noise
            err_console.print(warning_line(message, category), markup=False, highlight=False, soft_wrap=True)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = say
        if quiet or not sys.stderr.isatty():
            llm = LLM.load(model, device=device, dtype=dtype, ctx=ctx, quantize=quantize, kv_type=kv_type, tp=tp)
        else:
            with loading_bar(f"loading {model or 'default model'}"):
                llm = LLM.load(model, device=device, dtype=dtype, ctx=ctx, quantize=quantize, kv_type=kv_type, tp=tp)
    return llm


@contextlib.contextmanager
def loading_bar(what: str):
    """A spinner for `what` on stderr, and a bar under it for each long step the loader reports
    (core/progress.py): widening a GGUF once, quantizing at load."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..core import progress

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=True) as bar:
        bar.add_task(what, total=None)
        steps: dict[str, int] = {}

        def step(name: str, done: int, total: int) -> None:
            if name not in steps:
                steps[name] = bar.add_task(name, total=total)
            bar.update(steps[name], completed=done, total=total)

        with progress.listening(step):
            yield


def check_draft(draft: Optional[str], draft_k: str, lookahead: Optional[str] = None):
    """--draft, --draft-k and --lookahead checked (core/spec/options.py) before any model loads:
    the options for load_speculator, or None without --draft."""
    from ..core.spec.options import parse_draft_options

    return parse_draft_options(draft, draft_k, lookahead)


def load_speculator(llm, options, quiet: bool = False):
    """The Speculator for check_draft's options, or None; its warnings become one 'warning:' line
    each on stderr."""
    import warnings

    if options is None or not options.draft:
        return None
    from ..core.spec.build import build_speculator

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if quiet or not sys.stderr.isatty():
            speculator = build_speculator(llm, options)
        else:
            with err_console.status(f"preparing the draft ({options.draft})…", spinner="dots"):
                speculator = build_speculator(llm, options)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    return speculator

