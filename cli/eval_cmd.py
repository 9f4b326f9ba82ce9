"""`brisk eval`: perplexity over a text file; with --base, KL divergence and top-1 agreement."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from . import common as c
from .app import app


@app.command("eval")
def eval_(
    model_pos: Optional[str] = typer.Argument(None, metavar="[MODEL]", help="Model (default: embedded SmolLM2)."),
    model: Optional[str] = c.ModelArg,
    text: Path = typer.Option(..., "--text", "-f", help="UTF-8 text file to score."),
    base: Optional[str] = typer.Option(None, "--base", help="Reference model with the same tokenizer: adds "
                                       "KL(base || model) per token, top-1 agreement and the base's perplexity."),
    ctx: Optional[int] = typer.Option(None, "--ctx", help="Window length in tokens (default: 512, or the "
                                      "model's context if shorter).", min=16),
    stride: Optional[int] = typer.Option(None, "--stride", help="Tokens between window starts (default ctx/2): "
                                         "each window scores only tokens no earlier window scored, so every "
                                         "scored token has at least ctx - stride tokens of context.", min=1),
    quantize: str = c.QuantizeOpt,
    base_quantize: str = typer.Option("auto", "--base-quantize", help="--quantize for the base model."),
    kv_type: str = c.KvTypeOpt,
    base_kv_type: str = typer.Option("auto", "--base-kv-type", help="--kv-type for the base model: e.g. --base "
                                     "SAME --kv-type q8_0 measures what the cache type alone costs."),
    device: str = c.DeviceOpt,
    dtype: str = c.DtypeOpt,
    threads: Optional[int] = c.ThreadsOpt,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Perplexity of MODEL on a text file (sliding windows, like Hugging Face's perplexity guide).

    With --base: also the base's perplexity, their ratio, and how far MODEL's next-token
    distributions are from the base's (mean KL divergence, top-1 agreement), like llama-perplexity's
    KL mode: e.g. a quantized model against its float original.

    Examples:  brisk eval model-int4 --text wiki.txt  ·  brisk eval out-nf4 --base org/name --text wiki.txt --json
    """
    from ..core.errors import BriskError

    with c.user_errors():
        if model and model_pos:
            raise BriskError("model given twice (positional and --model)")
        if ctx and stride and stride > ctx:
            raise BriskError(f"--stride {stride} is longer than --ctx {ctx}")
        from ..core.load_options import check_kv_type

        check_kv_type(kv_type)
        if base:
            check_kv_type(base_kv_type)
        content = _read(text)
        from ..core.load_options import check_load_options

        for name, quant in ((model or model_pos, quantize), (base, base_quantize)) if base else ((model or model_pos, quantize),):
            check_load_options(name, device, dtype, quant, threads)  # both models, before torch loads
        from ..core.evaluate import evaluate

        llm = c.load_llm(model or model_pos, device, dtype, ctx or 512, quiet=as_json, quantize=quantize, threads=threads,
                         kv_type=kv_type)
        ref = c.load_llm(base, device, dtype, ctx or 512, quiet=as_json, quantize=base_quantize, threads=threads,
                         kv_type=base_kv_type) if base else None
        ctx = ctx or min(llm.ctx, ref.ctx if ref else llm.ctx)
        stride = stride or ctx // 2
        ids = llm.tokenizer.encode(content, add_special=True)
        console = Console(stderr=True)
        if as_json or not console.is_terminal:
            res = evaluate(llm, ids, ctx, stride, ref)
        else:
            from rich.progress import Progress

            with Progress(console=console, transient=True) as bar:
                task = bar.add_task("scoring", total=None)
                res = evaluate(llm, ids, ctx, stride, ref, progress=lambda d, n: bar.update(task, completed=d, total=n))
    if as_json:
        out = {"model": llm.name, "base": ref.name if ref else None, "text": str(text), **res.to_dict()}
        print(json.dumps({k: v for k, v in out.items() if v is not None}))
        return
    t = Table(title=f"brisk eval · {text.name} · {res.tokens} tokens scored in {res.windows} windows "
                    f"(ctx {res.ctx}, stride {res.stride})")
    t.add_column("metric")
    t.add_column(llm.name, justify="right")
    if ref is not None:
        t.add_column(f"{ref.name} (base)", justify="right")
    rows = [("perplexity", f"{res.ppl:.4f}", f"{res.base_ppl:.4f}" if ref else None),
            ("mean NLL (nats)", f"{res.nll:.4f}", f"{res.base_nll:.4f}" if ref else None)]
    if ref is not None:
        rows += [("ppl ratio (model / base)", f"{res.ppl_ratio:.4f}", ""),
                 ("mean KL(base || model)", f"{res.kl_mean:.6f}", ""),
                 ("KL median", f"{res.kl_median:.6f}", ""), ("KL p99", f"{res.kl_p99:.6f}", ""),
                 ("KL max", f"{res.kl_max:.6f}", ""),
                 ("top-1 agreement", f"{100 * res.top1_agreement:.2f} %", "")]
    for r in rows:
        t.add_row(*[v for v in r if v is not None])
    Console().print(t)


def _read(path: Path) -> str:
    from ..core.errors import FileError

    try:
        content = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileError("no such file", path) from None
    except (OSError, UnicodeDecodeError) as e:
        raise FileError(f"cannot read the text ({e.strerror if isinstance(e, OSError) else e})", path) from None
    if not content.strip():
        raise FileError("the text is empty", path)
    return content
