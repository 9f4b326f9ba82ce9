"""Each method's recipe for one block, apart from the block loop so that the loop (and resume) is
the same for every method: a recipe takes the float block and hands back the checkpoint's tensors
for its linears, and each linear's relative squared error."""
from __future__ import annotations

import torch
from torch import nn

from .blocks import capture, linear_names, linears

AWQ_SEARCH_TOKENS = 512  # tokens (evenly strided) the AWQ scale/clip grid searches see: cost is linear in it

# GPTQModel's "true sequential" order: the linears reading one input are quantized together, and
# each step's inputs come from the block with the earlier steps' linears already quantized.
GPTQ_STEPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
              ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def gptq_steps(block) -> list[list[tuple[str, ...]]]:
    """GPTQ_STEPS for this block: each step a list of input-sharing sets. An MoE block's gate/up
    step holds every expert's pair, its down step every expert's down: each expert's Hessian from
    the tokens routed to it."""
    names = linear_names(block)
    if "mlp.gate_proj" in names:
        return [[s] for s in GPTQ_STEPS]
    experts = sorted({n.rsplit(".", 1)[0] for n in names if ".experts." in n}, key=lambda p: int(p.rsplit(".", 1)[1]))
    return [[GPTQ_STEPS[0]], [GPTQ_STEPS[1]], [(f"{e}.gate_proj", f"{e}.up_proj") for e in experts],
            [(f"{e}.down_proj",) for e in experts]]


def gptq_block(block, x, rope, kv, opts, prefix: str = ""):
    """prefix: the block's name (model.layers.N.), for --dynamic's per-layer bits."""
    def one(g, name):
        # Without act-order the groups still go in order of input size (g_idx stays sorted, so the
        # fast kernels run it): measured on SmolLM2-135M (issue 15), both it and the grid search
        # roughly halve the KL to float of min/max GPTQ.
        res = g.quantize(bits=opts.bits_for(prefix + name), group_size=opts.group_size, sym=opts.sym_for(prefix + name),
                         act_order=opts.act_order, damp=opts.damp, search=True, group_order=not opts.act_order)
        return res.tensors(), res.dequantized, res.error

    return _true_sequential(block, x, rope, kv, one)


def bnb_calibrated_block(block, x, rope, kv, opts, fmt, qcfg, dtype):
    """bitsandbytes NF4/FP4/int8 by GPTQ on the format's own grid (a 16-entry codebook per block
    of 64, 255 levels per row): the same tensors as round-to-nearest, with codes and scales that
    compensate each other's errors on the calibration inputs. The weight is rounded to the
    checkpoint's float dtype first, as bnb_block does (what bitsandbytes would quantize)."""
    from ...quant.gptq import output_error

    def one(g, name):
        w = g.weight.to(dtype)
        t = fmt.quantize_int8(w, hessian=g.H) if opts.method == "int8" else \
            fmt.quantize_4bit(w, quant_type=opts.method, blocksize=64, double_quant=opts.double_quant, hessian=g.H)
        deq = _loaded(fmt, t, name, qcfg)  # what the model runs, and what the next steps must see
        return t, deq, output_error(deq, g.weight, g.H)

    return _true_sequential(block, x, rope, kv, one)


def _true_sequential(block, x, rope, kv, quantize_one):
    """Each step's linears quantized by quantize_one(GPTQ, name) -> (tensors, dequantized weight,
    error) on the Hessian of their inputs, captured with the earlier steps already quantized."""
    from ...quant.gptq import GPTQ

    lins = linears(block)
    tensors, errors = {}, {}
    for step in gptq_steps(block):
        firsts = {names[0]: GPTQ(lins[names[0]].weight) for names in step}
        # one set (a dense block): its forward cut short at the linear; an MoE step runs the whole block
        capture(block, x, rope, kv, {lins[n]: g.add_batch for n, g in firsts.items()},
                stop_at=lins[step[0][0]] if len(step) == 1 else None)
        for names in step:
            first = firsts[names[0]]
            if first.n == 0:  # an expert no calibration token reached: round to nearest on the grid
                first = GPTQ.with_hessian(first.weight, torch.eye(first.H.shape[0]), 1)
            for n in names:
                # the linears of a set read the same input: the Hessian depends on the input only
                g = first if n == names[0] else GPTQ.with_hessian(lins[n].weight, first.H, first.n)
                t, deq, err = quantize_one(g, n)
                tensors.update({f"{n}.{k}": v for k, v in t.items()})
                errors[n] = float(err)
                lins[n].weight.copy_(deq)
    return tensors, errors


def _loaded(fmt, t: dict, name: str, qcfg: dict) -> torch.Tensor:
    """The float32 weight a linear's checkpoint tensors `t` load as."""
    return fmt.load_linear({f"{name}.{k}": v for k, v in t.items()}, name, qcfg, None).dequantize(torch.float32)


# Which captured input each linear reads (q/k/v share one, gate/up another).
AWQ_FEED = {"self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.q_proj",
            "self_attn.v_proj": "self_attn.q_proj", "self_attn.o_proj": "self_attn.o_proj",
            "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.gate_proj", "mlp.down_proj": "mlp.down_proj"}


def awq_block(block, x, rope, kv, opts, dtype=torch.float32):
    """AutoAWQ's recipe: scales searched on the float block's inputs for each group of linears that
    share an input, folded into the op before them. Then, with opts.compensate (the default), GPTQ on
    the scaled weights (_awq_gptq); without, AutoAWQ's own: a clip search per linear (not q/k, whose
    products go through softmax) on the scaled inputs, then min/max quantization."""
    from ...quant import awq

    lins = linears(block)
    feeds = {n: [] for n in dict.fromkeys(AWQ_FEED.values())}
    capture(block, x, rope, kv, {lins[n]: lambda t, acc=acc: acc.append(t.reshape(-1, t.shape[-1]))
                                 for n, acc in feeds.items()}, stop_at=lins["mlp.down_proj"])
    inputs = {n: _subsample(torch.cat(v), AWQ_SEARCH_TOKENS) for n, v in feeds.items()}
    groups = awq_groups(block)
    scales = [awq.search_scales(inputs[AWQ_FEED[names[0]]], [lins[n].weight for n in names], opts.bits,
                                opts.group_size, folded=_offset_norm_fold(prev, dtype)) for prev, names in groups]
    for (prev, names), s in zip(groups, scales):  # all searched first, on the float block, as AutoAWQ does
        fold_scales(block, prev, names, s)
        inputs[AWQ_FEED[names[0]]] = inputs[AWQ_FEED[names[0]]] / s
    if opts.compensate:
        return _true_sequential(block, x, rope, kv, _awq_gptq(opts))
    tensors, errors = {}, {}
    for n, lin in lins.items():
        xs, w = inputs[AWQ_FEED[n]], lin.weight
        clip = None if n in ("self_attn.q_proj", "self_attn.k_proj") else awq.search_clip(xs, w, opts.bits, opts.group_size)
        res = awq.quantize(w, opts.bits, opts.group_size, clip=clip, x=xs)
        tensors.update({f"{n}.{k}": v for k, v in res.tensors().items()})
        errors[n] = float(res.error)
    return tensors, errors


def _awq_gptq(opts):
    """quantize_one for _true_sequential: GPTQ on the scaled weights (AWQ's grid: asymmetric, groups
    in order), written in the AWQ GEMM layout. AWQ's paper combines the two; the scales take the
    salient channels' error down, the compensation the rest."""
    from ...quant import awq_format

    def one(g, name):
        res = g.quantize(bits=opts.bits, group_size=opts.group_size, sym=False, act_order=False, damp=0.01,
                         search=True, group_order=True)
        return awq_format.pack_layer(res.q, res.zeros, res.scales), res.dequantized, res.error

    return one


def _offset_norm_fold(prev: nn.Module, dtype: torch.dtype):
    """For a norm stored as w for a scale of offset + w (Gemma's 1 + w): the scale s folded into it
    leaves (offset + w) / s - offset to store, which rounds in bfloat16 to ~2^-9 of |w|. Where AWQ
    scales an input up (s >> offset + w) that is w ~ -1 and all of the rounding falls on the small
    offset + w that remains (measured on Gemma 3 270M: folded scales near 0.08, some rounded to 0;
    KL to float 0.30 at 4-bit g32 against GPTQ's 0.11). So the search sees the rounding, and each
    candidate is rescaled by one constant (the error is otherwise the same for any constant) so that
    the folded scales' median is the norm's own: None for other ops (their folding rounds relatively)."""
    offset = getattr(prev, "offset", 0.0)
    if isinstance(prev, nn.Linear) or not offset:
        return None
    g = prev.weight.detach().float() + offset

    def folded(s):
        s = s * ((g / s).abs().median() / g.abs().median()).clamp(min=1e-30)
        kept = ((g / s - offset).to(dtype).float() + offset) * s
        return s, torch.where(g == 0, torch.ones_like(g), kept / g)

    return folded


def awq_groups(block) -> list[tuple[nn.Module, list[str]]]:
    """(the op before, the linears it feeds) for each AWQ scale: the input norm before q/k/v, the MLP's
    norm before gate/up (Gemma's pre-feedforward norm), up_proj before down_proj, and v_proj before
    o_proj when their shapes allow it (not with grouped-query attention)."""
    mlp_norm = block.pre_feedforward_layernorm if block.sandwich else block.post_attention_layernorm
    groups = [(block.input_layernorm, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
              (mlp_norm, ["mlp.gate_proj", "mlp.up_proj"]),
              (block.mlp.up_proj, ["mlp.down_proj"])]
    attn = block.self_attn
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:
        groups.insert(1, (attn.v_proj, ["self_attn.o_proj"]))
    return groups


def fold_scales(block, prev: nn.Module, names: list[str], s: torch.Tensor) -> None:
    """Multiply the input columns of the linears `names` by s and divide the output channels of `prev`
    by s: the block computes the same function, with the salient channels scaled up. prev is an
    RMSNorm (Gemma's stores w for a scale of 1 + w) or a linear (rows, and bias)."""
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s[:, None])
        if prev.bias is not None:
            prev.bias.div_(s)
    else:
        prev.weight.copy_((prev.weight + prev.offset) / s - prev.offset)
    for n in names:
        block.get_submodule(n).weight.mul_(s)


def _subsample(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if len(x) <= n else x[torch.arange(n) * len(x) // n]


def bnb_block(block, opts, fmt, qcfg, dtype):
    """Round-to-nearest (--samples 0: no calibration): each weight (rounded to the checkpoint's float
    dtype, what bitsandbytes would quantize) is quantized on its own; the error is the weight's."""
    tensors, errors = {}, {}
    for n, lin in linears(block).items():
        w = lin.weight.to(dtype)
        t = fmt.quantize_int8(w) if opts.method == "int8" else \
            fmt.quantize_4bit(w, quant_type=opts.method, blocksize=64, double_quant=opts.double_quant)
        deq = _loaded(fmt, t, n, qcfg)
        wf = w.float()
        errors[n] = float((deq - wf).pow(2).sum() / wf.pow(2).sum().clamp(min=1e-30))
        tensors.update({f"{n}.{k}": v for k, v in t.items()})
    return tensors, errors
