"""`brisk info`: what a model is and whether it fits, from its headers (like `ollama show`)."""
from __future__ import annotations

import json
from typing import Optional

import typer

from . import common as c
from .app import app


@app.command()
def info(
    model_pos: Optional[str] = typer.Argument(None, metavar="[MODEL]", help="Model (default: embedded SmolLM2)."),
    model: Optional[str] = c.ModelArg,
    ctx: Optional[int] = typer.Option(None, "--ctx", min=16, help="Context for the KV-cache and fit figures "
                                      "(default: min(4096, model's), as loading the model does)."),
    kv_type: str = typer.Option("auto", "--kv-type", "-ctk", "--cache-type-k", help="The CPU KV cache's type for "
                                "the figures: auto | f32 | f16 | bf16 | q8_0 (as generate's --kv-type)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (byte counts as integers)."),
):
    """Describe a model without loading its weights: architecture, parameters, quantization by tensor
    type, file size, memory needed on the CPU (and GPU) with the KV cache for --ctx, and whether that
    fits in the memory free now; context length, vocabulary, chat template, recommended sampling.

    Reads headers only (GGUF metadata, config.json, safetensors headers): quick for any size.
    A hub id is looked up in the local Hugging Face cache only, never downloaded.

    Examples:  brisk info  ·  brisk info model.gguf --ctx 8192  ·  brisk info org/name --json
    """
    with c.user_errors():
        from ..core.errors import BriskError
        from ..core.model_info import model_info

        if model and model_pos:
            raise BriskError("model given twice (positional and --model)")
        result = model_info(model or model_pos, ctx, kv_type)
    if as_json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        for line in render(result):
            print(line)


def render(i) -> list[str]:
    """The human-readable lines for a ModelInfo: a label column, then the facts."""
    rows: list[tuple[str, str]] = [("model", i.name)] if i.name != i.path else []
    rows += [
        ("file", f"{i.path}  ({'GGUF' if i.format == 'gguf' else 'Hugging Face folder'}, {size(i.file_bytes)})"),
        ("architecture", f"{i.architecture} · {i.layers} layers · hidden {i.hidden_size} · FFN {i.ffn_dim} · "
                         f"{i.heads} heads, {i.kv_heads} KV head{'s' if i.kv_heads != 1 else ''} of {i.head_dim}"
                         + (" · tied embeddings" if i.tie_embeddings else "")),
        ("parameters", count(i.parameters)),
    ]
    if i.experts:
        rows.append(("experts", f"{i.experts} per MoE layer, {i.experts_used} routed per token · "
                                f"{count(i.active_parameters)} parameters active"))
    rows.append(("per token", f"{size(i.read_bytes_per_token)} of weights read per decode step"))
    if i.quant_method:
        rows.append(("quantization", i.quant_method))
    width = max(len(u.type) for u in i.quantization) if i.quantization else 0
    for n, u in enumerate(i.quantization):
        tensors = f"{u.tensors:>5} {'tensor ' if u.tensors == 1 else 'tensors'}"
        rows.append(("tensors" if n == 0 else "",
                     f"{u.type:<{width}}  {tensors}  {count(u.elements):>7} weights  {size(u.bytes):>10}"))
    window = f" · {i.sliding_layers} layers slide over {i.sliding_window}" if i.sliding_layers else ""
    rows += [
        ("context", f"{i.context_length} tokens max{window}"),
        ("vocab", f"{i.vocab_size} tokens"),
        ("chat template", "yes" if i.chat_template else "no (prompts go in raw)"),
        ("sampling", " · ".join(f"{k} {v}" for k, v in i.sampling.items()) or "none recommended (brisk's defaults)"),
        ("KV cache", f"{size(i.kv_bytes_per_token)} per token ({i.kv_dtype}) · {size(i.kv_bytes)} for {i.ctx} tokens"),
    ]
    for m in i.memory:
        where = "CPU" if m.device == "cpu" else m.device
        approx = "~" if m.approximate else ""
        rows.append((f"on {where}", f"{approx}{size(m.weights_bytes)} weights ({m.dtype} where widened) + "
                                    f"{size(m.kv_bytes)} KV = {approx}{size(m.needed_bytes)}"))
        free = "RAM available" if m.device == "cpu" else "free"
        if m.fits is None:
            verdict = f"unknown ({free} could not be read)"
        else:
            verdict = f"{'yes' if m.fits else 'NO'}: {size(m.available_bytes)} {free} of {size(m.total_bytes)}"
        rows.append(("  fits", verdict))
    label = max(len(k) for k, _ in rows) + 2
    return [f"{k:<{label}}{v}" for k, v in rows] + [f"note: {n}" for n in i.notes]


def size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)
