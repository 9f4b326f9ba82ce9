"""Attention sinks (gpt-oss): each query head's softmax also spans a learned sink logit whose value
vector is zero. Every KV implementation and each of its paths against Hugging Face's eager formula,
and each result checked to differ from the same call without sinks (so the sinks are not ignored)."""
from __future__ import annotations

import pytest
import torch
from test_kv import D, H, KV, PARENTS, SCALE, allowed_by_position, ancestors

from brisk.core import paged_attention_kernel
from brisk.core.kv import ContiguousKV, FixedKeys, FixedTree, NoKV, PagedKV, PagedStep, Row
from brisk.core.kv.base import sdpa

# the Triton interpreter's own noise (as in test_paged_attention_kernel.py)
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter"),
              pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")]
GEN = torch.Generator().manual_seed(7)
SINKS = torch.randn(H, generator=GEN) * 2
SINKS[::2] += 4  # large positive ones too, so the effect is big


def rand(T, heads=H, batch=1):
    return torch.randn(batch, heads, T, D, generator=GEN)


def reference(q, k, v, allowed, sinks=None):
    """transformers' GptOss eager_attention_forward: q [H, T, D], k/v [KV, S, D], allowed [T, S]
    -> [T, H, D], float64; GQA by repeating the KV heads."""
    G = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(G, 0), v.double().repeat_interleave(G, 0)
    w = (q.double() @ k.transpose(1, 2)) * SCALE
    w = w.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return (torch.softmax(w, -1) @ v).transpose(0, 1)
    combined = torch.cat([w, sinks.double().view(-1, 1, 1).expand(-1, w.shape[1], 1)], -1)
    combined = combined - combined.max(-1, keepdim=True).values
    probs = torch.softmax(combined, -1)[..., :-1]
    return (probs @ v).transpose(0, 1)


def check(got, plain, q, k, v, allowed, rtol=1e-5, atol=1e-6):
    """got (with SINKS) and plain (without) [T, H, D] against the reference, and far apart."""
    torch.testing.assert_close(got.double(), reference(q, k, v, allowed, SINKS), rtol=rtol, atol=atol)
    torch.testing.assert_close(plain.double(), reference(q, k, v, allowed), rtol=rtol, atol=atol)
    assert (got.double() - plain.double()).abs().max() > 0.1


def attend_both(kv, q, k, v, window):
    """The same call with and without sinks (writing the same K/V twice changes nothing)."""
    return kv.attend(0, q, k, v, window, SCALE, SINKS), kv.attend(0, q, k, v, window, SCALE)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("T", [1, 4])
def test_contiguous(window, T):
    """A prompt from position 0, then a chunk (T > 1: SDPA) or one token (the bmm) after it; two
    sequences in the batch."""
    B, P = 2, 9
    kv = ContiguousKV(1, KV, D, 32, torch.float32, "cpu", batch=B)
    q0, k0, v0 = rand(P, batch=B), rand(P, KV, B), rand(P, KV, B)
    kv.begin(0, P)
    got, plain = attend_both(kv, q0, k0, v0, window)
    pos = torch.arange(P + T)
    for b in range(B):
        check(got[b], plain[b], q0[b], k0[b], v0[b], allowed_by_position(pos[:P], pos[:P], window))
    q, k, v = rand(T, batch=B), rand(T, KV, B), rand(T, KV, B)
    kv.begin(P, T)
    got, plain = attend_both(kv, q, k, v, window)
    for b in range(B):
        check(got[b], plain[b], q[b], torch.cat([k0, k], 2)[b], torch.cat([v0, v], 2)[b],
              allowed_by_position(pos[P:], pos, window))


def test_causal_sdpa():
    """The unmasked causal prompt (is_causal, what a GPU prompt from position 0 takes)."""
    T = 7
    q, k, v = rand(T), rand(T, KV), rand(T, KV)
    got = sdpa(q, k, v, None, SCALE, SINKS, is_causal=True)[0].transpose(0, 1)
    plain = sdpa(q, k, v, None, SCALE, is_causal=True)[0].transpose(0, 1)
    check(got, plain, q[0], k[0], v[0], torch.ones(T, T, dtype=torch.bool).tril())


@pytest.mark.parametrize("window", [None, 3])
def test_contiguous_tree_step(window):
    kv = ContiguousKV(1, KV, D, 32, torch.float32, "cpu")
    P, tree = 6, ancestors(PARENTS)
    T = len(PARENTS)
    k0, v0 = rand(P, KV), rand(P, KV)
    kv.begin(0, P)
    kv.attend(0, rand(P), k0, v0, window, SCALE, SINKS)
    q, k, v = rand(T), rand(T, KV), rand(T, KV)
    kv.begin(P, T, tree)
    got, plain = attend_both(kv, q, k, v, window)
    q_pos = P + tree.sum(-1) - 1
    allowed = torch.cat([allowed_by_position(q_pos, torch.arange(P), window),
                         tree & allowed_by_position(q_pos, q_pos, window)], 1)
    check(got[0], plain[0], q[0], torch.cat([k0, k], 2)[0], torch.cat([v0, v], 2)[0], allowed)


def garbage_cache():
    kv = ContiguousKV(1, KV, D, 32, torch.float32, "cpu")
    kv.k[0].normal_(generator=GEN)  # only the slots a step may see count
    kv.v[0].normal_(generator=GEN)
    return kv


@pytest.mark.parametrize("window", [None, 4])
def test_fixed_keys(window):
    """A decode step of fixed shapes: the masked bmm, and (Triton, here interpreted) the paged
    kernel that CUDA takes, reading the cache as one block per sequence."""
    kv, pos = garbage_cache(), 11
    q, k, v = rand(1), rand(1, KV), rand(1, KV)
    fixed = FixedKeys(kv, 24)
    fixed.begin(torch.tensor([pos]), 1)
    got, plain = attend_both(fixed, q, k, v, window)
    keys, values = kv.k[0][0, :, :pos + 1], kv.v[0][0, :, :pos + 1]
    allowed = allowed_by_position(torch.tensor([pos]), torch.arange(pos + 1), window)
    check(got[0], plain[0], q[0], keys, values, allowed)
    if paged_attention_kernel.available():
        got, plain = kv._paged_kernel(0, q, window, SCALE, SINKS), kv._paged_kernel(0, q, window, SCALE)
        check(got[0], plain[0], q[0], keys, values, allowed)


@pytest.mark.parametrize("window", [None, 3])
def test_fixed_tree(window):
    """A verifying step of fixed shapes: the tree's tokens at slots slot0.., keys past them garbage."""
    kv, P, tree = garbage_cache(), 6, ancestors(PARENTS)
    T = len(PARENTS)
    q_pos = P + tree.sum(-1) - 1
    fixed = FixedTree(kv, 24, torch.tensor([P]), q_pos, tree)
    fixed.begin(None, T)
    q, k, v = rand(T), rand(T, KV), rand(T, KV)
    got, plain = attend_both(fixed, q, k, v, window)
    allowed = torch.cat([allowed_by_position(q_pos, torch.arange(P), window),
                         tree & allowed_by_position(q_pos, q_pos, window)], 1)
    check(got[0], plain[0], q[0], kv.k[0][0, :, :P + T], kv.v[0][0, :, :P + T], allowed)


@pytest.mark.parametrize("tree", [None, ancestors(PARENTS)])
@pytest.mark.parametrize("window", [None, 3])
def test_no_kv(window, tree):
    """A whole causal sequence, or a tree's tokens seeing their ancestors (by index)."""
    T, kv = len(PARENTS), NoKV()
    kv.begin(0, T, tree)
    q, k, v = rand(T), rand(T, KV), rand(T, KV)
    pos = torch.arange(T)
    allowed = allowed_by_position(pos, pos, window)
    if tree is not None:
        allowed &= tree
    check(*(y[0] for y in attend_both(kv, q, k, v, window)), q[0], k[0], v[0], allowed)


@pytest.mark.parametrize("window", [None, 6])
def test_paged_step(window):
    """A first step prefilling three sequences from position 0, then one step mixing a prefill
    chunk with two decode rows of different lengths; blocks scattered. With Triton (interpreted
    here), the kernel CUDA runs for the decode rows over the same block tables."""
    bs = 4
    kv = PagedKV(1, KV, D, 16, bs, torch.float32, "cpu")
    kv.first_use(list(range(16)))
    tables = [[7, 2, 9, 4], [3, 12, 1], [5, 11, 6]]
    lens, done = [13, 10, 12], [8, 9, 11]
    full = [(rand(n, KV)[0], rand(n, KV)[0]) for n in lens]  # [KV, n, D] each
    first = PagedStep.build(kv, [Row([0] * done[i], 0, tables[i]) for i in range(3)], "cpu")
    first.begin(first.positions, len(first.tokens))
    q = rand(sum(done))
    k = torch.cat([full[i][0][:, :done[i]] for i in range(3)], 1)[None]
    v = torch.cat([full[i][1][:, :done[i]] for i in range(3)], 1)[None]
    got, plain = attend_both(first, q, k, v, window)
    s = 0
    for i in range(3):
        pos = torch.arange(done[i])
        check(got[0, s:s + done[i]], plain[0, s:s + done[i]], q[0, :, s:s + done[i]], full[i][0][:, :done[i]],
              full[i][1][:, :done[i]], allowed_by_position(pos, pos, window))
        s += done[i]

    rows = [Row([0] * 5, 8, tables[0]), Row([0], 9, tables[1]), Row([0], 11, tables[2])]
    step = PagedStep.build(kv, rows, "cpu")
    order = [1, 2, 0]  # decode rows come first
    new = {0: slice(8, 13), 1: slice(9, 10), 2: slice(11, 12)}
    q = rand(7)
    k = torch.cat([full[i][0][:, new[i]] for i in order], 1)[None]
    v = torch.cat([full[i][1][:, new[i]] for i in order], 1)[None]
    step.begin(step.positions, 7)
    got, plain = attend_both(step, q, k, v, window)
    s = 0
    for i in order:
        pos = torch.arange(lens[i] if i == 0 else new[i].stop)
        n = new[i].stop - new[i].start
        check(got[0, s:s + n], plain[0, s:s + n], q[0, :, s:s + n], full[i][0][:, :len(pos)], full[i][1][:, :len(pos)],
              allowed_by_position(pos[new[i]], pos, window))
        s += n
    if paged_attention_kernel.available():
        args = (q[0, :, :2].transpose(0, 1).contiguous(), kv.k[0], kv.v[0], step.decode_blocks, step.decode_lens, SCALE,
                window)
        got = paged_attention_kernel.paged_decode_attention(*args, sinks=SINKS)
        plain = paged_attention_kernel.paged_decode_attention(*args)
        for r, i in enumerate(order[:2]):
            pos = torch.arange(new[i].stop)
            check(got[r:r + 1], plain[r:r + 1], q[0, :, r:r + 1], full[i][0][:, :len(pos)], full[i][1][:, :len(pos)],
                  allowed_by_position(pos[new[i]], pos, window))


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_kernel(splits, window):
    """The kernel alone (interpreted on the CPU), split-K included: a split that is empty or not
    the first must not count the sink again; a length-0 row stays 0."""
    if not paged_attention_kernel.available():
        pytest.skip("triton is not installed")
    from test_paged_attention_kernel import make_case

    Hk, KVk, Dk = 8, 2, 64
    lengths = [0, 3, 40, 150]
    q, k, v, tables, lens = make_case(lengths, Hk, KVk, Dk, 8, torch.float32, seed=5)
    sinks = torch.linspace(-3, 6, Hk, device=q.device)
    scale = Dk ** -0.5
    got = paged_attention_kernel.paged_decode_attention(q, k, v, tables, lens, scale, window, splits=splits,
                                                        sinks=sinks)
    plain = paged_attention_kernel.paged_decode_attention(q, k, v, tables, lens, scale, window, splits=splits)
    assert (got[0] == 0).all() and torch.isfinite(got).all()
    for r, n in enumerate(lengths[1:], start=1):
        keys = k[tables[r].long()].flatten(0, 1)[:n].transpose(0, 1).cpu()  # [KV, n, D]
        vals = v[tables[r].long()].flatten(0, 1)[:n].transpose(0, 1).cpu()
        allowed = allowed_by_position(torch.tensor([n - 1]), torch.arange(n), window)
        G = Hk // KVk
        w = (q[r].double().cpu()[:, None] @ keys.double().repeat_interleave(G, 0).transpose(1, 2)) * scale
        w = w.masked_fill(~allowed, float("-inf"))
        comb = torch.cat([w, sinks.double().cpu().view(-1, 1, 1)], -1)
        ref = (torch.softmax(comb, -1)[..., :-1] @ vals.double().repeat_interleave(G, 0))[:, 0]
        torch.testing.assert_close(got[r].double().cpu(), ref, rtol=1e-5, atol=1e-5)
        assert (got[r] - plain[r]).abs().max() > 0.1


def test_bfloat16_sinks():
    """Model-dtype sinks and activations: the SDPA mask and the bmm's sink column in bf16/fp32."""
    kv = ContiguousKV(1, KV, D, 32, torch.bfloat16, "cpu")
    P = 9
    q0, k0, v0 = rand(P).bfloat16(), rand(P, KV).bfloat16(), rand(P, KV).bfloat16()
    sinks = SINKS.bfloat16()
    kv.begin(0, P)
    got = kv.attend(0, q0, k0, v0, None, SCALE, sinks)
    pos = torch.arange(P + 1)
    torch.testing.assert_close(got[0].double(), reference(q0[0], k0[0], v0[0], allowed_by_position(pos[:P], pos[:P]),
                                                          SINKS), rtol=2e-2, atol=2e-2)
    q, k, v = rand(1).bfloat16(), rand(1, KV).bfloat16(), rand(1, KV).bfloat16()
    kv.begin(P, 1)
    got = kv.attend(0, q, k, v, None, SCALE, sinks)
    torch.testing.assert_close(got[0].double(), reference(q[0], torch.cat([k0, k], 2)[0], torch.cat([v0, v], 2)[0],
                                                          allowed_by_position(pos[P:], pos), SINKS),
                               rtol=2e-2, atol=2e-2)
