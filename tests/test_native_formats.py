"""Every GGUF block format brisk's native kernels read (quant/kernels/gguf_types.h, gguf_kquants.h), at every
instruction-set level this CPU has: dequantization bit-for-bit equal to the gguf package's
(gguf.quants.dequantize), row lookups, and products close to float64 ones with the same weights, each
row's bits independent of the rest of its batch."""
from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch

from brisk.quant import gguf_interleave, native
from brisk.quant.native import JoinedWeights

from int_dot_bound import activation_bound

T = gguf.GGMLQuantizationType
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# Byte offsets of each block's fp16 fields (d, and dmin/m where the type has one): random bytes there
# could be NaN or infinity, so random blocks get sane halves written over them.
FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
               "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
N = 37  # rows: not a multiple of the kernels' tile of 4 (a ragged last tile)


def shapes(name: str) -> list[int]:
    return [256, 512] if name.removesuffix(" x8").endswith("_K") else [96, 512]


CASES = [(name, K) for name in TYPES + ["Q2_K x8", "Q3_K x8", "Q4_K x8", "Q5_K x8", "Q6_K x8", "Q8_0 x8", "Q4_0 x8", "Q4_1 x8",
                                        "Q5_0 x8", "Q5_1 x8"]
         for K in shapes(name)]


@pytest.fixture(autouse=True, scope="module")
def kernels():
    if not native.available():
        pytest.skip("the native kernels are not available (no C compiler, or BRISK_NATIVE=0)")


@functools.cache
def blocks(name: str, K: int, source: str, N: int = N) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [N, row bytes] of type `name` and gguf's dequantization of them, float32 [N, K]. `source`:
    "quantized" (gguf.quants.quantize of random weights, None where the package cannot) or "random" (random
    bytes, fp16 fields overwritten with halves of either sign between 1e-3 and 0.25)."""
    qt = T[name]
    rng = np.random.default_rng([int(qt), K, source == "random"])
    if source == "quantized":
        try:
            raw = gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32), qt)
        except NotImplementedError:
            return None
    else:
        bw, bb = native.BLOCK[int(qt)]
        raw = rng.integers(0, 256, (N, K // bw, bb), dtype=np.uint8)
        for off in FP16_FIELDS[name]:
            half = rng.uniform(1e-3, 0.25, (N, K // bw)) * rng.choice([-1.0, 1.0], (N, K // bw))
            raw[:, :, off:off + 2] = half.astype(np.float16).view(np.uint8).reshape(N, K // bw, 2)
        raw = raw.reshape(N, -1)
    ref = gguf.quants.dequantize(raw, qt)
    assert ref.shape == (N, K) and ref.dtype == np.float32
    assert np.isfinite(ref).all() and ref.std() > 0  # a reference of zeros would prove nothing
    return np.ascontiguousarray(raw), ref


def weight(name: str, K: int, source: str = "random", N: int = N) -> tuple[native.NativeWeight, np.ndarray]:
    """name "Q2_K x8" ... "Q4_1 x8", "Q5_0 x8", "Q5_1 x8": rows interleaved by 8
    (gguf_interleave), as brisk loads those types (N = 37: four groups and a tail of 5 rows in the file's layout)."""
    x8 = name.endswith(" x8")
    name = name.removesuffix(" x8")
    made = blocks(name, K, source, N)
    if made is None:
        pytest.skip(f"the gguf package cannot quantize {name}")
    raw, ref = made
    assert native.takes(int(T[name]), K)
    if x8:
        packed = gguf_interleave.pack(torch.from_numpy(raw), int(T[name]))
        assert torch.equal(gguf_interleave.unpack(packed, int(T[name])), torch.from_numpy(raw))
        return native.NativeWeight(int(T[name]), N, K, packed, layout=native.X8), ref
    return native.NativeWeight(int(T[name]), N, K, torch.from_numpy(raw)), ref


@pytest.mark.parametrize("source", ["quantized", "random"])
@pytest.mark.parametrize("name,K", CASES)
def test_dequantize_is_gguf_bit_for_bit(level, name, K, source):
    w, ref = weight(name, K, source)
    got = w.dequantize()
    assert got.dtype == torch.float32 and got.shape == (N, K)
    if not np.array_equal(got.numpy(), ref):
        bad = np.argwhere(got.numpy() != ref)[0]
        pytest.fail(f"{name} K={K} level {level}: {(got.numpy() != ref).sum()} weights differ, first "
                    f"[{bad[0]}, {bad[1]}]: {got[bad[0], bad[1]].item()!r} != {ref[bad[0], bad[1]]!r}")
    ids = torch.tensor([[N - 1, 0, 5], [5, 17, 2]])  # any order, repeats, any shape
    rows = w.rows(ids)
    assert rows.shape == (2, 3, K)
    assert torch.equal(rows, torch.from_numpy(ref[ids.numpy()]))


@pytest.fixture(params=["8-bit", "16-bit"])
def act_bits(request):
    """The K-quants' activations both ways (int8_dot.h, the default, and int_dot.h's 16-bit grid)."""
    native.set_act8(request.param == "8-bit")
    yield request.param
    native.set_act8(True)


@pytest.mark.parametrize("name,K", CASES)
def test_matmul_is_close_and_batch_invariant(level, name, K):
    _close_and_batch_invariant(name, K)


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("threads", [1, 3])
def test_native_packing_is_the_reference_layout(name, threads):
    """Loads interleave with the kernels' packer (a program of bit moves derived from the layout's
    torch implementation): its bytes are the torch implementation's, for every type, on any threads."""
    raw, _ = blocks(name, 512, "random")
    src = torch.from_numpy(raw)
    ref = gguf_interleave._pack_groups(src[:32], int(T[name]))
    assert gguf_interleave.bit_moves(int(T[name])) is not None
    native.set_threads(threads)
    try:
        out = gguf_interleave.pack(src, int(T[name]))
    finally:
        native.set_threads(torch.get_num_threads())
    assert torch.equal(out[:32], ref) and torch.equal(out[32:], src[32:])


@pytest.mark.parametrize("name,K", [(n, K) for n, K in CASES if n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q2_K x8",
                                                                                 "Q3_K x8", "Q4_K x8", "Q5_K x8", "Q6_K x8")])
def test_k_quants_both_activation_grids(level, act_bits, name, K):
    _close_and_batch_invariant(name, K)


@pytest.mark.parametrize("name", ["Q4_K x8", "Q5_K x8", "Q6_K x8", "Q2_K x8", "Q4_1 x8", "Q8_0 x8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_blocks_keep_each_rows_bits(level, name, threads):
    """A prefill's product against a long K goes through the weight's rows 64 at a time and the
    activations a few rows at a time (X8_PASS_ROWS, x8_act_rows: 16 rows at K = 2048): 77 rows (two
    passes, then a tail in the file's layout) times 40 activation rows (three blocks). Each row is
    still close, and alone gives the bits it gives in the batch."""
    native.set_threads(threads)
    try:
        _close_and_batch_invariant(name, 2048, N=77, Ms=(40,))
    finally:
        native.set_threads(torch.get_num_threads())


def _close_and_batch_invariant(name, K, N=N, Ms=(1, 3, 17)):
    w, ref = weight(name, K, N=N)
    g = torch.Generator().manual_seed(K)
    wd = torch.from_numpy(ref).double()
    for M in Ms:
        x = torch.randn(M, K, generator=g)
        y = w.matmul(x)
        assert y.dtype == torch.float32 and y.shape == (M, N)
        want = x.double() @ wd.T
        scale = x.double().abs() @ wd.abs().T  # float32 sums err relative to sum |x w|
        err = (y.double() - want).abs()
        bound = 1e-5 * scale + 1.001 * activation_bound(x, wd, int(T[name.removesuffix(" x8")])) + 1e-30
        assert (err <= bound).all(), f"{name} M={M}: max error / bound {(err / bound).max().item()}"
        for i in range(M):  # alone, each row gives the bits it gives in the batch
            assert torch.equal(w.matmul(x[i:i + 1])[0], y[i]), f"{name} M={M}: row {i} differs alone"


@pytest.mark.parametrize("name", TYPES)
def test_bad_row_ids_raise(name):
    w, _ = weight(name, shapes(name)[0])
    for bad in ([N], [-1], [0, N + 3]):
        with pytest.raises(IndexError):
            w.rows(torch.tensor(bad))


def _extreme_block(name: str) -> np.ndarray:
    """One super-block whose codes times scales are the format's largest: every int32 sum of the
    256-grid kernels (int_dot.h) at its stated bound when the activations are all at full scale."""
    one = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    if name == "Q2_K":  # every code 3, scale 15, minimum 15; d = 1, dmin = -1: both terms at their largest, adding
        b = np.full(84, 0xFF, np.uint8)
        b[80:82] = one
        b[82:84] = np.frombuffer(np.float16(-1.0).tobytes(), np.uint8)
        return b
    if name == "Q3_K":  # d = 1, every scale -32; weights 0..127 code 3 (q + 4 = 7, the largest unsigned), the rest -4
        b = np.zeros(110, np.uint8)
        b[0:32] = 0x0F  # hmask: the third bits of weights 0..127
        b[32:64] = 0xFF  # qs: their low bits
        b[108:110] = one
        return b
    if name == "Q6_K":  # ql = qh = 0: code - 32 = -32, every scale -128: products of 4096
        b = np.zeros(210, np.uint8)
        b[192:208] = np.uint8(128)
        b[208:210] = one
        return b
    # Q4_K / Q5_K: d = 1, dmin = 0, the 12 scale bytes giving every scale 63 and every minimum 0
    b = np.zeros(144 if name == "Q4_K" else 176, np.uint8)
    b[0:2] = one
    b[4:8], b[8:12], b[12:16] = 0xFF, 0x00, 0x0F
    b[16:] = 0xFF  # every code 15 (Q5_K: qh all ones too, every code 31)
    return b


def _q6k_top_codes() -> np.ndarray:
    """A Q6_K super-block with every code 63 (31 after the offset) and every scale -128: the largest
    pair sums of the 8-bit path's unsigned codes (2 x 63 x 127) times its largest scales."""
    b = np.full(210, 0xFF, np.uint8)
    b[192:208] = np.uint8(128)
    b[208:210] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    return b


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q6_K top codes", "Q2_K x8", "Q3_K x8",
                                  "Q4_K x8", "Q5_K x8", "Q6_K x8", "Q6_K top codes x8"])
def test_extreme_super_blocks_do_not_overflow(level, act_bits, name):
    K, rows = 512, 13  # x8: a group of 8 and 5 rows after it
    x8, name = name.endswith(" x8"), name.removesuffix(" x8")
    top = name == "Q6_K top codes"
    block, name = (_q6k_top_codes(), "Q6_K") if top else (_extreme_block(name), name)
    raw = np.tile(block, (rows, K // 256))
    ref = torch.from_numpy(gguf.quants.dequantize(raw, T[name])).double()
    assert ref.abs().max().item() == (31 * 128 if top else {"Q2_K": 60, "Q3_K": 128, "Q4_K": 945, "Q5_K": 1953, "Q6_K": 4096}[name])
    data = gguf_interleave.pack(torch.from_numpy(raw), int(T[name])) if x8 else torch.from_numpy(raw)
    w = native.NativeWeight(int(T[name]), rows, K, data, layout=native.X8 if x8 else 0)
    x = torch.ones(3, K)
    x[1] = -1.0
    x[2, ::2] = -1.0  # mixed signs: partial sums cancel
    y = w.matmul(x).double()
    want = x.double() @ ref.T
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-3)


@pytest.mark.parametrize("name", ["Q2_K x8", "Q3_K x8", "Q4_K x8", "Q5_K x8", "Q6_K x8", "Q8_0 x8", "Q4_1 x8", "Q5_0 x8",
                                  "Q5_1 x8"])
def test_interleaved_rows_split_anywhere_across_threads(name):
    """Threads split a joined product's rows in chunks counted over all its weights: the second
    weight (after 37 rows) has its groups of 8 cut mid-group. Each row must still get its bits."""
    a, _ = weight(name, 512)
    quantizable = blocks(name.removesuffix(" x8"), 512, "quantized") is not None  # gguf quantizes no K-quant
    b, _ = weight(name, 512, "quantized") if quantizable else (a, None)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    native.set_threads(2)
    try:
        joined = native.JoinedWeights([a, b]).matmul(x)
    finally:
        native.set_threads(torch.get_num_threads())
    assert torch.equal(joined, torch.cat([a.matmul(x), b.matmul(x)], dim=1))


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_packing_in_chunks_and_into_a_given_buffer_is_the_same(name, monkeypatch):
    """Loads pack big matrices a few thousand rows at a time (bounded temporaries), into a buffer the
    loader allocates (huge pages): the bytes must be those of one pass."""
    raw, _ = blocks(name, 512, "random")
    whole = gguf_interleave.pack(torch.from_numpy(raw), int(T[name]))
    monkeypatch.setattr(gguf_interleave, "CHUNK", 16)  # 37 rows: two chunks of 16, then a tail of 5
    out = torch.full(raw.shape, 7, dtype=torch.uint8)
    assert gguf_interleave.pack(torch.from_numpy(raw), int(T[name]), out=out) is out
    assert torch.equal(out, whole)
    assert torch.equal(gguf_interleave.unpack(out, int(T[name])), torch.from_numpy(raw))


@pytest.mark.parametrize("name,K", [(n, K) for n, K in CASES
                                    if n.removesuffix(" x8") in {native.GGUF_TYPES[t] for t in native.ACT8_TYPES}])
def test_heavy_tailed_rows_run_their_remainder(level, name, K):
    """BRISK_ACT8_SPLIT: a heavy-tailed row (an outlier in every 256, as a down projection's input)
    also runs the remainder of its 8-bit rounding: its product lands within the remainder's grid,
    ~254x finer, where the 8-bit grid alone is far off; Gaussian rows do not split (the bits they
    give without it), and every row's bits are its own in any batch."""
    w, ref = weight(name, K)
    wd = torch.from_numpy(ref).double()
    g = torch.Generator().manual_seed(K + 1)
    heavy = torch.randn(3, K, generator=g) * 0.05
    heavy[:, ::256] = 20.0
    x = torch.stack([heavy[0], torch.randn(K, generator=g), heavy[1], heavy[2], torch.randn(K, generator=g)])
    is_heavy = [True, False, True, True, False]
    try:
        native.set_act8_outliers(0.0)  # the exact outlier inputs take precedence over the split
        native.set_act8_split(0.0)
        plain = w.matmul(x)
        native.set_act8_split(1e-3)
        split = w.matmul(x)
        alone = [w.matmul(x[i:i + 1])[0] for i in range(len(x))]
    finally:
        native.set_act8_split(0.0)
        native.set_act8_outliers(native.DEFAULT_ACT8_OUTLIERS)
    want = x.double() @ wd.T
    kind = int(T[name.removesuffix(" x8")])
    bound8 = activation_bound(x, wd, kind)
    scale = x.double().abs() @ wd.abs().T
    for i, h in enumerate(is_heavy):
        assert torch.equal(alone[i], split[i]), f"row {i} differs alone"
        if not h:
            assert torch.equal(split[i], plain[i]), f"Gaussian row {i} was split"
            continue
        err = (split[i].double() - want[i]).abs()
        assert (err <= 1e-5 * scale[i] + 1.001 * bound8[i] / 254 + 1e-30).all(), f"row {i}: {(err / bound8[i]).max()}"
        assert err.max() < (plain[i].double() - want[i]).abs().max() / 20


@pytest.mark.parametrize("name", ["Q4_K x8", "Q6_K x8", "Q6_K", "Q2_K x8", "Q3_K x8", "Q5_K x8"])
def test_outlier_columns_cache_is_bounded(level, name, monkeypatch):
    """The outliers' dequantized columns live in a bounded cache: a weight with room for 3 of them
    gives the bits of one with room for all, in any batch and whatever ran before. A product whose
    columns fit is served from the cache, evicting others (a column dequantized again is the same
    floats); one whose columns do not fit dequantizes their blocks as it goes, to the same bits. Joined
    with a weight of more room, the smaller room decides."""
    K = 1024
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, K, generator=g) * 0.05
    for m in range(6):  # one outlier in blocks 1 and 3 of rows 0-2 (2 columns: they fit), in every block of rows 3-5
        blocks = torch.tensor([1, 3] if m < 3 else [0, 1, 2, 3])
        cols = blocks * 256 + torch.randint(0, 256, (len(blocks),), generator=g)
        x[m, cols] = (10.0 + 10.0 * torch.rand(len(cols), generator=g)) * torch.randn(len(cols), generator=g).sign()
        if m >= 3:  # and a second one in block 0: its entries' order is the same in either path
            x[m, (cols[0] + 1 + torch.randint(0, 255, (1,), generator=g)) % 256] = -8.0
    monkeypatch.setattr(native, "outlier_columns", lambda row_bytes: K)
    wide, _ = weight(name, K)
    monkeypatch.setattr(native, "outlier_columns", lambda row_bytes: 3)
    narrow, _ = weight(name, K)
    try:
        native.set_act8_outliers(0.0)
        plain = wide.matmul(x)
        native.set_act8_outliers(1e-3)
        want = wide.matmul(x)
        got = narrow.matmul(x)
        alone = [narrow.matmul(x[i:i + 1])[0] for i in range(len(x))]
        filled = narrow.cached_columns("filled")
        first = narrow.matmul(x[:1])[0]  # its columns evicted by rows 1 and 2
        again = narrow.matmul(x.flip(0)).flip(0)
        joined = JoinedWeights([wide, narrow]).matmul(x)
    finally:
        native.set_act8_outliers(native.DEFAULT_ACT8_OUTLIERS)
    assert not torch.equal(want, plain)  # the outliers were taken
    assert torch.equal(got, want) and torch.equal(again, want) and torch.equal(first, want[0])
    assert all(torch.equal(a, w) for a, w in zip(alone, want))
    assert torch.equal(joined, torch.cat([want, want], 1))
    assert wide.cached_columns("filled") == wide.cached_columns() == 2 * 3 + 5 * 3  # every column once
    assert narrow.cached_columns("cap") == 3 and narrow.cached_columns() == 3
    assert filled == 6 and narrow.cached_columns("filled") == 8  # rows 0-2 through the cache, row 0 twice


@pytest.mark.parametrize("name,K", [(n, K) for n, K in CASES
                                    if n.removesuffix(" x8") in {native.GGUF_TYPES[t] for t in native.ACT8_TYPES}])
def test_coarse_blocks_keep_their_outlier_exact(level, name, K):
    """BRISK_ACT8_OUTLIERS (on by default): a block whose 8-bit rounding is coarse (one outlier, as
    in a down projection's input) gives up its largest input, multiplied exactly by the weight's
    dequantized column, and the rest get a finer grid: the product lands within the 8-bit bound of
    the row without its outliers, far closer than before. A block with a second outlier gives up
    both. Gaussian rows keep their bits; a row's bits are its own in any batch; the columns are
    dequantized once and kept."""
    w, ref = weight(name, K)
    wd = torch.from_numpy(ref).double()
    g = torch.Generator().manual_seed(K + 2)
    heavy = torch.randn(3, K, generator=g) * 0.05
    heavy[:, 3::256] = 20.0
    heavy[2, 231::256] = -15.0  # still coarse once the 20 is out (sub-block 7: a high nibble, a top bit)
    if K > 256:
        heavy[1, 3] = 0.01  # row 2's first block is Gaussian: it keeps its largest input on the grid
    x = torch.stack([heavy[0], torch.randn(K, generator=g), heavy[1], heavy[2], torch.randn(K, generator=g)])
    is_heavy = [True, False, True, True, False]
    try:
        native.set_act8_outliers(0.0)
        plain = w.matmul(x)
        native.set_act8_outliers(1e-3)
        exact = w.matmul(x)
        alone = [w.matmul(x[i:i + 1])[0] for i in range(len(x))]
        again = w.matmul(x.flip(0)).flip(0)
    finally:
        native.set_act8_outliers(native.DEFAULT_ACT8_OUTLIERS)
    assert w.cached_columns() == 2 * K // 256  # columns 3 and 7 of every block, dequantized once
    want = x.double() @ wd.T
    kind = int(T[name.removesuffix(" x8")])
    rest = x.clone()
    rest[[0, 2, 3]] = torch.where(x[[0, 2, 3]].abs() >= 15.0, 0.0, x[[0, 2, 3]])
    bound8 = activation_bound(rest, wd, kind)  # the row without its outliers on the 8-bit grid
    scale = x.double().abs() @ wd.abs().T
    for i, h in enumerate(is_heavy):
        assert torch.equal(alone[i], exact[i]) and torch.equal(again[i], exact[i]), f"row {i} differs in another batch"
        if not h:
            assert torch.equal(exact[i], plain[i]), f"Gaussian row {i} changed"
            continue
        err = (exact[i].double() - want[i]).abs()
        assert (err <= 1e-5 * scale[i] + 1.001 * bound8[i] + 1e-30).all(), f"row {i}: {(err / bound8[i]).max()}"
        assert err.max() < (plain[i].double() - want[i]).abs().max() / 10
