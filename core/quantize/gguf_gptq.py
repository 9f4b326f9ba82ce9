"""`brisk quantize --format gguf --method gptq`: GPTQ's error compensation on llama.cpp's own grids.

The float model runs the calibration batch block by block, as core/quantize/pipeline.py does for
Hugging Face output (true-sequential steps, recipes._true_sequential): each linear's Hessian from its
inputs with the earlier linears already quantized, then GPTQ column by column where each block's
scales are fitted to the weights as updated by then (quant/gguf_grid.py: llama.cpp's own choice, or a
search weighted by the Hessian's diagonal where that rounds them better), and the next block sees what
the quantized model computes. In the 32-weight types (one scale a block) GPTQ takes each block's
columns by decreasing Hessian diagonal (group_order); the K-quants' sub-block scales need them in
order. The result is each linear's GGUF blocks of the type the mix gives its tensor; an MoE layer's
experts each on the tokens routed to them, joined into llama.cpp's stacked tensors
(gguf_gptq_moe.py). Tensors without calibration inputs (token table, output head, norms, the router)
and the types without a grid there (Q2_K, Q3_K, Q5_0, Q5_1) are
left to the caller's round-to-nearest.

Resume: each finished block's GGUF blocks go to the partial folder (core/quantize/resume.py's layout);
a rerun with the same arguments decodes them into the block's linears instead of running GPTQ again.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn


def quantized_linears(path, targets: dict[str, int], opts, report, partial: Path | None = None
                      ) -> tuple[dict[str, np.ndarray], dict[str, list[float]]]:
    """For the GGUF file `path` and its tensors' target types, {GGUF tensor name: its blocks [rows, row
    bytes] uint8, rows in the file's order} for every linear GPTQ covered, and {name: [GPTQ's output
    error, round-to-nearest's]} (relative, on the calibration inputs of that linear).
    partial: a folder keeping each finished block (resume.py's layout), so that a rerun with the same
    arguments resumes after the blocks there; None: nothing kept."""
    from ...quant import gguf_types
    from ...quant.gguf_grid import GRIDS, GGUFGrid
    from ...quant.gptq import output_error
    from .. import arch as arch_mod
    from .. import calibration
    from ..checkpoint import gguf_to_hf_name
    from ..llm import LLM
    from . import blocks, recipes, resume
    from .gguf_gptq_moe import StackedExperts

    llm = LLM.load(str(path), device="cpu", dtype="float32", ctx=max(16, opts.seq_len), quantize="none")
    net, cfg = llm.model, llm.config
    arch = arch_mod.by_name(cfg.arch)
    by_hf = {gguf_to_hf_name(n, arch): n for n in targets}
    hf_of = {n: hf for hf, n in by_hf.items()}
    texts = calibration.load_texts(opts.calib)
    ids = calibration.calibration_batch(llm.tokenizer, texts, opts.samples, opts.seq_len)
    report("calibration", samples=opts.samples, seq_len=opts.seq_len, tokens=ids.numel())
    done = {}
    if partial is not None:
        key = run_key(path, targets, opts, texts)
        done = resume.resume_state(partial, key)
        resume.prepare_partial(partial, key, opts, done, report)
    out, errors = {}, {}  # blocks in brisk's row order until the end

    experts = StackedExperts(targets, cfg.n_experts or 0, _nearest)

    def one(g, name, prefix):
        hf = prefix + name + ".weight"
        gname = by_hf.get(hf)
        qtype = targets.get(gname)
        stacked = experts.target(hf)  # MoE hook: an expert of a stacked tensor (gguf_gptq_moe.py)
        if stacked is not None:
            return experts.quantize(g, stacked, opts.damp, out, errors)
        N, K = g.weight.shape
        if qtype is None or not gguf_types.BY_ID[qtype].quantized:  # kept float: F16 rows are what it runs
            deq = g.weight.half().float() if qtype == gguf_types.F16 else g.weight.float()
            return {}, deq, output_error(deq, g.weight, g.H)
        rtn_rows, rtn = _nearest(qtype, g.weight)
        rtn_err = output_error(rtn, g.weight, g.H)
        if qtype in GRIDS and K % gguf_types.BY_ID[qtype].block_weights == 0:
            grid = GGUFGrid(qtype)
            c = g.run(grid, grid.block, act_order=False, group_order=not grid.positional, damp=opts.damp)
            rows, deq, err = grid.encode(c.q, c.params[2]), c.dequantized, c.error
        else:
            rows, deq, err = rtn_rows, rtn, rtn_err
        out[gname] = rows
        errors[gname] = [err, rtn_err]
        return {}, deq, err

    def restore(block, prefix, saved):
        """A block a previous run finished: its linears set to what its saved blocks decode to (what
        `one` set them to), so that it computes the next block's inputs as it did then."""
        for gname, rows in saved.items():
            out[gname] = rows.numpy()
        for name, lin in recipes.linears(block).items():
            hf = prefix + name + ".weight"
            gname, qtype, rows = by_hf.get(hf), targets.get(by_hf.get(hf)), None
            stacked = experts.target(hf)
            if stacked is not None and stacked[0] in saved:  # an expert: its slice of the stacked tensor
                gname, expert, qtype = stacked
                n = lin.weight.shape[0]
                rows = out[gname][expert * n:(expert + 1) * n]
            elif gname in saved:
                rows = out[gname]
            if rows is not None:
                deq = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(qtype))
                lin.weight.copy_(torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32)).reshape(lin.weight.shape))
            elif qtype == gguf_types.F16:
                lin.weight.copy_(lin.weight.half().float())

    layers = net.model.layers
    with torch.no_grad():
        x, rope, kv = blocks.block_inputs(net, ids)
        report("layers", total=len(layers))
        for i in range(len(layers)):
            prefix, t0 = f"model.layers.{i}.", time.perf_counter()
            if i in done:
                restore(layers[i], prefix, resume.load_layer(partial, i))
                errors.update(done[i]["errors"])
            else:
                before, errors_before = set(out), set(errors)
                recipes._true_sequential(layers[i], x, rope, kv, lambda g, name: one(g, name, prefix))
                if partial is not None:  # (an MoE's errors are per expert, its blocks per stacked tensor)
                    resume.save_layer(partial, i, {n: torch.from_numpy(out[n]) for n in out if n not in before},
                                      time.perf_counter() - t0, {n: errors[n] for n in errors if n not in errors_before})
            x = blocks.forward(layers[i], x, rope, kv)
            layers[i] = nn.Identity()  # done with it: its blocks are in `out`
            report("layer", index=i)
    for gname, rows in out.items():  # the file's row order (llama.cpp's q/k layout, where it differs)
        hf = hf_of.get(gname)  # none for a stacked expert tensor: its rows are in the file's order
        order = arch.gguf_row_order(hf, rows.shape[0], cfg) if hf else None
        if order is not None:
            out[gname] = rows[torch.argsort(order).numpy()]
    return out, errors


def run_key(path: Path, targets: dict[str, int], opts, texts) -> str:
    """A hash of everything a block's output depends on: the source file, each tensor's type, the
    calibration options and text. A partial run with another key starts over."""
    from .. import calibration

    st = Path(path).stat()
    blob = json.dumps({"v": _VERSION, "model": [str(Path(path).resolve()), st.st_size, st.st_mtime_ns],
                       "targets": targets, "opts": asdict(opts), "calib": calibration.texts_digest(texts)},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


_VERSION = 1  # bump when the blocks written for the same arguments change: partial runs then restart


def _nearest(qtype: int, weight: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """llama.cpp's round-to-nearest of the rows: (the blocks, what they decode to)."""
    from ...quant import native

    rows = native.quantize_rows(qtype, weight.float().numpy())
    deq = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(qtype))
    return rows, torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32)).reshape(weight.shape)
