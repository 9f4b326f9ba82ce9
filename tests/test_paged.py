"""The paged KV cache: block accounting, prefix naming, and batched paged forwards that give the
same logits as the single-stream model."""
from __future__ import annotations

import pytest
import torch

from brisk.core import LLM
from brisk.core.batching import BlockPool, block_hash
from brisk.core.kv import PagedKV, PagedStep, Row


def pool(n_blocks=8, block_size=4) -> BlockPool:
    return BlockPool(n_blocks=n_blocks, block_size=block_size)


class Paged:
    """A block pool and its paged KV for a model, as the batching engine pairs them."""

    def __init__(self, model, n_blocks, block_size):
        cfg = model.cfg
        self.model, self.pool = model, BlockPool(n_blocks, block_size)
        self.kv = PagedKV(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_blocks, block_size, torch.float32, "cpu")

    def allocate(self, n_tokens):
        blocks = self.pool.allocate(self.pool.blocks_for(n_tokens))
        self.kv.first_use(blocks)
        return blocks

    def forward(self, rows):
        step = PagedStep.build(self.kv, rows, "cpu")
        return self.model(step.tokens[None], step.positions, step, logit_rows=step.logit_rows)[0]


def test_allocate_release_and_exhaustion():
    p = pool()
    a = p.allocate(3)
    b = p.allocate(5)
    assert sorted(a + b) == list(range(8)) and p.n_free == 0
    with pytest.raises(RuntimeError):
        p.allocate(1)
    p.release(a)
    assert p.n_free == 3
    p.release(b)
    assert p.n_free == 8 and p.refs == [0] * 8
    p.check()
    with pytest.raises(AssertionError):
        p.release(a[:1])  # a second release is a bug, not a silent refcount underflow


def test_fresh_blocks_are_zeroed():
    kv = PagedKV(2, 1, 4, 8, 4, torch.float32, "cpu")  # block 0 (decode tables' padding) is zeroed at once
    kv.k[:, 1:].fill_(float("nan"))
    kv.v[:, 1:].fill_(float("nan"))
    b = pool().allocate(3)
    kv.first_use(b)
    assert not kv.k[:, b].isnan().any() and not kv.v[:, b].isnan().any()


def test_named_blocks_are_shared_then_cached_then_evicted():
    p = pool(n_blocks=4)
    names = [block_hash(None, [1, 2, 3, 4])]
    names.append(block_hash(names[0], [5, 6, 7, 8]))
    assert names[1] != block_hash(None, [5, 6, 7, 8])  # a block's name depends on what came before
    a = p.allocate(2)
    p.name(a[0], names[0], ready=False)
    p.name(a[1], names[1], ready=False)
    assert p.lookup(names) == ([], True)  # being computed: wait for it
    p.mark_ready(a[0])
    assert p.lookup(names) == ([a[0]], True)
    p.mark_ready(a[1])
    assert p.lookup(names) == (a, False)
    p.share(a)
    assert p.refs[a[0]] == 2
    p.release(a)
    p.release(a)
    assert p.n_free == 4 and p.lookup(names) == (a, False)  # unreferenced, still findable
    p.check()
    p.share(a[:1])  # revived from the cache
    assert p.n_free == 3
    p.release(a[:1])
    p.allocate(4)  # needs every block: the cached prefixes are evicted
    assert p.lookup(names) == ([], False)
    p.check()


def test_unfinished_named_block_is_forgotten_on_release():
    p = pool()
    a = p.allocate(1)
    name = block_hash(None, [9, 9, 9, 9])
    p.name(a[0], name, ready=False)
    p.release(a)  # its owner went away before computing it: nothing valid to keep
    assert p.lookup([name]) == ([], False) and p.n_free == 8
    p.check()


def _models(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_gemma3_dir", "tiny_mistral_dir", "tiny_qwen2_dir"])
def tiny(request):
    return LLM.load(str(_models(request)), device="cpu", dtype="float32")


@torch.inference_mode()
def test_batched_paged_forward_matches_single_stream(tiny):
    """Rows of every kind in one call (prefill chunks, decode tokens, different lengths) give the
    logits the single-stream model gives for the same positions; Gemma's and Mistral's sliding
    windows (8 and 16 tokens) are crossed."""
    torch.manual_seed(0)
    seqs = [torch.randint(2, 300, (n,)).tolist() for n in (13, 7, 41, 1)]
    ref = [tiny.logits(s) for s in seqs]
    p = Paged(tiny.model, 64, 4)
    tables = [p.allocate(len(s)) for s in seqs]
    done = [0] * len(seqs)
    chunks = [5, 3, 17, 1]
    while any(d < len(s) for d, s in zip(done, seqs)):
        rows, where = [], []
        for i, s in enumerate(seqs):
            if done[i] >= len(s):
                continue
            n = min(chunks[i], len(s) - done[i])
            rows.append(Row(s[done[i]:done[i] + n], done[i], tables[i]))
            where.append((i, done[i] + n - 1))
            done[i] += n
            chunks[i] = 1 if done[i] > 10 else chunks[i]  # then decode
        logits = p.forward(rows)
        for j, (i, pos) in enumerate(where):
            torch.testing.assert_close(logits[j], ref[i][pos], atol=2e-5, rtol=1e-4)


@torch.inference_mode()
def test_shared_prefix_blocks_give_the_same_logits(tiny_llama_dir):
    """Sequence B reads A's first blocks instead of computing its own: same logits as computing
    everything itself, and the shared blocks are not written."""
    llm = LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32")
    torch.manual_seed(1)
    prefix = torch.randint(2, 300, (12,)).tolist()
    a, b = prefix + [5, 6, 7], prefix + [40, 41, 42, 43, 44]
    p = Paged(llm.model, 32, 4)
    ta = p.allocate(len(a))
    p.forward([Row(a, 0, ta)])
    shared = ta[:3]
    before = p.kv.k[:, shared].clone()
    p.pool.share(shared)
    tb = shared + p.allocate(len(b) - 12)
    with_sharing = p.forward([Row(b[12:], 12, tb)])
    assert torch.equal(p.kv.k[:, shared], before)
    fresh = Paged(llm.model, 32, 4)
    tf = fresh.allocate(len(b))
    without = fresh.forward([Row(b, 0, tf)])
    torch.testing.assert_close(with_sharing, without, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(with_sharing[0], llm.logits(b)[-1], atol=1e-5, rtol=1e-4)
