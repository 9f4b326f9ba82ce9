"""`brisk quantize --format gguf`: a float (or Q8_0) GGUF model requantized into one of llama.cpp's
mixes, the same type per tensor as `llama-quantize` (quant/gguf_mix.py). --method rtn: the blocks
llama.cpp writes without an importance matrix (quant/kernels/gguf_quantize.h), byte for byte;
--method gptq: the linears by GPTQ on those grids, calibrated (gguf_gptq.py), the rest as rtn. The
metadata (tokenizer, chat template, architecture keys) is copied as the source holds it, with
general.file_type and general.quantization_version set; the file is written atomically
(core/gguf_writer.py). gptq keeps each finished block in OUT.gptq.partial (resume.py's layout; the
writer's OUT.partial is the file being written): a rerun with the same arguments resumes there and
writes the same bytes; rtn (seconds) starts over. A Hugging Face folder is first written as
llama.cpp's float GGUF (gguf_from_hf.py): the output itself for --type F32/F16/BF16, else a hidden
file beside OUT that is requantized as above and removed.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import BriskError, InvalidValue

GGUF_METHODS = ("rtn", "gptq")
# the source types llama.cpp requantizes exactly (their values are float32 without loss)
SOURCE_TYPES = ("F32", "F16", "BF16", "Q8_0")
# --type values that convert a Hugging Face folder without quantizing (gguf_from_hf.py)
FLOAT_TYPES = ("F32", "F16", "BF16")
_REPLACED = ("general.file_type", "general.quantization_version", "split.no", "split.count", "split.tensors.count")


@dataclass
class GGUFSummary:
    out: str
    type: str
    method: str
    source_bytes: int
    out_bytes: int
    tensors: dict[str, int]  # type name -> how many tensors have it
    seconds: float
    quantized: int  # tensors rounded here (the others copied as they were)
    format: str = "gguf"
    calibration_tokens: int = 0
    # gptq: per tensor it covered, [GPTQ's, round-to-nearest's] relative output error on its calibration inputs
    errors: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def check_options(type_name: str | None, method: str | None) -> tuple[object, str]:
    """(the mix, or a float type's name, F32/F16/BF16; the method) for --type/--method, or a
    BriskError naming the flag."""
    from ...quant.gguf_mix import MIXES

    names = ", ".join([*MIXES, *FLOAT_TYPES])
    if type_name is None:
        raise InvalidValue("type", None, "", template=f"--format gguf needs {{option}}: one of {names}")
    if type_name.upper() in FLOAT_TYPES:  # a conversion: nothing is rounded to a grid
        if method not in (None, "rtn"):
            raise InvalidValue("method", method, "", template=f"{{option}} {method} does not apply to --type "
                               f"{type_name.upper()} (a float file: nothing is quantized)")
        return type_name.upper(), "rtn"
    mix = MIXES.get(type_name.upper())
    if mix is None:
        raise InvalidValue("type", type_name, "", template=f"unknown {{option}} {type_name!r}; use one of {names}")
    # gptq by default: its KL to the float model is below rtn's at the same size (docs/quantization.md)
    method = method or "gptq"
    if method not in GGUF_METHODS:
        raise InvalidValue("method", method, "", template=f"--format gguf takes {{option}} {' or '.join(GGUF_METHODS)}, "
                           f"not {method!r}")
    return mix, method


def _model_shape(meta: dict, path: Path):
    from ...quant.gguf_mix import ModelShape, seventy_b

    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise BriskError(f"{path}: no general.architecture in its metadata")
    if arch == "falcon":
        raise BriskError("falcon: llama.cpp's own mix rules for it are not followed yet")

    def first(v):
        return v[0] if isinstance(v, list) and v else v

    n_layer, heads = meta.get(f"{arch}.block_count"), first(meta.get(f"{arch}.attention.head_count"))
    kv = first(meta.get(f"{arch}.attention.head_count_kv", heads))
    if not isinstance(n_layer, int) or not isinstance(heads, int):
        raise BriskError(f"{path}: {arch}.block_count or {arch}.attention.head_count is missing")
    n_expert = int(meta.get(f"{arch}.expert_count", 0) or 0)
    return ModelShape(n_layer=n_layer, gqa=heads // kv if kv else 0, n_expert=n_expert,
                      is_70b=seventy_b(arch, n_layer, heads, kv, n_expert))


def quantize_gguf(model: str | None, out: Path, type_name: str | None, method: str | None = None,
                  force: bool = False, report=lambda event, **info: None, calib: dict | None = None) -> GGUFSummary:
    """Write `model` (a GGUF file, or a Hugging Face folder) as OUT, a GGUF file of the mix `type_name` (Q4_K_M, Q8_0, ...).
    calib: gptq's calibration options (calib, samples, seq_len, damp: QuantOptions' fields)."""
    from ..checkpoint import resolve

    mix, method = check_options(type_name, method)
    if isinstance(mix, str) and calib:  # nothing calibrates a conversion
        flag = next(iter(calib))
        raise InvalidValue(flag, calib[flag], "", template=f"{{option}} does not apply to --type {mix} (nothing is quantized)")
    opts = _gptq_options(calib or {}) if method == "gptq" else None
    out = Path(out)
    if out.is_dir():
        raise InvalidValue("out", str(out), "", template=f"{{option}} {out} is a folder; --format gguf writes one .gguf file")
    if out.exists() and not force:
        raise BriskError(f"{out} exists (--force replaces it)")
    if not out.parent.is_dir():
        raise InvalidValue("out", str(out), "", template=f"{{option}}: no folder {out.parent}")
    name, path = resolve(model)
    if out.resolve() == path.resolve():
        raise BriskError(f"{out} is the input model itself; write the output elsewhere")
    if path.is_dir():
        return _from_hf_folder(name, path, out, mix, method, opts, report)
    if isinstance(mix, str):
        raise InvalidValue("type", mix, "", template=f"{{option}} {mix} converts a Hugging Face folder; {name} is a "
                           "GGUF file already (requantize it with a mix such as Q8_0)")
    return _requantize(name, path, out, mix, method, opts, report)


def _from_hf_folder(name: str, folder: Path, out: Path, mix, method: str, opts, report) -> GGUFSummary:
    """A Hugging Face folder: converted straight to OUT for a float --type, else to a float GGUF
    beside OUT (the checkpoint's own float types, nothing rounded) that is then requantized as a GGUF
    input is, and removed."""
    from ..checkpoint import safetensors_files
    from . import gguf_from_hf

    t0 = time.perf_counter()
    source_bytes = sum(f.stat().st_size for f in safetensors_files(folder))
    title = Path(name).name  # general.name: a hub id's model name, not its cache snapshot's hash
    if isinstance(mix, str):
        report("loading", model=name)
        gguf_from_hf.write(folder, out, mix, name=title, report=report)
        return _float_summary(out, mix, source_bytes, t0)
    source = out.with_name(f".{out.name}.source.gguf")  # hidden, and written atomically itself
    try:
        gguf_from_hf.write(folder, source, None, name=title, report=report)
        # dated as the folder's newest file, not as this conversion: gptq's resume key takes the
        # source's date, so a rerun of an interrupted run resumes
        stamp = max(f.stat().st_mtime_ns for f in folder.iterdir() if f.is_file())
        os.utime(source, ns=(stamp, stamp))
        summary = _requantize(name, source, out, mix, method, opts, report)
    finally:
        if source.exists():  # gptq loaded it: its header cache goes with it
            import shutil

            from ..checkpoint import _gguf_cache_dir

            shutil.rmtree(_gguf_cache_dir(source), ignore_errors=True)
            source.unlink()
    summary.source_bytes, summary.seconds = source_bytes, round(time.perf_counter() - t0, 2)
    return summary


def _float_summary(out: Path, type_name: str, source_bytes: int, t0: float) -> GGUFSummary:
    from ..gguf_file import open_gguf

    counts: dict[str, int] = {}
    for t in open_gguf(out).tensors:
        counts[_type_name(t.qtype)] = counts.get(_type_name(t.qtype), 0) + 1
    return GGUFSummary(out=str(out), type=type_name, method="convert", source_bytes=source_bytes,
                       out_bytes=out.stat().st_size, tensors=counts, seconds=round(time.perf_counter() - t0, 2),
                       quantized=0)


def _requantize(name: str, path: Path, out: Path, mix, method: str, opts, report) -> GGUFSummary:
    """The GGUF file `path` written as OUT in the mix."""
    from ...quant import gguf_types, native
    from ...quant.gguf_mix import QUANTIZATION_VERSION, file_order, tensor_types
    from .. import gguf_writer
    from ..gguf_file import open_gguf

    partial = gptq_partial(out)
    t0 = time.perf_counter()
    report("loading", model=name)
    src = open_gguf(path)
    shape = _model_shape(src.metadata, path)
    tensors = {t.name: t for t in src.tensors}
    targets = tensor_types({n: (t.shape, t.qtype) for n, t in tensors.items()}, mix, shape)
    order = file_order(tensors)
    for n in order:
        t = tensors[n]
        current = gguf_types.BY_ID.get(t.qtype)
        if targets[n] != t.qtype and (current is None or current.name not in SOURCE_TYPES):
            raise BriskError(f"{name}: tensor {n} is {_type_name(t.qtype)}; --format gguf "
                             f"requantizes from {', '.join(SOURCE_TYPES)} tensors only")
    if any(targets[n] not in (tensors[n].qtype, gguf_types.F16, gguf_types.F32) for n in order) and not native.available():
        raise BriskError("--format gguf needs brisk's native CPU kernels, which could not be built here (a C compiler)")
    # a tensor kept as it is may be of a type brisk does not run: its size is the file's
    entries = [gguf_writer.TensorEntry(n, tensors[n].shape, targets[n], tensors[n].nbytes if targets[n] == tensors[n].qtype
                                       else _nbytes(tensors[n].shape, targets[n])) for n in order]
    records = [bytes(src.data[a:b]) for k, (a, b) in src.kv_spans.items() if k not in _REPLACED]
    records += [gguf_writer.u32_record("general.quantization_version", QUANTIZATION_VERSION),
                gguf_writer.u32_record("general.file_type", mix.file_type)]
    align = src.metadata.get("general.alignment", gguf_writer.DEFAULT_ALIGNMENT)
    done, errors = {}, {}
    if opts is not None:
        from .gguf_gptq import quantized_linears

        wanted = {n: targets[n] for n in order if targets[n] != tensors[n].qtype}
        done, errors = quantized_linears(path, wanted, opts, report, partial)
    report("start", total=len(order), type=mix.name)

    def data():
        for i, n in enumerate(order):
            t, target = tensors[n], targets[n]
            if target == t.qtype:
                blob = src.raw(t)
            elif n in done:
                blob = done.pop(n)
            else:
                rows = src.load(t).numpy().reshape(-1, t.shape[-1])
                blob = rows.astype(np.float16) if target == gguf_types.F16 else \
                    rows if target == gguf_types.F32 else native.quantize_rows(target, rows)
            report("tensor", index=i, name=n, type=_type_name(target), quantized=target != t.qtype)
            yield blob

    report("writing", out=str(out))
    size = gguf_writer.write(out, records, entries, data(), align)
    shutil.rmtree(partial, ignore_errors=True)
    counts: dict[str, int] = {}
    for e in entries:
        counts[_type_name(e.qtype)] = counts.get(_type_name(e.qtype), 0) + 1
    return GGUFSummary(out=str(out), type=mix.name, method=method, source_bytes=path.stat().st_size, out_bytes=size,
                       tensors=counts, seconds=round(time.perf_counter() - t0, 2),
                       quantized=sum(targets[n] != tensors[n].qtype for n in order),
                       calibration_tokens=opts.samples * opts.seq_len if opts else 0, errors=errors)


def gptq_partial(out: Path) -> Path:
    """Where --method gptq keeps its finished blocks until OUT is written."""
    return out.with_name(out.name + ".gptq.partial")


def _gptq_options(calib: dict):
    """--method gptq's calibration options, checked as `brisk quantize --method gptq` checks them."""
    from .options import QuantOptions

    return QuantOptions(method="gptq", **calib).checked()


def _nbytes(shape: tuple[int, ...], qtype: int) -> int:
    from ...quant import gguf_types

    t = gguf_types.BY_ID[qtype]
    n = int(np.prod(shape))
    return n // t.block_weights * t.block_bytes


def _type_name(qtype: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"
