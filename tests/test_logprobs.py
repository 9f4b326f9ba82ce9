"""Token logprobs, as the OpenAI API returns them: each equals the log-softmax of a plain forward
over the whole text (the model's distribution, not the sampler's or the draft's), from the
batching engine, the single-stream loop, the speculative loop and echo's prompt scoring alike;
the API's shapes (chat's content entries, the completions' parallel lists), streamed equal to
not streamed; n choices, several prompts, token-id prompts; bad values are 400s."""
from __future__ import annotations

import json

import pytest
import torch

from brisk.core import GREEDY, Session
from brisk.core.batching import Engine, EngineThread, Request, SerialEngine
from brisk.core.sampling import SamplingParams

from test_serve import KEY, Server  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """log-softmax after each position of ids, one plain forward: [len(ids), V]."""
    with torch.inference_mode():
        logits = llm.model(torch.tensor([ids]), 0, llm.new_cache())[0]
    return torch.log_softmax(logits.float(), -1)


def check_against_reference(llm, prompt: list[int], tokens: list[int], entries, k: int, atol=1e-4):
    """entries: one per token, and one more for the end token when the answer ended on it."""
    assert tokens and len(entries) in (len(tokens), len(tokens) + 1)
    if len(entries) > len(tokens):
        assert entries[-1].token in llm.eos_ids
        tokens = tokens + [entries[-1].token]
    ref = reference_logprobs(llm, prompt + tokens)
    for i, (t, e) in enumerate(zip(tokens, entries)):
        row = ref[len(prompt) - 1 + i]
        assert e.token == t and abs(e.logprob - float(row[t])) < atol, (i, e.logprob, float(row[t]))
        assert len(e.top) == k
        if k:
            want = row.topk(k)
            assert [v for _, v in e.top] == pytest.approx(want.values.tolist(), abs=atol)
            assert e.top[0][0] == int(want.indices[0])


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=3,
                                                             repetition_penalty=1.3)], ids=["greedy", "sampled"])
def test_engine_logprobs_are_the_models_distribution(tiny, sampling):
    """Batched: several sequences at once, each token's logprob the raw model's (the penalty and
    the temperature change what is drawn, not what is reported)."""
    prompts = [tiny.prompt_ids(p, raw=True) for p in ("The sky", "Once upon a time there", "1 2 3")]
    seqs = Engine(tiny, max_batch=4).run([Request(p, sampling, 10, logprobs=5) for p in prompts])
    for p, s in zip(prompts, seqs):
        check_against_reference(tiny, p, s.result.tokens, s.result.logprobs, 5)


def test_echo_scores_every_prompt_token_even_beside_a_shared_prefix(tiny):
    """Echo's prompt logprobs: one per prompt token (None for the first), through prefill chunks
    smaller than the prompt, next to a sequence whose blocks would otherwise be shared."""
    long = tiny.prompt_ids("a b c d e f g h " * 12, raw=True)
    engine = Engine(tiny, max_batch=4, step_tokens=40)
    first = engine.run([Request(long, GREEDY, 2)])[0]  # its blocks are now cached
    shared = engine.stats.shared_tokens
    seqs = engine.run([Request(long, GREEDY, 3, logprobs=2, prompt_logprobs=2), Request(long[:50], GREEDY, 0,
                                                                                       prompt_logprobs=0)])
    assert engine.stats.shared_tokens == shared  # echo computes its prompt
    ref = reference_logprobs(tiny, long)
    got = seqs[0].result.prompt_logprobs
    assert got[0] is None and len(got) == len(long)
    for i in range(1, len(long)):
        assert abs(got[i].logprob - float(ref[i - 1, long[i]])) < 1e-4 and len(got[i].top) == 2
    assert seqs[0].result.tokens == first.result.tokens[:2] + seqs[0].result.tokens[2:]
    scored = seqs[1].result
    assert scored.tokens == [] and scored.finish_reason == "length" and len(scored.prompt_logprobs) == 50
    assert [e.logprob for e in scored.prompt_logprobs[1:]] == pytest.approx([e.logprob for e in got[1:50]], abs=1e-5)


@pytest.mark.parametrize("draft", [None, "ngram", "lookahead"])
def test_single_stream_and_speculative_logprobs_are_the_targets(tiny, draft):
    """The speculative loop reports the target's logprobs for drafted-and-accepted tokens (their
    rows of the verifying pass, chains and trees), equal to plain decoding's."""
    from brisk.core.spec.build import make_speculator

    ids = tiny.prompt_ids("the sky the sky the sky is the sky", raw=True)
    session = Session(tiny, make_speculator(tiny, draft) if draft else None)
    list(session.stream(ids, GREEDY, 24, logprobs=3))
    res = session.last
    check_against_reference(tiny, ids, res.tokens, res.logprobs, 3)
    if draft:
        assert res.spec["accepted"] > 0  # drafts were accepted, so their rows were used


def test_serial_engine_echo_and_logprobs(tiny):
    from brisk.core.spec.build import make_speculator

    ids = tiny.prompt_ids("one two three four five", raw=True)
    engine = SerialEngine(tiny, make_speculator(tiny, "ngram"))
    seq = engine.run([Request(ids, GREEDY, 8, logprobs=1, prompt_logprobs=1)])[0]
    check_against_reference(tiny, ids, seq.result.tokens, seq.result.logprobs, 1)
    ref = reference_logprobs(tiny, ids)
    assert [e.logprob for e in seq.result.prompt_logprobs[1:]] == pytest.approx(
        [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))], abs=1e-4)


def test_token_bytes_spell_the_text(smollm2, tiny_gguf_path):
    """Byte-level BPE (SmolLM2) and SentencePiece with byte fallback (tinycoder): the tokens'
    bytes join to the text's UTF-8, characters cut across tokens included."""
    from brisk.core import LLM

    text = "Héllo wörld — 東京 is 🙂 fine.\n  x"
    for llm in (smollm2, LLM.load(str(tiny_gguf_path), device="cpu")):
        tok = llm.tokenizer
        ids = tok.encode(text, add_special=False)
        joined = b"".join(tok.token_bytes(i) for i in ids)
        assert joined.decode("utf-8").removeprefix(" ") == text
    cut = [i for i in smollm2.tokenizer.encode(text, add_special=False) if not _utf8(smollm2.tokenizer.token_bytes(i))]
    assert cut  # SmolLM2 splits a character over tokens: each part's bytes as they are


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ---------------------------------------------------------------- the API

@pytest.fixture(scope="module")
def server(tiny):
    s = Server(tiny)
    yield s
    s.close()


def test_chat_logprobs_shape_and_values(server, tiny):
    r = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Paris is"}],
                                              max_tokens=8, temperature=0, logprobs=True, top_logprobs=4)
    content = r.choices[0].logprobs.content
    ids = tiny.prompt_ids("Paris is")
    s = Session(tiny)
    list(s.stream(ids, GREEDY, 8, logprobs=4))
    assert len(content) == len(s.last.tokens)  # the end token is not part of the message
    for c, e in zip(content, s.last.logprobs):
        assert bytes(c.bytes) == tiny.tokenizer.token_bytes(e.token)
        assert c.logprob == pytest.approx(e.logprob, abs=1e-5) and len(c.top_logprobs) == 4
        assert c.top_logprobs[0].logprob >= c.logprob - 1e-6
    assert "".join(bytes(c.bytes).decode("utf-8", "replace") for c in content) == r.choices[0].message.content
    plain = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Paris is"}],
                                                  max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_equal_whole(server):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Tell me"}], max_tokens=10, temperature=0,
              logprobs=True, top_logprobs=2)
    whole = server.client.chat.completions.create(**kw).choices[0].logprobs.content
    parts = [c for chunk in server.client.chat.completions.create(**kw, stream=True) for ch in chunk.choices
             if ch.logprobs for c in ch.logprobs.content]
    assert [(c.token, round(c.logprob, 5)) for c in parts] == [(c.token, round(c.logprob, 5)) for c in whole]
    kw = dict(model="tiny", prompt="Tell me", max_tokens=10, temperature=0, logprobs=2, echo=True)
    whole = server.client.completions.create(**kw).choices[0]
    chunks = [ch for chunk in server.client.completions.create(**kw, stream=True) for ch in chunk.choices]
    assert "".join(ch.text for ch in chunks) == whole.text
    streamed = [x for ch in chunks if ch.logprobs for x in ch.logprobs.token_logprobs]
    assert len(streamed) == len(whole.logprobs.token_logprobs) and streamed[0] is None
    assert streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-6)


def test_completions_echo_scores_token_prompts_as_lm_eval_asks(server, tiny):
    """lm-eval's loglikelihood request: token-id prompts, several per request, echo, logprobs 1,
    max_tokens 1; token_logprobs[i] scores prompt token i given those before (None for the first)."""
    prompts = [tiny.prompt_ids("The capital of France is Paris", raw=True), tiny.prompt_ids("2 + 2 = 4", raw=True)]
    status, out = server.raw("POST", "/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": 1,
                                                         "echo": True, "logprobs": 1, "temperature": 0})
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1]
    for ids, choice in zip(prompts, out["choices"]):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = reference_logprobs(tiny, ids)
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx([float(ref[i - 1, ids[i]]) for i in range(1, len(ids))],
                                                                 abs=1e-4)
        for tok, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]):
            assert tok in top and 1 <= len(top) <= 2
        assert choice["text"].startswith(tiny.tokenizer.decode(ids, skip_special=True))
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts)) and out["usage"]["completion_tokens"] == 2
    # the one generated token is the end token: it is scored all the same (lm-eval drops the last entry)
    eos = min(tiny.eos_ids)
    status, out = server.raw("POST", "/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": 1,
                                                         "echo": True, "logprobs": 1, "logit_bias": {str(eos): 100}})
    for ids, choice in zip(prompts, out["choices"]):
        assert choice["finish_reason"] == "stop" and len(choice["logprobs"]["token_logprobs"]) == len(ids) + 1
    # max_tokens 0: the prompt scored, nothing generated
    status, out = server.raw("POST", "/v1/completions", {"model": "tiny", "prompt": prompts[0], "max_tokens": 0,
                                                         "echo": True, "logprobs": 0})
    assert status == 200 and len(out["choices"][0]["logprobs"]["token_logprobs"]) == len(prompts[0])
    assert out["usage"]["completion_tokens"] == 0


def test_n_choices_share_the_prompt(server, tiny):
    r = server.client.completions.create(model="tiny", prompt="Once upon", max_tokens=6, n=3, temperature=1.0,
                                         seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(tiny.prompt_ids("Once upon", raw=True))  # once, not per choice
    assert 3 <= r.usage.completion_tokens <= 18
    again = server.client.completions.create(model="tiny", prompt="Once upon", max_tokens=6, n=3, temperature=1.0,
                                             seed=5)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seed + choice index: reproducible
    assert len({c.text for c in r.choices}) > 1
    from brisk.core.kv.paged import BLOCK_SIZE

    long = "the quick brown fox " * 12
    n_blocks = (len(tiny.prompt_ids(long, raw=True)) - 1) // BLOCK_SIZE
    before = server.runner.engine.stats.shared_tokens
    server.client.completions.create(model="tiny", prompt=long, max_tokens=2, n=4, temperature=1.0)
    assert n_blocks and server.runner.engine.stats.shared_tokens - before == 3 * n_blocks * BLOCK_SIZE  # computed once
    g = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2,
                                              max_tokens=5, temperature=0)
    assert len(g.choices) == 2 and g.choices[0].message.content == g.choices[1].message.content


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": [[1, 2], [10 ** 9]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 17}, "n"),
])
def test_bad_logprob_requests_are_400s(server, path, extra, param):
    body = {"model": "tiny", "max_tokens": 2}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    status, out = server.raw("POST", path, body | extra)
    assert status == 400 and out["error"]["param"] == param, out
    assert server.raw("POST", path, body)[0] == 200  # and the server goes on
