"""The Triton paged decode-attention kernel against a float64 torch reference that gathers the
blocks explicitly. Without a GPU the kernel runs in Triton's interpreter on CPU tensors."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before the import
pytest.importorskip("triton", reason="triton is not installed")

from brisk.core.paged_attention_kernel import available, paged_decode_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter's own noise: tensor loop bounds, and log2(0) for an empty split's -inf lse
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter"),
              pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")]


def reference(q, k_pool, v_pool, tables, lengths, scale, window):
    """float64 attention of each row over its gathered blocks: [R, H, D]."""
    R, H, D = q.shape
    KV = k_pool.shape[2]
    out = torch.empty(R, H, D, dtype=torch.float64)
    for r in range(R):
        n = int(lengths[r])
        keys = k_pool[tables[r].long()].flatten(0, 1)[:n].double().cpu()  # [n, KV, D]
        vals = v_pool[tables[r].long()].flatten(0, 1)[:n].double().cpu()
        lo = max(0, n - window) if window else 0
        keys, vals = keys[lo:], vals[lo:]
        keys, vals = keys.repeat_interleave(H // KV, 1), vals.repeat_interleave(H // KV, 1)
        scores = torch.einsum("hd,nhd->hn", q[r].double().cpu(), keys) * scale
        out[r] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)
    return out


def make_case(lengths, H, KV, D, block_size, dtype, seed=0):
    """A pool whose blocks are handed to rows in shuffled order; every slot no row may see
    (unused blocks, the unfilled end of last blocks) holds NaN."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    width = max(need) + 1  # one padding column at least
    n_blocks = sum(need) + 3
    ids = torch.randperm(n_blocks, generator=g)
    k_pool = torch.full((n_blocks, block_size, KV, D), float("nan"), dtype=torch.float32)
    v_pool = k_pool.clone()
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    nan_block = int(ids[-1])  # padding entries point at an all-NaN block
    tables.fill_(nan_block)
    used = 0
    for r, n in enumerate(lengths):
        blocks = ids[used:used + need[r]]
        used += need[r]
        tables[r, :need[r]] = blocks.int()
        flat_k = torch.randn(n, KV, D, generator=g)
        flat_v = torch.randn(n, KV, D, generator=g)
        for i in range(n):
            k_pool[blocks[i // block_size], i % block_size] = flat_k[i]
            v_pool[blocks[i // block_size], i % block_size] = flat_v[i]
    q = torch.randn(len(lengths), H, D, generator=g)
    to = lambda t: t.to(dtype).to(DEVICE)  # noqa: E731
    return (to(q), to(k_pool), to(v_pool), tables.to(DEVICE),
            torch.tensor(lengths, dtype=torch.int32, device=DEVICE))


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def check(lengths, H, KV, D, block_size, dtype, window, splits=None, seed=0):
    q, k, v, tables, lens = make_case(lengths, H, KV, D, block_size, dtype, seed)
    scale = D ** -0.5
    out = paged_decode_attention(q, k, v, tables, lens, scale, window=window, splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    ref = reference(q, k, v, tables.cpu(), lens.cpu(), scale, window)
    err = (out.double().cpu() - ref).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), err


def test_available():
    assert available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("H,KV,D,block_size", [(8, 2, 64, 8), (4, 4, 128, 16)])
def test_matches_reference(H, KV, D, block_size, dtype, window):
    check([1, 7, 8, 9, 37, 100], H, KV, D, block_size, dtype, window)


@pytest.mark.parametrize("window", [None, 16])
def test_split_k(window):
    """Long rows cut into chunks whose partial softmaxes are merged; a short row leaves some
    splits empty, which must contribute nothing."""
    check([3, 150, 300], 8, 2, 64, 8, torch.float32, window, splits=4, seed=1)


def test_odd_group_and_head_dim():
    """G = H/KV not a power of two (Qwen-style 7 heads per kv head), D padded to a power of two."""
    check([5, 40], 14, 2, 80, 8, torch.float32, None, seed=2)


def test_out_and_strided_q():
    """Writes into a given buffer; q may be a slice (the decode rows of a step); int64 tables
    and lengths (what PagedStep builds) work too."""
    q, k, v, tables, lens = make_case([9, 20], 4, 2, 64, 8, torch.float32, seed=3)
    big = torch.randn(4, 4, 64, device=DEVICE)
    big[1:3] = q
    out = torch.full((2, 4, 64), float("nan"), device=DEVICE)
    got = paged_decode_attention(big[1:3], k, v, tables.long(), lens.long(), 0.125, out=out)
    assert got is out
    ref = reference(q, k, v, tables.cpu(), lens.cpu(), 0.125, None)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-5, atol=1e-5)


def test_zero_length_row_is_zero():
    """A padding row (length 0, as a CUDA-graph batch may hold) gives 0, not NaN."""
    q, k, v, tables, lens = make_case([0, 12], 4, 2, 64, 8, torch.float32, seed=4)
    for splits in (1, 2):
        out = paged_decode_attention(q, k, v, tables, lens, 0.125, splits=splits)
        assert (out[0] == 0).all() and torch.isfinite(out).all()
