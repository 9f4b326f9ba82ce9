"""`brisk quantize`: write a quantized Hugging Face checkpoint (GPTQ, AWQ, bitsandbytes NF4/FP4/int8), or a
GGUF file in one of llama.cpp's mixes (--format gguf)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from . import common as c
from .app import app
from .resumable_job import JobProgress, run_resumable_job


@app.command()
def quantize(
    model: Optional[str] = typer.Argument(None, metavar="[MODEL]",
                                          help="HF folder, hub id, .gguf file (default: embedded SmolLM2)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder (a Hugging Face checkpoint), or the .gguf file "
                             "(--format gguf)."),
    method: Optional[str] = typer.Option(None, "--method", help="gptq | awq | nf4 | fp4 | int8; --format gguf: gptq "
                                         "(the default there: calibrated, on llama.cpp's grids) or rtn (llama-quantize's "
                                         "own blocks, in seconds)."),
    fmt: str = typer.Option("hf", "--format", help="hf: a Hugging Face folder (default); gguf: one GGUF file that "
                            "llama.cpp, ollama and brisk run (from a Hugging Face folder of llama, qwen2, qwen3, "
                            "gemma3 or phi3, or a GGUF model of F32, F16, BF16 or Q8_0 tensors)."),
    qtype: Optional[str] = typer.Option(None, "--type", help="--format gguf: llama.cpp's mix, Q4_K_M, Q5_K_M, Q6_K, "
                                        "Q8_0, Q4_0, Q3_K_M or Q2_K: the same tensor types as llama-quantize "
                                        "(--method rtn: its blocks too, without an imatrix); or F32, F16, BF16: "
                                        "a Hugging Face folder converted, nothing quantized."),
    bits: Optional[int] = typer.Option(None, "--bits", help="gptq: 2, 3, 4 (default) or 8. awq/nf4/fp4: 4; int8: 8."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="gptq: -1, 32, 64, 128; awq: 32, 64, 128. "
                                             "Default: 128, or the largest that divides every layer."),
    sym: Optional[bool] = typer.Option(None, "--sym/--asym", help="gptq: symmetric (default) or asymmetric grid."),
    act_order: Optional[bool] = typer.Option(None, "--act-order/--no-act-order",
                                             help="gptq: quantize columns by decreasing activation size (desc_act)."),
    damp: Optional[float] = typer.Option(None, "--damp", help="gptq: Hessian dampening, a fraction of its mean "
                                         "diagonal (default 0.01)."),
    double_quant: Optional[bool] = typer.Option(None, "--double-quant/--no-double-quant",
                                                help="nf4/fp4: quantize the block scales too (default off)."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Calibration text (gptq, awq, nf4, fp4, int8): a text file, or .jsonl "
                                         "with a \"text\" field per line. Default: brisk's built-in set."),
    samples: Optional[int] = typer.Option(None, "--samples", help="Calibration sequences (default 32). nf4/fp4/int8: 0 "
                                       "rounds to nearest as bitsandbytes does (seconds, not minutes; lower quality)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Calibration tokens per sequence (default 256)."),
    embedding: Optional[str] = typer.Option(None, "--embedding", help="The token embedding (and an output layer tied "
                                            "to it): 16bit (default), or int8: 8-bit codes with a scale per 32 (GGUF Q8_0's grid), "
                                            "about half its bytes (SmolLM2: -27 MB). Such folders load in brisk only, not "
                                            "transformers or vLLM."),
    dynamic: Optional[list[str]] = typer.Option(None, "--dynamic", metavar="REGEX=BITS",
                                                help="gptq: other bits for the layers whose name (model.layers.N.mlp.down_proj) "
                                                "the regex matches from its start, e.g. '.*down_proj=8'; repeatable, the first "
                                                "match applies. 8-bit layers are symmetric (GGUF Q8_0's grid: brisk's CPU "
                                                "kernels run them). Written as GPTQModel's dynamic config, which vLLM reads too."),
    compensate: Optional[bool] = typer.Option(None, "--compensate/--no-compensate",
                                              help="awq: after AWQ's scales, GPTQ's error compensation on the "
                                              "scaled weights, in the same AWQ GEMM layout (default on; --no-compensate: "
                                              "AutoAWQ's clip search and rounding)."),
    threads: Optional[int] = c.ThreadsOpt,
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON instead of a table."),
):
    """Quantize a model into a Hugging Face folder that brisk, transformers and vLLM load.

    Interrupted (Ctrl-C, crash), the same command resumes from the last finished layer.
    Examples:  brisk quantize -o smol-gptq --method gptq  ·  brisk quantize org/name -o out --method awq
    ·  brisk quantize model.gguf -o out-nf4 --method nf4 --double-quant
    ·  brisk quantize model-f16.gguf -o model-Q4_K_M.gguf --format gguf --type Q4_K_M [--method rtn]
    ·  brisk quantize ./hf-folder -o model-Q4_K_M.gguf --format gguf --type Q4_K_M
    """
    from ..core.errors import InvalidValue

    hf_only = {"bits": bits, "group_size": group_size, "sym": sym, "act_order": act_order, "damp": damp,
               "double_quant": double_quant, "calib": calib, "samples": samples, "seq_len": seq_len,
               "embedding": embedding, "dynamic": dynamic, "compensate": compensate}
    if fmt == "gguf":
        _quantize_gguf(model, out, qtype, method, hf_only, threads, force, as_json)
        return
    with c.user_errors():
        if fmt != "hf":
            raise InvalidValue("format", fmt, "", template=f"{{option}} must be hf or gguf, not {fmt!r}")
        if qtype is not None:
            raise InvalidValue("type", qtype, "", template="{option} applies to --format gguf only")
        if method is None:
            raise InvalidValue("method", None, "", template="{option} is required (gptq, awq, nf4, fp4 or int8)")
        from ..core.files import regular_file
        from ..core.load_options import check_load_options

        check_load_options(model, threads=threads)  # before the stack that loads it is imported
        if calib is not None and samples != 0:  # with --samples 0, QuantOptions refuses --calib itself
            regular_file(calib)
        from ..core.errors import FileError
        from ..core.quantize.options import QuantOptions

        opts = QuantOptions(method=method, bits=bits, group_size=group_size, sym=sym, act_order=act_order,
                            damp=damp, double_quant=double_quant, calib=str(calib) if calib else None,
                            samples=samples, seq_len=seq_len, embedding=embedding,
                            dynamic=tuple(dynamic) if dynamic else None, compensate=compensate).checked()
        if Path(out).expanduser().exists() and not force:  # as quantize_model says it, before torch loads
            raise FileError("already exists (use --force to replace it)", Path(out).expanduser())
        from ..core.quantize import quantize_model
        from ..core.device import set_cpu_threads

        set_cpu_threads(threads)
        progress = _Progress(enabled=not as_json)
        run_resumable_job(lambda: quantize_model(model, out, opts, force=force, report=progress),
                            progress, out, as_json, _print_summary)


# the calibration flags --format gguf --method gptq takes (the others are the Hugging Face formats')
GGUF_CALIBRATION = ("calib", "samples", "seq_len", "damp")


def _quantize_gguf(model, out, qtype, method, hf_only, threads, force, as_json) -> None:
    from ..core.errors import InvalidValue
    from ..core.quantize.gguf_quantize import gptq_partial, quantize_gguf

    progress = _GGUFProgress(enabled=not as_json)
    with c.user_errors():
        calib = {n: (str(v) if n == "calib" else v) for n, v in hf_only.items() if n in GGUF_CALIBRATION and v is not None}
        for name, value in hf_only.items():
            if value is not None and (name not in GGUF_CALIBRATION or method not in (None, "gptq")):
                raise InvalidValue(name, value, "", template="{option} does not apply to --format gguf" + (
                    f" with --method {method}" if name in GGUF_CALIBRATION else ""))
        from ..core.device import set_cpu_threads

        set_cpu_threads(threads)
        # gptq resumes from its partial folder; rtn keeps nothing (it takes seconds) and starts over
        stopped = f"interrupted: run the same command again to resume from {gptq_partial(Path(out))}" \
            if method in (None, "gptq") else f"interrupted: {out} not written"
        run_resumable_job(lambda: quantize_gguf(model, out, qtype, method, force=force, report=progress, calib=calib),
                          progress, out, as_json, _print_gguf_summary, interrupted=stopped)


def _print_gguf_summary(summary) -> None:
    console = Console(highlight=False)
    mb = lambda n: f"{n / 2**20:,.1f} MB"  # noqa: E731
    types = ", ".join(f"{n} {t}" for t, n in sorted(summary.tensors.items(), key=lambda kv: -kv[1]))
    if summary.method == "convert":  # a float --type: nothing rounded to a grid
        console.print(f"GGUF {summary.type}: converted; tensors by type: {types}")
    else:
        console.print(f"GGUF {summary.type} ({summary.method}): {summary.quantized} tensors rounded; "
                      f"tensors by type: {types}")
    if summary.errors:
        gptq = sum(e[0] for e in summary.errors.values()) / len(summary.errors)
        rtn = sum(e[1] for e in summary.errors.values()) / len(summary.errors)
        console.print(f"calibration: {summary.calibration_tokens:,} tokens; output error of the {len(summary.errors)} "
                      f"linears (mean): gptq {gptq:.3e}, rtn {rtn:.3e}")
    console.print(f"size: {mb(summary.source_bytes)} source -> {mb(summary.out_bytes)}")
    console.print(f"time: {summary.seconds:.1f} s   ->  {summary.out}")


class _GGUFProgress(JobProgress):
    """--format gguf's events: one bar over the tensors (after one over a Hugging Face folder's conversion,
    and one over GPTQ's blocks)."""

    def show(self, event: str, info: dict) -> None:
        if event == "calibration":
            self.log(f"calibration: {info['samples']} sequences x {info['seq_len']} tokens")
        elif event == "converting":  # a Hugging Face folder: a bar over its tensors first
            self.start_bar()
            self.converting = self.bar.add_task(f"converting ({info['type']})", total=info["total"], note="")
        elif event == "converted":
            self.bar.update(self.converting, advance=1, note=f"{info['name']}: {info['type']}")
        elif event == "resume":
            self.log(f"resuming: {info['layers']} layers already done")
        elif event == "layers":  # gptq: a bar over the blocks first
            self.start_bar()
            self.layers = self.bar.add_task("gptq", total=info["total"], note="")
        elif event == "layer":
            self.bar.update(self.layers, advance=1, note=f"layer {info['index']}")
        elif event == "start":
            self.start_bar()
            self.task = self.bar.add_task(f"quantizing ({info['type']})", total=info["total"], note="")
        elif event == "tensor":
            self.bar.update(self.task, advance=1, note=f"{info['name']}: {info['type']}")


class _Progress(JobProgress):
    """The pipeline's events: one bar over the blocks."""

    def __init__(self, enabled: bool):
        super().__init__(enabled)
        self.task = self.calib = None

    def show(self, event: str, info: dict) -> None:
        log = self.log
        if event == "calibration":  # told with the bar: until then an error is the only line
            self.calib = f"calibration: {info['samples']} sequences x {info['seq_len']} tokens"
        elif event == "resume":
            log(f"resuming: {info['layers']} layers already done")
        elif event == "start":
            if self.calib:
                log(self.calib)
            # layers a previous run finished count as done from the start, so they stay out of the ETA
            self.start_bar()
            self.task = self.bar.add_task("quantizing", total=info["total"], completed=info["done"], note="")
        elif event == "layer":
            st = info["stats"]
            if not st.resumed:
                self.bar.update(self.task, advance=1, note=f"layer {st.index}: err {st.mean_error:.2e}")
        elif event == "writing":
            self.bar.update(self.task, note=f"writing {info['out']}")


def _print_summary(s) -> None:
    console = Console(highlight=False)
    o = s.options
    fmt = {"gptq": "GPTQ", "awq": "AWQ (GEMM)", "nf4": "bitsandbytes NF4", "fp4": "bitsandbytes FP4",
           "int8": "bitsandbytes int8"}[s.method]
    group = o.get("group_size")
    title = f"{fmt}, {o['bits']}-bit" + (f", group {group}" if group is not None else "")
    table = Table(title=title, title_justify="left")
    for col in ("layer", "bits", f"{s.error_kind} err (mean)", "max", "seconds"):
        table.add_column(col, justify="right")
    from ..core.quantize.options import LINEAR_NAMES, QuantOptions

    opts = QuantOptions(method=s.method, **o)
    for st in s.layers:  # with --dynamic, the bits its linears got (4/8)
        bits = sorted({opts.bits_for(f"model.layers.{st.index}.{n}") for n in LINEAR_NAMES})
        table.add_row(str(st.index), "/".join(map(str, bits)), f"{st.mean_error:.3e}", f"{st.max_error:.3e}",
                      f"{st.seconds:.1f}" + (" (earlier run)" if st.resumed else ""))
    console.print(table)
    mb = lambda n: f"{n / 2**20:,.1f} MB"  # noqa: E731
    console.print(f"size: {mb(s.source_bytes)} source file, {mb(s.fp16_bytes)} at 16 bits -> {mb(s.out_bytes)} "
                  f"({s.out_bytes / max(s.fp16_bytes, 1):.0%} of 16-bit)")
    if s.calibration_tokens:
        console.print(f"calibration: {s.calibration_tokens:,} tokens")
    console.print(f"kept {s.float_dtype}: {', '.join(s.kept_float)}")
    if o.get("embedding") == "int8":
        console.print("embedding: 8-bit, a scale per 32 (brisk's format: transformers and vLLM cannot load this folder)")
    console.print(f"time: {s.seconds:.1f} s   ->  {s.out}")
