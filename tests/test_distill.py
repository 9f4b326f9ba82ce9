"""`brisk distill` and the draft heads: training lowers the loss, an interrupted run resumes to the
same bytes, the file round-trips and is refused on another model, the tree is Medusa's greedy
one, and the drafter's tree holds the heads' top choices along each path."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
import torch
from conftest import default_sigint
from interrupt import Stopped, brisk_command, stop_after
from typer.testing import CliRunner

from brisk.cli.main import app
from brisk.core import LLM, BriskError
from brisk.core import distill as D
from brisk.core.errors import FileError
from brisk.core.spec import heads_file, heads_net, heads_tree
from brisk.core.spec.heads import HeadsDrafter

runner = CliRunner()
BRISK = [sys.executable, "-c", "from brisk.cli.main import run; run()"]
# a few seconds on the tiny model: 10 short answers, 12 steps, a checkpoint every 4
FAST = dict(heads=3, samples=10, max_tokens=20, steps=12, batch=64, lr=3e-2, checkpoint_every=4, concurrency=8,
            sim_prompts=2, sim_tokens=12)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def heads_dir(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("heads") / "tiny-heads"
    summary = D.distill(str(tiny_llama_dir), out, D.DistillOptions(**FAST))
    assert summary.steps == 12 and len(summary.top1) == 3
    return out


def heads_bytes(folder):
    return (folder / heads_file.WEIGHTS).read_bytes()


# ---------------------------------------------------------------- training

def test_training_lowers_the_loss(tiny, tmp_path):
    opts = D.DistillOptions(**FAST).checked()
    prompts = D.load_prompts(None)
    plan = D.sample_plan(len(prompts), opts)
    partial = D.Partial(tmp_path / "out")
    info = partial.open("key", lambda *a, **k: None)
    feats = D.generate_data(tiny, prompts, plan, opts, partial, info, lambda *a, **k: None)
    data = D.Data([feats[s] for s in range(len(plan)) if not plan[s][1]])
    trainer = D.Trainer(tiny, D.draft_vocabulary(data, 0, tiny.config.vocab_size), opts)
    idx = torch.arange(data.n)
    with torch.no_grad():
        before = trainer.losses(data, idx)[1]  # each head's KL to the model on every training position
    for step in range(opts.steps):
        trainer.step(data, step)
    with torch.no_grad():
        after = trainer.losses(data, idx)[1]
    # (a random tiny model's distributions two tokens ahead are hard to guess: a few % in 12 steps)
    assert all(a < 0.97 * b for a, b in zip(after, before)), (before, after)


def test_interrupted_run_resumes_byte_identical(tiny_llama_dir, heads_dir, tmp_path, monkeypatch):
    out = tmp_path / "resumed"
    with monkeypatch.context() as m:  # dies after its first checkpoint (step 4 of 12), as a crash would
        m.setattr(D.Trainer, "save", stop_after(D.Trainer.save, 1))
        with pytest.raises(Stopped, match="stopped after 1 calls of save"):
            D.distill(str(tiny_llama_dir), out, D.DistillOptions(**FAST))
    partial = tmp_path / "resumed.partial"
    assert not out.exists() and (partial / "train.safetensors").is_file()

    events = []
    summary = D.distill(str(tiny_llama_dir), out, D.DistillOptions(**FAST), report=lambda e, **i: events.append((e, i)))
    assert ("resume", {"step": 4, "total": 12}) in events and summary.resumed_step == 4
    assert ("generate_start", {"total": 10, "done": 10}) in events  # the answers were kept too
    assert heads_bytes(out) == heads_bytes(heads_dir)
    assert not partial.exists()


def test_other_training_arguments_keep_the_data(tiny_llama_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(D.Trainer, "save", stop_after(D.Trainer.save, 1))
        with pytest.raises(Stopped):
            D.distill(str(tiny_llama_dir), out, D.DistillOptions(**FAST))
    events = []
    D.distill(str(tiny_llama_dir), out, D.DistillOptions(**{**FAST, "lr": 5e-3}), report=lambda e, **i: events.append(e))
    assert "resume" not in events and "restart" not in events  # steps start over, answers are reused


# ---------------------------------------------------------------- the file

def test_file_round_trip(heads_dir, tmp_path):
    config, heads, vocab = heads_file.load(heads_dir)
    assert config["format"] == heads_file.FORMAT and config["n_heads"] == 3 and config["dims"]["hidden"] == 64
    assert len(config["accuracy"]["top1"]) == 3 and config["tree"]["budget"] >= 1 and config["measured"]["pass_ms"]
    heads_file.save(tmp_path / "copy", heads, vocab, config)
    config2, heads2, vocab2 = heads_file.load(tmp_path / "copy")
    assert config2 == config and torch.equal(vocab2, vocab)
    assert torch.equal(heads2.weight, heads.weight) and torch.equal(heads2.bias, heads.bias)
    assert json.loads((heads_dir / heads_file.CONFIG).read_text())["version"] == heads_file.VERSION


def test_bad_folders_are_file_errors(heads_dir, tmp_path):
    with pytest.raises(FileError, match="no such folder"):
        heads_file.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileError, match="not a draft-heads folder"):
        heads_file.load(tmp_path / "empty")
    other = tmp_path / "other"
    other.mkdir()
    (other / heads_file.CONFIG).write_text('{"format": "something-else"}')
    with pytest.raises(FileError, match="not a brisk-draft-heads"):
        heads_file.load(other)


def test_heads_for_another_model_are_refused(tiny_qwen2_dir, heads_dir, tiny_llama_dir):
    other = LLM.load(str(tiny_qwen2_dir), device="cpu", dtype="float32")
    with pytest.raises(BriskError) as e:
        HeadsDrafter(other, heads_dir)
    msg = str(e.value)
    assert "\n" not in msg and str(tiny_llama_dir) in msg and str(tiny_qwen2_dir) in msg
    # the same model loaded another way (quantized at load) has the same shapes: accepted
    same = LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32", quantize="int8")
    assert HeadsDrafter(same, heads_dir).heads.n_heads == 3


# ---------------------------------------------------------------- the tree

def test_tree_is_the_greedy_best_by_estimated_acceptance():
    acc = [[0.6, 0.2, 0.1], [0.41, 0.19, 0.09], [0.33, 0.13, 0.07]]
    nodes, probs = heads_tree.build_tree(acc, 12)
    assert nodes[:5] == [(0,), (0, 0), (1,), (0, 1), (2,)]
    # every path up to depth 3 with its product: the tree is the top-12 of them, in order
    every = {}
    for d in range(1, 4):
        for path in itertools.product(range(3), repeat=d):
            every[path] = torch.tensor([acc[i][r] for i, r in enumerate(path)]).prod().item()
    best = sorted(every, key=lambda p: -every[p])[:12]
    assert nodes == best
    assert probs == pytest.approx([every[p] for p in nodes])
    for n in range(1, 13):  # any prefix is a tree: parents come first
        assert all(p < i for i, p in enumerate(heads_tree.tree_parents(nodes[:n])))
    assert heads_tree.expected_length(probs[:1]) == pytest.approx(1.6)
    assert heads_tree.build_tree([[0.0, 0.0]], 5)[0] == [(0,), (1,)]  # zero accuracies: still a valid tree


# ---------------------------------------------------------------- the drafter

def test_drafter_tree_holds_the_heads_top_choices(tiny, heads_dir):
    drafter = HeadsDrafter(tiny, heads_dir)
    ctx = tiny.prompt_ids("Hello there")
    assert drafter.tree and drafter.needs_hidden and drafter.tree_options()
    assert drafter.bucket(ctx) is None and drafter.propose_tree(ctx, 10) is None  # nothing observed yet
    hidden = D.hidden_states(tiny.model, ctx, tiny.device)[-2:]  # rows: [pending, one draft]
    drafter.observe(None, None, hidden, [0])  # the draft was accepted: its row chose the next token
    assert drafter.bucket(ctx) == 0
    draft = drafter.propose_tree(ctx, 10)
    tokens, parents = draft.tokens, draft.parents
    assert len(tokens) == len(parents) == 10 and draft.q is None and draft.candidate is None
    assert all(-1 <= p < i for i, p in enumerate(parents))
    nodes = drafter.nodes[:10]
    assert [p for p in parents] == heads_tree.tree_parents(nodes)
    ranked = drafter.vocab[drafter.logits(hidden[1], ctx[-1]).argsort(dim=-1, descending=True)]
    for tok, node in zip(tokens, nodes):
        assert tok == int(ranked[len(node) - 1, node[-1]])
    for i, node in enumerate(nodes):  # and along each path, its ancestors' choices
        j, path = i, []
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        assert path[::-1] == [int(ranked[d, r]) for d, r in enumerate(node)]
    assert drafter.bucket(ctx) is None  # one hidden state, one proposal

    drafter.observe(None, None, hidden, [0])  # the loop's limits: at most 2 deep, at most 4 nodes
    small = drafter.propose_tree(ctx, 10, 2, 4, None, None, None)
    shallow = [n for n in drafter.nodes if len(n) <= 2][:4]  # the tree's first 4 such nodes, wherever they sit
    assert small.tokens == [int(ranked[len(n) - 1, n[-1]]) for n in shallow]
    assert all(-1 <= p < i for i, p in enumerate(small.parents))

    drafter.observe(None, None, hidden, [])  # nothing accepted: row 0 chose the pending token
    chain, q = drafter.propose(ctx, 3, None, None, None)
    firsts = drafter.vocab[drafter.logits(hidden[0], ctx[-1]).argmax(-1)]
    assert q is None and chain == firsts[:3].tolist()
    # the int8 readout ranks as the float rows do, but for near-ties
    with torch.no_grad():
        e = tiny.model.embed(torch.tensor([ctx[-1]]))[0]
        rows = heads_net.output_rows(tiny.model, drafter.vocab)
        exact = heads_net.head_logits(drafter.heads, rows, hidden[0], e, None)
    assert (exact.argmax(-1) == drafter.logits(hidden[0], ctx[-1]).argmax(-1)).float().mean() >= 0.5
    drafter.observe(None, None, hidden, [])
    drafter.start(ctx, None)  # a new generation forgets the last one's state
    assert drafter.bucket(ctx) is None


# ---------------------------------------------------------------- the command line

def test_cli_help_and_errors(tmp_path, tiny_llama_dir):
    r = runner.invoke(app, ["distill", "--help"])
    assert r.exit_code == 0 and "--data" in r.output and "--heads" in r.output and "<bool>" not in r.output
    r = subprocess.run(BRISK + ["distill", str(tiny_llama_dir), "-o", str(tmp_path / "h"), "--data",
                                str(tmp_path / "nope.jsonl")], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope.jsonl'}: no such file"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"oops": 1}\n')
    r = runner.invoke(app, ["distill", str(tiny_llama_dir), "-o", str(tmp_path / "h"), "--data", str(bad)])
    assert r.exit_code == 1 and f"{bad}:2:" in r.output
    (tmp_path / "exists").mkdir()
    r = runner.invoke(app, ["distill", str(tiny_llama_dir), "-o", str(tmp_path / "exists")])
    assert r.exit_code == 1 and "already exists (use --force" in r.output


def test_cli_json_with_own_prompts(tmp_path, tiny_llama_dir):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(p) for p in [{"prompt": "Tell me about cats."}, {"text": "Count to ten."},
                                                      {"messages": [{"role": "user", "content": "Hi!"}]}]))
    out = tmp_path / "heads"
    r = runner.invoke(app, ["distill", str(tiny_llama_dir), "-o", str(out), "--data", str(data), "--samples", "6",
                            "--max-tokens", "12", "--steps", "4", "--batch", "32", "--heads", "2", "--no-measure",
                            "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["n_heads"] == 2 and len(s["top1"]) == 2 and s["samples"] == 6 and s["steps"] == 4
    assert heads_file.load(out)[0]["n_heads"] == 2


def test_cli_ctrl_c_says_how_to_resume(tmp_path, tiny_llama_dir):
    out = tmp_path / "heads"
    args = ["distill", str(tiny_llama_dir), "-o", str(out), "--samples", "6", "--max-tokens", "12", "--steps", "8",
            "--batch", "32", "--checkpoint-every", "2", "--no-measure"]
    # a real Ctrl-C right after the first checkpoint (step 2 of 8) is written
    r = subprocess.run(brisk_command("brisk.core.distill:Trainer.save", 1, "sigint") + args, capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL, preexec_fn=default_sigint)
    assert r.returncode == 130 and "run the same command again to resume" in r.stderr, r.stderr
    assert not out.exists()
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "resuming: step 2 of 8" in r.stderr and "held-out top-1" in r.stdout
