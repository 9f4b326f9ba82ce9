"""Generation behaviour: greedy answers, sampling, seeds, stop strings, chat cache reuse."""
from __future__ import annotations

import pytest
import torch

from brisk.core import GREEDY, LLM, BriskError, Chat, SamplingParams, Session
from brisk.core.output_stream import StopMatcher
from brisk.core.sampling import probabilities


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm2):
    res = smollm2.generate("What is the capital of France?", GREEDY, max_tokens=24)
    assert "Paris" in res.text
    assert res.finish_reason in ("eos", "length")


def test_streamed_text_equals_decoded_tokens(tiny):
    s = Session(tiny)
    pieces = list(s.stream(tiny.prompt_ids("hello", raw=True), GREEDY, max_tokens=20))
    assert "".join(pieces) == s.last.text == tiny.tokenizer.decode(s.last.tokens, skip_special=True)


def test_greedy_matches_argmax_of_full_recomputation(tiny):
    ids = tiny.prompt_ids("The quick brown fox", raw=True)
    s = Session(tiny)
    list(s.stream(ids, GREEDY, max_tokens=12))
    seq = list(ids)
    for tok in s.last.tokens:
        assert int(tiny.logits(seq)[-1].argmax()) == tok
        seq.append(tok)


def test_same_seed_same_output_different_seed_differs(tiny):
    p = tiny.prompt_ids("Paris is", raw=True)
    runs = [Session(tiny) for _ in range(3)]
    outs = []
    for s, seed in zip(runs, (7, 7, 8)):
        list(s.stream(p, SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed), 30))
        outs.append(s.last.tokens)
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


def test_probabilities_truncation():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    full = torch.softmax(logits, -1)
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0))
    assert torch.allclose(p[:2], full[:2] / full[:2].sum()) and p[2:].sum() == 0
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0))
    assert (p > 0).sum() == 2  # 0.64 < 0.7, so the second token is needed too
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.3))
    assert (p > 0).sum() == 2  # e^-1 = 0.37 >= 0.3, e^-2 < 0.3
    hot = probabilities(logits, SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0))
    assert torch.allclose(hot, torch.softmax(logits / 0.5, -1))


def _dense_probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The rules over the whole vocabulary, as written: temperature, top-k (ties with the k-th kept),
    softmax, min-p, top-p (the most likely token always kept), renormalized."""
    x = logits.double() / max(p.temperature, 1e-5)
    if p.top_k and p.top_k < x.numel():
        x[x < torch.topk(x, p.top_k).values[-1]] = float("-inf")
    probs = torch.softmax(x, -1)
    if p.min_p > 0:
        probs[probs < p.min_p * probs.max()] = 0
    if p.top_p < 1:
        sorted_p, order = probs.sort(descending=True, stable=True)
        before = sorted_p.cumsum(-1) - sorted_p
        before[0] = 0
        sorted_p[before >= p.top_p] = 0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs / probs.sum()


@pytest.mark.parametrize("top_k,top_p,min_p", [(40, 0.9, 0.1), (3, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.05),
                                               (7, 0.5, 0.0), (5000, 0.95, 0.0)])
def test_candidates_are_the_whole_vocabularys_rules(top_k, top_p, min_p):
    """The top-k candidates (sampling's work over k tokens, not the vocabulary) against the rules
    applied to the whole vocabulary: the same tokens kept, the same probabilities; ties with the k-th
    token stay; a batch of rows is each row's; a draw picks only kept tokens, as often as their
    probabilities say."""
    from brisk.core.sampling import Sampler, candidates

    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(3000, generator=gen) * (1 + trial % 4)
        if trial % 5 == 0:  # ties at the k-th and beyond (rounded logits)
            logits = (logits * 2).round() / 2
        p = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p)
        want = _dense_probabilities(logits, p)
        got = probabilities(logits, p)
        assert torch.equal(got > 0, want > 0), trial
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
        batch = probabilities(torch.stack([logits, logits.flip(0)]), p)
        assert torch.equal(batch[0], got) and torch.equal(batch[1], probabilities(logits.flip(0), p))
    ids, probs = candidates(logits, p)
    assert (ids is None) == (not top_k or top_k >= logits.numel())
    sampler, counts = Sampler(SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p, seed=1)), {}
    for _ in range(3000):
        t = sampler(logits)
        counts[t] = counts.get(t, 0) + 1
    assert all(want[t] > 0 for t in counts)
    for t, n in counts.items():
        assert abs(n / 3000 - want[t].item()) < 0.04, (t, n, want[t].item())
    # draw() (speculative decoding's residuals, the whole-vocabulary rules): among the nonzero entries alike
    from brisk.core.sampling import draw

    gen, counts = torch.Generator().manual_seed(2), {}
    for _ in range(3000):
        t = draw(want.float(), gen)
        counts[t] = counts.get(t, 0) + 1
    assert all(want[t] > 0 for t in counts)
    for t, n in counts.items():
        assert abs(n / 3000 - want[t].item()) < 0.04, (t, n, want[t].item())


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=1.0),
                                 dict(top_k=-3), dict(repetition_penalty=0), dict(presence_penalty=2.5),
                                 dict(frequency_penalty=-2.1), dict(logit_bias={1: 101}), dict(logit_bias={-1: 1}),
                                 dict(logit_bias={i: 1 for i in range(301)})])
def test_invalid_sampling_values_are_refused(bad):
    with pytest.raises(BriskError):
        SamplingParams(**bad).validate()


def test_presence_frequency_and_bias_by_hand():
    """logits[t] -= p * (c[t] > 0) + f * c[t] over the answer's tokens only, then + bias[t]."""
    from brisk.core.sampling import Seen, apply_penalties
    logits = torch.tensor([1.0, 2.0, -1.0, 0.5, 3.0])
    # prompt [4, 4], answer [1, 1, 2]: c = [0, 2, 1, 0, 0] (the prompt's 4s do not count)
    seen = Seen(torch.tensor([4, 4, 1, 1, 2]), start=2)
    p = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={0: 10, 4: -100})
    out = apply_penalties(logits, seen, p)
    assert out.tolist() == pytest.approx([1.0 + 10, 2.0 - 0.5 - 0.5, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 100])
    assert logits.tolist() == [1.0, 2.0, -1.0, 0.5, 3.0]  # not changed in place
    assert not SamplingParams().penalized and p.penalized
    # at their defaults the penalties are the identity, the very tensor
    assert apply_penalties(logits, seen, SamplingParams()) is logits


def test_stop_matcher_never_leaks_a_stop_string():
    m = StopMatcher(["STOP", "\n\n"])
    out, stopped = "", False
    for piece in ["hello S", "TO", "P after"]:
        text, stopped = m.feed(piece)
        out += text
        if stopped:
            break
    assert stopped and out == "hello "
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", False) and m.feed("ay") == ("STay", False)


def test_generation_stops_at_stop_string(tiny):
    p = tiny.prompt_ids("The", raw=True)
    s = Session(tiny)
    full = "".join(s.stream(p, GREEDY, max_tokens=30))
    assert len(full) > 6
    stop = full[3:6]
    s2 = Session(tiny)
    cut = "".join(s2.stream(p, GREEDY, max_tokens=30, stop=[stop]))
    assert cut == full[:full.index(stop)] and s2.last.finish_reason == "stop"


def test_prompt_over_context_is_refused(tiny_llama_dir):
    llm = LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32", ctx=32)
    with pytest.raises(BriskError, match="context"):
        list(Session(llm).stream(list(range(3, 40)), GREEDY, 4))
    with pytest.raises(BriskError, match="empty"):
        llm.prompt_ids("   ")


def test_max_tokens_respected(tiny):
    s = Session(tiny)
    list(s.stream(tiny.prompt_ids("a", raw=True), GREEDY, max_tokens=5))
    assert len(s.last.tokens) <= 5


def test_chat_second_turn_prefills_only_new_tokens(tiny):
    chat = Chat(tiny, sampling=GREEDY, max_tokens=8)
    first = "".join(chat.send("hello there"))
    r1 = chat.session.last
    assert r1.prefilled_tokens == r1.prompt_tokens
    cached_before = len(chat.session.ids)
    "".join(chat.send("and again"))
    r2 = chat.session.last
    # The whole first exchange was reused: only the tokens after it were run.
    assert r2.prompt_tokens > r1.prompt_tokens + len(r1.tokens)
    assert r2.prefilled_tokens < r2.prompt_tokens - cached_before + 4
    assert r2.prefilled_tokens <= r2.prompt_tokens - r1.prompt_tokens
    # and the answer is what a fresh session would give for the same conversation
    fresh = Session(tiny)
    ids = tiny.tokenizer.encode(tiny.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first},
         {"role": "user", "content": "and again"}]), add_special=False)
    list(fresh.stream(ids, GREEDY, 8))
    assert fresh.last.tokens == r2.tokens


def test_chat_drops_oldest_turns_to_fit(tiny_llama_dir):
    llm = LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32", ctx=96)
    chat = Chat(llm, sampling=GREEDY, max_tokens=8)
    for i in range(8):
        "".join(chat.send(f"turn {i} the quick brown fox jumps"))
    assert chat.dropped > 0 and chat.messages[-2]["content"].startswith("turn 7")


def test_chat_save_load_roundtrip(tiny, tmp_path):
    chat = Chat(tiny, system="be brief", sampling=GREEDY, max_tokens=4)
    "".join(chat.send("hi"))
    chat.save(tmp_path / "c.json")
    other = Chat(tiny, sampling=GREEDY)
    other.load(tmp_path / "c.json")
    assert other.messages == chat.messages and other.system == "be brief"
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(BriskError):
        other.load(tmp_path / "bad.json")


def test_output_stream_rules(tiny):
    """The one OutputStream behind Session, Engine and speculation: EOS ends unseen, a stop string
    is cut and never shown, the budget ends with the held-back tail released."""
    from brisk.core.output_stream import OutputStream

    tok = tiny.tokenizer
    ids = tok.encode("hello world, hello again", add_special=False)
    eos = next(iter(tiny.eos_ids))
    out = OutputStream(tok, {eos}, (), 100, 3)
    text = "".join(out.push(t) for t in ids) + out.push(eos)
    assert out.finished and out.result.finish_reason == "eos" and out.result.tokens == ids
    assert text == out.result.text == tok.decode(ids)
    out = OutputStream(tok, {eos}, (", hello",), 100, 3)
    text = ""
    for t in ids:
        text += out.push(t)
        if out.finished:
            break
    assert out.result.finish_reason == "stop" and text == out.result.text == tok.decode(ids).split(", hello")[0]
    out = OutputStream(tok, {eos}, ("zzz",), 2, 3)
    text = "".join(out.push(t) for t in ids[:2])
    assert out.result.finish_reason == "length" and text == tok.decode(ids[:2]) and out.result.decode_s >= 0


def test_loop_guard_fires_on_an_exact_repeat_only():
    from brisk.core.output_stream import LoopGuard

    G = LoopGuard
    for period in (1, 2, 7, 16, 40, G.MAX_PERIOD):
        unit = list(range(100, 100 + period))
        tokens = [1, 2, 3] + unit * 200
        g = LoopGuard()
        fired = next(i for i, t in enumerate(tokens) if g.push(t))
        # the repeat is seen once the unit has followed itself for max(MIN_SPAN, (REPEATS-1)*period) tokens
        assert fired == 3 + period + max(G.MIN_SPAN, (G.REPEATS - 1) * period) - 1, period
    g = LoopGuard()  # a period over MAX_PERIOD, and text that only nearly repeats, never fire
    assert not any(g.push(t) for t in list(range(G.MAX_PERIOD + 1)) * 5)
    g = LoopGuard()
    assert not any(g.push(t) for i in range(400) for t in (7, 8, 9, i))  # "7 8 9 0 7 8 9 1 ..."


@pytest.mark.parametrize("prompt", ["hi", "Once upon a time"])
def test_stop_loops_ends_a_looping_answer_where_it_starts_repeating(tiny_gguf_path, prompt):
    """The random-weight model falls into greedy loops: with stop_loops the answer is the plain
    answer's prefix up to where LoopGuard sees the loop, and says why it ended."""
    from dataclasses import replace

    from brisk.core.output_stream import LoopGuard

    llm = LLM.load(str(tiny_gguf_path), device="cpu")
    plain = llm.generate(prompt, GREEDY, max_tokens=200)
    g = LoopGuard()
    at = next(i for i, t in enumerate(plain.tokens) if g.push(t))  # StopIteration: the model no longer loops
    res = llm.generate(prompt, replace(GREEDY, stop_loops=True), max_tokens=200)
    assert res.finish_reason == "loop" and res.tokens == plain.tokens[:at + 1]
    assert res.text == llm.tokenizer.decode(res.tokens)


def test_long_load_steps_report_progress(smollm2_path, tiny_llama_dir, tmp_path, monkeypatch):
    """Widening a GGUF once and quantizing at load report (what, done, total) from 0 to total, the
    total being the tensors widened / the linear layers converted (the CLI draws its bars from these)."""
    import shutil

    import brisk.core.checkpoint as ck
    from brisk.core import progress

    monkeypatch.setattr(ck, "CACHE_DIR", tmp_path / "cache")
    gguf = tmp_path / "m.gguf"
    shutil.copy(smollm2_path, gguf)
    for model, quantize, word in ((gguf, "none", "widening"), (tiny_llama_dir, "int8", "quantizing")):
        seen = []
        with progress.listening(lambda *a: seen.append(a)):
            llm = LLM.load(str(model), device="cpu", dtype="float32", quantize=quantize)
        steps = [s[1:] for s in seen if word in s[0]]
        n = steps[-1][1] if steps else 0
        if word == "widening":  # every tensor of a quantized type, once; the float ones are cheap
            assert n == sum(t.qtype not in (0, 1, 30) for t in ck._gguf_header(gguf)[2])
            assert steps == [(i, n) for i in range(n + 1)]
        else:
            float_model = LLM.load(str(model), device="cpu", dtype="float32", quantize="none").model
            assert n == sum(isinstance(m, torch.nn.Linear) for m in float_model.modules())
            assert steps == [(i, n) for i in range(1, n + 1)] and llm.quantization.startswith("int8")
    from brisk.quant import native  # without the native kernels: the first load repacks for torch's

    monkeypatch.setattr(native, "available", lambda: False)
    for first in (True, False):
        seen = []
        with progress.listening(lambda *a: seen.append(a)):
            LLM.load(str(gguf), device="cpu", dtype="float32")
        steps = [s[1:] for s in seen if "repacking" in s[0]]
        n = len(ck._gguf_header(gguf)[2])
        assert steps == ([(i, n) for i in range(n + 1)] if first else []), steps[-2:]  # then cached
