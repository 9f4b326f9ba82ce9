"""How `--tp N` splits a model (core/tensor_parallel.py): each rank's query and KV heads, its span
of the MLP's width, and from those every decoder projection's part, by module name (what a
quantized checkpoint's layers are cut to: core/tp_quantized.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import BriskError


def span(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank's part of n items split evenly (n a multiple of world)."""
    step = n // world
    return rank * step, (rank + 1) * step


def heads_of(cfg, rank: int, world: int) -> tuple[int, int, list[int]]:
    """The rank's query heads q_lo:q_hi (as even a split as the count allows: the first ranks take
    one more) and the KV heads it keeps, in order: those its query heads read when they are whole
    groups; the one they all read when they are part of one group; else one per query head (a
    group cut between ranks: each query head gets its KV head's copy, so attention stays regular)."""
    per, extra = divmod(cfg.n_heads, world)
    q_lo = rank * per + min(rank, extra)
    q_hi = q_lo + per + (rank < extra)
    group = cfg.n_heads // cfg.n_kv_heads
    read = [h // group for h in range(q_lo, q_hi)]
    if q_lo % group == 0 and (q_hi - q_lo) % group == 0:
        return q_lo, q_hi, sorted(set(read))
    if len(set(read)) == 1:
        return q_lo, q_hi, read[:1]
    return q_lo, q_hi, read


def head_rows(heads: list[int], head_dim: int) -> torch.Tensor:
    """The output rows of a projection that hold `heads`, in that order."""
    return (torch.tensor(heads)[:, None] * head_dim + torch.arange(head_dim)).flatten()


@dataclass(frozen=True)
class Part:
    """A rank's part of one projection: output channels `rows`, or input columns lo:hi."""
    rows: torch.Tensor | None = None
    lo: int = 0
    hi: int = 0
    keep_bias: bool = True  # a row-parallel layer's bias stays on rank 0 alone (added once by the all-reduce)


def parts(cfg, rank: int, world: int) -> dict[str, Part]:
    """Every decoder projection's part on `rank`, by module name (the checkpoint's key prefix)."""
    hd = cfg.head_dim
    q_lo, q_hi, kv = heads_of(cfg, rank, world)
    q_rows, kv_rows = head_rows(list(range(q_lo, q_hi)), hd), head_rows(kv, hd)
    out = {}
    for i in range(cfg.n_layers):
        a = f"model.layers.{i}.self_attn."
        out.update({a + "q_proj": Part(q_rows), a + "k_proj": Part(kv_rows), a + "v_proj": Part(kv_rows),
                    a + "o_proj": Part(None, q_lo * hd, q_hi * hd, rank == 0)})
        mlps = ([(f"model.layers.{i}.mlp.experts.{e}.", cfg.expert_ffn_dim) for e in range(cfg.n_experts)]
                if cfg.is_moe_layer(i) else [(f"model.layers.{i}.mlp.", cfg.ffn_dim)])
        for m, width in mlps:
            lo, hi = span(width, rank, world)
            rows = torch.arange(lo, hi)
            out.update({m + "gate_proj": Part(rows), m + "up_proj": Part(rows),
                        m + "down_proj": Part(None, lo, hi, rank == 0)})
    return out


def check_blocks(prefix: str, kind: str, block: int, k: int, spans: list[tuple[int, int]], world: int) -> None:
    """Refuse a layer stored in blocks of `block` consecutive weights of the row-major flattened
    weight (NF4, MXFP4) whose rank's part would cut one: rows of k weights that are not whole
    blocks (a block would straddle two rows, which any cut separates), or a span of input
    columns not on block boundaries."""
    if k % block or any(lo % block or hi % block for lo, hi in spans):
        columns = ", ".join(str(hi - lo) for lo, hi in spans)
        raise BriskError(f"--tp {world}: {prefix}'s {kind} blocks of {block} weights do not split over {world} "
                         f"ranks ({f'rows of {k} weights' if k % block else columns + ' columns each'})")
