"""Tree speculation and lookahead decoding: verify_tree's rule (greedy cases, sampling in
distribution), the cache after a tree round (keep_path), a generic tree drafter and lookahead in
the decode loop giving plain decoding's output (greedy: token for token, with stop strings, EOS,
length limits and the repetition penalty; sampling: in distribution), the TreePolicy's back-off,
the hidden states a drafter can ask for, and the command line."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from brisk.core import GREEDY, LLM, BriskError, SamplingParams, Session
from brisk.core.kv.base import ancestor_mask
from brisk.core.sampling import Seen
from brisk.core.spec.build import make_speculator
from brisk.core.spec.drafter import Draft, Drafter
from brisk.core.spec.lookahead import LookaheadDrafter, Shape
from brisk.core.spec.options import parse_lookahead
from brisk.core.spec.speculator import Speculator
from brisk.core.spec.tree_policy import TreePolicy
from brisk.core.spec.verify import verify_tree

from test_speculative import SAMPLING, assert_cache_holds, chi_square_fails, exact_distribution, run

SHAPES = ["auto", "2,3,2", "0,3,1", "4,3,3", "1,2,1", "3,4,2", "5,3,1"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def prompts(tiny):
    return [tiny.prompt_ids("The quick brown fox", raw=True),
            tiny.prompt_ids("def add(a, b):\n    return a + b\n\ndef add(a, b):\n", raw=True)]


def lookahead(llm, shape: str):
    return make_speculator(llm, "lookahead", lookahead=None if shape == "auto" else shape)


# ---------------------------------------------------------------- verify_tree

def logits_of(rows) -> torch.Tensor:
    return torch.log(torch.tensor(rows, dtype=torch.float32).clamp(min=1e-30))


def test_verify_tree_greedy_cases():
    g = torch.Generator().manual_seed(0)
    # root argmax 1; node 0 (token 1) argmax 2; node 2 (token 2 under node 0) argmax 0
    tokens, parents = [1, 3, 2, 0], [-1, -1, 0, 0]  # root -> 1 -> {2, 0}; root -> 3
    rows = [[0.1, 0.6, 0.2, 0.1],  # the root: argmax 1
            [0.1, 0.1, 0.7, 0.1],  # node 0 (token 1): argmax 2
            [0.1, 0.2, 0.3, 0.4],  # node 1 (token 3)
            [0.1, 0.15, 0.05, 0.7],  # node 2 (token 2): argmax 3, then 1, 0
            [0.25, 0.25, 0.25, 0.25]]
    logits = logits_of(rows)
    assert verify_tree(logits, tokens, parents, None, GREEDY, g, None) == ([0, 2], 3)
    # the matching child is not a candidate: the walk stops at its parent
    assert verify_tree(logits, tokens, parents, [True, True, False, True], GREEDY, g, None) == ([0], 2)
    assert verify_tree(logits, tokens, parents, [False, True, True, True], GREEDY, g, None) == ([], 1)
    # no tree at all: the target's own token
    assert verify_tree(logits[:1], [], [], None, GREEDY, g, None) == ([], 1)
    # the repetition penalty at a node sees the context (3) and the path's tokens (1 and 2 at
    # node 2): were 1 not penalized there, it (0.15) would beat 0
    pen = SamplingParams(temperature=0.0, repetition_penalty=100.0)
    assert verify_tree(logits, tokens, parents, None, pen, g, Seen(torch.tensor([3]), 1)) == ([0, 2], 0)


def _exact_two(tokens, parents, p):
    """P(first two emitted tokens) for the tree below, by the target's rows: what plain sampling
    would give (the node rows stand for the target after each prefix)."""
    out = {}
    child_of_root = {tokens[i]: i for i, par in enumerate(parents) if par == -1}
    for a in range(len(p[0])):
        pa = p[0][a]
        if a in child_of_root:  # the target after [a] is that node's row
            for b, pb in enumerate(p[1 + child_of_root[a]]):
                out[(a, b)] = out.get((a, b), 0) + pa * pb
        else:  # rows for other prefixes: uniform (their second token is not emitted by verify_tree)
            out[(a,)] = out.get((a,), 0) + pa
    return out


def test_verify_tree_samples_the_target_distribution(monkeypatch):
    """Sequential point-mass rejection over the candidate children draws exactly from p at each
    node: the first two emitted tokens follow the target's rows (chi-square), and accepting every
    candidate (a wrong rule) is caught by the same test."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    tokens, parents = [1, 0, 2], [-1, -1, 0]  # root -> token 1 -> token 2; root -> token 0
    p = [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0]]
    logits = logits_of(p)
    dist = _exact_two(tokens, parents, p)

    def sample(n, rule):
        g, counts = torch.Generator().manual_seed(1), Counter()
        for _ in range(n):
            path, nxt = rule(logits, tokens, parents, None, params, g, None)
            seq = [tokens[i] for i in path] + [nxt]
            counts[tuple(seq[:2]) if seq[0] in (0, 1) else (seq[0],)] += 1
        return counts

    counts = sample(4000, verify_tree)
    assert not chi_square_fails(counts, dist, 4000)

    def greedy_accepting(logits, tokens, parents, candidate, params, gen, seen):
        # wrong on purpose: always takes the first candidate child
        path, node = [], -1
        while True:
            kids = [i for i, par in enumerate(parents) if par == node]
            if not kids:
                return path, int(torch.multinomial(torch.softmax(logits[node + 1], -1), 1, generator=gen))
            path.append(kids[0])
            node = kids[0]

    assert chi_square_fails(sample(2000, greedy_accepting), dist, 2000)


def test_ancestor_mask():
    m = ancestor_mask([-1, -1, 0, 2])
    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]],
                        dtype=torch.bool)
    assert torch.equal(m, want)
    with pytest.raises(ValueError, match="come before"):
        ancestor_mask([-1, 2, 0])


# ---------------------------------------------------------------- the cache after a tree round

@torch.inference_mode()
def test_keep_path_equals_running_the_path_as_a_chain(tiny):
    """A tree step, then keep_path of a path that is not the tree's first branch: the cache holds
    what a chain of the path's tokens writes, and the next step's logits are the chain's."""
    model, prompt = tiny.model, list(range(20, 32))
    tokens, parents = [40, 41, 42, 43, 44, 45, 46], [-1, -1, 0, 1, 1, 4, 5]
    path = [1, 4, 5, 6]  # root -> 41 -> 44 -> 45 -> 46
    kv = tiny.new_cache(64)
    model(torch.tensor([prompt]), 0, kv)
    start = len(prompt)
    model(torch.tensor([[39] + tokens]), start, kv, tree=ancestor_mask(parents))
    kv.keep_path(start, [start + 1 + i for i in path])
    chain = prompt + [39] + [tokens[i] for i in path]
    ref = tiny.new_cache(64)
    for pos, t in enumerate(chain):
        model(torch.tensor([[t]]), pos, ref)
    n = len(chain)
    for layer in range(len(kv.k)):
        assert torch.equal(kv.k[layer][:, :, :n], ref.k[layer][:, :, :n])  # the native passes: same bits
        assert torch.equal(kv.v[layer][:, :, :n], ref.v[layer][:, :, :n])
    got = model(torch.tensor([[7]]), n, kv)[0, -1]
    want = model(torch.tensor([[7]]), n, ref)[0, -1]
    assert torch.equal(got, want)


# ---------------------------------------------------------------- a generic tree drafter in the loop

class RandomTrees(Drafter):
    """Test-only: random trees around the true continuation (known from a plain run), which is
    in the tree about half the time, at a random branch, possibly cut short; other nodes are
    random tokens, some of them not candidates. With needs_hidden it records what observe gets."""

    name = "random-trees"
    tree = True

    def __init__(self, answer_ctx: list[int], seed: int = 0, needs_hidden: bool = False):
        self.truth, self.rng = answer_ctx, random.Random(seed)
        self.needs_hidden = needs_hidden
        self.seen_calls: list = []

    def tree_options(self):
        return ["any"]

    def propose_tree(self, ctx, option, depth, size, params, gen, seen):
        rng, n = self.rng, len(ctx)
        tokens, parents, cand = [], [], []

        def branch(seq, under=-1, is_cand=True):
            node = under
            for t in seq:
                if len(tokens) >= size:
                    return
                tokens.append(t)
                parents.append(node)
                cand.append(is_cand)
                node = len(tokens) - 1

        for _ in range(rng.randint(0, 3)):  # distractors, before or after the truth
            branch([rng.randrange(300) for _ in range(rng.randint(1, 3))], -1, rng.random() < 0.7)
        if rng.random() < 0.5:
            true = self.truth[n:n + rng.randint(1, 5)][:depth]
            cut = rng.randint(0, len(true))
            branch(true[:cut])  # the true path, then random children under its nodes
            if tokens and rng.random() < 0.5:
                branch([rng.randrange(300)], rng.randrange(len(tokens)))
            if cut < len(true) and tokens:
                branch(true[cut:], len(tokens) - 1 if cut else -1)
        for _ in range(rng.randint(0, 2)):
            if tokens:
                branch([rng.randrange(300) for _ in range(2)], rng.randrange(len(tokens)), rng.random() < 0.5)
        if not tokens:
            return None
        return Draft(tokens, parents=parents, candidate=cand)

    def observe(self, draft, logits, hidden, path):
        self.seen_calls.append((list(draft.tokens), logits, hidden, list(path)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_trees_give_plain_greedy(tiny, prompts, seed):
    for ids in prompts:
        plain, plain_pieces = run(tiny, ids, n=40)
        drafter = RandomTrees(ids + plain.last.tokens, seed)
        s, pieces = run(tiny, ids, n=40, speculator=Speculator(drafter, "fixed"))
        assert s.last.tokens == plain.last.tokens and "".join(pieces) == "".join(plain_pieces)
        assert s.ids == plain.ids
        st = s.last.spec
        assert st["accepted"] > 0 and st["passes"] < len(plain.last.tokens) - 1
        assert_cache_holds(tiny.model, s.cache, s.ids)


def test_hidden_states_reach_the_drafter(tiny, prompts):
    """needs_hidden: every observe() gets the final-norm rows of its pass (the output head's
    input, so lm_head gives back its logits), the first call the prefill's last row."""
    ids = prompts[0]
    plain, _ = run(tiny, ids, n=20)
    drafter = RandomTrees(ids + plain.last.tokens, 3, needs_hidden=True)
    s, _ = run(tiny, ids, n=20, speculator=Speculator(drafter, "fixed"))
    assert s.last.tokens == plain.last.tokens
    calls = drafter.seen_calls
    first_tokens, first_logits, first_hidden, first_path = calls[0]
    assert first_tokens == [] and first_path == [] and first_hidden.shape == (1, tiny.config.dim)
    torch.testing.assert_close(first_logits[0].float(), tiny.logits(ids)[-1], rtol=1e-4, atol=1e-4)
    assert len(calls) == s.last.spec["passes"] + 1
    for tokens, logits, hidden, _ in calls:
        assert hidden.shape == (1 + len(tokens), tiny.config.dim) and logits.shape[0] == 1 + len(tokens)
        torch.testing.assert_close(tiny.model.logits_of(hidden), logits)


def test_tree_drafts_need_a_contiguous_cache(tiny, prompts):
    s = Session(tiny, speculator=lookahead(tiny, "auto"))
    s.cache = type("Paged", (), {"max_len": 64})()
    with pytest.raises(BriskError, match="contiguous KV cache"):
        list(s.stream(prompts[0], GREEDY, 4))


# ---------------------------------------------------------------- lookahead: greedy is plain greedy

@pytest.mark.parametrize("shape", SHAPES)
def test_lookahead_greedy_identical_to_plain(tiny, prompts, shape):
    sp = lookahead(tiny, shape)
    for ids in prompts:
        plain, plain_pieces = run(tiny, ids, n=48)
        s, pieces = run(tiny, ids, n=48, speculator=sp)
        assert s.last.tokens == plain.last.tokens, shape
        assert "".join(pieces) == "".join(plain_pieces) == s.last.text
        assert s.last.finish_reason == plain.last.finish_reason and s.ids == plain.ids
        st = s.last.spec
        assert st["drafter"] == "lookahead" and st["k"] == shape
        assert st["accepted"] <= st["drafted"]
        if shape != "auto":
            assert st["accepted"] > 0 and st["passes"] < len(plain.last.tokens) - 1
    assert_cache_holds(tiny.model, s.cache, s.ids)


@pytest.mark.parametrize("shape", ["auto", "2,3,2", "4,4,2"])
def test_lookahead_stop_eos_length_and_penalty_as_plain(tiny, prompts, shape):
    ids = prompts[0]
    sp = lookahead(tiny, shape)
    plain, _ = run(tiny, ids, n=30)
    text, toks = plain.last.text, plain.last.tokens
    stop = text[len(text) // 2:len(text) // 2 + 3]
    want, want_pieces = run(tiny, ids, n=30, stop=(stop,))
    got, got_pieces = run(tiny, ids, n=30, stop=(stop,), speculator=sp)
    assert want.last.finish_reason == got.last.finish_reason == "stop"
    assert "".join(got_pieces) == "".join(want_pieces) and stop not in got.last.text
    assert got.last.tokens == want.last.tokens and got.ids == want.ids
    for n in (1, 2, 5, 9):
        got, _ = run(tiny, ids, n=n, speculator=sp)
        assert got.last.tokens == toks[:n] and got.last.finish_reason == "length"
    eos = tiny.eos_ids
    tiny.eos_ids = eos | {toks[6]}
    try:
        want, _ = run(tiny, ids, n=30)
        got, _ = run(tiny, ids, n=30, speculator=sp)
    finally:
        tiny.eos_ids = eos
    assert want.last.finish_reason == got.last.finish_reason == "eos"
    assert got.last.tokens == want.last.tokens and got.ids == want.ids
    penalty = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    for ids in prompts:
        want, _ = run(tiny, ids, penalty, n=30)
        got, _ = run(tiny, ids, penalty, n=30, speculator=sp)
        assert got.last.tokens == want.last.tokens


def test_lookahead_near_the_end_of_the_context(tiny, prompts):
    """Trees shrink to the cache's room: the last tokens before a full context stay plain's."""
    ids = prompts[1]
    got = {}
    for sp in (None, lookahead(tiny, "4,3,3")):
        s = Session(tiny, speculator=sp)
        s.cache = tiny.new_cache(len(ids) + 12)
        run(tiny, ids, n=40, session=s)
        got[sp is None] = s.last.tokens
    assert got[True] == got[False] and len(got[True]) == 12


def test_lookahead_sampling_matches_target_distribution(tiny, prompts):
    """Sampled lookahead rounds draw from the target's distribution: the whole path (pool, tree
    pass, verify_tree, keep_path, the sampler's stream) against exact enumeration."""
    ids = prompts[0]
    ids = ids + run(tiny, ids, n=6)[0].last.tokens + ids  # the prompt's n-grams then match
    dist = exact_distribution(tiny, ids, SAMPLING, 4)
    sp = lookahead(tiny, "2,3,2")
    s, counts, drafted = Session(tiny, speculator=sp), Counter(), 0
    n = 600
    for seed in range(n):
        list(s.stream(ids, SamplingParams(**{**SAMPLING.__dict__, "seed": seed}), 4))
        counts[tuple(s.last.tokens)] += 1
        drafted += s.last.spec["drafted"]
    assert drafted > n  # candidates were verified in most runs
    assert not chi_square_fails(counts, dist, n)


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["auto", "none"])
def test_smollm2_lookahead_greedy_identical_to_plain(smollm2_path, quantize):
    """The default load (Q4_1 kept quantized) and float32: 40 tokens token for token, with a stop string."""
    llm = LLM.load(str(smollm2_path), quantize=quantize) if quantize == "auto" else \
        LLM.load(str(smollm2_path), device="cpu", dtype="float32", quantize="none")
    for text in ("Tell me a story about a dragon who is afraid of the dark.",
                 "Rewrite this sentence in the passive voice and keep everything else: "
                 "The committee approved the new budget for the city library on Monday."):
        ids = llm.prompt_ids(text)
        plain, plain_pieces = run(llm, ids, n=40)
        stop = plain.last.text[-12:-8]
        plain_stop, _ = run(llm, ids, n=40, stop=(stop,))
        for shape in ("auto", "2,3,2", "5,4,3", "0,3,2"):
            sp = lookahead(llm, shape)
            s, pieces = run(llm, ids, n=40, speculator=sp)
            assert s.last.tokens == plain.last.tokens, shape
            assert "".join(pieces) == "".join(plain_pieces)
            s, _ = run(llm, ids, n=40, stop=(stop,), speculator=sp)
            assert s.last.tokens == plain_stop.last.tokens and s.last.finish_reason == plain_stop.last.finish_reason


# ---------------------------------------------------------------- the lookahead drafter's parts

def test_window_layout_and_jacobi_step():
    """Level l, column j sits at depth l+1+j under level l-1's column j (level 0: column j-1);
    the top level's argmaxes become the next level, each diagonal plus its argmax an n-gram."""
    d = LookaheadDrafter([Shape(3, 3, 1)], prompt_ngrams=False, text_ngrams=False)
    ctx = [5, 6, 7]
    d.start(ctx[:-1], None)
    d.levels = [[10, 11, 12], [20, 21, 22]]
    d.frame = len(ctx) - 1
    draft = d.propose_tree(ctx, Shape(3, 3, 1), 8, 32, GREEDY, None, None)
    assert draft.tokens == [10, 11, 12, 20, 21, 22] and draft.parents == [-1, 0, 1, 0, 1, 2]
    assert not any(draft.candidate)
    mask = ancestor_mask(draft.parents)
    assert (mask.sum(1) - 1).tolist() == [0, 1, 2, 3, 2, 3, 4]  # depths: level l, column j at l+1+j
    logits = torch.zeros(7, 50)
    for row, tok in zip((4, 5, 6), (30, 31, 32)):  # the top level's nodes' argmaxes
        logits[row, tok] = 1.0
    d.observe(draft, logits, None, [])
    assert d.levels == [[20, 21, 22], [30, 31, 32]]
    assert d.pool == {}  # the first step's diagonals start on random guesses: not collected yet
    d.levels, d.frame = [[10, 11, 12], [20, 21, 22]], d.frame - 1
    d.fresh = 5
    draft = d.propose_tree(ctx, Shape(3, 3, 1), 8, 32, GREEDY, None, None)
    d.observe(draft, logits, None, [])
    assert d.pool == {10: {(20, 30): None}, 11: {(21, 31): None}, 12: {(22, 32): None}}
    # the next round, one token on: the pool's n-gram for the pending token is the candidate
    draft = d.propose_tree(ctx + [11], Shape(3, 3, 1), 8, 32, GREEDY, None, None)
    assert draft.tokens[:2] == [21, 31] and draft.candidate[:2] == [True, True] and not any(draft.candidate[2:])


def test_pool_from_prompt_and_text():
    d = LookaheadDrafter([Shape(0, 3, 2)])
    d.start([1, 2, 3, 1, 2, 4], None)
    assert d.pool[1] == {(2, 3): None, (2, 4): None}
    draft = d.propose_tree([1, 2, 3, 1, 2, 4, 9, 1], Shape(0, 3, 2), 8, 32, GREEDY, None, None)
    # candidates: the newest n-grams for 1 first, merged into a trie (2 shared)
    assert draft.tokens == [2, 4, 3] and draft.parents == [-1, 0, 0] and all(draft.candidate)
    assert d.pool[4] == {(9, 1): None}  # the answer's n-grams join as it grows
    assert d.propose_tree([1, 2, 3, 1, 2, 4, 9, 1], Shape(0, 3, 2), 1, 32, GREEDY, None, None).tokens == [2]


def test_parse_lookahead():
    assert parse_lookahead("5,3,2") == Shape(5, 3, 2) and parse_lookahead(" 0, 4, 1") == Shape(0, 4, 1)
    assert parse_lookahead(None) is None
    for bad, word in (("5,3", "three integers"), ("a,b,c", "three integers"), ("5,1,2", "N >= 2"),
                      ("-1,3,2", "W >= 0"), ("5,3,0", "G >= 1"), ("20,4,20", "at most 64")):
        with pytest.raises(BriskError, match=word):
            parse_lookahead(bad)


# ---------------------------------------------------------------- the policy

class Clock:
    """Rounds of a pretend loop: each option's seconds per round and tokens per round."""

    def __init__(self, policy, speeds):
        self.p, self.speeds, self.t = policy, speeds, 0.0
        self.picks = Counter()

    def rounds(self, n):
        for _ in range(n):
            self.p.closed(self.t)
            c = self.p.choose()
            self.picks[c] += 1
            seconds, tokens = self.speeds[c]
            self.p.opened(c, self.t, 9 if c else 1, 3 if c else 1)
            self.p.emitted(tokens)
            self.t += seconds


def test_tree_policy_backs_off_and_retries():
    p = TreePolicy(["small", "big"])
    clock = Clock(p, {None: (1.0, 1), "small": (1.1, 1.6), "big": (3.0, 1.5)})
    clock.rounds(20)
    assert clock.picks[None] >= TreePolicy.RUN and clock.picks["small"] and clock.picks["big"] == TreePolicy.RUN
    clock.picks.clear()
    clock.rounds(400)
    assert clock.picks["small"] > 0.8 * 400  # the fastest runs most
    assert 0 < clock.picks["big"] <= 3 * TreePolicy.RUN  # the slow one: retried, ever more rarely
    # the text changes: plain is now the fastest, and the policy follows
    clock.speeds["small"] = (1.5, 1.0)
    clock.picks.clear()
    clock.rounds(400)
    assert clock.picks[None] > 0.8 * 400
    # fixed: always the one option, whatever it costs
    p = TreePolicy(["big"], adaptive=False)
    clock = Clock(p, {"big": (3.0, 1.0)})
    clock.rounds(50)
    assert clock.picks == {"big": 50}


def test_tree_policy_skips_hopeless_retries():
    """An option whose deepest path over the pass's measured cost cannot beat the best: its run
    ends after one round and it is not tried again while that holds."""
    p = TreePolicy(["big"], cost=lambda n: 1.0 if n == 1 else 4.0)
    clock = Clock(p, {None: (1.0, 1), "big": (4.0, 1.5)})  # at most 3 tokens per 4 s < 1 token/s
    clock.rounds(1000)
    assert clock.picks["big"] == 1


def test_tree_policy_uses_the_drafters_estimate():
    """A drafter's own estimate of its tokens per round (trained heads measure theirs) replaces the
    deepest path as the hope: an option that cannot pay runs one round, not RUN rounds at every
    retry; one whose rounds emit more than the estimate (a text the heads suit) is judged by that."""
    cost = lambda n: 1.0 if n == 1 else 1.3  # noqa: E731  (a pass over a few tokens: 1.3 steps)
    runs = {}
    for expected in (None, lambda c: 1.2):
        p = TreePolicy(["t"], cost=cost, expected=expected)
        clock = Clock(p, {None: (1.0, 1), "t": (1.3, 1.2)})  # the deepest path (3 tokens) would pay
        clock.rounds(1000)
        runs[expected is None] = clock.picks["t"]
    assert runs[False] == 1 and runs[True] > 3 * TreePolicy.RUN, runs
    p = TreePolicy(["t"], cost=cost, expected=lambda c: 1.2)
    clock = Clock(p, {None: (1.0, 1), "t": (1.3, 2.0)})  # emits more than estimated: 1.5 tokens/s
    clock.rounds(1000)
    assert clock.picks["t"] > 0.9 * 1000


# ---------------------------------------------------------------- command line

def test_cli_lookahead_options(tiny_llama_dir):
    import json

    from typer.testing import CliRunner

    from brisk.cli.main import app

    runner = CliRunner()
    base = ["generate", str(tiny_llama_dir), "The quick brown fox", "--raw", "-n", "24", "--temperature", "0",
            "--json", "--dtype", "float32"]
    plain = json.loads(runner.invoke(app, base).stdout)
    for extra in (["--draft", "lookahead"], ["--draft", "lookahead", "--lookahead", "3,3,2"]):
        r = runner.invoke(app, base + extra)
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert out["text"] == plain["text"] and out["spec"]["drafter"] == "lookahead"
    for bad, word in ((["--lookahead", "3,3,2"], "needs --draft lookahead"),
                      (["--draft", "ngram", "--lookahead", "3,3,2"], "needs --draft lookahead"),
                      (["--draft", "lookahead", "--lookahead", "3,3"], "--lookahead"),
                      (["--draft", "lookahead", "--lookahead", "30,3,9"], "at most 64"),
                      (["--draft", "lookahead", "--draft-k", "3"], "--draft-k")):
        r = runner.invoke(app, base + bad)
        assert r.exit_code == 1 and word in r.stderr and "Traceback" not in r.output, (bad, r.output)
        assert len(r.stderr.strip().splitlines()) == 1
    r = runner.invoke(app, ["chat", str(tiny_llama_dir), "--draft", "lookahead", "--lookahead", "2,3,2", "-n", "12"],
                      input="hello\n/stats\n")
    assert r.exit_code == 0 and "draft lookahead (2,3,2)" in r.stdout
    r = runner.invoke(app, ["bench", str(tiny_llama_dir), "-p", "0", "-n", "16", "-r", "1", "--draft", "lookahead",
                            "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [row["test"].split(",")[0] for row in rows] == ["tg16", "tg16 text", "tg16 lookahead auto"]
