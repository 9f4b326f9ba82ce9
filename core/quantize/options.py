"""What the user asked for, and whether the model can hold it: every refusal that can come before
the weights load (or right after, against the model's shapes) lives here, so a run that starts
does not fail an hour in."""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..errors import BriskError, InvalidValue

METHODS = ("gptq", "awq", "nf4", "fp4", "int8")
GROUPED = ("gptq", "awq")  # a group size, and the GPTQ/AWQ packing
# bitsandbytes' formats run GPTQ on their own grid when calibrated (the default) and can also be
# rounded to nearest, bitsandbytes' own way, with --samples 0 (no calibration data, ~100x faster).
ROUNDABLE = ("nf4", "fp4", "int8")
GPTQ_BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128)  # what --group-size takes (gptq also -1: one group per row)
AUTO_GROUPS = (128, 64, 32)  # the default: the largest that divides every layer's in_features
DEFAULT_SAMPLES, DEFAULT_SEQ_LEN = 32, 256
EMBEDDINGS = ("16bit", "int8")  # the token table (and a tied output layer): the ecosystem's 16 bits, or brisk's 8-bit codes (Q8_0's grid)


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
    samples: int | None = None  # 0: no calibration (round-to-nearest; nf4, fp4, int8 only)
    seq_len: int | None = None
    embedding: str | None = None  # "16bit" (default) or "int8" (quant/embedding_format.py)
    # gptq: ("REGEX=BITS", ...) as given; checked(): ((regex, bits), ...), GPTQModel's "dynamic"
    dynamic: tuple | None = None
    compensate: bool | None = None  # awq: GPTQ's error compensation after AWQ's scales (default on)

    def _dynamic_bits(self, name: str) -> int | None:
        """The bits of the first --dynamic regex matching `name` from its start, None if none does."""
        return next((b for p, b in self.dynamic or () if re.match(p, name)), None)

    def bits_for(self, name: str) -> int:
        """The bits of the layer called `name` (model.layers.N.mlp.down_proj): --dynamic's, else --bits."""
        bits = self._dynamic_bits(name)
        return self.bits if bits is None else bits

    def sym_for(self, name: str) -> bool:
        """--sym, except that --dynamic's 8-bit layers are always symmetric: every zero 128 makes
        them GGUF Q8_0 blocks, which the native kernels run (8 bits leave no room for a zero's gain)."""
        return True if self._dynamic_bits(name) == 8 else self.sym

    @property
    def calibrated(self) -> bool:
        """Whether the method runs on calibration data (of checked() options)."""
        return bool(self.samples)

    def checked(self) -> "QuantOptions":
        """Defaults filled in; a BriskError for anything the method's format cannot hold.
        (The group size is settled later, against the model's shapes.)"""
        m = self.method
        if m not in METHODS:
            raise InvalidValue("method", m, "", template=f"unknown {{option}} {m!r}; use one of {', '.join(METHODS)}")
        _only(m, ("gptq",), act_order=self.act_order, damp=self.damp, dynamic=self.dynamic or None)
        _only(m, ("nf4", "fp4"), double_quant=self.double_quant)
        _only(m, ("awq",), compensate=self.compensate)
        o = replace(self, embedding=self.embedding or "16bit")
        if o.embedding not in EMBEDDINGS:
            raise InvalidValue("embedding", o.embedding, "", template=f"{{option}} must be {' or '.join(EMBEDDINGS)}, not {o.embedding!r}")
        if o.samples == 0 and m in ROUNDABLE:
            for name, value in (("calib", o.calib), ("seq_len", o.seq_len)):
                if value is not None:
                    raise InvalidValue(name, value, "", template="{option} does not apply with --samples 0 (no calibration)")
        else:
            o = replace(o, samples=DEFAULT_SAMPLES if o.samples is None else o.samples,
                        seq_len=o.seq_len or DEFAULT_SEQ_LEN)
            if o.samples < 1:
                raise InvalidValue("samples", o.samples, "", template=f"{{option}} must be at least 1, not {o.samples}" + (
                    " (0: round to nearest, without calibration)" if m in ROUNDABLE else ""))
            if o.seq_len < 16:
                raise InvalidValue("seq_len", o.seq_len, "must be at least 16")
        if m == "gptq":
            o = replace(o, bits=o.bits or 4, sym=True if o.sym is None else o.sym,
                        act_order=bool(o.act_order), damp=0.01 if o.damp is None else o.damp)
            if o.bits not in GPTQ_BITS:
                raise InvalidValue("bits", o.bits, "", template=f"gptq holds {', '.join(map(str, GPTQ_BITS))}-bit weights, not {o.bits}")
            if o.group_size is not None and o.group_size not in (-1, *GROUP_SIZES):
                raise InvalidValue("group_size", o.group_size, "", template=f"gptq {{option}} must be -1, 32, 64 or 128, not {o.group_size}")
            o = replace(o, dynamic=tuple(_dynamic_entry(e) for e in o.dynamic) or None if o.dynamic else None)
            if not 0 < o.damp < 1:
                raise InvalidValue("damp", o.damp, "", template=f"{{option}} must be between 0 and 1 (a fraction of the Hessian's mean diagonal), not {o.damp}")
        elif m == "awq":
            if o.bits not in (None, 4):
                raise InvalidValue("bits", o.bits, "", template=f"awq (GEMM) holds 4-bit weights only, not {o.bits}-bit")
            if o.sym:
                raise InvalidValue("sym", o.sym, "", template="awq stores a zero point per group (asymmetric); {option} does not apply")
            if o.group_size is not None and o.group_size not in GROUP_SIZES:
                raise InvalidValue("group_size", o.group_size, "", template=f"awq {{option}} must be 32, 64 or 128, not {o.group_size}")
            o = replace(o, bits=4, sym=False, compensate=True if o.compensate is None else o.compensate)
        else:
            bits = 8 if m == "int8" else 4
            if o.bits not in (None, bits):
                raise InvalidValue("bits", o.bits, "", template=f"{m} holds {bits}-bit weights, not {o.bits}-bit")
            if o.group_size is not None:
                raise InvalidValue("group_size", o.group_size, "", template=f"{m} has no {{option}}" + (
                    " (bitsandbytes' blocksize is 64)" if bits == 4 else " (one scale per output row)"))
            if o.sym is not None:
                raise BriskError(f"--sym/--asym do not apply to {m}")
            o = replace(o, bits=bits, double_quant=bool(o.double_quant) if m != "int8" else None)
        return o

    def public(self) -> dict:
        """The options a summary shows: those set, less the method."""
        return {k: v for k, v in asdict(self).items() if v is not None and k != "method"}


def _dynamic_entry(entry) -> tuple[str, int]:
    """"REGEX=BITS" -> (regex, bits); a --dynamic that is not one names itself."""
    if isinstance(entry, tuple):
        return entry
    pattern, sep, bits = str(entry).rpartition("=")
    template = f"{{option}} takes REGEX=BITS (e.g. '.*mlp\\.down_proj=8'), not {entry!r}"
    if not sep or not pattern or not bits.strip().isdigit():
        raise InvalidValue("dynamic", entry, "", template=template)
    try:
        re.compile(pattern)
    except re.error as e:
        raise InvalidValue("dynamic", entry, "", template=f"{{option}} {pattern!r} is not a regex ({e})") from None
    if int(bits) not in GPTQ_BITS:
        raise InvalidValue("dynamic", entry, "", template=f"{{option}} {entry!r}: gptq holds {', '.join(map(str, GPTQ_BITS))}-bit weights")
    return pattern, int(bits)


def _only(method: str, allowed: tuple[str, ...], **flags) -> None:
    for name, value in flags.items():
        if value is not None and method not in allowed:
            raise InvalidValue(name, value, "", template=f"{{option}} applies to {' and '.join(allowed)} only, not {method}")


def check_input(model: str | None, out: Path):
    """A quantized model is not a base for another format; and OUT must not be the model itself.
    Returns the ModelConfig of an HF folder (read from config.json alone), None for a GGUF."""
    from ..checkpoint import resolve
    from ..arch import from_hf_config

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


LINEAR_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear in a block (of an MoE block: each expert's)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {"self_attn.q_proj": (q, cfg.dim), "self_attn.k_proj": (kv, cfg.dim), "self_attn.v_proj": (kv, cfg.dim),
           "self_attn.o_proj": (cfg.dim, q)}
    if not cfg.n_experts or cfg.dense_layers:
        out |= {"mlp.gate_proj": (cfg.ffn_dim, cfg.dim), "mlp.up_proj": (cfg.ffn_dim, cfg.dim),
                "mlp.down_proj": (cfg.dim, cfg.ffn_dim)}
    for e in range(cfg.n_experts):
        f = cfg.expert_ffn_dim
        out |= {f"mlp.experts.{e}.gate_proj": (f, cfg.dim), f"mlp.experts.{e}.up_proj": (f, cfg.dim),
                f"mlp.experts.{e}.down_proj": (cfg.dim, f)}
    return out


def check_shapes(opts: QuantOptions, cfg) -> QuantOptions:
    """Pick the default group size for this model, and check that its shapes fit the format
    (and the calibration sequences its context)."""
    if cfg.arch == "gpt_oss":  # no checkpoint layout for its quantized per-expert layers yet
        raise BriskError("brisk quantize does not take gpt-oss models yet (its MXFP4 experts run as they are)")
    if cfg.n_experts and opts.method == "awq":  # its scales fold into the norm every expert shares
        raise BriskError(f"awq does not take mixture-of-experts models ({cfg.arch}) yet: use --method gptq")
    if opts.calibrated and opts.seq_len > cfg.max_seq_len:
        raise InvalidValue("seq_len", opts.seq_len, "", template=f"{{option}} {opts.seq_len} exceeds the model's context ({cfg.max_seq_len})")
    if opts.method not in GROUPED:
        return opts
    linears = shapes(cfg)
    ins = sorted({k for _, k in linears.values()})
    if opts.group_size is None:
        fits = [g for g in AUTO_GROUPS if all(k % g == 0 for k in ins)]
        if not fits and opts.method == "awq":
            raise BriskError(f"awq needs a group size of 32, 64 or 128 dividing every layer's in_features ({ins})")
        opts = replace(opts, group_size=fits[0] if fits else -1)
    g = opts.group_size
    for name, (n, k) in linears.items():
        if g != -1 and k % g:
            raise InvalidValue("group_size", g, "", template=f"{{option}} {g} does not divide {name}'s in_features ({k}); "
                               f"try {' or '.join(str(x) for x in AUTO_GROUPS if k % x == 0) or '-1'}")
        for bits in {opts.bits_for(f"model.layers.{i}.{name}") for i in range(cfg.n_layers)}:
            per_int = 32 if bits == 3 else 32 // bits  # values packed per int32 (3-bit: 32 in 3 words)
            along = (k, n) if opts.method == "gptq" else (n,)  # gptq packs qweight along K, qzeros along N; awq along N
            if any(d % per_int for d in along):
                raise BriskError(f"{name} ({n}x{k}) cannot be packed {bits}-bit in the {opts.method} layout "
                                 f"(needs multiples of {per_int})")
    return opts


def float_dtype(ckpt) -> "torch.dtype":
    """The checkpoint's float tensors keep the source's 16-bit dtype; from float32 or GGUF: float16,
    bfloat16 for Gemma 3 (trained in bf16; its activations overflow float16)."""
    import torch  # here: the options are checked before the CLI imports torch

    if ckpt.kind == "hf":
        cfg = json.loads((ckpt.path / "config.json").read_text())
        src = cfg.get("torch_dtype") or cfg.get("dtype") or (cfg.get("text_config") or {}).get("torch_dtype")
        if src in ("float16", "bfloat16"):
            return getattr(torch, src)
    return torch.bfloat16 if ckpt.config.arch == "gemma3" else torch.float16


def estimate_bytes(cfg, opts: QuantOptions) -> int:
    """About the size of the output folder (for the disk check)."""
    per_layer = 0
    for name, (n, k) in shapes(cfg).items():
        if opts.method in GROUPED:
            groups = 1 if opts.group_size == -1 else k // opts.group_size
            bits = max(opts.bits_for(f"model.layers.{i}.{name}") for i in range(cfg.n_layers))
            per_layer += n * k * bits // 8 + groups * n * (2 + bits / 8) + 4 * k
        elif opts.method == "int8":
            per_layer += n * k + 4 * n
        else:
            per_layer += n * k // 2 + n * k // 64 * (1 if opts.double_quant else 4)
    table = cfg.vocab_size * cfg.dim
    floats = table * (0 if opts.embedding == "int8" else 1) + table * (0 if cfg.tie_embeddings else 1) + (cfg.n_layers * 4 + 1) * cfg.dim
    return int(per_layer * cfg.n_layers + 2 * floats + (table + 2 * cfg.vocab_size if opts.embedding == "int8" else 0))
