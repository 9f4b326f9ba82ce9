"""brisk on a CUDA GPU, one run: the device's copy bandwidth, the quantized kernels against cuBLAS,
batch-1 decode of a Llama-3-8B-shaped model (random weights: decode speed does not depend on the
values) in bf16/int8/int4/NF4 against that bandwidth and against HF transformers, prefill, batched
decode over the paged cache, and speculative decoding.

    python bench/gpu.py [--sections copy,kernels,decode,profile,verify,hf,prefill,batch,spec] [--json out.json]

Each section catches its own failure and goes on; the table at the end is what RESULTS.md records.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from brisk.core.config import ModelConfig  # noqa: E402
from brisk.core.cuda_graph import decode_step  # noqa: E402
from brisk.core.kernel_passes import apply_device_kernels  # noqa: E402
from brisk.core.kv import ContiguousKV  # noqa: E402
from brisk.core.model import LAST, Transformer  # noqa: E402
from brisk.quant import triton_matmul as tm  # noqa: E402
from brisk.quant.linear import quantize_model  # noqa: E402

LLAMA3_8B = dict(arch="llama", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                 ffn_dim=14336, norm_eps=1e-5, max_seq_len=8192, rope_theta=500000.0,
                 rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"})
SMOLLM2_135M = dict(arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                    ffn_dim=1536, norm_eps=1e-5, max_seq_len=8192, rope_theta=100000.0, tie_embeddings=True)
SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]  # (N, K) of Llama-3-8B
RESULTS: dict = {}


def log(*a):
    print(*a, flush=True)


def section(fn):
    def run(*a, **k):
        log(f"\n== {fn.__name__} ==")
        t = time.perf_counter()
        try:
            fn(*a, **k)
        except Exception:
            traceback.print_exc()
            RESULTS.setdefault("errors", []).append(fn.__name__)
        log(f"({fn.__name__}: {time.perf_counter() - t:.1f} s)")
        gc.collect()
        torch.cuda.empty_cache()
    return run


def graph_time(fn, reps: int = 20) -> float:
    """Median seconds of one fn() call, replayed from a CUDA graph (no launch gaps)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


# ---------------------------------------------------------------- the ceilings

@section
def copy_bandwidth():
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = graph_time(lambda: dst.copy_(src), reps=10)
    RESULTS["copy_GBps"] = 2 * src.numel() / t / 1e9  # bytes read + bytes written
    log(f"device-to-device copy: {RESULTS['copy_GBps']:.0f} GB/s (read + write)")


# ---------------------------------------------------------------- kernels alone

def _copies(make, nbytes: int, budget: int = 1 << 30):
    """Enough independent weights that cycling through them never hits in L2 (50 MB on an H100)."""
    return [make() for _ in range(max(2, min(64, budget // nbytes)))]


def _sweep(kind: str, sweep: bool, block_ks, fn, n: int):
    """(seconds per matmul, launch config): the current GEMV config, or the best of a sweep."""
    configs = [dict(tm.GEMV[kind])]
    if sweep:
        configs = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw) for bn in (4, 8, 16, 32) for bk in block_ks
                   for nw in (2, 4, 8)]
    best = None
    for cfg in configs:
        tm.GEMV[kind] = cfg
        try:
            t = graph_time(fn) / n
        except Exception as e:  # a config Triton rejects (e.g. too many registers)
            log(f"  {kind} {cfg}: {type(e).__name__}")
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    return best


@section
def kernels(sweep: bool):
    rows = []
    for N, K in SHAPES:
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        entry = {"N": N, "K": K}
        ws = _copies(lambda: torch.randn(N, K, device="cuda", dtype=torch.bfloat16), N * K * 2)
        t = graph_time(lambda: [torch.nn.functional.linear(x, w) for w in ws]) / len(ws)
        entry["bf16_us"], entry["bf16_GBps"] = t * 1e6, N * K * 2 / t / 1e9
        del ws
        for G in (32, 128):
            q4 = _copies(lambda: (torch.randint(0, 255, (N, K // 2), device="cuda", dtype=torch.uint8),
                                  torch.rand(N, K // G, device="cuda").to(torch.bfloat16),
                                  torch.rand(N, K // G, device="cuda").to(torch.bfloat16)), N * K // 2)
            nbytes = N * K // 2 + 2 * 2 * N * K // G
            best = _sweep("int4", sweep, (256, 512, 1024), lambda: [tm.int4_matmul(x, *w, G) for w in q4], len(q4))
            tm.GEMV["int4"] = best[1]
            entry[f"int4_g{G}_us"], entry[f"int4_g{G}_GBps"] = best[0] * 1e6, nbytes / best[0] / 1e9
            entry[f"int4_g{G}_cfg"] = best[1]
            del q4
        q8 = _copies(lambda: (torch.randint(-127, 127, (N, K), device="cuda", dtype=torch.int8),
                              torch.rand(N, device="cuda").to(torch.bfloat16)), N * K)
        best = _sweep("int8", sweep, (128, 256, 512), lambda: [tm.int8_matmul(x, *w) for w in q8], len(q8))
        tm.GEMV["int8"] = best[1]
        entry["int8_us"], entry["int8_GBps"], entry["int8_cfg"] = best[0] * 1e6, N * K / best[0] / 1e9, best[1]
        del q8
        # torch's tinygemm int4 kernel (what gpt-fast uses) on the same shape, for comparison
        try:
            w = torch.randint(0, 255, (N, K // 2), device="cuda", dtype=torch.uint8)
            packed = [torch._convert_weight_to_int4pack(w, 8) for _ in range(max(2, min(64, (1 << 30) // (N * K // 2))))]
            sz = torch.rand(K // 128, N, 2, device="cuda").to(torch.bfloat16)
            t = graph_time(lambda: [torch._weight_int4pack_mm(x, p, 128, sz) for p in packed]) / len(packed)
            entry["tinygemm_g128_us"], entry["tinygemm_g128_GBps"] = t * 1e6, (N * K // 2 + 4 * N * K // 128) / t / 1e9
            del packed
        except Exception as e:
            log(f"  tinygemm: {type(e).__name__}: {str(e)[:100]}")
        rows.append(entry)
        log(json.dumps(entry))
    RESULTS["kernels"] = rows
    # the best config per shape, voted: what GEMV defaults should be
    for kind in ("int4_g32", "int4_g128", "int8"):
        log(kind, [r.get(f"{kind}_cfg") for r in rows])


@section
def small_m():
    """int4 (g128) products with a few activation rows, as a verifying pass over T tokens has:
    torch's tinygemm (what Int4Linear runs on CUDA) against the Triton tiled kernel over a sweep of
    tiles, per Llama-3-8B shape; microseconds per product, weights cycled past the L2."""
    G, rows = 128, []
    configs = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw) for bn in (32, 64, 128) for bk in (128, 256) for nw in (4, 8)]
    blocks = tm._gemm_blocks
    for N, K in SHAPES[:4]:
        q4 = _copies(lambda: (torch.randint(0, 255, (N, K // 2), device="cuda", dtype=torch.uint8),
                              torch.rand(N, K // G, device="cuda").to(torch.bfloat16),
                              torch.rand(N, K // G, device="cuda").to(torch.bfloat16)), N * K // 2, 1 << 28)
        packed = [torch._convert_weight_to_int4pack(w[0], 8) for w in q4]
        sz = torch.rand(K // G, N, 2, device="cuda").to(torch.bfloat16)
        for M in (1, 2, 8, 16, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row = {"N": N, "K": K, "M": M,
                   "tinygemm_us": graph_time(lambda: [torch._weight_int4pack_mm(x, p, G, sz) for p in packed]) / len(packed) * 1e6}
            best = None
            for cfg in configs if M > 1 else [None]:
                if cfg is not None:
                    tm._gemm_blocks = lambda m, c=cfg: dict(c, BLOCK_M=16 if m <= 16 else 64)
                try:
                    t = graph_time(lambda: [tm.int4_matmul(x, *w, G) for w in q4]) / len(q4) * 1e6
                except Exception as e:
                    log(f"  {cfg}: {type(e).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            tm._gemm_blocks = blocks
            row["triton_us"], row["triton_cfg"] = best
            rows.append(row)
            log(json.dumps(row))
        del q4, packed
    RESULTS["small_m"] = rows


@section
def planes(sweep: bool):
    """The planes int4 kernel (reads each weight once for up to 64 rows) against tinygemm, per
    Llama-3-8B shape and row count, microseconds per product, weights cycled past the L2; with
    --sweep, the best launch shape per row bucket becomes tm.PLANES for the sections after."""
    G, rows = 128, []
    configs = [None]
    if sweep:
        configs = [dict(BLOCK_N=bn, BLOCKS=bl, WAVES=w, num_warps=nw, num_stages=st)
                   for bn in (64, 128) for bl in (1, 2) for w in (2, 4) for nw in (4,) for st in (2, 4)]
    votes: dict = {16: {}, 64: {}}
    for N, K in SHAPES[:4]:
        q4 = _copies(lambda: (torch.randint(0, 16, (N, K), device="cuda", dtype=torch.uint8),
                              torch.rand(N, K // G, device="cuda").to(torch.bfloat16)), N * K // 2, 1 << 28)
        packed = [torch._convert_weight_to_int4pack((q[:, 0::2] | q[:, 1::2] << 4).contiguous(), 8) for q, _ in q4]
        words = [tm.pack_int4_planes(q) for q, _ in q4]
        sz = torch.rand(K // G, N, 2, device="cuda").to(torch.bfloat16)
        del q4
        for M in (1, 2, 4, 8, 16, 32, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row = {"N": N, "K": K, "M": M,
                   "tinygemm_us": graph_time(lambda: [torch._weight_int4pack_mm(x, p, G, sz) for p in packed]) / len(packed) * 1e6}
            timed = []
            for cfg in configs:
                try:
                    t = graph_time(lambda: [tm.int4_planes_matmul(x, w, sz, G, cfg) for w in words]) / len(words) * 1e6
                except Exception as e:  # a launch shape Triton rejects
                    log(f"  {cfg}: {type(e).__name__}: {str(e)[:80]}")
                    continue
                timed.append((t, cfg))
                bucket = votes[16 if M <= 16 else 64]
                key = json.dumps(cfg, sort_keys=True)
                n, total = bucket.get(key, (0, 0.0))
                bucket[key] = (n + 1, total + t / row["tinygemm_us"])  # summed time against tinygemm's
            best = min(timed, key=lambda r: r[0])
            row["planes_us"], row["planes_cfg"] = best
            row["planes_GBps"] = (N * K // 2 + 4 * N * K // G) / best[0] / 1e3
            rows.append(row)
            log(json.dumps(row))
        del packed, words
    RESULTS["planes"] = rows
    if sweep:
        for bucket, scores in votes.items():
            runs = max(n for n, _ in scores.values())
            full = {k: total for k, (n, total) in scores.items() if n == runs}  # ran on every shape and M
            best = min(full, key=full.get)
            tm.PLANES[bucket] = json.loads(best)
            log(f"planes rows <= {bucket}: {best} (summed time / tinygemm {full[best]:.2f} over {runs})")
        RESULTS["planes_chosen"] = dict(tm.PLANES)


@section
def kernel_correctness():
    """The Triton kernels on the GPU against float64, fresh random inputs, every row count path."""
    errs = {}
    for M in (1, 4, 16, 64, 300):
        for N, K, G in ((4096, 4096, 32), (1024, 4096, 128), (576, 1536, 32)):
            gen = torch.Generator(device="cuda").manual_seed(M + N)
            q = torch.randint(0, 16, (N, K), device="cuda", dtype=torch.uint8, generator=gen)
            packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
            s = (torch.rand(N, K // G, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
            z = (torch.randn(N, K // G, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
            x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
            w = ((q.double() - 8).view(N, -1, G) * s.double()[..., None] + z.double()[..., None]).view(N, K)
            ref = x.double() @ w.T
            y = tm.int4_matmul(x, packed, s, z, G).double()
            errs[f"int4 M{M} {N}x{K} g{G}"] = float((y - ref).norm() / ref.norm())
            q8 = torch.randint(-127, 128, (N, K), device="cuda", dtype=torch.int8, generator=gen)
            s8 = (torch.rand(N, device="cuda", generator=gen) * 0.01).to(torch.bfloat16)
            ref = x.double() @ (q8.double() * s8.double()[:, None]).T
            errs[f"int8 M{M} {N}x{K}"] = float((tm.int8_matmul(x, q8, s8).double() - ref).norm() / ref.norm())
    from brisk.quant.linear import Int4Linear

    from brisk.quant import linear

    for M, layout in ((1, "tinygemm"), (16, "tinygemm"), (300, "tinygemm"), (1, "planes"), (7, "planes"),
                      (64, "planes"), (300, "planes")):  # the layer as the model runs it
        for N, K, G in ((4096, 4096, 32), (1024, 4096, 128), (576, 1536, 32), (100, 96, 32)):
            lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
            linear.CUDA_INT4 = layout
            layer = Int4Linear.from_float(lin, G)
            linear.CUDA_INT4 = "tinygemm"
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ layer.dequantize(torch.float64).T
            errs[f"Int4Linear[{layer.layout}] M{M} {N}x{K} g{G}"] = float((layer(x).double() - ref).norm() / ref.norm())
    worst = max(errs.values())
    RESULTS["kernel_rel_err_max"] = worst
    log(f"worst relative error over {len(errs)} cases: {worst:.2e} (bf16 inputs: expect 1e-3..1e-2)")
    for k, v in errs.items():
        if v > 1e-2:
            log("  HIGH", k, v)


# ---------------------------------------------------------------- the 8B-shaped model

def build_8b(dtype=torch.bfloat16, shape: dict = LLAMA3_8B) -> Transformer:
    cfg = ModelConfig(**shape)
    with torch.device("meta"):
        net = Transformer(cfg)
    net = net.to_empty(device="cuda").to(dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=gen)
    net.setup_rope(4096, torch.device("cuda"))
    apply_device_kernels(net, torch.device("cuda"))
    return net.eval().requires_grad_(False)


def step_bytes(net) -> int:
    """Bytes a decode step reads: every weight except the embedding table (one row is looked up)."""
    seen, total = set(), 0
    emb = {net.model.embed_tokens.weight.data_ptr()} if hasattr(net.model.embed_tokens, "weight") else set()
    for t in list(net.parameters()) + [b for _, b in net.named_buffers() if b is not None]:
        if t.data_ptr() in seen or t.data_ptr() in emb:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


@torch.inference_mode()
def time_decode(net, n: int = 256, reps: int = 5, prompt: int = 32, graphs: bool = True) -> float:
    """Median tok/s of n greedy steps after a `prompt`-token prefill, as brisk generate runs them."""
    import os

    os.environ["BRISK_CUDA_GRAPHS"] = "1" if graphs else "0"
    cache = ContiguousKV.for_model(net, prompt + n + 1)
    step = decode_step(net, cache)
    ids = torch.randint(0, net.cfg.vocab_size, (1, prompt), device="cuda")
    speeds = []
    for r in range(reps + 1):
        tok = int(net(ids, 0, cache, logit_rows=LAST)[0, -1].argmax())
        torch.cuda.synchronize()
        t = time.perf_counter()
        for pos in range(prompt, prompt + n):
            tok = int(step(tok, pos).argmax())
        torch.cuda.synchronize()
        if r:  # the first run captures the graphs
            speeds.append(n / (time.perf_counter() - t))
    return statistics.median(speeds)


def quantized_copy(net, method: str, group: int = 32):
    q = copy.deepcopy(net)
    if method == "nf4":
        from brisk.quant.linear import replace_linears
        from brisk.quant.nf4 import NF4Linear

        replace_linears(q, NF4Linear.from_float, head=False)
    else:
        quantize_model(q, method, group_size=group, head=True)
    apply_device_kernels(q, torch.device("cuda"))
    return q


@section
def decode(state, only: list[str] = ()):
    net = state.get("net") or build_8b()
    state["net"] = net
    copy_bw = RESULTS.get("copy_GBps")
    rows = []
    from brisk.quant import linear

    variants = [("bf16", None), ("bf16 eager (no graphs)", None), ("int8", "int8"), ("int4 g32", "int4:32"),
                ("int4 g128", "int4:128"), ("int4 g32 planes", "int4:32"), ("int4 g128 planes", "int4:128"),
                ("nf4 (bitsandbytes)", "nf4")]
    names = {n for n, _ in variants}
    for name, method in variants:  # a filter naming a variant exactly takes that one alone
        if only and not any(o == name if o in names else o in name for o in only):
            continue
        try:
            model = net
            linear.CUDA_INT4 = "planes" if "planes" in name else "tinygemm"
            if method:
                m, _, g = method.partition(":")
                model = quantized_copy(net, m, int(g or 32))
            nbytes = step_bytes(model)
            tps = time_decode(model, graphs="eager" not in name, n=128 if "eager" in name or "nf4" in name else 256)
            row = {"variant": name, "tok_s": tps, "step_GB": nbytes / 1e9, "GBps": nbytes * tps / 1e9,
                   "of_copy": nbytes * tps / 1e9 / copy_bw if copy_bw else None}
            rows.append(row)
            log(json.dumps(row))
            if model is not net:
                del model
        except Exception:
            traceback.print_exc()
        gc.collect()
        torch.cuda.empty_cache()
    linear.CUDA_INT4 = "tinygemm"
    RESULTS["decode_8b"] = rows


@section
def profile(state, layout: str = "planes"):
    """Where an int4 g128 decode step's time goes: one eager step under the profiler, its kernels
    grouped by name (count, summed device time); the summed time against the graph replay's step
    time (decode section) says what is launch gaps and what is kernels."""
    import os

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    from brisk.quant import linear

    net = state.get("net") or build_8b()
    state["net"] = net
    linear.CUDA_INT4 = layout
    model = quantized_copy(net, "int4", 128)
    os.environ["BRISK_CUDA_GRAPHS"] = "0"
    with torch.inference_mode():
        cache = ContiguousKV.for_model(model, 64)
        step = decode_step(model, cache)
        tok = 1
        for pos in range(8):
            tok = int(step(tok, pos).argmax())
        torch.cuda.synchronize()
        with profiler(activities=[ProfilerActivity.CUDA]) as p:
            step(tok, 8)
            torch.cuda.synchronize()
    events = [(e.key, e.count, getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0))
              for e in p.key_averages()]
    events = sorted([e for e in events if e[2] > 0], key=lambda e: -e[2])
    total = sum(e[2] for e in events)
    out = {"layout": layout, "kernels": sum(e[1] for e in events), "kernel_us": total,
           "top": [{"name": k[:90], "count": n, "us": round(t, 1)} for k, n, t in events[:14]]}
    log(json.dumps(out, indent=1))
    RESULTS.setdefault("profile", []).append(out)
    linear.CUDA_INT4 = "tinygemm"
    del model


@section
def verify(state):
    """What a speculative round's verifying pass over T tokens (the pending token and T - 1 drafts)
    costs against a one-token decode step, both graph replays, and the same pass run eagerly (as
    every round ran before the verifier had graphs): what a drafter must beat on this GPU."""
    from brisk.core.cuda_graph import verify_pass

    from brisk.quant import linear

    out = {}
    for name, shape, method in (("llama3-8b bf16", LLAMA3_8B, None), ("llama3-8b int4 g128", LLAMA3_8B, "int4"),
                                ("llama3-8b int4 g128 planes", LLAMA3_8B, "int4"), ("llama3-8b int8", LLAMA3_8B, "int8"),
                                ("smollm2-135m bf16", SMOLLM2_135M, None)):
        net = state.get("net") if shape is LLAMA3_8B else None
        net = net or build_8b(shape=shape)
        if shape is LLAMA3_8B:
            state["net"] = net
        linear.CUDA_INT4 = "planes" if "planes" in name else "tinygemm"
        model = quantized_copy(net, method, 128) if method else net
        linear.CUDA_INT4 = "tinygemm"
        with torch.inference_mode():
            cache = ContiguousKV.for_model(model, 1024)
            ids = torch.randint(0, model.cfg.vocab_size, (1, 256), device="cuda")
            model(ids, 0, cache, logit_rows=LAST)
            step = decode_step(model, cache)
            graphed, eager = verify_pass(model, cache, fixed=True), verify_pass(model, cache, fixed=False)

            def median_ms(fn, reps=30):
                for _ in range(3):
                    fn()
                times = []
                for _ in range(reps):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                return statistics.median(times) * 1e3

            base = median_ms(lambda: int(step(5, 256).argmax()))
            row = {"step_ms": base}
            for T in (1, 2, 4, 8, 16, 32, 64):
                toks = list(range(10, 10 + T))
                g = median_ms(lambda: graphed(toks, 256, None, False)[0].argmax(-1).tolist())
                e = median_ms(lambda: eager(toks, 256, None, False)[0].argmax(-1).tolist(), reps=10)
                row[f"T{T}"] = {"graph_ms": g, "graph_x_step": g / base, "eager_ms": e, "eager_x_step": e / base}
            out[name] = row
            log(name, json.dumps(row))
        del model, cache
        gc.collect()
        torch.cuda.empty_cache()
    RESULTS["verify_pass"] = out


@section
def hf(state, single: bool = True):
    """HF transformers on the same shapes (its own random weights), bf16, greedy, static cache."""
    import transformers as tf

    c = LLAMA3_8B
    cfg = tf.LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["dim"], intermediate_size=c["ffn_dim"],
                         num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"],
                         num_key_value_heads=c["n_kv_heads"], max_position_embeddings=8192,
                         rope_theta=c["rope_theta"], rope_scaling=c["rope_scaling"], rms_norm_eps=1e-5)
    if "net" in state:  # one 8B model at a time next to HF's
        del state["net"]
        gc.collect()
        torch.cuda.empty_cache()
    with torch.device("cuda"):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    log(f"transformers {tf.__version__}")
    ids = torch.randint(0, c["vocab_size"], (1, 32), device="cuda")
    out = {}
    for label, kwargs in (("hf eager, dynamic cache", {}), ("hf static cache (+ its auto compile)",
                                                              {"cache_implementation": "static"}))[:2 if single else 0]:
        try:
            def gen(n):
                torch.cuda.synchronize()
                t = time.perf_counter()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)
                torch.cuda.synchronize()
                return time.perf_counter() - t
            t0 = time.perf_counter()
            gen(8)
            gen(8)  # warm-up (compiles where generate compiles)
            log(f"  {label}: warm-up {time.perf_counter() - t0:.0f} s")
            short = statistics.median(gen(1) for _ in range(3))
            full = statistics.median(gen(129) for _ in range(3))
            out[label] = 128 / (full - short)
            log(f"  {label}: {out[label]:.1f} tok/s")
        except Exception:
            traceback.print_exc()
    for b in (16, 64):  # batched greedy, equal-length prompts (no padding), HF's default cache
        try:
            ids_b = torch.randint(0, c["vocab_size"], (b, 32), device="cuda")

            def gen_b(n):
                torch.cuda.synchronize()
                t = time.perf_counter()
                model.generate(ids_b, max_new_tokens=n, min_new_tokens=n, do_sample=False)
                torch.cuda.synchronize()
                return time.perf_counter() - t
            gen_b(4)
            short = statistics.median(gen_b(1) for _ in range(2))
            full = statistics.median(gen_b(65) for _ in range(2))
            out[f"hf dynamic cache x{b} aggregate"] = b * 64 / (full - short)
            log(f"  hf x{b}: {out[f'hf dynamic cache x{b} aggregate']:.1f} tok/s aggregate")
        except Exception:
            traceback.print_exc()
    RESULTS["hf_8b"] = out
    del model


@section
def prefill(state):
    net = state.get("net") or build_8b()
    state["net"] = net
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        cache = ContiguousKV.for_model(net, 600)
        ids = torch.randint(0, net.cfg.vocab_size, (1, 512), device="cuda")
        for _ in range(2):
            net(ids, 0, cache, logit_rows=LAST)
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            net(ids, 0, cache, logit_rows=LAST)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        RESULTS["pp512_tok_s"] = 512 / statistics.median(times)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            net(ids, 0, cache, logit_rows=LAST)
            torch.cuda.synchronize()
        names = {e.key for e in prof.key_averages()}
        attn = sorted(n for n in names if any(s in n.lower() for s in ("flash", "fmha", "attention", "sdpa", "efficient")))
        RESULTS["prefill_attention_kernels"] = attn[:6]
    log(f"pp512: {RESULTS['pp512_tok_s']:.0f} tok/s; attention kernels: {attn[:6]}")


class _Tokens:
    """A stand-in tokenizer for random-token benchmarks: no text, no EOS."""
    bos_id, eos_ids, special_ids, has_chat_template = 1, set(), set(), False

    def decode(self, ids, skip_special=True):
        return ""

    def fit_rows(self, rows, model_name):
        pass


def fake_llm(net):
    from brisk.core.llm import LLM, LoadInfo

    ckpt = SimpleNamespace(name="llama3-8b-shaped (random)")
    return LLM(net, _Tokens(), ckpt, torch.device("cuda"), torch.bfloat16, 4096, LoadInfo(0, step_bytes(net), 0, step_bytes(net)))


@section
def batch(state):
    """The batching engine on the 8B shapes: aggregate decode tok/s at 1, 16 and 64 sequences, its
    decode-only steps as graph replays (core/batching/decode_graphs.py) and eager, against
    single-stream graph decode (what x1 should match)."""
    import os

    from brisk.core.benchmark import run_batch

    net = state.get("net") or build_8b()
    state["net"] = net
    llm = fake_llm(net)
    out = {"single_stream_tok_s": time_decode(net, n=128, reps=3)}
    log(f"single stream (graphs): {out['single_stream_tok_s']:.1f} tok/s")
    for label, flag in (("graphs", "1"), ("eager", "0")):
        os.environ["BRISK_CUDA_GRAPHS"] = flag
        rows = run_batch(llm, [1, 16, 64], 64, 3)
        out[label] = [{"concurrency": r.test, "tok_s": r.tok_s, "spread": r.spread} for r in rows]
        for r in rows:
            log(f"{label} {r.test}: {r.tok_s:.1f} tok/s aggregate (+/- {r.spread:.1f})")
    os.environ["BRISK_CUDA_GRAPHS"] = "1"
    RESULTS["batch_8b"] = out


COPY_PROMPT = ("Repeat the following paragraph exactly, word for word.\n\n"
               "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil "
               "and a rag for the lens. From the gallery he could see the fishing boats returning to the "
               "harbour, their lamps swinging like fireflies over the dark water.")


@section
def spec(state, paths: list[str]):
    """Speculative decoding on CUDA: the 8B-shaped model (random weights: nothing to draft from its
    near-uniform predictions, so this shows the cost of trying) and the real models (acceptance)."""
    from brisk.core import GREEDY, LLM, generate
    from brisk.core.cuda_graph import verify_pass
    from brisk.core.generate import Session
    from brisk.core.spec.build import make_speculator

    def run(llm, ids, draft, n=128):
        draft, _, k = (draft or "").partition("/")
        s = Session(llm, speculator=make_speculator(llm, draft, int(k) if k else "auto") if draft else None)
        list(s.stream(ids, GREEDY, 16))  # warm-up: captures the graphs
        list(s.stream(ids, GREEDY, n))
        return s.last

    out = {}
    cases = []
    if not paths:  # the 8B-shaped model: speed with nothing to draft (measured before: skipped with real models)
        net = state.get("net") or build_8b()
        state["net"] = net
        g = torch.Generator().manual_seed(0)
        cases.append(("llama3-8b-shaped (random)", fake_llm(net), torch.randint(0, 128256, (64,), generator=g).tolist()))
    for path in paths:  # float weights (bf16): the self-draft is an int4 copy of them
        llm = LLM.load(path, device="cuda", quantize="none")
        cases.append((Path(path).name + " (bf16)", llm, llm.prompt_ids(COPY_PROMPT)))
    for name, llm, ids in cases:
        plain = run(llm, ids, None)
        for draft in (None, "ngram", "ngram/4", "self:int4", "self:int4/4", "lookahead", "lookahead/eager"):
            if draft is not None and draft.endswith("/eager"):  # verifying passes as before they had graphs
                generate.verify_pass = lambda model, cache: verify_pass(model, cache, fixed=False)
            r = plain if draft is None else run(llm, ids, draft.removesuffix("/eager"))
            generate.verify_pass = verify_pass
            row = {"tok_s": r.decode_tps, "x_plain": r.decode_tps / plain.decode_tps,
                   "same_as_plain": r.tokens == plain.tokens, "spec": r.spec}
            out[f"{name} {draft or 'plain'}"] = row
            log(name, draft or "plain", json.dumps(row))
    RESULTS["spec"] = out


@section
def models(paths: list[str]):
    """Real models on the GPU against the CPU float32 path: logits over a prompt and the CPU's
    greedy answer, and the GPU's own 32 greedy tokens (graph replays) against the CPU's."""
    from brisk.core import GREEDY, LLM
    from brisk.core.generate import Session

    def greedy(llm, prompt):
        s = Session(llm)
        list(s.stream(prompt, GREEDY, 32))
        return s.last.tokens

    out = {}
    for path in paths:
        name = Path(path).name
        cpu = LLM.load(path, device="cpu", dtype="float32", quantize="none")
        prompt = cpu.prompt_ids("What is the capital of France?")
        ref_tokens = greedy(cpu, prompt)
        ids = prompt + ref_tokens
        ref = cpu.logits(ids)
        cpu_q = LLM.load(path, device="cpu", dtype="float32")  # the default load: GGUF blocks kept
        ref_q_tokens, ref_q = greedy(cpu_q, prompt), cpu_q.logits(ids)
        del cpu, cpu_q
        for label, kw, (rt, rl) in (("cuda float32, float weights", dict(quantize="none", dtype="float32"), (ref_tokens, ref)),
                                    ("cuda bf16, float weights", dict(quantize="none"), (ref_tokens, ref)),
                                    ("cuda bf16, default load", {}, (ref_q_tokens, ref_q))):
            gpu = LLM.load(path, device="cuda", **kw)
            lg = gpu.logits(ids).cpu()
            toks = greedy(gpu, prompt)
            story = gpu.prompt_ids("Write a long story about a lighthouse keeper who finds a message in a bottle.")
            s = Session(gpu)
            for _ in range(2):  # the first run captures the graphs
                list(s.stream(story, GREEDY, 256))
            n_same = next((i for i, (a, b) in enumerate(zip(toks, rt)) if a != b), min(len(toks), len(rt)))
            row = {"model": name, "run": label, "quant": gpu.quantization,
                   "max_abs_diff": float((lg - rl).abs().max()), "logit_range": float(rl.abs().max()),
                   "rel_err": float((lg - rl).norm() / rl.norm()),
                   "top1_agree": float((lg.argmax(-1) == rl.argmax(-1)).float().mean()),
                   "greedy_same_prefix": n_same, "greedy_len": len(rt), "text": gpu.tokenizer.decode(toks)[:80],
                   "decode_tok_s": s.last.decode_tps, "decode_tokens": len(s.last.tokens),
                   "prefill_tok_s": s.last.prefill_tps}
            out[f"{name} {label}"] = row
            log(json.dumps(row))
            del gpu
            gc.collect()
            torch.cuda.empty_cache()
    RESULTS["models"] = out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="copy,correct,kernels,decode,verify,hf,prefill,batch,spec")
    ap.add_argument("--sweep", action="store_true", help="try many GEMV launch shapes per matrix shape")
    ap.add_argument("--variants", default="", help="decode section: only the variants whose names contain one of these (comma-separated)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--hf-batched-only", action="store_true", help="hf section: the x16/x64 rows alone")
    ap.add_argument("--models", default="", help="comma-separated model paths for the models section")
    a = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    import triton

    RESULTS["device"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, triton {triton.__version__}"
    log(RESULTS["device"])
    state: dict = {}
    todo = a.sections.split(",")
    if "copy" in todo:
        copy_bandwidth()
    if "correct" in todo:
        kernel_correctness()
    if "models" in todo:
        models([m for m in a.models.split(",") if m])
    if "kernels" in todo:
        kernels(a.sweep)
    if "planes" in todo:  # before decode and verify: a sweep's choice is what they run
        planes(a.sweep)
    if "decode" in todo:
        decode(state, [v for v in a.variants.split(",") if v])
    if "profile" in todo:
        for layout in ("planes", "tinygemm"):
            profile(state, layout)
    if "verify" in todo:
        verify(state)
    if "small_m" in todo:
        small_m()

    if "prefill" in todo:
        prefill(state)
    if "batch" in todo:
        batch(state)
    if "spec" in todo:
        spec(state, [m for m in a.models.split(",") if m])
    if "hf" in todo:
        hf(state, single=not a.hf_batched_only)
    if a.json:
        Path(a.json).write_text(json.dumps(RESULTS, indent=1, default=str))
    log("\n" + json.dumps({k: v for k, v in RESULTS.items() if k != "kernels"}, indent=1, default=str))


if __name__ == "__main__":
    main()
