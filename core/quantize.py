"""`brisk quantize`: quantize a whole model, block by block, into a Hugging Face folder in a format
the ecosystem reads (GPTQ, AWQ GEMM, bitsandbytes NF4/FP4 and int8).

This is the one place that joins the model (core) and the algorithms (quant). For GPTQ and AWQ the
calibration batch runs through the embeddings, then through one decoder block at a time: the block
runs once in float with hooks on its linears (GPTQ accumulates Hessians, AWQ keeps the inputs), its
linears are quantized, the block is rebuilt from the quantized tensors and run again to give the
next block its inputs. So the next block sees what the quantized model computes, and memory stays
at the model plus one block's activations (finished blocks are dropped). NF4/FP4/int8 need no data.

Resume: each finished block is saved to OUT.partial/layers/ with a manifest keyed by a hash of
everything that decides the output. A rerun with the same arguments reloads the finished blocks
(running them to rebuild the activations), and produces the same bytes as an uninterrupted run.
The folder appears at OUT only when complete. Test hook: BRISK_QUANTIZE_STOP_AFTER=N stops a run
with an error after it has quantized N blocks, as a crash would; N:sigint sends the process a
SIGINT there instead, as Ctrl-C would.

Embeddings, norms and lm_head stay float (as GPTQModel and AutoAWQ leave them).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field, replace
from math import gcd
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from . import calibration, hf_export
from .errors import BriskError
from .files import write_text_atomic

METHODS = ("gptq", "awq", "nf4", "fp4", "int8")
CALIBRATED = ("gptq", "awq")
GPTQ_BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128)  # what --group-size takes (gptq also -1: one group per row)
AUTO_GROUPS = (128, 64, 32)  # the default: the largest that divides every layer's in_features
DEFAULT_SAMPLES, DEFAULT_SEQ_LEN = 32, 256
AWQ_SEARCH_TOKENS = 512  # tokens (evenly strided) the AWQ scale/clip grid searches see: cost is linear in it
CHUNK_TOKENS = 4096  # calibration tokens per block call: bounds the block's activation memory
STOP_ENV = "BRISK_QUANTIZE_STOP_AFTER"
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_VERSION = 1  # bump when the output for the same arguments changes: partial runs then restart


@dataclass(frozen=True)
class QuantOptions:
    """What the user asked for; None means the method's default (see checked())."""
    method: str
    bits: int | None = None
    group_size: int | None = None
    sym: bool | None = None
    act_order: bool | None = None
    damp: float | None = None
    double_quant: bool | None = None
    calib: str | None = None
    samples: int | None = None
    seq_len: int | None = None

    def checked(self) -> "QuantOptions":
        """Defaults filled in; a BriskError for anything the method's format cannot hold.
        (The group size is settled later, against the model's shapes.)"""
        m = self.method
        if m not in METHODS:
            raise BriskError(f"unknown --method {m!r}; use one of {', '.join(METHODS)}")
        _only(m, CALIBRATED, calib=self.calib, samples=self.samples, seq_len=self.seq_len)
        _only(m, ("gptq",), act_order=self.act_order, damp=self.damp)
        _only(m, ("nf4", "fp4"), double_quant=self.double_quant)
        o = self
        if m in CALIBRATED:
            o = replace(o, samples=o.samples or DEFAULT_SAMPLES, seq_len=o.seq_len or DEFAULT_SEQ_LEN)
            if o.samples < 1 or o.seq_len < 16:
                raise BriskError("--samples must be at least 1 and --seq-len at least 16")
        if m == "gptq":
            o = replace(o, bits=o.bits or 4, sym=True if o.sym is None else o.sym,
                        act_order=bool(o.act_order), damp=0.01 if o.damp is None else o.damp)
            if o.bits not in GPTQ_BITS:
                raise BriskError(f"gptq holds {', '.join(map(str, GPTQ_BITS))}-bit weights, not {o.bits}")
            if o.group_size is not None and o.group_size not in (-1, *GROUP_SIZES):
                raise BriskError(f"gptq --group-size must be -1, 32, 64 or 128, not {o.group_size}")
            if not 0 < o.damp < 1:
                raise BriskError(f"--damp must be between 0 and 1 (a fraction of the Hessian's mean diagonal), not {o.damp}")
        elif m == "awq":
            if o.bits not in (None, 4):
                raise BriskError(f"awq (GEMM) holds 4-bit weights only, not {o.bits}-bit")
            if o.sym:
                raise BriskError("awq stores a zero point per group (asymmetric); --sym does not apply")
            if o.group_size is not None and o.group_size not in GROUP_SIZES:
                raise BriskError(f"awq --group-size must be 32, 64 or 128, not {o.group_size}")
            o = replace(o, bits=4, sym=False)
        else:
            bits = 8 if m == "int8" else 4
            if o.bits not in (None, bits):
                raise BriskError(f"{m} holds {bits}-bit weights, not {o.bits}-bit")
            if o.group_size is not None:
                raise BriskError(f"{m} has no --group-size" + (" (bitsandbytes' blocksize is 64)" if bits == 4 else
                                                                " (one scale per output row)"))
            if o.sym is not None:
                raise BriskError(f"--sym/--asym do not apply to {m}")
            o = replace(o, bits=bits, double_quant=bool(o.double_quant) if m != "int8" else None)
        return o


def _only(method: str, allowed: tuple[str, ...], **flags) -> None:
    for name, value in flags.items():
        if value is not None and method not in allowed:
            flag = "--" + name.replace("_", "-")
            raise BriskError(f"{flag} applies to {' and '.join(allowed)} only, not {method}")


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
    from .engine import LLM

    t_start = time.perf_counter()
    report = report or (lambda event, **info: None)
    opts = opts.checked()
    out = Path(out).expanduser()
    partial = out.with_name(out.name + ".partial")
    if out.exists() and not force:
        raise BriskError(f"{out} already exists (use --force to replace it)")
    texts = calibration.load_texts(opts.calib) if opts.method in CALIBRATED else None

    early = _check_input(model, out)
    if early is not None:  # an HF folder's config.json: shape errors before the weights load
        opts = _check_shapes(opts, early)
    report("loading", model=model or "default")
    # quantize="none": GGUF blocks widened to float too; they are the base the new format starts from
    llm = LLM.load(model, device="cpu", dtype="float32", ctx=max(16, opts.seq_len or 16), quantize="none")
    ckpt, net, cfg = llm.checkpoint, llm.model, llm.config
    opts = _check_shapes(opts, cfg)
    dtype = _float_dtype(ckpt)
    config = hf_export.source_config(ckpt, dtype)  # fails now, not after an hour, for an unexportable model
    ids = None
    if texts is not None:
        ids = calibration.calibration_batch(llm.tokenizer, texts, opts.samples, opts.seq_len)
        report("calibration", samples=opts.samples, seq_len=opts.seq_len, tokens=ids.numel())

    fmt, qcfg = _format(opts, dtype)
    key = _run_key(ckpt, opts, dtype, texts)
    done = _resume_state(partial, key)
    _check_disk(out, partial, done, _estimate_bytes(cfg, opts))
    _prepare_partial(partial, key, opts, done, report)

    summary = QuantSummary(llm.name, str(out), opts.method, _public_options(opts),
                           "output" if ids is not None else "weight", float_dtype=str(dtype).removeprefix("torch."),
                           calibration_tokens=0 if ids is None else ids.numel(), source_bytes=ckpt.file_bytes)
    summary.kept_float = ["model.embed_tokens", "lm_head" + (" (tied)" if cfg.tie_embeddings else ""), "norms"]
    summary.fp16_bytes = 2 * sum(p.numel() for p in {id(p): p for p in net.parameters()}.values())

    with torch.no_grad():
        _quantize_blocks(net, ids, opts, fmt, qcfg, dtype, partial, done, report, summary)
        report("writing", out=str(out))
        _assemble(net, cfg, ckpt, config, qcfg, opts, dtype, partial, max_shard_bytes)
    if out.exists():  # --force: the old folder goes only once the new one is complete
        os.replace(out, partial / "replaced")
    os.replace(partial / "output", out)
    shutil.rmtree(partial, ignore_errors=True)
    summary.out_bytes = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    summary.seconds = time.perf_counter() - t_start
    return summary


# ---------------------------------------------------------------- the block loop

def _quantize_blocks(net, ids, opts, fmt, qcfg, dtype, partial, done, report, summary) -> None:
    layers = net.model.layers
    stop_after = int(os.environ.get(STOP_ENV, "0").split(":")[0] or 0)
    x = rope = mask = None
    if ids is not None:
        _round_(net.model.embed_tokens.weight, dtype)  # calibrate on the embeddings the checkpoint will hold
        x = net.model.embed_tokens(ids)
        if net.cfg.embed_scale != 1.0:
            x = x * torch.tensor(net.cfg.embed_scale, dtype=x.dtype)
        T = ids.shape[1]
        rope = [(c[:T], s[:T]) for c, s in net.rope]
        mask = net._masks(0, T, ids.device)
    report("start", total=len(layers), done=len(done))
    fresh = 0
    for i in range(len(layers)):
        block, prefix = layers[i], f"model.layers.{i}."
        t0 = time.perf_counter()
        if i in done:
            tensors = _load_layer(partial, i) if x is not None else None
            stats = LayerStats(i, done[i]["seconds"], done[i]["errors"], resumed=True)
        else:
            for p in _float_params(block):
                _round_(p, dtype)
            if opts.method == "gptq":
                tensors, errors = _gptq_block(block, x, rope, mask, opts)
            elif opts.method == "awq":
                tensors, errors = _awq_block(block, x, rope, mask, opts)
            else:
                tensors, errors = _bnb_block(block, opts, fmt, qcfg, dtype)
            tensors = {prefix + k: v for k, v in tensors.items()}
            tensors.update({prefix + n: p.to(dtype) for n, p in _named_float_params(block)})
        if x is not None:
            _install(block, tensors, prefix, fmt, qcfg)
            x = _run_block(block, x, rope, mask)
        if i not in done:
            stats = LayerStats(i, time.perf_counter() - t0, errors)
            _save_layer(partial, i, tensors, stats)
            fresh += 1
        layers[i] = nn.Identity()  # done with it: its tensors are on disk
        summary.layers.append(stats)
        report("layer", stats=stats, total=len(layers))
        if stop_after and fresh >= stop_after and i + 1 < len(layers):
            if os.environ[STOP_ENV].endswith(":sigint"):  # a real Ctrl-C, at a known point
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler raises KeyboardInterrupt here
            raise BriskError(f"stopped after {fresh} blocks ({STOP_ENV}); run again to resume")


class _NoCache:
    """Calibration runs whole sequences once: attention needs this block's K/V only, so the
    'cache' hands them straight back instead of storing them."""

    @staticmethod
    def write(layer, start, k, v):
        return k, v


def _run_block(block, x, rope, mask):
    """The block over the calibration batch, a few sequences at a time (always the same split,
    so a resumed run computes the same bytes)."""
    chunk = max(1, CHUNK_TOKENS // x.shape[1])
    return torch.cat([block(x[s:s + chunk], rope, _NoCache, 0, mask) for s in range(0, len(x), chunk)])


def _linears(block) -> dict[str, nn.Linear]:
    return {n: block.get_submodule(n) for n in LINEARS}


def _named_float_params(block):
    """The block's tensors that stay float in the checkpoint: norms, and biases."""
    quantized = {f"{n}.weight" for n in LINEARS}
    return [(n, p) for n, p in block.named_parameters() if n not in quantized]


def _float_params(block):
    return [p for _, p in _named_float_params(block)]


def _round_(p: torch.Tensor, dtype: torch.dtype) -> None:
    p.copy_(p.to(dtype).float())


def _install(block, tensors: dict, prefix: str, fmt, qcfg: dict) -> None:
    """Make the block compute exactly what the checkpoint's tensors say: each linear's weight
    becomes its dequantized codes, the float tensors their stored (rounded) values. The same
    function runs for fresh and resumed blocks, which is what keeps resumed output identical."""
    for name, lin in _linears(block).items():
        full = prefix + name
        sub = {k: v for k, v in tensors.items() if k.startswith(full + ".")}
        bias = sub.pop(full + ".bias", None)
        layer = fmt.load_linear(sub, full, qcfg, bias)
        lin.weight.copy_(layer.dequantize(torch.float32))
    for name, p in _named_float_params(block):
        p.copy_(tensors[prefix + name].float())


# ---------------------------------------------------------------- the methods, per block

class _Stop(Exception):
    """Raised by a capture hook: the rest of the block's forward is not needed."""


def _capture(block, x, rope, mask, feeds: dict, stop_at: nn.Module) -> None:
    """Run the block over the calibration batch, handing the input of each linear in `feeds`
    ({linear: fn(x)}) to its function, and cut each forward short at `stop_at`'s input."""
    def hook(mod, args):
        if mod in feeds:
            feeds[mod](args[0])
        if mod is stop_at:
            raise _Stop

    handles = [m.register_forward_pre_hook(hook) for m in {**feeds, stop_at: None}]
    chunk = max(1, CHUNK_TOKENS // x.shape[1])
    try:
        for s in range(0, len(x), chunk):
            try:
                block(x[s:s + chunk], rope, _NoCache, 0, mask)
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()


# GPTQModel's "true sequential" order: the linears reading one input are quantized together, and
# each step's inputs come from the block with the earlier steps' linears already quantized.
GPTQ_STEPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
              ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def _gptq_block(block, x, rope, mask, opts):
    from ..quant.gptq import GPTQ

    lins = _linears(block)
    tensors, errors = {}, {}
    for names in GPTQ_STEPS:
        first = GPTQ(lins[names[0]].weight)
        _capture(block, x, rope, mask, {lins[names[0]]: first.add_batch}, stop_at=lins[names[0]])
        for n in names:
            g = first if n == names[0] else _same_inputs(GPTQ(lins[n].weight), first)
            res = g.quantize(bits=opts.bits, group_size=opts.group_size, sym=opts.sym, act_order=opts.act_order,
                             damp=opts.damp)
            tensors.update({f"{n}.{k}": v for k, v in res.tensors().items()})
            errors[n] = float(res.error)
            lins[n].weight.copy_(res.dequantized)
    return tensors, errors


def _same_inputs(g, src):
    """Give GPTQ `g` the Hessian `src` accumulated: the linears read the same input, and the
    Hessian depends on the input only (it is copied before use, so sharing is safe)."""
    g.H, g.n = src.H, src.n
    return g


# Which captured input each linear reads (q/k/v share one, gate/up another).
AWQ_FEED = {"self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.q_proj",
            "self_attn.v_proj": "self_attn.q_proj", "self_attn.o_proj": "self_attn.o_proj",
            "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.gate_proj", "mlp.down_proj": "mlp.down_proj"}


def _awq_block(block, x, rope, mask, opts):
    """AutoAWQ's recipe: scales searched on the float block's inputs for each group of linears that
    share an input, folded into the op before them; then a clip search per linear (not q/k, whose
    products go through softmax) on the scaled inputs; then min/max quantization."""
    from ..quant import awq

    lins = _linears(block)
    feeds = {n: [] for n in dict.fromkeys(AWQ_FEED.values())}
    _capture(block, x, rope, mask, {lins[n]: lambda t, acc=acc: acc.append(t.reshape(-1, t.shape[-1]))
                                    for n, acc in feeds.items()}, stop_at=lins["mlp.down_proj"])
    inputs = {n: _subsample(torch.cat(v), AWQ_SEARCH_TOKENS) for n, v in feeds.items()}
    groups = awq_groups(block)
    scales = [awq.search_scales(inputs[AWQ_FEED[names[0]]], [lins[n].weight for n in names], opts.bits,
                                opts.group_size) for _, names in groups]
    for (prev, names), s in zip(groups, scales):  # all searched first, on the float block, as AutoAWQ does
        fold_scales(block, prev, names, s)
        inputs[AWQ_FEED[names[0]]] = inputs[AWQ_FEED[names[0]]] / s
    tensors, errors = {}, {}
    for n, lin in lins.items():
        xs, w = inputs[AWQ_FEED[n]], lin.weight
        clip = None if n in ("self_attn.q_proj", "self_attn.k_proj") else awq.search_clip(xs, w, opts.bits, opts.group_size)
        res = awq.quantize(w, opts.bits, opts.group_size, clip=clip, x=xs)
        tensors.update({f"{n}.{k}": v for k, v in res.tensors().items()})
        errors[n] = float(res.error)
    return tensors, errors


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


def _bnb_block(block, opts, fmt, qcfg, dtype):
    """No calibration: each weight (rounded to the checkpoint's float dtype, what bitsandbytes would
    quantize) is quantized on its own; the error is the weight's."""
    tensors, errors = {}, {}
    for n, lin in _linears(block).items():
        w = lin.weight.to(dtype)
        t = fmt.quantize_int8(w) if opts.method == "int8" else \
            fmt.quantize_4bit(w, quant_type=opts.method, blocksize=64, double_quant=opts.double_quant)
        deq = fmt.load_linear({f"{n}.{k}": v for k, v in t.items()}, n, qcfg, None).dequantize(torch.float32)
        wf = w.float()
        errors[n] = float((deq - wf).pow(2).sum() / wf.pow(2).sum().clamp(min=1e-30))
        tensors.update({f"{n}.{k}": v for k, v in t.items()})
    return tensors, errors


def _format(opts: QuantOptions, dtype: torch.dtype):
    """The format module (quant/*_format.py) and the quantization_config for config.json."""
    if opts.method == "gptq":
        from ..quant import gptq_format as fmt

        return fmt, fmt.quantization_config(bits=opts.bits, group_size=opts.group_size, sym=opts.sym,
                                            desc_act=opts.act_order, damp=opts.damp)
    if opts.method == "awq":
        from ..quant import awq_format as fmt

        return fmt, fmt.quantization_config(bits=opts.bits, group_size=opts.group_size)
    from ..quant import bnb_format as fmt

    return fmt, fmt.quantization_config(opts.method, double_quant=bool(opts.double_quant), blocksize=64,
                                        compute_dtype=str(dtype).removeprefix("torch."), skip_modules=["lm_head"])


# ---------------------------------------------------------------- shapes, sizes, dtypes

def _check_input(model: str | None, out: Path):
    """A quantized model is not a base for another format; and OUT must not be the model itself.
    Returns the ModelConfig of an HF folder (read from config.json alone), None for a GGUF."""
    from .checkpoint import resolve
    from .config import from_hf_config

    _, path = resolve(model)
    if out.resolve() in (path.resolve(), path.resolve().parent if path.is_file() else None):
        raise BriskError(f"{out} is the input model's own folder; write the output elsewhere")
    if path.is_dir() and (path / "config.json").is_file():
        qcfg = json.loads((path / "config.json").read_text()).get("quantization_config")
        if qcfg:
            raise BriskError(f"{model} is already quantized ({qcfg.get('quant_method', '?')}); "
                             "brisk quantize starts from a float or GGUF model")
        return from_hf_config(json.loads((path / "config.json").read_text()))
    return None


def _shapes(cfg) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear in a block."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"self_attn.q_proj": (q, cfg.dim), "self_attn.k_proj": (kv, cfg.dim), "self_attn.v_proj": (kv, cfg.dim),
            "self_attn.o_proj": (cfg.dim, q), "mlp.gate_proj": (cfg.ffn_dim, cfg.dim),
            "mlp.up_proj": (cfg.ffn_dim, cfg.dim), "mlp.down_proj": (cfg.dim, cfg.ffn_dim)}


def _check_shapes(opts: QuantOptions, cfg) -> QuantOptions:
    """Pick the default group size for this model, and check that its shapes fit the format
    (and the calibration sequences its context)."""
    if opts.method not in CALIBRATED:
        return opts
    if opts.seq_len > cfg.max_seq_len:
        raise BriskError(f"--seq-len {opts.seq_len} exceeds the model's context ({cfg.max_seq_len})")
    shapes = _shapes(cfg)
    ins = sorted({k for _, k in shapes.values()})
    if opts.group_size is None:
        fits = [g for g in AUTO_GROUPS if all(k % g == 0 for k in ins)]
        if not fits and opts.method == "awq":
            raise BriskError(f"awq needs a group size of 32, 64 or 128 dividing every layer's in_features ({ins})")
        opts = replace(opts, group_size=fits[0] if fits else -1)
    g = opts.group_size
    for name, (n, k) in shapes.items():
        if g != -1 and k % g:
            raise BriskError(f"--group-size {g} does not divide {name}'s in_features ({k}); "
                             f"try {' or '.join(str(x) for x in AUTO_GROUPS if k % x == 0) or '-1'}")
        per_int = 32 if opts.bits == 3 else 32 // opts.bits  # values packed per int32 (3-bit: 32 in 3 words)
        along = (k, n) if opts.method == "gptq" else (n,)  # gptq packs qweight along K, qzeros along N; awq along N
        if any(d % per_int for d in along):
            raise BriskError(f"{name} ({n}x{k}) cannot be packed {opts.bits}-bit in the {opts.method} layout "
                             f"(needs multiples of {per_int})")
    return opts


def _float_dtype(ckpt) -> torch.dtype:
    """The checkpoint's float tensors keep the source's 16-bit dtype; from float32 or GGUF: float16,
    bfloat16 for Gemma 3 (trained in bf16; its activations overflow float16)."""
    if ckpt.kind == "hf":
        cfg = json.loads((ckpt.path / "config.json").read_text())
        src = cfg.get("torch_dtype") or cfg.get("dtype") or (cfg.get("text_config") or {}).get("torch_dtype")
        if src in ("float16", "bfloat16"):
            return getattr(torch, src)
    return torch.bfloat16 if ckpt.config.arch == "gemma3" else torch.float16


def _estimate_bytes(cfg, opts: QuantOptions) -> int:
    per_layer = 0
    for n, k in _shapes(cfg).values():
        if opts.method in CALIBRATED:
            groups = 1 if opts.group_size == -1 else k // opts.group_size
            per_layer += n * k * opts.bits // 8 + groups * n * (2 + opts.bits / 8) + 4 * k
        elif opts.method == "int8":
            per_layer += n * k + 4 * n
        else:
            per_layer += n * k // 2 + n * k // 64 * (1 if opts.double_quant else 4)
    floats = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2) + (cfg.n_layers * 4 + 1) * cfg.dim
    return int(per_layer * cfg.n_layers + 2 * floats)


def _check_disk(out: Path, partial: Path, done: dict, estimate: int) -> None:
    """The block files and the final shards coexist for a moment: about twice the output."""
    have = sum(_layer_path(partial, i).stat().st_size for i in done)
    need = int(2.05 * estimate) - have
    where = out.parent
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need:
        raise BriskError(f"not enough disk space in {where}: the output needs about {_mb(need)}, {_mb(free)} free")


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MB" if n < 2**30 else f"{n / 2**30:.2f} GB"


def _public_options(opts: QuantOptions) -> dict:
    return {k: v for k, v in asdict(opts).items() if v is not None and k != "method"}


# ---------------------------------------------------------------- the partial folder (resume)

def _run_key(ckpt, opts: QuantOptions, dtype: torch.dtype, texts) -> str:
    """A hash of everything the output depends on: a partial run with another key is discarded."""
    files = [ckpt.path] if ckpt.path.is_file() else sorted(
        p for p in ckpt.path.iterdir() if p.suffix in (".safetensors", ".json", ".bin"))
    ident = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    blob = json.dumps({"v": _VERSION, "model": [str(ckpt.path.resolve()), ident], "opts": asdict(opts),
                       "calib": calibration.texts_digest(texts) if texts else None, "dtype": str(dtype)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _read_manifest(partial: Path) -> dict | None:
    try:
        return json.loads((partial / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def _resume_state(partial: Path, key: str) -> dict[int, dict]:
    """The blocks a previous run with the same key finished: {index: stats} (read only)."""
    if not partial.exists():
        return {}
    info = _read_manifest(partial)
    if info is None and (not partial.is_dir() or any(partial.iterdir())):
        raise BriskError(f"{partial} exists and is not a brisk partial run; remove it")
    if info is None or info.get("key") != key:
        return {}
    return {int(i): v for i, v in info.get("layers", {}).items() if _layer_path(partial, int(i)).is_file()}


def _prepare_partial(partial: Path, key: str, opts: QuantOptions, done: dict, report) -> None:
    """Keep a matching partial run (resume), or start a clean one."""
    if done:
        report("resume", layers=len(done))
        return
    if partial.exists():
        if _read_manifest(partial) and _read_manifest(partial).get("layers"):
            report("restart", reason="the unfinished run there used other arguments or another model")
        shutil.rmtree(partial)
    (partial / "layers").mkdir(parents=True)
    write_text_atomic(partial / "manifest.json", json.dumps({"key": key, "options": asdict(opts), "layers": {}}))


def _layer_path(partial: Path, i: int) -> Path:
    return partial / "layers" / f"layer_{i:04d}.safetensors"


def _save_layer(partial: Path, i: int, tensors: dict, stats: LayerStats) -> None:
    from safetensors.torch import save_file

    path = _layer_path(partial, i)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)
    manifest = partial / "manifest.json"
    info = json.loads(manifest.read_text())
    info["layers"][str(i)] = {"seconds": stats.seconds, "errors": stats.errors}
    write_text_atomic(manifest, json.dumps(info))


def _load_layer(partial: Path, i: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(_layer_path(partial, i)))


def _assemble(net, cfg, ckpt, config, qcfg, opts, dtype, partial: Path, max_shard_bytes: int) -> None:
    """partial/output: config.json (+ quantization_config), shards, tokenizer, generation config."""
    dest = partial / "output"
    if dest.exists():
        shutil.rmtree(dest)  # from a run that died while writing
    dest.mkdir()
    tensors = {"model.embed_tokens.weight": net.model.embed_tokens.weight.to(dtype)}
    for i in range(cfg.n_layers):
        tensors.update(_load_layer(partial, i))
    tensors["model.norm.weight"] = net.model.norm.weight.to(dtype)
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = net.lm_head.weight.to(dtype)
    hf_export.write_shards(dest, tensors, max_shard_bytes)
    hf_export.write_json(dest / "config.json", {**config, "quantization_config": qcfg})
    if opts.method == "gptq":  # the older AutoGPTQ loaders read it from here
        hf_export.write_json(dest / "quantize_config.json", qcfg)
    hf_export.write_tokenizer(ckpt, dest)
    hf_export.write_generation_config(ckpt, dest)
