"""How far the native kernels' kept-quantized path is from the same file widened to float32, per GGUF
type: KL(widened || kept) per token, top-1 agreement and the logits' relative error on held-out text.

    python bench/kept_kl.py [--tokens 1024] [--k-quant-act-bits 16] [--models gemma3:Q3_K_M,gemma3:Q2_K]

Both sides hold the same weights (the file's, dequantized exactly on the widened side), so what is
measured is the kernels' arithmetic: 16-bit activations for the integer types, 8-bit ones for the
K-quants (Q4_K, Q5_K, Q6_K; 16-bit with --k-quant-act-bits 16), a different summation order for all. Files: the two real models (SmolLM2 Q4_1, Gemma 3 270M Q4_K_M) and a
4-layer Llama-shaped model with random weights (widths 2048/5632, which every K-quant takes) in each
of llama.cpp's file types. Random weights give near-uniform distributions, on which KL is small
whatever the error: read their relative logit error. Not a test; recorded in bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_files import build_random_llama, model_label, model_path  # noqa: E402

from brisk.core import LLM  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(dim=2048, layers=4, heads=32, kv_heads=4, ffn=5632, vocab=32000, ctx=2048)
FTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q4_K_S", "Q5_K_S", "Q6_K"]


@torch.inference_mode()
def compare(path: Path, n_tokens: int, window: int = 512) -> dict:
    kept = LLM.load(str(path), device="cpu", dtype="float32")
    wide = LLM.load(str(path), device="cpu", dtype="float32", quantize="none")
    ids = kept.tokenizer.encode((ROOT / "bench" / "heldout.txt").read_text(), add_special=False)[:n_tokens]
    kl, agree, num, den = [], 0, 0.0, 0.0
    for s in range(0, len(ids) - 1, window):  # independent windows: each token's context is its window's
        chunk = ids[s:s + window]
        a, b = kept.logits(chunk).double(), wide.logits(chunk).double()
        pa, pb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kl.append((pb.exp() * (pb - pa)).sum(-1))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        num, den = num + float(((a - b) ** 2).sum()), den + float(((b - b.mean(-1, keepdim=True)) ** 2).sum())
    kl = torch.cat(kl)
    return {"kept as": kept.quantization, "tokens": len(kl), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1": agree / len(kl), "rel_logit_err": (num / den) ** 0.5}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--k-quant-act-bits", type=int, choices=(8, 16), default=8)
    ap.add_argument("--models", default=None, help="only these files, as bench/llama_compare.py names them "
                    "(smollm2, gemma3, gemma3:Q3_K_M: Gemma 3 requantized by llama.cpp to that file type, ...)")
    a = ap.parse_args()
    from brisk.quant import native

    native.set_act8(a.k_quant_act_bits == 8)
    if a.models:
        files = {model_label(m): model_path(m) for m in a.models.split(",")}
    else:
        files = {"SmolLM2-135M Q4_1": model_path("smollm2"), "Gemma 3 270M Q4_K_M": model_path("gemma3")}
        files |= {f"random 4x2048 llama {f}": p for f, p in build_random_llama(SMALL, FTYPES).items()}
    print("| file | kept as | tokens | KL mean | KL max | top-1 agreement | relative logit error |")
    print("|---|---|---|---|---|---|---|")
    for name, path in files.items():
        r = compare(path, a.tokens)
        print(f"| {name} | {r['kept as']} | {r['tokens']} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | "
              f"{r['top1']:.1%} | {r['rel_logit_err']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
