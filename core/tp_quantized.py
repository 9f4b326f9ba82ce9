"""Tensor parallelism (`--tp N`) over checkpoints stored quantized: GPTQ, AWQ, bitsandbytes
(NF4/FP4 and int8) and gpt-oss's MXFP4 experts. Each rank's part of every decoder projection is
cut from the checkpoint's own tensors before the layers are built, so the kernels pack the shard
alone and no rank holds a whole quantized layer past its cut.

The parts are Megatron's (core/tensor_parallel.py): q/k/v and gate/up keep output channels, o and
down a span of input columns, and a quantized output layer its span of the vocabulary (channels).
An output channel's codes, zero point and scale belong to it alone in every format, so a
column-parallel part is any set of channels (AWQ and GPTQ pack zeros along the output channels:
they are unpacked, selected and packed again). A span of input columns keeps whole quantization
groups or it is refused, as the groups' scales are shared by their columns:
- GPTQ: the groups g_idx names (act-order included: a rank's columns keep their g_idx, renumbered
  over the groups the rank holds, and an act-order layer whose groups straddle the cut is refused);
- AWQ: groups of group_size consecutive columns;
- NF4/FP4: blocks of blocksize along the row-major flattened weight, so a row must be whole
  blocks for any cut, and a span starts and ends on a block;
- int8: a per-row scale, any span;
- MXFP4 (the experts, as GGUF rows of 17-byte blocks: mxfp4_format): blocks of 32 columns.
The checks run from the checkpoint's small tensors (g_idx, scales' shapes, quant_state) before any
rank starts (`check`); each rank then rewrites its tensors in place (`cut`) and the format's loader
reads them as a checkpoint of the shard's shapes.
"""
from __future__ import annotations

import contextlib
import json
import torch

from .checkpoint import release_mapped_tensors, trim_heap
from .errors import BriskError, FileError
from .tp_split import Part, check_blocks, parts, span
from ..quant import awq_format, bnb_format, gptq_format, mxfp4_format, packing
from ..quant.errors import FormatError
from ..quant.formats import find_format

FORMATS = {gptq_format: "GPTQ", awq_format: "AWQ", bnb_format: "bitsandbytes", mxfp4_format: "MXFP4"}
_NF4_STATES = tuple(f".weight.quant_state.bitsandbytes__{t}" for t in bnb_format.QUANT_TYPES)


def quantized_layers(tensors: dict) -> list[str]:
    """The prefixes of the layers a checkpoint stores quantized (GPTQ/AWQ, bitsandbytes 4- and 8-bit,
    MXFP4)."""
    names = []
    for key in tensors:
        for end in (".qweight", ".SCB", mxfp4_format.SUFFIX) + _NF4_STATES:
            if key.endswith(end):
                names.append(key[:-len(end)])
    return names


def check(ckpt, world: int) -> None:
    """Refuse, before any rank starts, a quantized checkpoint whose layers do not split over
    `world` ranks: a format not sharded, a quantized layer outside the decoder projections and the
    output layer, a quantized output layer whose vocabulary does not split in equal parts, or a
    rank's part that cuts a group or block (named with the layer)."""
    try:
        fmt = find_format(ckpt.quant_config)
    except Exception:  # the load itself reports an unknown format
        fmt = None
    if fmt not in FORMATS:
        raise BriskError(f"--tp {world}: {ckpt.name} is stored as {ckpt.quant_config.get('quant_method', '?')}, "
                         "a format not sharded yet (float, GGUF blocks, GPTQ, AWQ, bitsandbytes and MXFP4 are)")
    every = [_parts(ckpt.config, r, world) for r in range(world)]
    stored = set(quantized_layers(ckpt.tensors))
    outside = sorted(stored - every[0].keys())
    if outside:
        raise BriskError(f"--tp {world}: {outside[0]} is stored quantized ({FORMATS[fmt]}), and only the decoder "
                         "layers' q/k/v/o and MLP projections and the output layer are sharded")
    vocab = ckpt.config.vocab_size
    if "lm_head" in stored and vocab % world:  # no padding of a quantized format's channels
        raise BriskError(f"--tp {world}: lm_head is stored quantized ({FORMATS[fmt]}), and its vocabulary of {vocab} "
                         f"does not split over {world} ranks in equal parts")
    for prefix in every[0]:  # in the model's order: the first layer that does not split is named
        if prefix in stored:
            with _unreadable(ckpt, prefix):
                _check_layer(ckpt.tensors, prefix, ckpt.quant_config, [p[prefix] for p in every], world)


def _parts(cfg, rank: int, world: int) -> dict[str, Part]:
    """Every decoder projection's part, and the output layer's: its rank's span of the vocabulary
    (output channels), as tensor_parallel cuts a float head when the parts are equal."""
    return {**parts(cfg, rank, world), "lm_head": Part(torch.arange(*span(cfg.vocab_size, rank, world)))}


@contextlib.contextmanager
def _unreadable(ckpt, prefix: str):
    """A layer's tensors that are missing or of the wrong shapes: the error the load gives, one line."""
    try:
        yield
    except FormatError as e:
        raise FileError(str(e), ckpt.name) from None
    except (KeyError, IndexError, ValueError, RuntimeError, TypeError, ZeroDivisionError) as e:
        raise FileError(f"{prefix}: quantized tensors missing or of inconsistent shapes ({e})", ckpt.name) from None


def _check_layer(t: dict, prefix: str, qcfg: dict, ps: list[Part], world: int) -> None:
    spans = [(p.lo, p.hi) for p in ps if p.rows is None]
    columns = ", ".join(str(hi - lo) for lo, hi in spans)
    if prefix + ".qweight" in t:
        name, g, bits = _groups(t, prefix, qcfg)
        run = 32 // bits if 32 % bits == 0 else 32  # values that fill whole words
        channels = [len(p.rows) for p in ps if p.rows is not None]
        if any(n % (8 if name == "AWQ" else run) for n in channels):  # zeros (AWQ: codes too) packed along them
            raise BriskError(f"--tp {world}: {prefix}'s {name} zero points, packed {8 if name == 'AWQ' else run} "
                             f"to a word along its output channels, do not split over {world} ranks "
                             f"({', '.join(map(str, channels))} channels each)")
        if any(lo % run or hi % run for lo, hi in spans):  # the codes are packed along the input columns
            raise BriskError(f"--tp {world}: {prefix}'s {bits}-bit codes of packed words do not split over {world} "
                             f"ranks ({columns} columns each)")
        full = torch.bincount(g)
        for lo, hi in spans:
            part = torch.bincount(g[lo:hi], minlength=full.numel())
            if bool(((part != 0) & (part != full)).any()):
                act_order = name == "GPTQ" and not bool((g[1:] >= g[:-1]).all())
                raise BriskError(f"--tp {world}: {prefix}'s {name} groups " +
                                 ("(act-order, desc_act) straddle a rank's part of its input columns" if act_order
                                  else f"of {int(full.max())} columns do not split over {world} ranks")
                                 + f" ({columns} columns each)")
    if any(prefix + s in t for s in _NF4_STATES):
        s = _quant_state(t, prefix)  # unreadable: a KeyError here, reported as the load would
        check_blocks(prefix, s["quant_type"].upper(), int(s["blocksize"]), s["shape"][1], spans, world)
    if prefix + mxfp4_format.SUFFIX in t:  # rows of whole blocks: only the columns' cut can split one
        check_blocks(prefix, "MXFP4", 32, 32, spans, world)


def _quant_state(t: dict, prefix: str) -> dict:
    """A bitsandbytes 4-bit layer's quant_state JSON."""
    stored = next(t[prefix + s] for s in _NF4_STATES if prefix + s in t)
    return json.loads(bytes(stored.to(torch.uint8).numpy()).decode("utf-8"))


def _groups(t: dict, prefix: str, qcfg: dict) -> tuple[str, torch.Tensor, int]:
    """(format name, each input column's group [K], bits) of a GPTQ or AWQ layer."""
    if awq_format.detect(qcfg):
        K, G = t[prefix + ".qweight"].shape[0], t[prefix + ".scales"].shape[0]
        return "AWQ", torch.arange(K) // (K // G), 4
    layer = gptq_format.layer_config(qcfg, prefix) or {}
    bits, gs = layer.get("bits", 4), layer.get("group_size", -1)
    K = t[prefix + ".qweight"].shape[0] * 32 // bits
    g = t.get(prefix + ".g_idx")
    return "GPTQ", torch.arange(K) // (K if gs == -1 else gs) if g is None else g.long(), bits


def cut(ckpt, rank: int, world: int) -> set[str]:
    """This rank's part of every quantized layer, in place of the whole in ckpt.tensors (check
    passed on every rank's parts). Returns the names of the layers cut: the model's shard leaves
    them as they are built."""
    t, qcfg = ckpt.tensors, ckpt.quant_config
    mine = _parts(ckpt.config, rank, world)
    done = set()
    for prefix in quantized_layers(t):
        whole = {k: v for k, v in t.items() if k.startswith(prefix + ".")}
        with _unreadable(ckpt, prefix):
            _cut_layer(t, prefix, mine[prefix], qcfg)
        read = {v.untyped_storage().data_ptr() for v in whole.values()}
        for k in whole.keys() & t.keys():
            if t[k].untyped_storage().data_ptr() in read:  # kept as it is (g_idx, a code book, rank 0's bias)
                t[k] = _own(t[k])
        # every tensor the rank keeps is its own now: the file's pages of the whole layer can go
        release_mapped_tensors(whole.values())
        done.add(prefix)
    trim_heap()  # the unpacked whole layers' temporaries
    return done


def _cut_layer(t: dict, prefix: str, p: Part, qcfg: dict) -> None:
    if prefix + ".qweight" in t:
        (_cut_awq if awq_format.detect(qcfg) else _cut_gptq)(t, prefix, p, qcfg)
    elif prefix + mxfp4_format.SUFFIX in t:  # GGUF rows [N, K / 32 * 17 bytes]: a span of whole blocks
        rows, b = t[prefix + mxfp4_format.SUFFIX], mxfp4_format.BLOCK_BYTES
        t[prefix + mxfp4_format.SUFFIX] = _own(rows[p.rows] if p.rows is not None else
                                               rows[:, p.lo // 32 * b:p.hi // 32 * b])
    elif prefix + ".SCB" in t:
        w = t[prefix + ".weight"]
        t[prefix + ".weight"] = _own(w[p.rows] if p.rows is not None else w[:, p.lo:p.hi])
        if p.rows is not None:
            t[prefix + ".SCB"] = t[prefix + ".SCB"][p.rows]
    else:
        _cut_4bit(t, prefix, p, qcfg)
    bias = t.get(prefix + ".bias")
    if bias is not None and p.rows is not None:
        t[prefix + ".bias"] = bias[p.rows]
    elif bias is not None and not p.keep_bias:
        del t[prefix + ".bias"]


def _own(x: torch.Tensor) -> torch.Tensor:
    """x in storage of its own: a slice of a memory-mapped file would keep the whole tensor's pages."""
    return x.clone(memory_format=torch.contiguous_format)


def _channels(packed: torch.Tensor, rows: torch.Tensor, per: int, unpack, pack) -> torch.Tensor:
    """Output channels `rows` of a tensor packed `per` channels to a word along its last dim: whole
    words where the channels come in aligned runs of `per` (heads and MLP spans do), else unpacked,
    selected and packed again."""
    runs = rows.view(-1, per) if rows.numel() % per == 0 else None
    if runs is not None and bool((runs[:, 0] % per == 0).all()) and bool((runs == runs[:, :1] + torch.arange(per)).all()):
        return packed[:, runs[:, 0] // per]
    return pack(unpack(packed)[:, rows])


def _cut_gptq(t: dict, prefix: str, p: Part, qcfg: dict) -> None:
    """qweight [K*b/32, N] (packed along K), qzeros [G, N*b/32] (packed along N), scales [G, N], g_idx [K]."""
    _, g, bits = _groups(t, prefix, qcfg)
    qweight, qzeros, scales = t[prefix + ".qweight"], t[prefix + ".qzeros"], t[prefix + ".scales"]
    if p.rows is not None:
        t[prefix + ".qweight"] = _own(qweight[:, p.rows])
        if 32 % bits == 0:
            t[prefix + ".qzeros"] = _channels(qzeros, p.rows, 32 // bits, lambda x: packing.unpack(x, bits),
                                              lambda x: packing.pack(x, bits))
        else:  # 3 bits: values straddle words
            t[prefix + ".qzeros"] = packing.pack(packing.unpack(qzeros, bits)[:, p.rows], bits)
        t[prefix + ".scales"] = _own(scales[:, p.rows])
        return
    words = bits if 32 % bits else 1  # a run of 32/bits values (3 bits: 32 values in 3 words)
    per = 32 // bits if 32 % bits == 0 else 32
    t[prefix + ".qweight"] = _own(qweight[p.lo // per * words:p.hi // per * words])
    mine = g[p.lo:p.hi]
    held = torch.unique(mine)  # sorted: the rank's groups keep their order
    t[prefix + ".qzeros"], t[prefix + ".scales"] = _own(qzeros[held]), _own(scales[held])
    if prefix + ".g_idx" in t:
        t[prefix + ".g_idx"] = torch.searchsorted(held, mine).to(t[prefix + ".g_idx"].dtype)


def _cut_awq(t: dict, prefix: str, p: Part, qcfg: dict) -> None:
    """qweight [K, N/8] and qzeros [G, N/8] packed along N (interleaved), scales [G, N]."""
    qweight, qzeros, scales = t[prefix + ".qweight"], t[prefix + ".qzeros"], t[prefix + ".scales"]
    if p.rows is not None:
        t[prefix + ".qweight"] = _channels(qweight, p.rows, 8, awq_format.unpack_awq, awq_format.pack_awq)
        t[prefix + ".qzeros"] = _channels(qzeros, p.rows, 8, awq_format.unpack_awq, awq_format.pack_awq)
        t[prefix + ".scales"] = _own(scales[:, p.rows])
        return
    gs = qweight.shape[0] // scales.shape[0]
    t[prefix + ".qweight"] = _own(qweight[p.lo:p.hi])
    t[prefix + ".qzeros"] = _own(qzeros[p.lo // gs:p.hi // gs])
    t[prefix + ".scales"] = _own(scales[p.lo // gs:p.hi // gs])


def _cut_4bit(t: dict, prefix: str, p: Part, qcfg: dict) -> None:
    """NF4/FP4: the loader reads the layer (double quantization undone), its rows or block columns
    are kept, and they go back as a plain (not double-quantized) layer of the shard's shape."""
    keys = [k for k in t if k.startswith(prefix + ".weight")]
    dtype = _quant_state(t, prefix).get("dtype", "float32")  # what bitsandbytes dequantizes to: kept
    whole = bnb_format.load_linear({k: t.pop(k) for k in keys}, prefix, qcfg, None)
    N, K, bs = whole.out_features, whole.in_features, whole.blocksize
    codes, absmax = whole.weight.view(N, K // 2), whole.absmax.view(N, K // bs)
    if p.rows is not None:
        codes, absmax, n, k = codes[p.rows], absmax[p.rows], len(p.rows), K
    else:
        codes, absmax = codes[:, p.lo // 2:p.hi // 2], absmax[:, p.lo // bs:p.hi // bs]
        n, k = N, p.hi - p.lo
    state = {"quant_type": whole.quant_type, "blocksize": bs, "dtype": dtype, "shape": [n, k]}
    t.update({prefix + ".weight": _own(codes).view(-1, 1), prefix + ".weight.absmax": _own(absmax).view(-1),
              prefix + ".weight.quant_map": whole.code,
              f"{prefix}.weight.quant_state.bitsandbytes__{whole.quant_type}": bnb_format.json_tensor(state)})
