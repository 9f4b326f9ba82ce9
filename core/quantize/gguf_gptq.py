"""`brisk quantize --format gguf --method gptq`: GPTQ's error compensation on llama.cpp's own grids.

The float model runs the calibration batch block by block, as core/quantize/pipeline.py does for
Hugging Face output (true-sequential steps, recipes._true_sequential): each linear's Hessian from its
inputs with the earlier linears already quantized, then GPTQ column by column where each block's
scales are llama.cpp's own choice for the weights as updated by then (quant/gguf_grid.py), and the
next block sees what the quantized model computes. The result is each linear's GGUF blocks of the
type the mix gives its tensor; an MoE layer's experts each on the tokens routed to them, joined into
llama.cpp's stacked tensors (gguf_gptq_moe.py). Tensors without calibration inputs (token table,
output head, norms, the router) and the types without a grid there (Q2_K, Q3_K, Q5_0, Q5_1) are
left to the caller's round-to-nearest.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn


def quantized_linears(path, targets: dict[str, int], opts, report) -> tuple[dict[str, np.ndarray], dict[str, list[float]]]:
    """For the GGUF file `path` and its tensors' target types, {GGUF tensor name: its blocks [rows, row
    bytes] uint8, rows in the file's order} for every linear GPTQ covered, and {name: [GPTQ's output
    error, round-to-nearest's]} (relative, on the calibration inputs of that linear)."""
    from ...quant import gguf_types
    from ...quant.gguf_grid import GRIDS, GGUFGrid
    from ...quant.gptq import output_error
    from .. import arch as arch_mod
    from .. import calibration
    from ..checkpoint import gguf_to_hf_name
    from ..llm import LLM
    from . import blocks, recipes
    from .gguf_gptq_moe import StackedExperts

    llm = LLM.load(str(path), device="cpu", dtype="float32", ctx=max(16, opts.seq_len), quantize="none")
    net, cfg = llm.model, llm.config
    arch = arch_mod.by_name(cfg.arch)
    by_hf = {gguf_to_hf_name(n, arch): n for n in targets}
    ids = calibration.calibration_batch(llm.tokenizer, calibration.load_texts(opts.calib), opts.samples, opts.seq_len)
    report("calibration", samples=opts.samples, seq_len=opts.seq_len, tokens=ids.numel())
    out, errors = {}, {}

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
            c = g.run(grid, grid.block, act_order=False, group_order=False, damp=opts.damp)
            rows, deq, err = grid.encode(c.q, c.params[2]), c.dequantized, c.error
        else:
            rows, deq, err = rtn_rows, rtn, rtn_err
        order = arch.gguf_row_order(hf, N, cfg)
        out[gname] = rows if order is None else rows[torch.argsort(order).numpy()]
        errors[gname] = [err, rtn_err]
        return {}, deq, err

    layers = net.model.layers
    with torch.no_grad():
        x, rope, kv = blocks.block_inputs(net, ids)
        report("layers", total=len(layers))
        for i in range(len(layers)):
            prefix = f"model.layers.{i}."
            recipes._true_sequential(layers[i], x, rope, kv, lambda g, name: one(g, name, prefix))
            x = blocks.forward(layers[i], x, rope, kv)
            layers[i] = nn.Identity()  # done with it: its blocks are in `out`
            report("layer", index=i)
    return out, errors


def _nearest(qtype: int, weight: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """llama.cpp's round-to-nearest of the rows: (the blocks, what they decode to)."""
    import gguf

    from ...quant import native

    rows = native.quantize_rows(qtype, weight.float().numpy())
    deq = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(qtype))
    return rows, torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32)).reshape(weight.shape)
