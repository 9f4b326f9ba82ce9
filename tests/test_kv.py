"""The KV implementations behind the model's one attention interface (core/kv), each against a
dense reference (softmax over explicitly masked scores), tree-shaped steps included; and a tree of
candidates run in one forward giving the logits of running each of its paths on its own."""
from __future__ import annotations

import pytest
import torch

from brisk.core import LLM
from brisk.core.kv import ContiguousKV, FixedKeys, NoKV, PagedKV, PagedStep, Row
from brisk.core.kv.base import ancestor_mask
from brisk.core.native_decoder import NativeDecoder

H, KV, D, SCALE = 4, 2, 8, 0.35
PARENTS = [-1, 0, 0, 1, 1, 2, 5]  # a tree of 7 candidates: node 0 the root


def ancestors(parents) -> torch.Tensor:
    """tree[i, j]: node j is node i or one of its ancestors."""
    T = len(parents)
    tree = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            tree[i, j] = True
            j = parents[j]
    return tree


def dense(q, k, v, allowed):
    """q [H, T, D], k/v [KV, S, D], allowed [T, S] -> [T, H, D], in float64."""
    k, v = k.double().repeat_interleave(H // KV, 0), v.double().repeat_interleave(H // KV, 0)
    scores = (q.double() @ k.transpose(1, 2)) * SCALE
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)


def rand(T, heads=H):
    return torch.randn(1, heads, T, D, generator=GEN)


GEN = torch.Generator().manual_seed(0)


def allowed_by_position(q_pos, k_pos, window=None):
    ok = k_pos[None, :] <= q_pos[:, None]
    if window:
        ok &= k_pos[None, :] > q_pos[:, None] - window
    return ok


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("T", [1, 4])
def test_contiguous_run_against_dense(window, T):
    kv = ContiguousKV(1, KV, D, 32, torch.float32, "cpu")
    P = 9
    k0, v0 = rand(P, KV), rand(P, KV)
    kv.begin(0, P)
    kv.attend(0, rand(P), k0, v0, window, SCALE)
    q, k, v = rand(T), rand(T, KV), rand(T, KV)
    kv.begin(P, T)
    y = kv.attend(0, q, k, v, window, SCALE)
    pos = torch.arange(P + T)
    ref = dense(q[0], torch.cat([k0, k], 2)[0], torch.cat([v0, v], 2)[0], allowed_by_position(pos[P:], pos, window))
    torch.testing.assert_close(y[0].double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 3])
def test_contiguous_tree_step_against_dense(window):
    """The tree's nodes take the slots after the prefix, each at position prefix + depth, and see
    the prefix (within the window, by position) and their own ancestors only."""
    kv = ContiguousKV(1, KV, D, 32, torch.float32, "cpu")
    P, tree = 6, ancestors(PARENTS)
    T = len(PARENTS)
    k0, v0 = rand(P, KV), rand(P, KV)
    kv.begin(0, P)
    kv.attend(0, rand(P), k0, v0, window, SCALE)
    q, k, v = rand(T), rand(T, KV), rand(T, KV)
    kv.begin(P, T, tree)
    y = kv.attend(0, q, k, v, window, SCALE)
    q_pos = P + tree.sum(-1) - 1
    allowed = torch.cat([allowed_by_position(q_pos, torch.arange(P), window),
                         tree & allowed_by_position(q_pos, q_pos, window)], 1)
    ref = dense(q[0], torch.cat([k0, k], 2)[0], torch.cat([v0, v], 2)[0], allowed)
    torch.testing.assert_close(y[0].double(), ref, rtol=1e-5, atol=1e-6)


def test_fixed_keys_ignores_slots_past_the_position():
    kv = ContiguousKV(1, KV, D, 32, torch.float32, "cpu")
    kv.k[0].normal_(generator=GEN)  # garbage everywhere: only slots up to the position count
    kv.v[0].normal_(generator=GEN)
    pos = 11
    q, k, v = rand(1), rand(1, KV), rand(1, KV)
    fixed = FixedKeys(kv, 24)
    fixed.begin(torch.tensor([pos]), 1)
    y = fixed.attend(0, q, k, v, None, SCALE)
    keys, values = kv.k[0][0, :, :pos + 1], kv.v[0][0, :, :pos + 1]
    ref = dense(q[0], keys, values, torch.ones(1, pos + 1, dtype=torch.bool))
    torch.testing.assert_close(y[0].double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 6])
def test_no_kv_against_dense(window):
    T = 10
    q, k, v = rand(T), rand(T, KV), rand(T, KV)
    kv = NoKV()
    kv.begin(0, T)
    pos = torch.arange(T)
    torch.testing.assert_close(kv.attend(0, q, k, v, window, SCALE)[0].double(),
                               dense(q[0], k[0], v[0], allowed_by_position(pos, pos, window)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 6])
def test_paged_step_against_dense(window):
    """Two sequences in one step: one prefilling a chunk, one decoding; blocks scattered."""
    bs = 4
    kv = PagedKV(1, KV, D, 16, bs, torch.float32, "cpu")
    kv.first_use(list(range(16)))
    tables = [[7, 2, 9, 4], [3, 12, 1]]
    full = {0: (rand(13, KV), rand(13, KV)), 1: (rand(10, KV), rand(10, KV))}
    # what each sequence already holds: 8 and 9 tokens, written through a first step
    done = {0: 8, 1: 9}
    first = PagedStep.build(kv, [Row([0] * done[i], 0, tables[i]) for i in (0, 1)], "cpu")
    first.begin(first.positions, len(first.tokens))
    first.attend(0, rand(17), torch.cat([full[0][0][:, :, :8], full[1][0][:, :, :9]], 2),
                 torch.cat([full[0][1][:, :, :8], full[1][1][:, :, :9]], 2), window, SCALE)
    step = PagedStep.build(kv, [Row([0] * 5, 8, tables[0]), Row([0], 9, tables[1])], "cpu")
    q = rand(6)
    k = torch.cat([full[1][0][:, :, 9:10], full[0][0][:, :, 8:13]], 2)  # decode rows come first
    v = torch.cat([full[1][1][:, :, 9:10], full[0][1][:, :, 8:13]], 2)
    step.begin(step.positions, 6)
    y = step.attend(0, q, k, v, window, SCALE)[0]
    pos1, pos0 = torch.arange(10), torch.arange(13)
    torch.testing.assert_close(y[:1].double(), dense(q[0, :, :1], full[1][0][0], full[1][1][0],
                                                     allowed_by_position(pos1[9:], pos1, window)), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y[1:].double(), dense(q[0, :, 1:], full[0][0][0], full[0][1][0],
                                                     allowed_by_position(pos0[8:], pos0, window)), rtol=1e-5, atol=1e-6)


def test_ancestor_mask_matches_the_reference():
    """The decode loop's mask for a draft (parents of the nodes after the pending token)."""
    draft_parents = [p - 1 for p in PARENTS[1:]]  # node i + 1 of PARENTS is draft node i
    assert torch.equal(ancestor_mask(draft_parents), ancestors(PARENTS))


@pytest.mark.parametrize("blocks", ["native", "torch"])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_gemma3_dir"])
@torch.inference_mode()
def test_tree_forward_equals_each_path_run_alone(fixture, blocks, request, monkeypatch):
    """A tree of candidate tokens after a prompt, in one forward with its mask: each node's logits
    are those of running the path root..node after the prompt. Gemma's 8-token sliding window is
    crossed (prompt of 12). On the native decoder (one slot per block table entry: each row reads
    its own ancestors) the bits are those of decoding the path token by token; the torch blocks
    (SDPA with the mask) agree to rounding."""
    if blocks == "torch":
        monkeypatch.setattr(NativeDecoder, "run", lambda *a: None)
    llm = LLM.load(str(request.getfixturevalue(fixture)), device="cpu", dtype="float32")
    if blocks == "native" and not NativeDecoder.takes(llm.model):
        pytest.skip("the native decoder does not take this model here")
    prompt = list(range(20, 32))
    tokens = [40, 41, 42, 43, 44, 45, 46]
    tree = ancestors(PARENTS)
    kv = llm.new_cache(64)
    llm.model(torch.tensor([prompt]), 0, kv)
    got = llm.model(torch.tensor([tokens]), len(prompt), kv, tree=tree)[0]
    for i in range(len(tokens)):
        path = [tokens[j] for j in range(len(tokens)) if tree[i, j]]
        want = llm.logits(prompt + path)[-1]
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)
        if blocks == "native":
            chain = llm.new_cache(64)
            llm.model(torch.tensor([prompt]), 0, chain)
            for d, t in enumerate(path):
                step = llm.model(torch.tensor([[t]]), len(prompt) + d, chain)[0, -1]
            assert torch.equal(got[i], step)
