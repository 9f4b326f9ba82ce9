"""`--format gguf --method gptq` on an MoE model: each expert compensated on its own tokens, written
into llama.cpp's stacked expert tensors.

llama.cpp stores a layer's experts as one 3-D tensor per projection (`blk.N.ffn_gate_exps.weight`,
[n_expert, rows, cols]); its blocks are the experts' rows one expert after the other. brisk's model
runs each expert as its own linear (`model.layers.N.mlp.experts.E.gate_proj`), and the GPTQ pass
(recipes._true_sequential) already builds each expert's Hessian from the calibration tokens the
router sends to it. StackedExperts maps those linears to their stacked tensor and joins the
experts' blocks once all of a tensor's experts are done.

An expert reached by fewer than MIN_EXPERT_TOKENS calibration tokens gets llama.cpp's
round-to-nearest blocks: a Hessian of so few tokens says little about the inputs it will see, and
compensating on it fits those few.
"""
from __future__ import annotations

import re

import numpy as np

# below this many routed calibration tokens an expert is rounded to nearest, not compensated
MIN_EXPERT_TOKENS = 8

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


class StackedExperts:
    """The expert linears of the stacked tensors GPTQ is asked for, and their blocks as they come."""

    def __init__(self, targets: dict[str, int], n_experts: int, nearest):
        """nearest(qtype, weight) -> (llama.cpp's round-to-nearest blocks, what they decode to)."""
        from ...quant import gguf_types

        # a stacked tensor kept float is no business of this pass
        self.targets = {n: t for n, t in targets.items()
                        if re.search(r"\.ffn_(gate|up|down)_exps\.weight$", n) and gguf_types.BY_ID[t].quantized}
        self.n_experts, self.nearest = n_experts, nearest
        self.rows: dict[str, dict[int, np.ndarray]] = {}

    def target(self, hf: str) -> tuple[str, int, int] | None:
        """(the stacked GGUF tensor, the expert's index in it, its target type) for an expert's linear
        of a tensor asked for, else None."""
        m = _EXPERT.match(hf)
        if not m:
            return None
        layer, expert, proj = m.groups()
        gname = f"blk.{layer}.ffn_{proj}_exps.weight"
        return (gname, int(expert), self.targets[gname]) if gname in self.targets else None

    def quantize(self, g, stacked: tuple[str, int, int], damp: float, out: dict, errors: dict):
        """GPTQ on the grid of the stacked tensor's type for one expert (g: its GPTQ, Hessian from its
        routed tokens), as gguf_gptq's linears are: (no checkpoint tensors, what it decodes to, its
        error). Its [GPTQ's, rtn's] error goes in `errors`, the stacked tensor's blocks in `out` once
        complete."""
        from ...quant import gguf_types
        from ...quant.gguf_grid import GRIDS, GGUFGrid
        from ...quant.gptq import output_error

        gname, expert, qtype = stacked
        rtn_rows, rtn = self.nearest(qtype, g.weight)
        rtn_err = output_error(rtn, g.weight, g.H)
        if (g.n >= MIN_EXPERT_TOKENS and qtype in GRIDS
                and g.weight.shape[1] % gguf_types.BY_ID[qtype].block_weights == 0):
            grid = GGUFGrid(qtype)
            c = g.run(grid, grid.block, act_order=False, group_order=False, damp=damp)
            rows, deq, err = grid.encode(c.q, c.params[2]), c.dequantized, c.error
        else:
            rows, deq, err = rtn_rows, rtn, rtn_err
        errors[error_name(gname, expert)] = [err, rtn_err]
        whole = self.add(gname, expert, rows)
        if whole is not None:
            out[gname] = whole
        return {}, deq, err

    def add(self, gname: str, expert: int, rows: np.ndarray) -> np.ndarray | None:
        """Record one expert's blocks [rows, row bytes]; the stacked tensor's blocks, experts in order,
        once the last of them is in."""
        have = self.rows.setdefault(gname, {})
        have[expert] = rows
        if len(have) < self.n_experts:
            return None
        del self.rows[gname]
        return np.concatenate([have[e] for e in range(self.n_experts)])


def error_name(gname: str, expert: int) -> str:
    """The summary's name for one expert of a stacked tensor (brisk's GGUF name for it)."""
    return gname.replace("_exps.weight", f"_exps.{expert}.weight")
