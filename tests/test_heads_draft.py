"""`--draft heads:PATH`: draft heads from `brisk distill` in the decode loop give plain decoding's
output (greedy: token for token, with stop strings, EOS, length limits and the repetition penalty;
sampling: in distribution), on the tiny model and on SmolLM2; bad folders, heads for another model
and impossible tree sizes are one-line errors; generate, chat and bench take them."""
from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from brisk.cli.main import app
from brisk.core import GREEDY, LLM, BriskError, SamplingParams, Session
from brisk.core import distill as D
from brisk.core.errors import FileError, InvalidValue
from brisk.core.sampling import probabilities
from brisk.core.spec import speculator as speculator_module
from brisk.core.spec.build import make_speculator

from test_distill import heads_dir  # noqa: F401 (fixture: heads trained on the tiny model in seconds)
from test_lookahead import prompts  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
from test_speculative import SAMPLING, assert_cache_holds, chi_square_fails, exact_distribution, run

runner = CliRunner()
SIZES = ["auto", 1, 4, 16]  # --draft-k: auto (the TreePolicy), or a fixed tree of that many nodes


def heads(llm, folder, k="auto"):
    return make_speculator(llm, f"heads:{folder}", k)


# ---------------------------------------------------------------- greedy is plain greedy

def same_as_plain(llm, ids, sp, sampling=GREEDY, n=30, stop=()):
    """Runs plain and with `sp`; asserts the same tokens, text, ids and finish; returns the session."""
    want, want_pieces = run(llm, ids, sampling, n=n, stop=stop)
    got, got_pieces = run(llm, ids, sampling, n=n, stop=stop, speculator=sp)
    assert got.last.tokens == want.last.tokens and got.ids == want.ids, (n, stop)
    assert "".join(got_pieces) == "".join(want_pieces) and got.last.finish_reason == want.last.finish_reason
    return got


def test_greedy_identical_to_plain(tiny, prompts, heads_dir):
    accepted = 0
    for k in SIZES:
        sp = heads(tiny, heads_dir, k)
        for ids in prompts:  # one speculator for both: its state must not leak between generations
            s = same_as_plain(tiny, ids, sp, n=48)
            st = s.last.spec
            assert st["drafter"] == "heads" and st["k"] == str(k) and st["accepted"] <= st["drafted"]
            if k != "auto":  # fixed: a tree every round but the last (the budget leaves it no room)
                assert st["options"].get("plain", 0) <= 1 and st["rounds"] == st["options"][str(k)] >= 10
            accepted += st["accepted"]
            assert_cache_holds(tiny.model, s.cache, s.ids)
    assert accepted > 0  # some paths were kept: keep_path and the hidden row after them were exercised


def test_stop_eos_length_and_penalty_as_plain(tiny, prompts, heads_dir):
    ids, sp = prompts[0], heads(tiny, heads_dir, 8)
    plain = run(tiny, ids, n=30)[0].last
    stop = plain.text[len(plain.text) // 2:len(plain.text) // 2 + 3]
    last = same_as_plain(tiny, ids, sp, stop=(stop,)).last
    assert last.finish_reason == "stop" and stop not in last.text
    for n in (1, 2, 5, 9):  # trees shrink to the budget: never a token past max_tokens
        assert same_as_plain(tiny, ids, sp, n=n).last.finish_reason == "length"
    eos = tiny.eos_ids
    tiny.eos_ids = eos | {plain.tokens[6]}  # the answer's 7th token now ends it
    try:
        assert same_as_plain(tiny, ids, sp).last.finish_reason == "eos"
    finally:
        tiny.eos_ids = eos
    for p in prompts:  # the penalty at a tree node sees the path's tokens
        same_as_plain(tiny, p, sp, SamplingParams(temperature=0.0, repetition_penalty=1.5))


def test_near_the_end_of_the_context(tiny, prompts, heads_dir):
    """Trees shrink to the cache's room: the last tokens before a full context stay plain's."""
    ids = prompts[1]
    got = {}
    for sp in (None, heads(tiny, heads_dir, 16)):
        s = Session(tiny, speculator=sp)
        s.cache = tiny.new_cache(len(ids) + 12)
        run(tiny, ids, n=40, session=s)
        got[sp is None] = s.last.tokens
    assert got[True] == got[False] and len(got[True]) == 12


# ---------------------------------------------------------------- sampling: the distribution

def accept_first_branch(logits, tokens, parents, candidate, params, gen, seen):
    """Wrong on purpose: keeps the tree's first branch whatever the target says."""
    path = []
    while kids := [i for i, p in enumerate(parents) if p == (path[-1] if path else -1)]:
        path.append(kids[0])
    row = probabilities(logits[path[-1] + 1 if path else 0], params).cpu()
    return path, int(torch.multinomial(row, 1, generator=gen))


def test_sampling_matches_target_distribution(tiny, prompts, heads_dir, monkeypatch):
    """Sampled rounds of head trees draw from the target's distribution (tree pass, verify_tree's
    point-mass rejection, keep_path, the hidden row handed back), against exact enumeration; the
    same test catches a rule that keeps drafts regardless."""
    ids = prompts[0]
    dist = exact_distribution(tiny, ids, SAMPLING, 4)

    def sample(n_runs):
        s, counts, drafted = Session(tiny, speculator=heads(tiny, heads_dir, 4)), Counter(), 0
        for seed in range(n_runs):
            list(s.stream(ids, SamplingParams(**{**SAMPLING.__dict__, "seed": seed}), 4))
            counts[tuple(s.last.tokens)] += 1
            drafted += s.last.spec["drafted"]
        assert drafted > n_runs  # trees were verified in most runs
        return counts

    assert not chi_square_fails(sample(600), dist, 600)
    monkeypatch.setattr(speculator_module, "verify_tree", accept_first_branch)  # as the loop calls it
    assert chi_square_fails(sample(300), dist, 300)


# ---------------------------------------------------------------- refused

def test_bad_specs_refused(tiny, heads_dir, tiny_qwen2_dir, tiny_llama_dir, tmp_path):
    with pytest.raises(InvalidValue, match="heads:PATH needs the folder"):
        make_speculator(tiny, "heads:")
    with pytest.raises(FileError, match="no such folder"):
        make_speculator(tiny, f"heads:{tmp_path / 'missing'}")
    with pytest.raises(FileError, match="not a folder"):
        make_speculator(tiny, f"heads:{tiny_llama_dir / 'config.json'}")
    with pytest.raises(FileError, match="config.json is not a brisk-draft-heads file"):
        make_speculator(tiny, f"heads:{tiny_llama_dir}")  # a model's folder, not heads
    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((heads_dir / "config.json").read_text())
    for tree in ({"nodes": "?"}, {**config["tree"], "nodes": [[0, 0], [0]]}):  # no budget; a child first
        (broken / "config.json").write_text(json.dumps({**config, "tree": tree}))
        with pytest.raises(FileError, match="malformed"):
            make_speculator(tiny, f"heads:{broken}")
    other = LLM.load(str(tiny_qwen2_dir), device="cpu", dtype="float32")
    with pytest.raises(BriskError, match="were trained for") as e:
        make_speculator(other, f"heads:{heads_dir}")
    assert "\n" not in str(e.value) and str(tiny_qwen2_dir) in str(e.value)
    with pytest.raises(InvalidValue, match="K <= 63"):
        make_speculator(tiny, f"heads:{heads_dir}", 64)
    small = tmp_path / "small"  # heads whose stored tree has 5 nodes: --draft-k 6 cannot be drafted
    shutil.copytree(heads_dir, small)
    tree = {**config["tree"], "nodes": config["tree"]["nodes"][:5]}
    (small / "config.json").write_text(json.dumps({**config, "tree": tree}))
    assert make_speculator(tiny, f"heads:{small}", 5).drafter.tree_options() == [5]
    with pytest.raises(InvalidValue, match="has 5 nodes"):
        make_speculator(tiny, f"heads:{small}", 6)
    sp = make_speculator(tiny, f"heads:{heads_dir}", "3")
    assert sp.describe() == "heads 3" and sp.drafter.tree_options() == [3]
    # auto offers sizes up to the measured best, never a pass beyond the batch-invariant kernels
    assert max(heads(tiny, heads_dir).drafter.tree_options()) <= min(config["tree"]["budget"], 63)


def test_paged_cache_refused(tiny, prompts, heads_dir):
    s = Session(tiny, speculator=heads(tiny, heads_dir))
    s.cache = type("Paged", (), {"max_len": 64})()  # no keep_path: trees cannot be kept in it
    with pytest.raises(BriskError, match="heads drafts trees, which need a contiguous KV cache"):
        list(s.stream(prompts[0], GREEDY, 4))


# ---------------------------------------------------------------- command line

def test_cli_generate_chat_bench(tiny_llama_dir, heads_dir):
    base = ["generate", str(tiny_llama_dir), "The quick brown fox", "--raw", "-n", "24", "--temperature", "0",
            "--json", "--dtype", "float32"]
    plain = json.loads(runner.invoke(app, base).stdout)
    stop = plain["text"][10:13]
    plain_stop = json.loads(runner.invoke(app, base + ["--stop", stop]).stdout)
    assert plain_stop["finish_reason"] == "stop"
    for extra in (["--draft", f"heads:{heads_dir}"], ["--draft", f"heads:{heads_dir}", "--draft-k", "6"]):
        r = runner.invoke(app, base + extra)
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert out["text"] == plain["text"] and out["spec"]["drafter"] == "heads" and out["spec"]["drafted"] > 0
        r = runner.invoke(app, base + extra + ["--stop", stop])
        out = json.loads(r.stdout)
        assert out["text"] == plain_stop["text"] and out["finish_reason"] == "stop"
    r = runner.invoke(app, ["chat", str(tiny_llama_dir), "--draft", f"heads:{heads_dir}", "--draft-k", "4", "-n", "12"],
                      input="hello\n/stats\n")
    assert r.exit_code == 0 and "draft heads (4)" in r.stdout, r.output
    r = runner.invoke(app, ["bench", str(tiny_llama_dir), "-p", "0", "-n", "16", "-r", "1", "--draft",
                            f"heads:{heads_dir}", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [row["test"].split(",")[0] for row in rows] == ["tg16", "tg16 text", "tg16 heads auto"]
    assert rows[-1]["acceptance"] is not None
    for cmd in ("generate", "chat", "bench"):
        assert "heads:PATH" in runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "400"}).stdout


def test_cli_errors_are_one_line(tiny_llama_dir, tiny_qwen2_dir, heads_dir, tmp_path):
    base = ["generate", str(tiny_llama_dir), "Hi", "--raw", "-n", "4"]
    for args, want in (
            (["--draft", "heads:"], "error: --draft heads:PATH needs the folder"),
            (["--draft", f"heads:{tmp_path / 'nope'}"], f"error: {tmp_path / 'nope'}: no such folder"),
            (["--draft", f"heads:{tiny_llama_dir}"], "is not a brisk-draft-heads file"),
            (["--draft", f"heads:{heads_dir}", "--draft-k", "99"], "error: --draft-k 99: a heads tree"),
            (["--draft", f"heads:{heads_dir}", "--draft-k", "x"], "--draft-k"),
            (["--draft", f"heads:{heads_dir}", "--lookahead", "2,3,2"], "--lookahead needs --draft lookahead")):
        r = runner.invoke(app, base + args)
        assert r.exit_code == 1 and want in r.stderr and "Traceback" not in r.output, (args, r.output)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = runner.invoke(app, ["generate", str(tiny_qwen2_dir), "Hi", "--raw", "-n", "4", "--draft", f"heads:{heads_dir}"])
    assert r.exit_code == 1 and "were trained for" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # a bad folder fails before the model loads: here the model does not even exist
    r = runner.invoke(app, ["generate", str(tmp_path / "no-model"), "Hi", "--draft", f"heads:{tmp_path / 'nope'}"])
    assert r.exit_code == 1 and "no such folder (draft heads" in r.stderr
    for cmd in (["chat", str(tiny_llama_dir)], ["bench", str(tiny_llama_dir), "-p", "0", "-n", "4", "-r", "1"]):
        r = runner.invoke(app, cmd + ["--draft", f"heads:{tmp_path / 'nope'}"], input="")
        assert r.exit_code == 1 and "no such folder" in r.stderr, r.output


# ---------------------------------------------------------------- SmolLM2

@pytest.fixture(scope="module")
def smollm2_heads(smollm2_path, tmp_path_factory):
    """Heads for the default model after a few steps: quality does not matter here, exactness does."""
    out = tmp_path_factory.mktemp("smol") / "heads"
    D.distill(str(smollm2_path), out, D.DistillOptions(heads=2, samples=8, max_tokens=24, steps=6, batch=64,
                                                       concurrency=8, measure=False))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["auto", "none"])
def test_smollm2_heads_greedy_identical_to_plain(smollm2_path, smollm2_heads, quantize):
    """The default load (Q4_1 kept quantized) and float32, for which the heads are the same ones
    (same fingerprint): 40 tokens token for token, with a stop string."""
    llm = LLM.load(str(smollm2_path)) if quantize == "auto" else \
        LLM.load(str(smollm2_path), device="cpu", dtype="float32", quantize="none")
    ids = llm.prompt_ids("Tell me a story about a dragon who is afraid of the dark.")
    plain, plain_pieces = run(llm, ids, n=40)
    stop = plain.last.text[-12:-8]
    plain_stop, _ = run(llm, ids, n=40, stop=(stop,))
    for k in ("auto", 1, 16):
        sp = heads(llm, smollm2_heads, k)
        s, pieces = run(llm, ids, n=40, speculator=sp)
        assert s.last.tokens == plain.last.tokens, k
        assert "".join(pieces) == "".join(plain_pieces) and s.last.spec["drafted"] > 0
        s, _ = run(llm, ids, n=40, stop=(stop,), speculator=sp)
        assert s.last.tokens == plain_stop.last.tokens and s.last.finish_reason == plain_stop.last.finish_reason


def test_expected_tokens_from_the_file(tiny, heads_dir):
    """The TreePolicy's estimate: tokens per pass as distill measured them through the drafter, else
    1 + the tree's node probabilities."""
    sp = heads(tiny, heads_dir)
    d = sp.drafter
    assert sp.trees.expected == d.expected_tokens
    measured = (d.config.get("measured") or {}).get("tokens_per_pass") or {}
    probs = d.config["tree"]["probs"]
    for size in d.tree_options():
        want = measured.get(str(size), 1.0 + sum(probs[:size]))
        assert d.expected_tokens(size) == pytest.approx(want) and d.expected_tokens(size) >= 1.0
    d.config = {**d.config, "measured": None}
    assert d.expected_tokens(2) == pytest.approx(1.0 + probs[0] + probs[1])
