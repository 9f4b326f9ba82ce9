"""Matrix-vector speed of the CPU backends on SmolLM2-135M's layer shapes (the decode bottleneck).

Weights are 30 layers' worth of distinct matrices (about 400 MB), so each product streams from
DRAM as in real decoding. Run: .venv/bin/python bench/gemv.py
"""
import torch

from run import median_time as median_s  # bench/run.py, beside this script

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30


def main():
    ws = [torch.randn(o, i) for o, i in SHAPES]
    nps = [w.numpy() for w in ws]
    xs = {576: torch.randn(1, 576), 1536: torch.randn(1, 1536)}
    nbytes = sum(w.numel() for w in ws) * 4
    big = torch.randn(50_000_000)
    rows = [("torch.sum (read bandwidth)", big.numel() * 4 / median_s(lambda: big.sum()) / 1e9)]
    with torch.inference_mode():
        rows.append(("torch F.linear (MKL)", nbytes / median_s(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in ws]) / 1e9))
        from brisk.core import blas

        for n in (1, 2):  # brisk uses 1 (see core/blas.py); 2 only pays on an idle machine
            blas._set_openblas_threads(n)
            rows.append((f"numpy @ (OpenBLAS, {n} thread{'s' * (n > 1)})",
                         nbytes / median_s(lambda: [w @ xs[w.shape[1]][0].numpy() for w in nps]) / 1e9))
    print(f"{torch.get_num_threads()} torch threads")
    for name, gbs in rows:
        print(f"| {name} | {gbs:.1f} GB/s |")


if __name__ == "__main__":
    main()
