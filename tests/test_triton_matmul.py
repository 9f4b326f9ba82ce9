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


@pytest.mark.parametrize("M", [1, 7, 16, 40])
@pytest.mark.parametrize("N,K,G", [(40, 256, 32), (64, 384, 128), (24, 512, 64), (16, 576, 64), (8, 512, 256)])
@pytest.mark.parametrize("split", [None, 3])
def test_int4_planes_matmul(M, N, K, G, split):
    """The planes kernel (every row of a tile against each weight word once; K split across
    programs, partial sums added after) against float64: ragged N and M tiles, K not a whole
    number of 128-column blocks (576), a group spanning two blocks (256)."""
    gen = torch.Generator().manual_seed(M * 100 + N + K)
    q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    packed, scales, zeros = pack_int4(q), *random_int4(N, K, G, gen)[1:]
    x = torch.randn(M, K, generator=gen)
    ref = x.double() @ dequantize_int4(packed, scales, zeros, G, torch.float64).T
    words = tm.pack_int4_planes(q)
    assert words.dtype == torch.int32 and words.shape == (N, -(-K // 128) * 16)
    assert torch.equal(tm.unpack_int4_planes(words, K), q)
    sz = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()
    cfg = None if split is None else dict(BLOCK_N=32, BLOCKS=2, WAVES=0, SPLIT=split, num_warps=4, num_stages=2)
    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    y = tm.int4_planes_matmul(x.to(dtype).to(DEV), words.to(DEV), sz.to(DEV), G, cfg)
    assert y.dtype == dtype and y.shape == (M, N)
    assert rel_err(y.cpu(), ref) < (2e-6 if DEV == "cpu" else 1e-2)


def test_int4_planes_words_hold_the_codes():
    """Bit for bit: in 128-column block b, nibble j of word c is code (n, 128b + 16j + c), the
    top nibble's 8..15 included; the padded tail holds zeros."""
    q = torch.randint(0, 16, (5, 160), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    q[0, 112] = q[1, 127] = 15
    words = tm.pack_int4_planes(q).to(torch.int64) & 0xFFFFFFFF
    assert words.shape == (5, 32)
    for n in range(5):
        for k in range(256):
            b, j, c = k // 128, k % 128 // 16, k % 16
            assert int(words[n, 16 * b + c] >> (4 * j) & 0xF) == (int(q[n, k]) if k < 160 else 0)


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU, test_cuda.py::test_int4_cuda_layouts covers it")
def test_int4_linear_planes_layout_fused():
    """Int4Linear holding the planes layout (as on CUDA; here set by hand and run interpreted): its
    codes read back from the words, and q/k/v-style fusion keeps each original's columns."""
    from brisk.quant.linear import _pack, concat_linears, unpack_int4

    torch.manual_seed(0)
    parts = [Int4Linear.from_float(torch.nn.Linear(384, n, bias=False), 64) for n in (128, 32, 32)]
    codes = [m.codes().clone() for m in parts]
    for m in parts:
        m._set_kernel_data(_pack(unpack_int4(m.codes()), "planes"), "planes")
        assert m.weight is None and torch.equal(m.codes(), codes[parts.index(m)])
    fused = concat_linears(parts)
    assert fused is not None and fused.layout == "planes" and fused._packed.shape == (192, 48)
    x = torch.randn(5, 384)
    y = tm.int4_planes_matmul(x, fused._packed, fused._scales_zeros, 64)
    for m, part, c in zip(parts, y.split([128, 32, 32], dim=-1), codes):
        ref = x.double() @ dequantize_int4(c, m.scales, m.zeros, 64, torch.float64).T
        assert rel_err(part, ref) < 2e-6
        # the same columns alone: equal up to the interpreter's numpy dot, whose rounding can
        # depend on an output row's place in the tile (on the GPU: test_cuda.py)
        assert rel_err(tm.int4_planes_matmul(x, m._packed, m._scales_zeros, 64), part.double()) < 1e-6
