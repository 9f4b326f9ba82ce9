"""The Triton dequantize-matmul kernels (quant/triton_matmul.py) against a float64 reference.

On a machine without a GPU they run under Triton's interpreter on CPU tensors (conftest.py sets
TRITON_INTERPRET=1), so CI checks the same kernel code that runs on CUDA."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the CUDA kernels' tests need it)")

from brisk.quant import triton_matmul as tm  # noqa: E402
from brisk.quant.linear import Int4Linear, Int8Linear, dequantize_int4, pack_int4  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def skip_interpreted_bf16_dot(M, dtype):
    if DEV == "cpu" and dtype == torch.bfloat16 and M > tm.GEMM_ROWS:
        pytest.skip("Triton's interpreter computes tl.dot on bfloat16 inputs wrongly (float32 is checked here, bf16 on CUDA)")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(y).any()
    return float((y.double() - ref).norm() / ref.norm())


def random_int4(N, K, G, gen):
    q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(N, K // G, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    zeros = (torch.randn(N, K // G, generator=gen) * 0.05).to(torch.bfloat16)
    return pack_int4(q), scales, zeros


@pytest.mark.parametrize("M", [1, 3, 20])
@pytest.mark.parametrize("N,K,G", [(40, 256, 32), (64, 384, 128), (24, 96, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matmul(M, N, K, G, dtype):
    skip_interpreted_bf16_dot(M, dtype)
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    packed, scales, zeros = random_int4(N, K, G, gen)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = dequantize_int4(packed, scales, zeros, G, torch.float64)
    ref = x.double() @ w.T
    y = tm.int4_matmul(x.to(DEV), packed.to(DEV), scales.to(DEV), zeros.to(DEV), G)
    assert y.dtype == dtype and y.shape == (M, N)
    assert rel_err(y.cpu(), ref) < (2e-5 if dtype == torch.float32 and DEV == "cpu" else 1e-2)


@pytest.mark.parametrize("M", [1, 5, 33])
@pytest.mark.parametrize("N,K", [(48, 200), (16, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matmul(M, N, K, dtype):
    skip_interpreted_bf16_dot(M, dtype)
    gen = torch.Generator().manual_seed(M * 7 + N + K)
    q = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8)
    scales = (torch.rand(N, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16)
    x = torch.randn(M, K, generator=gen).to(dtype)
    ref = x.double() @ (q.double() * scales.double()[:, None]).T
    y = tm.int8_matmul(x.to(DEV), q.to(DEV), scales.to(DEV))
    assert y.dtype == dtype and y.shape == (M, N)
    assert rel_err(y.cpu(), ref) < (2e-5 if dtype == torch.float32 and DEV == "cpu" else 1e-2)


def test_gemv_writes_every_output():
    """Poisoned outputs: N not a multiple of the GEMV tile, so the masked tail must still be written."""
    gen = torch.Generator().manual_seed(3)
    packed, scales, zeros = random_int4(37, 128, 32, gen)
    x = torch.randn(1, 128, generator=gen)
    y = tm.int4_matmul(x.to(DEV), packed.to(DEV), scales.to(DEV), zeros.to(DEV), 32).cpu()
    ref = x.double() @ dequantize_int4(packed, scales, zeros, 32, torch.float64).T
    assert torch.isfinite(y).all() and rel_err(y, ref) < 1e-4
