"""GGUF's MXFP4 (gpt-oss's expert weights) kept in its blocks and run by brisk's native kernels, in the
file's layout and interleaved by 8, at every instruction-set level this CPU has: dequantization bit for
bit the gguf package's (tiny scales included: e = 0 and 1 give float denormals), row lookups, products
within the 16-bit activations' rounding and independent of the batch, and the gguf package's
dequantization where the kernels are off."""
from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from brisk.quant import gguf_interleave, native
from brisk.quant.gguf_linear import GGUFLinear

from int_dot_bound import activation_bound

MXFP4 = int(gguf.GGMLQuantizationType.MXFP4)
N = 37  # rows: four groups of 8 and a tail of 5 in the file's layout; tiles of 4 with a ragged last one
K = 512
LAYOUTS = ["file", "x8"]


@pytest.fixture
def kernels():
    if not native.available():
        pytest.skip("the native kernels are not available (no C compiler, or BRISK_NATIVE=0)")


@functools.cache
def blocks(source: str) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [N, K / 32 * 17] and gguf's dequantization of them, float32 [N, K]. "quantized": gguf's
    quantization of rows of several magnitudes, with all-zero blocks, blocks near the smallest normal
    float (scales e = 0, 1, 2, 3) and blocks whose e is then set to 0..5 (their weights denormals);
    "random": random bytes with e in 0..140."""
    rng = np.random.default_rng(39 + (source == "random"))
    nb = K // 32
    if source == "quantized":
        x = rng.standard_normal((N, nb, 32)) * 10.0 ** rng.uniform(-3, 1, (N, 1, 1))
        x[:, 1] = 0.0
        for e in range(4):  # largest |x| in [2^(e - 125), 2^(e - 124)): gguf picks e
            x[:, 2 + e] = rng.uniform(-1, 1, (N, 32)) * 2.0 ** (e - 125) * 1.9
        raw = gguf.quants.quantize(x.reshape(N, K).astype(np.float32), MXFP4).reshape(N, nb, 17)
        assert (raw[:, 2:6, 0] == np.arange(4)).all()
        raw[:, 6:12, 0] = np.arange(6)  # a normal block's codes with the smallest scales
    else:
        raw = rng.integers(0, 256, (N, nb, 17), dtype=np.uint8)
        raw[:, :, 0] = rng.integers(0, 141, (N, nb))
    raw = np.ascontiguousarray(raw.reshape(N, -1))
    ref = gguf.quants.dequantize(raw, MXFP4)
    assert ref.shape == (N, K) and ref.dtype == np.float32 and np.isfinite(ref).all()
    tiny = (ref != 0) & (np.abs(ref) < np.finfo(np.float32).tiny)
    assert tiny.any() or source == "random"  # denormal weights (e < 2): a reference that has them
    assert len(np.unique(ref)) > 100
    return raw, ref


def weight(source: str, layout: str) -> tuple[native.NativeWeight, np.ndarray]:
    raw, ref = blocks(source)
    assert native.takes(MXFP4, K)
    data = torch.from_numpy(raw)
    if layout == "x8":
        packed = gguf_interleave.pack(data, MXFP4)
        assert not torch.equal(packed, data) and torch.equal(gguf_interleave.unpack(packed, MXFP4), data)
        return native.NativeWeight(MXFP4, N, K, packed, layout=native.X8), ref
    return native.NativeWeight(MXFP4, N, K, data), ref


def test_block_shape_and_takes():
    assert native.GGUF_TYPES[MXFP4] == "MXFP4" and native.BLOCK[MXFP4] == (32, 17)
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.MXFP4] == (32, 17)
    assert MXFP4 in native.INT_DOT_TYPES and MXFP4 not in native.SUPER_TYPES
    assert gguf_interleave.packable(MXFP4, 8, 32) and not gguf_interleave.packable(MXFP4, 7, 32)
    if native.available():
        assert native.takes(MXFP4, 2880) and not native.takes(MXFP4, 2880 + 16)


@pytest.mark.parametrize("source", ["quantized", "random"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dequantize_is_gguf_bit_for_bit(kernels, level, layout, source):
    w, ref = weight(source, layout)
    got = w.dequantize().numpy()
    if not np.array_equal(got, ref):
        bad = np.argwhere(got != ref)[0]
        pytest.fail(f"{layout} level {level}: {(got != ref).sum()} weights differ, first {bad}: "
                    f"{got[tuple(bad)]!r} != {ref[tuple(bad)]!r}")
    ids = torch.tensor([[N - 1, 0, 5], [5, 33, 2]])  # any order, repeats, a row past the last group of 8
    rows = w.rows(ids)
    assert rows.shape == (2, 3, K) and torch.equal(rows, torch.from_numpy(ref[ids.numpy()]))
    with pytest.raises(IndexError):
        w.rows(torch.tensor([N]))


@pytest.fixture(params=["16-bit", "float32"])
def activations(request):
    """MXFP4's products both ways: exact int32 sums of its kvalues and 16-bit activations (int_dot.h,
    the default), or dequantized tiles times float32 activations (BRISK_INT_DOT=0)."""
    native.set_int_dot(request.param == "16-bit")
    yield request.param
    native.set_int_dot(True)


@pytest.mark.parametrize("source", ["quantized", "random"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matmul_is_close_and_batch_invariant(kernels, level, activations, layout, source):
    w, ref = weight(source, layout)
    wd = torch.from_numpy(ref).double()
    g = torch.Generator().manual_seed(3)
    for M in (1, 3, 17):
        x = torch.randn(M, K, generator=g)
        x[:, 64:96] *= 1e-3  # a block of small inputs: its own activation scale
        y = w.matmul(x)
        assert y.dtype == torch.float32 and y.shape == (M, N)
        want = x.double() @ wd.T
        scale = x.double().abs() @ wd.abs().T  # float32 sums err relative to sum |x w|
        err = (y.double() - want).abs()
        bound = 1e-5 * scale + 1.001 * activation_bound(x, wd, MXFP4) + 1e-30
        assert (err <= bound).all(), f"{layout} M={M}: max error / bound {(err / bound).max().item()}"
        assert err.max() > 0 or activations == "float32"  # the 16-bit grid rounds: the bound is not vacuous
        for i in range(M):  # alone, each row gives the bits it gives in the batch
            assert torch.equal(w.matmul(x[i:i + 1])[0], y[i]), f"{layout} M={M}: row {i} differs alone"


def test_joined_with_other_types_across_threads(kernels):
    """A decode step's gate/up: MXFP4 weights joined with each other and another type, rows split
    across threads mid-group: each weight's outputs are its own product's."""
    (a, _), (b, _) = weight("quantized", "x8"), weight("random", "file")
    q8 = gguf.quants.quantize(np.random.default_rng(1).standard_normal((N, K)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    c = native.NativeWeight(8, N, K, torch.from_numpy(np.ascontiguousarray(q8)))
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    native.set_threads(2)
    try:
        joined = native.JoinedWeights([a, b, c]).matmul(x)
    finally:
        native.set_threads(torch.get_num_threads())
    assert torch.equal(joined, torch.cat([a.matmul(x), b.matmul(x), c.matmul(x)], dim=1))


def test_packing_in_chunks_is_the_same(monkeypatch):
    raw, _ = blocks("random")
    whole = gguf_interleave.pack(torch.from_numpy(raw), MXFP4)
    monkeypatch.setattr(gguf_interleave, "CHUNK", 16)  # 37 rows: two chunks of 16, then a tail of 5
    out = torch.full(raw.shape, 7, dtype=torch.uint8)
    assert gguf_interleave.pack(torch.from_numpy(raw), MXFP4, out=out) is out
    assert torch.equal(out, whole) and torch.equal(gguf_interleave.unpack(out, MXFP4), torch.from_numpy(raw))


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "gguf"])
def test_gguf_layer_as_a_checkpoint_keeps_it(monkeypatch, native_on):
    """core/checkpoint.py keeps MXFP4 as a GGUFLinear, interleaved; with the kernels off (BRISK_NATIVE=0,
    or a tensor off the CPU) it dequantizes with the gguf package from the file's layout again."""
    from brisk.core import checkpoint

    if native_on and not native.available():
        pytest.skip("the native kernels are not available")
    monkeypatch.setattr(native, "ENABLED", native_on)
    raw, ref = blocks("quantized")
    layer = checkpoint.kept_layer(torch.from_numpy(raw), MXFP4, N, K)
    assert isinstance(layer, GGUFLinear) and layer.layout == native.X8 and layer.type_name == "MXFP4"
    assert layer.native == native_on
    assert torch.equal(layer.dequantize(), torch.from_numpy(ref))
    assert torch.equal(layer.rows(torch.tensor([3, 36])), torch.from_numpy(ref[[3, 36]]))
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(5))
    want = x.double() @ torch.from_numpy(ref).double().T
    y = layer(x)
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    if not native_on:
        assert torch.equal(y, F.linear(x, torch.from_numpy(ref)))
