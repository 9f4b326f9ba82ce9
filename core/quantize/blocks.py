"""One decoder block on the calibration batch: running it (the only code here that knows the
model's block API), watching its linears' inputs, and making it compute what the checkpoint will
hold. The recipes and the block loop share these, so fresh and resumed blocks run the same code."""
from __future__ import annotations

import torch
from torch import nn

CHUNK_TOKENS = 4096  # calibration tokens per block call: bounds the block's activation memory
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS = ATTENTION + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


# ---------------------------------------------------------------- the model's block API

def block_inputs(net, ids: torch.Tensor):
    """The first block's input for the token batch `ids` [B, T], with the rope tables and the KV
    object every block call takes. Calibration runs whole sequences once, so the KV stores nothing:
    attention needs the call's own keys and values only."""
    from ..kv import NoKV

    T = ids.shape[1]
    kv = NoKV()
    kv.begin(0, T)
    return net.embed(ids), net.rope_at(0, T), kv


def run_block(block: nn.Module, x: torch.Tensor, rope, kv) -> torch.Tensor:
    """The block's output for x (sequences from position 0, as block_inputs set up)."""
    return block(x, rope, kv)


# ---------------------------------------------------------------- over the calibration batch

def chunks(x: torch.Tensor) -> list[torch.Tensor]:
    """The calibration batch a few sequences at a time (always the same split, so a resumed run
    computes the same bytes)."""
    step = max(1, CHUNK_TOKENS // x.shape[1])
    return [x[s:s + step] for s in range(0, len(x), step)]


def forward(block: nn.Module, x: torch.Tensor, rope, kv) -> torch.Tensor:
    """The block over the whole calibration batch: the next block's input."""
    return torch.cat([run_block(block, c, rope, kv) for c in chunks(x)])


class _Stop(Exception):
    """Raised by a capture hook: the rest of the block's forward is not needed."""


def capture(block: nn.Module, x: torch.Tensor, rope, kv, feeds: dict, stop_at: nn.Module) -> None:
    """Run the block over the calibration batch, handing the input of each linear in `feeds`
    ({linear: fn(x)}) to its function, and cut each forward short at `stop_at`'s input (None: run
    it all). An MoE expert's linear sees the tokens routed to that expert only."""
    def hook(mod, args):
        if mod in feeds:
            feeds[mod](args[0])
        if mod is stop_at:
            raise _Stop

    handles = [m.register_forward_pre_hook(hook) for m in {**feeds, stop_at: None} if m is not None]
    try:
        for c in chunks(x):
            try:
                run_block(block, c, rope, kv)
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------- its linears and float tensors

def linear_names(block: nn.Module) -> tuple[str, ...]:
    """The block's quantized linears: attention's, then its MLP's or each expert's (never an MoE
    router, which stays float)."""
    mlp = block.mlp
    if hasattr(mlp, "experts"):
        return ATTENTION + tuple(f"mlp.experts.{e}.{p}" for e in range(len(mlp.experts))
                                 for p in ("gate_proj", "up_proj", "down_proj"))
    return LINEARS


def linears(block: nn.Module) -> dict[str, nn.Linear]:
    return {n: block.get_submodule(n) for n in linear_names(block)}


def named_float_params(block: nn.Module):
    """The block's tensors that stay float in the checkpoint: norms, biases, an MoE router."""
    quantized = {f"{n}.weight" for n in linear_names(block)}
    return [(n, p) for n, p in block.named_parameters() if n not in quantized]


def round_(p: torch.Tensor, dtype: torch.dtype) -> None:
    """p's values as the checkpoint's float dtype will hold them (p stays float32)."""
    p.copy_(p.to(dtype).float())


def install(block: nn.Module, tensors: dict, prefix: str, fmt, qcfg: dict) -> None:
    """Make the block compute exactly what the checkpoint's tensors say: each linear's weight
    becomes its dequantized codes, the float tensors their stored (rounded) values. The same
    function runs for fresh and resumed blocks, which is what keeps resumed output identical."""
    for name, lin in linears(block).items():
        full = prefix + name
        sub = {k: v for k, v in tensors.items() if k.startswith(full + ".")}
        bias = sub.pop(full + ".bias", None)
        layer = fmt.load_linear(sub, full, qcfg, bias)
        lin.weight.copy_(layer.dequantize(torch.float32))
    for name, p in named_float_params(block):
        p.copy_(tensors[prefix + name].float())
