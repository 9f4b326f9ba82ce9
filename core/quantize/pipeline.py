"""`brisk quantize`: quantize a whole model, block by block, into a Hugging Face folder in a format
the ecosystem reads (GPTQ, AWQ GEMM, bitsandbytes NF4/FP4 and int8).

This is the one place that joins the model (core) and the algorithms (quant). For GPTQ and AWQ the
calibration batch runs through the embeddings, then through one decoder block at a time: the block
runs once in float with hooks on its linears (GPTQ accumulates Hessians, AWQ keeps the inputs), its
linears are quantized, the block is rebuilt from the quantized tensors and run again to give the
next block its inputs. So the next block sees what the quantized model computes, and memory stays
at the model plus one block's activations (finished blocks are dropped). bitsandbytes' NF4/FP4/int8
run GPTQ on their own grids the same way, or round to nearest without data (--samples 0).

Each finished block goes to OUT.partial first, so an interrupted run resumes (see resume.py);
embeddings, norms and lm_head stay float (see export.py).
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ...quant import embedding_format
from .. import calibration, hf_export
from ..errors import FileError
from . import blocks, export, recipes, resume
from .options import QuantOptions, check_input, check_shapes, estimate_bytes, float_dtype


@dataclass
class LayerStats:
    index: int
    seconds: float
    errors: dict[str, float]  # linear -> relative squared error (output error on calibration data, or weight error)
    resumed: bool = False

    @property
    def mean_error(self) -> float:
        return sum(self.errors.values()) / len(self.errors)

    @property
    def max_error(self) -> float:
        return max(self.errors.values())


@dataclass
class QuantSummary:
    model: str
    out: str
    method: str
    options: dict
    error_kind: str  # "output" (calibrated: ||(W-Q)X||^2/||WX||^2) or "weight" (||W-Q||^2/||W||^2)
    layers: list[LayerStats] = field(default_factory=list)
    kept_float: list[str] = field(default_factory=list)
    float_dtype: str = ""
    calibration_tokens: int = 0
    source_bytes: int = 0
    fp16_bytes: int = 0
    out_bytes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        for row, st in zip(d["layers"], self.layers):
            row.update(mean_error=st.mean_error, max_error=st.max_error)
        return d


Report = Callable[..., None]  # report(event, **info): "loading", "calibration", "resume", "start", "layer", "writing"


def quantize_model(model: str | None, out: str | Path, opts: QuantOptions, force: bool = False,
                   report: Report | None = None, max_shard_bytes: int = hf_export.MAX_SHARD_BYTES) -> QuantSummary:
    """Quantize `model` (anything LLM.load takes) into the HF folder `out`; see the module docstring."""
    from ..llm import LLM

    t_start = time.perf_counter()
    report = report or (lambda event, **info: None)
    opts = opts.checked()
    out = Path(out).expanduser()
    partial = out.with_name(out.name + ".partial")
    if out.exists() and not force:
        raise FileError("already exists (use --force to replace it)", out)
    texts = calibration.load_texts(opts.calib) if opts.calibrated else None

    early = check_input(model, out)
    if early is not None:  # an HF folder's config.json: shape errors before the weights load
        opts = check_shapes(opts, early)
    report("loading", model=model or "default")
    # quantize="none": GGUF blocks widened to float too; they are the base the new format starts from
    llm = LLM.load(model, device="cpu", dtype="float32", ctx=max(16, opts.seq_len or 16), quantize="none")
    ckpt, net, cfg = llm.checkpoint, llm.model, llm.config
    opts = check_shapes(opts, cfg)
    dtype = float_dtype(ckpt)
    config = hf_export.source_config(ckpt, dtype)  # fails now, not after an hour, for an unexportable model
    ids = None
    if texts is not None:
        ids = calibration.calibration_batch(llm.tokenizer, texts, opts.samples, opts.seq_len)
        report("calibration", samples=opts.samples, seq_len=opts.seq_len, tokens=ids.numel())

    fmt, qcfg = export.choose_format(opts, dtype)
    key = resume.run_key(ckpt, opts, dtype, texts)
    done = resume.resume_state(partial, key)
    resume.check_disk(out, partial, done, estimate_bytes(cfg, opts))
    resume.prepare_partial(partial, key, opts, done, report)

    summary = QuantSummary(llm.name, str(out), opts.method, opts.public(),
                           "output" if ids is not None else "weight", float_dtype=str(dtype).removeprefix("torch."),
                           calibration_tokens=0 if ids is None else ids.numel(), source_bytes=ckpt.file_bytes)
    tied = " (tied)" if cfg.tie_embeddings else ""
    summary.kept_float = (["model.embed_tokens", "lm_head" + tied] if opts.embedding == "16bit"
                          else [] if cfg.tie_embeddings else ["lm_head"]) + ["norms"]
    summary.fp16_bytes = 2 * sum(p.numel() for p in {id(p): p for p in net.parameters()}.values())

    with torch.no_grad():
        table = None
        if opts.embedding == "int8":  # from the source's values, once (re-quantizing its own output may differ)
            table = embedding_format.quantize_table(net.model.embed_tokens.weight)
            net.model.embed_tokens.weight.copy_(embedding_format.decoded(table))
        _quantize_blocks(net, ids, opts, fmt, qcfg, dtype, partial, done, report, summary)
        report("writing", out=str(out))
        export.assemble(net, cfg, ckpt, config, qcfg, opts, dtype, partial, max_shard_bytes, table)
    if out.exists():  # --force: the old folder goes only once the new one is complete
        os.replace(out, partial / "replaced")
    os.replace(partial / "output", out)
    shutil.rmtree(partial, ignore_errors=True)
    summary.out_bytes = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    summary.seconds = time.perf_counter() - t_start
    return summary


def _quantize_blocks(net, ids, opts, fmt, qcfg, dtype, partial, done, report, summary) -> None:
    """Each block in turn: quantized (or reloaded from the partial run), saved, rebuilt from its
    checkpoint tensors and run to give the next block its inputs, then dropped."""
    layers = net.model.layers
    x = rope = kv = None
    if ids is not None:
        if opts.embedding == "16bit":  # calibrate on the embeddings the checkpoint will hold (int8: set already)
            blocks.round_(net.model.embed_tokens.weight, dtype)
        x, rope, kv = blocks.block_inputs(net, ids)
    report("start", total=len(layers), done=len(done))
    for i in range(len(layers)):
        block, prefix = layers[i], f"model.layers.{i}."
        t0 = time.perf_counter()
        if i in done:
            tensors = resume.load_layer(partial, i) if x is not None else None
            stats = LayerStats(i, done[i]["seconds"], done[i]["errors"], resumed=True)
        else:
            for _, p in blocks.named_float_params(block):
                blocks.round_(p, dtype)
            if opts.method == "gptq":
                tensors, errors = recipes.gptq_block(block, x, rope, kv, opts, prefix)
            elif opts.method == "awq":
                tensors, errors = recipes.awq_block(block, x, rope, kv, opts, dtype)
            elif x is not None:
                tensors, errors = recipes.bnb_calibrated_block(block, x, rope, kv, opts, fmt, qcfg, dtype)
            else:
                tensors, errors = recipes.bnb_block(block, opts, fmt, qcfg, dtype)
            tensors = {prefix + k: v for k, v in tensors.items()}
            tensors.update({prefix + n: p.to(dtype) for n, p in blocks.named_float_params(block)})
        if x is not None:
            blocks.install(block, tensors, prefix, fmt, qcfg)
            x = blocks.forward(block, x, rope, kv)
        if i not in done:
            stats = LayerStats(i, time.perf_counter() - t0, errors)
            resume.save_layer(partial, i, tensors, stats.seconds, stats.errors)
        layers[i] = nn.Identity()  # done with it: its tensors are on disk
        summary.layers.append(stats)
        report("layer", stats=stats, total=len(layers))
