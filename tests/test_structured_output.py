"""Structured output (core/grammar.py over llguidance): the masks let every token of a valid
document through and stop the first wrong one, on byte-level BPE and SentencePiece vocabularies;
answers held to a JSON schema, a Lark or a GBNF grammar parse, greedy and sampled, alone and
batched with unconstrained requests (which answer as before); speculative decoding under a grammar
gives plain decoding's greedy answer; the API's response_format and the openai client's parse()
work; a schema that does not compile is a 400 naming the problem, and the server goes on."""
from __future__ import annotations

import json

import pytest
import torch

from brisk.core import GREEDY, Session
from brisk.core.batching import Engine, Request
from brisk.core.errors import InvalidValue
from brisk.core.grammar import Vocabulary
from brisk.core.sampling import SamplingParams

pytest.importorskip("llguidance")
pytestmark = pytest.mark.usefixtures("one_thread")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def is_person(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "tags"} and isinstance(obj["name"], str)
            and isinstance(obj["age"], int) and isinstance(obj["tags"], list)
            and all(isinstance(t, str) for t in obj["tags"]))


def allowed(constraint, token: int) -> bool:
    row = constraint.mask(torch.zeros(constraint.vocab.n_vocab))
    return bool(torch.isfinite(row[token]))


@pytest.fixture(scope="module")
def sentencepiece(tiny_gguf_path):
    from brisk.core import LLM

    return LLM.load(str(tiny_gguf_path), device="cpu")


@pytest.mark.parametrize("which", ["smollm2", "sentencepiece"])
def test_masks_follow_a_valid_document_and_stop_a_wrong_token(which, request):
    llm = request.getfixturevalue(which)
    tok = llm.tokenizer
    vocab = Vocabulary.of(tok, llm.config.vocab_size)
    doc = json.dumps({"name": "Anna Ölund", "age": 31, "tags": ["a b", "東京"]}, ensure_ascii=False)
    c = vocab.compile("json_schema", PERSON).constraint()
    ids = vocab.tokenizer.tokenize_str(doc)  # as a continuation: no SentencePiece leading space
    assert b"".join(tok.token_bytes(i) for i in ids) == doc.encode()
    eos = min(tok.eos_ids)
    assert not allowed(c, tok.encode("x", add_special=False)[-1])  # a letter where "{" must come
    assert not allowed(c, eos)
    for i, t in enumerate(ids):
        assert allowed(c, t), (i, tok.token_bytes(t))
        c.take([t])
    assert allowed(c, eos)  # the document is complete: the end of turn is allowed
    for special in tok.special_ids - tok.eos_ids:
        assert not allowed(vocab.compile("json_schema", PERSON).constraint(), special)


def test_answers_follow_schema_and_grammars(smollm2):
    vocab = Vocabulary.of(smollm2.tokenizer, smollm2.config.vocab_size)
    session = Session(smollm2)
    ids = smollm2.prompt_ids("Describe a person as JSON: name, age and tags.")
    for sampling in (GREEDY, *(SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=s)
                               for s in range(3))):
        text = "".join(session.stream(ids, sampling, 160, grammar=vocab.compile("json_schema", PERSON)))
        assert session.last.finish_reason == "eos" and is_person(json.loads(text)), text
    yes_no = vocab.compile("lark", 'start: ("yes" | "no") "."')
    assert "".join(session.stream(smollm2.prompt_ids("Is the sky blue?"), GREEDY, 10, grammar=yes_no)) in ("yes.", "no.")
    gbnf = vocab.compile("gbnf", 'root ::= [0-9]+ " apples"')
    text = "".join(session.stream(smollm2.prompt_ids("How many apples?"), GREEDY, 10, grammar=gbnf))
    assert text.endswith(" apples") and text[:-7].isdigit()
    text = "".join(session.stream(ids, GREEDY, 100, grammar=vocab.compile("json_object", None)))
    assert isinstance(json.loads(text), dict)


def test_batched_constrained_and_free_requests(smollm2):
    """Per-sequence masks in one batch; the unconstrained requests answer as they do alone."""
    vocab = Vocabulary.of(smollm2.tokenizer, smollm2.config.vocab_size)
    prompts = [smollm2.prompt_ids(p) for p in ("A person as JSON.", "Tell me about cats.", "Is 2 > 1?")]
    grammars = [vocab.compile("json_schema", PERSON), None, vocab.compile("lark", 'start: "yes" | "no"')]
    seqs = Engine(smollm2, max_batch=4).run([Request(p, GREEDY, 120, grammar=g) for p, g in zip(prompts, grammars)])
    assert is_person(json.loads(seqs[0].result.text)) and seqs[2].result.text in ("yes", "no")
    alone = Session(smollm2)
    assert "".join(alone.stream(prompts[1], GREEDY, 120)) == seqs[1].result.text


@pytest.mark.parametrize("draft", ["ngram", "lookahead"])
def test_speculation_under_a_grammar_equals_plain_greedy(smollm2, draft):
    """Chains are cut to what the grammar accepts and each row masked before verification (trees
    are not drafted): greedy output equals plain decoding's under the same grammar."""
    from brisk.core.spec.build import make_speculator

    vocab = Vocabulary.of(smollm2.tokenizer, smollm2.config.vocab_size)
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                         "maxItems": 8}}, "required": ["items"]}
    ids = smollm2.prompt_ids("List fruits as JSON: apple, apple, pear, apple, pear, apple.")
    plain = Session(smollm2)
    want = "".join(plain.stream(ids, GREEDY, 120, grammar=vocab.compile("json_schema", schema)))
    spec = Session(smollm2, make_speculator(smollm2, draft))
    got = "".join(spec.stream(ids, GREEDY, 120, grammar=vocab.compile("json_schema", schema)))
    assert got == want and isinstance(json.loads(got), dict)
    if draft == "ngram":
        assert spec.last.spec["accepted"] > 0


@pytest.mark.parametrize("kind,source,words", [
    ("json_schema", {"type": "integr"}, "integr"),
    ("lark", "start: missing_rule", "missing_rule"),
    ("gbnf", "root ::= undefined-rule", "undefined-rule"),
    ("regex", "(?<=a)b", "look"),
])
def test_grammars_that_do_not_compile_are_named(smollm2, kind, source, words):
    vocab = Vocabulary.of(smollm2.tokenizer, smollm2.config.vocab_size)
    with pytest.raises(InvalidValue) as e:
        vocab.compile(kind, source, "response_format")
    assert e.value.name == "response_format" and words in str(e.value)


# ---------------------------------------------------------------- the API

@pytest.fixture(scope="module")
def server(smollm2):
    from test_serve import Server

    s = Server(smollm2, name="smollm2")
    yield s
    s.close()


def test_response_format_and_openai_parse(server):
    """The openai client's chat.completions.parse with a pydantic model: 10 prompts, 10 objects."""
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=40)
        country: str = pydantic.Field(max_length=40)
        population_millions: int

    cities = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Delhi", "Rome", "Seoul", "Quito", "Sydney"]
    for i, city in enumerate(cities):
        r = server.client.chat.completions.parse(
            model="smollm2", messages=[{"role": "user", "content": f"Give facts about {city} as JSON."}],
            response_format=City, max_tokens=120, temperature=0.7 if i % 2 else 0, seed=i)
        assert isinstance(r.choices[0].message.parsed, City), r.choices[0].message.content
    r = server.client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi as JSON"}],
                                              response_format={"type": "json_object"}, max_tokens=80, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    chunks = server.client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi as JSON"}],
                                                   response_format={"type": "json_object"}, max_tokens=80,
                                                   temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


@pytest.mark.parametrize("fmt,words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}, "integr"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "xml"}, "json_object"),
    ("json", "json_object"),
])
def test_bad_response_formats_are_400s(server, fmt, words):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "response_format": fmt}
    status, out = server.raw("POST", "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "response_format" and words in out["error"]["message"], out
    assert server.raw("POST", "/v1/chat/completions", {**body, "response_format": {"type": "text"}})[0] == 200


def test_unbounded_numbers_and_whitespace_get_llama_cpp_like_limits(smollm2):
    from brisk.core.grammar import NUMBER_LIMIT, bounded

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": ["number", "null"]},
                                               "k": {"type": "integer", "minimum": 0}}}
    out = bounded(schema)
    assert out["properties"]["n"] == {"type": "integer", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT}
    assert out["properties"]["x"]["maximum"] == NUMBER_LIMIT
    assert out["properties"]["k"] == {"type": "integer", "minimum": 0, "maximum": NUMBER_LIMIT}
    assert "minimum" not in schema["properties"]["n"]  # the caller's schema is left alone
    c = Vocabulary.of(smollm2.tokenizer, smollm2.config.vocab_size).compile("json_schema", schema).constraint()
    tokenize = c.vocab.tokenizer.tokenize_str
    for doc, ok in (('{"n": 1}', True), ('{\n  "n": 1\n}', True), ('{\n\n\n "n": 1}', False),
                    ('{"n": 1234567890123456}', False)):
        ids = tokenize(doc)
        assert (c.matcher.validate_tokens(ids) == len(ids)) is ok, doc


def test_generate_json_schema_and_grammar_files(smollm2_path, tmp_path):
    from typer.testing import CliRunner

    from brisk.cli.main import app

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                                  "required": ["city"], "additionalProperties": False}))
    runner = CliRunner()
    r = runner.invoke(app, ["generate", str(smollm2_path), "Where is the Eiffel tower?", "-t", "0",
                            "--json-schema", str(schema)])
    assert r.exit_code == 0 and set(json.loads(r.stdout)) == {"city"}, r.output
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= ("yes" | "no")\n')
    r = runner.invoke(app, ["generate", str(smollm2_path), "Is the sky green?", "-t", "0", "--grammar", str(gbnf)])
    assert r.exit_code == 0 and r.stdout.strip() in ("yes", "no"), r.output
    schema.write_text('{"type": "integr"}')
    r = runner.invoke(app, ["generate", str(smollm2_path), "x", "--json-schema", str(schema)])
    assert r.exit_code == 1 and str(schema) in r.output and "integr" in r.output


def test_greedy_shortcut_equals_the_masked_argmax(smollm2):
    """Greedy checks the model's argmax against the grammar and masks only when it is refused: the
    same token as the masked argmax, at every step of a document and after it (the end token)."""
    vocab = Vocabulary.of(smollm2.tokenizer, smollm2.config.vocab_size)
    c = vocab.compile("json_schema", PERSON).constraint()
    doc = vocab.tokenizer.tokenize_str('{"name": "Al", "age": 3, "tags": []}')
    g = torch.Generator().manual_seed(0)
    for t in doc + [None]:
        for _ in range(4):
            logits = torch.randn(vocab.n_vocab, generator=g)
            if _ % 2:  # the raw argmax allowed: the document's own next token (or the end) on top
                logits[t if t is not None else min(smollm2.tokenizer.eos_ids)] = 50.0
            assert c.argmax(logits) == int(c.mask(logits).argmax())
        if t is not None:
            c.take([t])
