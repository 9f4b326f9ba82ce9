"""Continuous batching: every request's output equals its single-stream output whatever the batch
around it, and every block returns to the pool however requests end."""
from __future__ import annotations

import random

import pytest
import torch

from brisk.core import GREEDY, LLM, BriskError, SamplingParams, Session
from brisk.core.batching import Engine, Request


@pytest.fixture(scope="module")
def gemma(tiny_gemma3_dir):
    return LLM.load(str(tiny_gemma3_dir), device="cpu", dtype="float32")


def prompts(n=8, shared=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(2, 300, (shared,), generator=g).tolist()
    return [head + torch.randint(2, 300, (int(k),), generator=g).tolist()
            for k in torch.randint(1, 50, (n,), generator=g)]


_reference: dict = {}


def single_stream(llm, ids, sampling=GREEDY, max_tokens=24, stop=()):
    """Session's answer (cached: several tests ask for the same ones)."""
    key = (id(llm), tuple(ids), repr(sampling), max_tokens, tuple(stop))
    if key not in _reference:
        s = Session(llm)
        list(s.stream(ids, sampling, max_tokens, stop))
        _reference[key] = s.last
    return _reference[key]


def assert_pool_empty(engine):
    engine.pool.check()
    assert engine.pool.n_free == engine.pool.n_blocks and not any(engine.pool.refs)
    assert not engine.running and not engine.waiting


CONFIGS = [dict(), dict(max_batch=3), dict(block_size=4, step_tokens=7), dict(kv_tokens=300, block_size=4),
           dict(prefix_sharing=False, block_size=8)]


@pytest.mark.parametrize("model", ["tiny", "gemma"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_batched_greedy_equals_single_stream(request, model, config):
    """Batch sizes, chunked prefill, a pool small enough to force preemption, with and without
    prefix sharing (half the prompts share a 21-token head); Gemma's sliding window is 8."""
    llm = request.getfixturevalue(model)
    ps = prompts(6, seed=1) + prompts(6, shared=21, seed=2)
    want = [single_stream(llm, p).tokens for p in ps]
    engine = Engine(llm, **config)
    seqs = engine.run([Request(p, GREEDY, 24) for p in ps])
    assert [s.result.tokens for s in seqs] == want
    assert_pool_empty(engine)
    if config.get("kv_tokens"):
        assert engine.stats.preemptions > 0  # the small pool did force recomputation


def test_arrival_order_and_staggered_arrivals(tiny):
    """Requests arriving in a shuffled order, some while others are mid-generation."""
    ps = prompts(10, shared=9, seed=3)
    want = [single_stream(tiny, p).tokens for p in ps]
    order = list(range(len(ps)))
    random.Random(0).shuffle(order)
    engine = Engine(tiny, max_batch=4, block_size=4)
    seqs = {}
    for k, i in enumerate(order):
        seqs[i] = engine.add(Request(ps[i], GREEDY, 24))
        for _ in range(k % 3):
            engine.step()
    while engine.has_work():
        engine.step()
    assert [seqs[i].result.tokens for i in range(len(ps))] == want
    assert_pool_empty(engine)


def test_prefix_is_stored_and_prefilled_once(tiny):
    """Sixteen requests with one system prompt arriving together: it is computed once, the
    others wait a step for it and then share its blocks."""
    system = prompts(1, seed=4)[0] * 3
    ps = [system + p for p in prompts(16, seed=5)]
    engine = Engine(tiny, block_size=8)
    seqs = engine.run([Request(p, GREEDY, 8) for p in ps])
    full_blocks = len(system) // 8 * 8
    assert engine.stats.shared_tokens >= 15 * full_blocks
    assert engine.stats.prefilled_tokens <= sum(len(p) for p in ps) - 15 * full_blocks
    assert all(s.result.prefilled_tokens < len(p) for s, p in zip(seqs[1:], ps[1:]))
    assert [s.result.tokens for s in seqs] == [single_stream(tiny, p, max_tokens=8).tokens for p in ps]
    assert_pool_empty(engine)
    again = engine.run([Request(ps[0], GREEDY, 8)])[0]  # later: the blocks are still cached
    assert again.result.prefilled_tokens <= len(ps[0]) - full_blocks


def test_per_request_sampling_stop_and_max_tokens(tiny):
    """Seeded sampling, a repetition penalty, stop strings and max_tokens act per request, as
    in single-stream generation (same tokens, same text, same finish reason)."""
    ps = prompts(4, seed=6)
    hot = SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    pen = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    greedy_text = single_stream(tiny, ps[2], max_tokens=30).text
    stop = greedy_text[len(greedy_text) // 2:][:3]
    # presence / frequency penalties count the answer only, the logit bias applies throughout
    hot_pen = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3, presence_penalty=1.5,
                             frequency_penalty=0.5, logit_bias={7: 2.0, 9: -50})
    cases = [(ps[0], hot, 30, ()), (ps[1], pen, 30, ()), (ps[2], GREEDY, 30, (stop,)), (ps[3], GREEDY, 5, ()),
             (ps[0], hot_pen, 30, ())]
    engine = Engine(tiny, max_batch=4)
    seqs = engine.run([Request(p, s, n, st) for p, s, n, st in cases])
    for seq, (p, s, n, st) in zip(seqs, cases):
        ref = single_stream(tiny, p, s, n, st)
        assert (seq.result.tokens, seq.result.text, seq.result.finish_reason) == \
            (ref.tokens, ref.text, ref.finish_reason)
    assert seqs[2].result.finish_reason == "stop" and stop not in seqs[2].result.text
    assert len(seqs[3].result.tokens) == 5 and seqs[3].result.finish_reason == "length"


def test_blocks_return_after_finished_cancelled_and_preempted(tiny):
    ps = prompts(12, shared=10, seed=7)
    engine = Engine(tiny, max_batch=6, kv_tokens=260, block_size=4)  # 65 blocks: preemption
    seqs = [engine.add(Request(p, GREEDY, 40, ignore_eos=True)) for p in ps]
    for step in range(40):
        engine.step()
        engine.pool.check()
        if step in (3, 9, 20):  # one running, one waiting, one whatever it is by then
            victim = engine.running[0] if step == 3 else engine.waiting[-1] if step == 9 else seqs[5]
            engine.cancel(victim)
            assert victim.result.finish_reason == "cancelled"
    while engine.has_work():
        engine.step()
    assert engine.stats.preemptions > 0
    assert sum(s.result.finish_reason == "cancelled" for s in seqs) == 3
    assert all(len(s.result.tokens) == 40 for s in seqs if s.result.finish_reason == "length")
    assert_pool_empty(engine)


def test_requests_the_engine_refuses(tiny):
    engine = Engine(tiny)
    with pytest.raises(BriskError, match="context"):
        engine.add(Request(list(range(2, 2 + tiny.ctx)), GREEDY, 4))
    with pytest.raises(BriskError, match="empty"):
        engine.add(Request([], GREEDY, 4))
    with pytest.raises(BriskError):
        engine.add(Request([5, 6], SamplingParams(top_p=2.0), 4))
    assert_pool_empty(engine)


def test_generation_stops_at_the_context(tiny_llama_dir):
    llm = LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32", ctx=40)
    p = list(range(2, 32))
    seq = Engine(llm).run([Request(p, GREEDY, 100, ignore_eos=True)])[0]
    assert len(seq.result.tokens) == 10 and seq.result.finish_reason == "length"


@pytest.mark.slow
def test_smollm2_batched_equals_single_stream(smollm2):
    """The real model on a few chat prompts, batched together."""
    qs = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
          "Say hello in Spanish."]
    ids = [smollm2.prompt_ids(q) for q in qs]
    want = [single_stream(smollm2, p, max_tokens=20) for p in ids]
    engine = Engine(smollm2, max_batch=8)
    seqs = engine.run([Request(p, GREEDY, 20) for p in ids])
    assert [s.result.text for s in seqs] == [w.text for w in want]
    assert "Paris" in seqs[0].result.text
    assert_pool_empty(engine)


def test_generate_batch_command(tiny, tiny_llama_dir, tmp_path):
    """`brisk generate MODEL --batch in.jsonl -o out.jsonl`: answers in input order, each equal to
    its single-stream answer; per-line fields override the flags; a bad line fails before any work."""
    import json

    from typer.testing import CliRunner

    from brisk.cli.main import app

    lines = [{"prompt": "The quick brown fox", "raw": True, "id": "fox"},
             {"messages": [{"role": "user", "content": "Paris is"}], "max_tokens": 5},
             {"prompt": "hello there", "temperature": 0.9, "seed": 4, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
             {"prompt": "def add(a, b):", "raw": True, "stop": ["\n"]}]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(app, ["generate", str(tiny_llama_dir), "--batch", str(src), "-o", str(out),
                                 "-t", "0", "-n", "12", "--max-concurrency", "3"])
    assert r.exit_code == 0, r.output
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["index"] for g in got] == [0, 1, 2, 3] and got[0]["id"] == "fox" and "id" not in got[1]
    hot = SamplingParams(temperature=0.9, seed=4, top_k=0, top_p=1.0, min_p=0.0)
    want = [single_stream(tiny, tiny.prompt_ids("The quick brown fox", raw=True), max_tokens=12),
            single_stream(tiny, tiny.prompt_ids("Paris is"), max_tokens=5),
            single_stream(tiny, tiny.prompt_ids("hello there"), hot, max_tokens=12),
            single_stream(tiny, tiny.prompt_ids("def add(a, b):", raw=True), max_tokens=12, stop=("\n",))]
    for g, w in zip(got, want):
        assert (g["text"], g["generated_tokens"], g["finish_reason"]) == (w.text, len(w.tokens), w.finish_reason)
        assert g["latency_s"] >= g["ttft_s"] > 0
    assert "requests" in r.stderr and "tok/s" in r.stderr and "p95" in r.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"prompt": "x", "max_tokens": "many"}) + "\n")
    out2 = tmp_path / "out2.jsonl"
    r = CliRunner().invoke(app, ["generate", str(tiny_llama_dir), "--batch", str(bad), "-o", str(out2)])
    assert r.exit_code == 1 and "bad.jsonl:2" in r.stderr and "max_tokens" in r.stderr
    assert not out2.exists()


def test_bench_batch_rows(tiny_llama_dir):
    import json

    from typer.testing import CliRunner

    from brisk.cli.main import app

    r = CliRunner().invoke(app, ["bench", str(tiny_llama_dir), "--batch", "1,3", "-n", "8", "-r", "1", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [row["test"] for row in rows] == ["tg8 x1", "tg8 x3"] and all(row["tok_s"] > 0 for row in rows)


def test_generate_batch_warns_of_unknown_keys(tiny_llama_dir, tmp_path):
    """A misspelt field ("temprature") is not silently ignored: a warning names it and its line."""
    import json

    from typer.testing import CliRunner

    from brisk.cli.main import app

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi", "max_tokens": 2}) + "\n"
                   + json.dumps({"prompt": "ho", "temprature": 0.2, "max_tokens": 2}) + "\n")
    r = CliRunner().invoke(app, ["generate", str(tiny_llama_dir), "--batch", str(src), "-o", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert "in.jsonl:2: unknown key 'temprature'" in r.stderr and "in.jsonl:1" not in r.stderr
