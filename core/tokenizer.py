"""Text <-> token ids, chat templates and streaming decode, over a HF `tokenizers.Tokenizer`.

The model's own tokenizer is the reference: a GGUF's vocabulary is rebuilt by gguf_tokenizer.py,
a HF folder's tokenizer.json is used as it is. BOS is added here rather than by the
tokenizer.json's post-processor, so both sources follow one rule.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from datetime import datetime
from pathlib import Path

import tokenizers

from .errors import BriskError, FileError

# Spellings of special tokens that end a turn: generation stops on them too, as llama.cpp does,
# because chat models end an answer with these rather than with their EOS token.
_END_OF_TURN = {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                "<|endoftext|>", "<|end_of_text|>", "<|return|>", "<EOT>"}
_BRISK_EOS_KEY = "brisk_eos_token_ids"  # extra tokenizer_config.json key written by save()


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, *, bos_id: int | None = None,
                 eos_id: int | None = None, eos_ids=(), add_bos: bool = False,
                 chat_template: str | None = None):
        self.backend = backend
        self.bos_id = bos_id
        self.add_bos = bool(add_bos) and bos_id is not None
        self.chat_template = chat_template or None
        self.bos_token = backend.id_to_token(bos_id) if bos_id is not None else None
        self.eos_token = backend.id_to_token(eos_id) if eos_id is not None else None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        # ids that decode(skip_special=True) drops: the added tokens flagged special
        specials = {i: t.content for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.special_ids = set(specials)
        # ids that end generation: EOS, the extra ones given, and end-of-turn special tokens
        self.eos_ids: set[int] = {i for i in (eos_id, *eos_ids) if i is not None}
        harmony = "<|channel|>" in specials.values()
        ends = (_END_OF_TURN - {"<|end|>"}) | {"<|call|>"} if harmony else _END_OF_TURN
        self.eos_ids |= {i for i, text in specials.items() if text in ends}
        if harmony:  # gpt-oss: <|end|> closes one message of a turn (its reasoning), <|call|> hands over
            self.eos_ids -= {i for i, text in specials.items() if text == "<|end|>"}  # to a tool (llama.cpp too)
        self._template = None  # compiled lazily: most runs never render one
        self._added_ids = set(backend.get_added_tokens_decoder())
        self._byte_level: bool | None = None  # whether pieces spell bytes in GPT-2's alphabet (found on first use)
        self._rows: int | None = None  # the model's embedding rows, where some token ids lie beyond them
        self._model_name = ""

    def fit_rows(self, rows: int, model_name: str) -> None:
        """The model this tokenizer feeds has `rows` embeddings: ids at or past them (added tokens a
        model file lists beyond its table) are refused by encode, not met as an index error later."""
        top = max([self.backend.get_vocab_size(with_added_tokens=False) - 1, *self._added_ids])
        self._rows, self._model_name = (rows if top >= rows else None), model_name

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        from .gguf_tokenizer import build_tokenizer

        backend = build_tokenizer(meta)
        n_tokens = len(meta["tokenizer.ggml.tokens"])

        def token_id(key):
            i = meta.get(key)
            return i if isinstance(i, int) and 0 <= i < n_tokens else None

        eos_ids = {token_id(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")}
        # llama.cpp's default: SentencePiece vocabularies want BOS, byte-level BPE ones do not
        add_bos = meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
        template = meta.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            import warnings

            warnings.warn(f"GGUF tokenizer.chat_template is not text ({type(template).__name__}): ignored")
            template = None
        return cls(backend, bos_id=token_id("tokenizer.ggml.bos_token_id"),
                   eos_id=token_id("tokenizer.ggml.eos_token_id"), eos_ids=eos_ids,
                   add_bos=add_bos if isinstance(add_bos, bool) else bool(add_bos), chat_template=template)

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """A HF model/tokenizer folder (also what save() writes)."""
        from .files import MAX_JSON_BYTES, exists, regular_file

        path = Path(path)
        tj = path / "tokenizer.json"
        if not exists(tj):
            raise FileError("no tokenizer.json (brisk needs the 'fast' tokenizer file; "
                            "re-save the tokenizer with transformers to create it)", path)
        if os.stat(regular_file(tj)).st_size > MAX_JSON_BYTES:
            raise FileError(f"is over {MAX_JSON_BYTES >> 20} MiB", tj)
        with _tokenizer_failures(lambda why: FileError(f"unreadable tokenizer ({why[:300]})", tj), also=Exception):
            backend = _tokenizer_from_json(tj)
        cfg = _read_json(path / "tokenizer_config.json")
        smap = _read_json(path / "special_tokens_map.json")
        gen = _read_json(path / "generation_config.json")

        def token_id(name):
            text = _token_text(cfg.get(name)) or _token_text(smap.get(name))
            return backend.token_to_id(text) if text else None

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        n_ids = backend.get_vocab_size(with_added_tokens=True)
        if bos_id is None and _token_ids(gen.get("bos_token_id")) and gen["bos_token_id"] < n_ids:
            bos_id = gen["bos_token_id"]
        eos_ids = {i for i in _token_ids(gen.get("eos_token_id")) + _token_ids(cfg.get(_BRISK_EOS_KEY)) if i < n_ids}
        if eos_id is None and eos_ids:
            eos_id = min(eos_ids)
        add_bos = cfg.get("add_bos_token")
        if not isinstance(add_bos, bool):
            # No flag: transformers then goes by the tokenizer.json post-processor. An EOS the
            # post-processor may append is ignored: a prompt to continue must not end with one.
            with_special = backend.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and with_special[:1] == [bos_id]
        return cls(backend, bos_id=bos_id, eos_id=eos_id, eos_ids=eos_ids, add_bos=add_bos,
                   chat_template=_chat_template(path, cfg))

    def save(self, folder: str | Path) -> None:
        """Write a HF-style tokenizer folder that from_hf_folder() loads back, faster than a
        GGUF vocabulary is rebuilt: a cache for big SentencePiece vocabularies (Gemma 3:
        1.8 s to build, 0.5 s to reload). Saving itself takes a few seconds there."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        data = json.loads(self.backend.to_str())
        model = data.get("model", {})
        merges = model.get("merges")
        if (model.get("type") == "BPE" and merges and isinstance(merges[0], list)
                and model.get("dropout") is None and not model.get("continuing_subword_prefix")
                and not model.get("end_of_word_suffix")):
            # Loading time is mostly merges: keep only those that can fire (Gemma: 513k ->
            # 236k), written as "a b" strings, which tokenizers parses faster than pairs.
            merges = _useful_merges([tuple(m) for m in merges])
            if not any(" " in a or " " in b for a, b in merges):
                merges = [f"{a} {b}" for a, b in merges]
            model["merges"] = merges
        (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        cfg = {"bos_token": self.bos_token, "eos_token": self.eos_token,
               "add_bos_token": self.add_bos, _BRISK_EOS_KEY: sorted(self.eos_ids)}
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1),
                                                     encoding="utf-8")
        jinja = folder / "chat_template.jinja"
        if self.chat_template:
            jinja.write_text(self.chat_template, encoding="utf-8")
        elif jinja.exists():
            jinja.unlink()

    # ---- text <-> ids --------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise BriskError(f"text to encode must be a string, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates (undecodable bytes of a command-line argument)
            text = text.encode("utf-8", "surrogateescape" if _escapes_only(text) else "surrogatepass") \
                .decode("utf-8", "replace")
        with _tokenizer_failures(lambda why: BriskError(
                f"{self._model_name or 'the model'}: the tokenizer failed on this text ({why[:200]}); its "
                "tokenizer.json pre-tokenizer regex may backtrack")):
            ids = self.backend.encode(text, add_special_tokens=False).ids
        if self._rows is not None and ids and max(ids) >= self._rows:
            bad = max(ids)
            raise BriskError(f"{self._model_name}: token {self.backend.id_to_token(bad)!r} (id {bad}) is beyond the "
                             f"model's {self._rows} embedding rows")
        # One BOS, even when the text already starts with the BOS token text (a doubled BOS
        # hurts generation; transformers would add a second one here).
        if add_special and self.add_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (part of a character, for some): byte-level BPE
        pieces mapped back through GPT-2's byte alphabet, SentencePiece's <0xNN> byte tokens as
        their byte and its '▁' as a space, added tokens as their text."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id not in self._added_ids:
            if self._byte_level is None:
                self._byte_level = "ByteLevel" in (self.backend.decoder.__getstate__() or b"").decode() \
                    if self.backend.decoder is not None else False
            if self._byte_level:
                table = _unicode_to_byte()
                if all(ch in table for ch in piece):
                    return bytes(table[ch] for ch in piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            else:
                return piece.replace("▁", " ").encode("utf-8")
        return piece.encode("utf-8")

    # ---- chat ------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The prompt text for a conversation; encode it with add_special=False. tools: OpenAI's
        function tools, passed to the template as transformers passes them."""
        import jinja2

        if self.chat_template is None:
            raise BriskError("model has no chat template; use --raw")
        try:
            if self._template is None:
                self._template = _jinja_env().from_string(self.chat_template)
            with _TemplateLimits() as limits:
                out = []
                for piece in self._template.generate(
                        messages=messages, add_generation_prompt=add_generation_prompt,
                        bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                        tools=tools, documents=None):
                    out.append(piece)
                    limits.add_output(len(piece))
            text = "".join(out)
            if not text.strip():  # a template that fails quietly (fields the messages lack, or the sandbox hides)
                raise BriskError("the chat template rendered nothing for these messages")
            return text
        except TemplateLimitExceeded as e:
            raise BriskError(f"chat template refused: {e}") from None
        except jinja2.TemplateError as e:
            raise BriskError(f"chat template: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        except RecursionError:
            raise BriskError("chat template refused: it recurses too deeply") from None
        except (OverflowError, MemoryError) as e:  # the sandbox's range limit, or an allocation refused
            reason = str(e).splitlines()[0] if str(e) else "it needs too much memory"
            raise BriskError(f"chat template refused: {reason}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
            raise BriskError(f"chat template failed: {type(e).__name__}: {e}"[:300]) from None

    # ---- comparing two tokenizers (e.g. a draft model's) ----------------------------------
    def vocab_fingerprint(self) -> tuple[int, str]:
        """(vocab size, sha256 of the token->id map and BOS/EOS): equal means interchangeable."""
        vocab = sorted(self.backend.get_vocab(with_added_tokens=True).items())
        h = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode())
        h.update(json.dumps([self.bos_id, sorted(self.eos_ids)]).encode())
        return self.vocab_size, h.hexdigest()

    def describe_difference(self, other: Tokenizer) -> str | None:
        """None when the two agree (every token's id, BOS, EOS), else the first difference."""
        if self.vocab_size != other.vocab_size:
            return f"vocabulary sizes differ: {self.vocab_size} vs {other.vocab_size}"
        a, b = self.backend, other.backend
        for i in range(self.vocab_size):
            ta, tb = a.id_to_token(i), b.id_to_token(i)
            if ta != tb:
                return f"token {i} differs: {ta!r} vs {tb!r}"
        if self.bos_id != other.bos_id:
            return f"BOS token differs: {self.bos_token!r} vs {other.bos_token!r}"
        if self.eos_ids != other.eos_ids:
            return f"EOS token ids differ: {sorted(self.eos_ids)} vs {sorted(other.eos_ids)}"
        return None


class IncrementalDecoder:
    """Turns a stream of generated ids into text pieces whose concatenation is decode(ids).

    Each push decodes only a short window: the ids of the last piece handed out (context) plus
    those after it, and returns what the new ids add to the context's text. While that ends in
    U+FFFD (a character still missing bytes: byte-fallback <0xNN> tokens, or byte-level BPE
    tokens that cut a character) nothing is handed out. Starting the window at the last piece
    boundary makes the tokenizer's own rules (SentencePiece's leading-space strip, byte
    grouping) act the same in the window as in the full decode.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tok = tokenizer
        self._skip = tokenizer.special_ids if skip_special else set()
        self._ids: list[int] = []   # the window
        self._context = 0           # ids[:context] were already handed out
        self._context_text = ""

    def push(self, token_id: int) -> str:
        if token_id in self._skip:  # skipping specials = decoding as if they were absent
            return ""
        self._ids.append(token_id)
        text = self._tok.decode(self._ids, skip_special=False)
        if text.endswith("\ufffd") or not text.startswith(self._context_text):
            return ""
        new = text[len(self._context_text):]
        if new:  # the ids just handed out become the next context
            self._ids = self._ids[self._context:]
            self._context = len(self._ids)
            self._context_text = self._tok.decode(self._ids, skip_special=False)
        return new

    def flush(self) -> str:
        text = self._tok.decode(self._ids, skip_special=False)
        new = text[len(self._context_text):] if text.startswith(self._context_text) else text
        self._ids, self._context, self._context_text = [], 0, ""
        return new


# ---- helpers -------------------------------------------------------------------------------
@contextlib.contextmanager
def _tokenizer_failures(error, also: type[BaseException] | tuple = ()):
    """The Rust tokenizer's panics (pyo3's PanicException derives from BaseException, so `except
    Exception` misses them), and exceptions of the `also` types, raised as error(the first line of
    the message) without the Rust traceback."""
    try:
        yield
    except BaseException as e:
        if not isinstance(e, also) and type(e).__name__ != "PanicException":
            raise
        raise error(next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)) from None


_BPE_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                "byte_fallback", "ignore_merges")


# tokenizer.json files from this size up (Gemma 3's: 9.6 MB) have their BPE built apart: below it the
# saving is small and the second parse costs more than it saves (SmolLM2: +25 ms on 55)
_BPE_APART_BYTES = 4 << 20


def _tokenizer_from_json(path: Path) -> tokenizers.Tokenizer:
    """A tokenizer.json's tokenizer: a large vocabulary's BPE built apart (_bpe_built_apart)."""
    if path.stat().st_size >= _BPE_APART_BYTES:
        backend = _bpe_built_apart(path)
        if backend is not None:
            return backend
    return tokenizers.Tokenizer.from_file(str(path))


def _bpe_built_apart(path: Path) -> tokenizers.Tokenizer | None:
    """A BPE tokenizer.json's model built from its vocabulary and merges (models.BPE) and put into
    the rest of the file, with the same ids; None where the file is not one it takes. With Gemma 3's
    262k tokens the process then peaks 8 MiB lower than after Tokenizer.from_file (bench/RESULTS.md)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model") if isinstance(data, dict) else None
    known = {"type", "vocab", "merges", *_BPE_OPTIONS}
    if not isinstance(model, dict) or model.get("type") != "BPE" or set(model) - known:
        return None
    vocab, merges = model.pop("vocab", {}), model.pop("merges", [])
    # the shell keeps the added tokens' own entries, so that they keep their ids
    added = data.get("added_tokens") or []
    model["vocab"] = {t["content"]: t["id"] for t in added}
    model["merges"] = []
    options = {k: model[k] for k in _BPE_OPTIONS if model.get(k) is not None}
    shell = json.dumps(data, ensure_ascii=False)
    del data, model
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]
    bpe = tokenizers.models.BPE(vocab, merges, **options)
    del vocab, merges
    backend = tokenizers.Tokenizer.from_str(shell)
    backend.model = bpe
    if any(backend.token_to_id(t["content"]) != t["id"] for t in added):
        return None
    return backend


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable bytes stand for themselves, the other
    bytes for the code points from 256 up, in byte order."""
    global _BYTE_OF
    if _BYTE_OF is None:
        printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
        others = [b for b in range(256) if b not in printable]
        _BYTE_OF = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    return _BYTE_OF


_BYTE_OF: dict[str, int] | None = None


def _useful_merges(merges: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The BPE merges that can ever be applied, in their order.

    Where a token t forms inside a longer word, the symbols inside its span merged exactly as
    when t is encoded alone (nothing outside can touch them without stopping t from forming),
    so t always comes from the pair that forms it alone. The other pairs giving t never fire,
    and BPE without them splits every text the same way.
    """
    rank = {m: i for i, m in enumerate(merges)}
    useful = set()
    for token in {a + b for a, b in merges}:
        symbols, last = list(token), None
        while len(symbols) > 1:  # plain BPE: lowest rank first, leftmost on a tie
            best, at = None, -1
            for i in range(len(symbols) - 1):
                r = rank.get((symbols[i], symbols[i + 1]))
                if r is not None and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            last = (symbols[at], symbols[at + 1])
            symbols[at:at + 2] = [last[0] + last[1]]
        if len(symbols) == 1:
            useful.add(last)
    return [m for m in merges if m in useful]


def _read_json(path: Path) -> dict:
    from .files import read_json

    data = read_json(path)
    if not isinstance(data, dict):
        raise FileError(f"must be a JSON object, not {type(data).__name__}", path)
    return data


def _token_ids(value) -> list[int]:
    """An id or a list of ids, as generation_config.json gives EOS; anything else counts as none."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def chat_template_in(folder: Path) -> str | None:
    """The chat template of a tokenizer folder, read without building the tokenizer."""
    return _chat_template(folder, _read_json(folder / "tokenizer_config.json"))


def _chat_template(path: Path, cfg: dict) -> str | None:
    from .files import exists, read_bounded

    jinja = path / "chat_template.jinja"  # where transformers 5 saves it
    if exists(jinja):
        try:
            return read_bounded(jinja, 1 << 20).decode("utf-8")
        except UnicodeDecodeError as e:
            raise FileError(f"not UTF-8 ({e.reason} at byte {e.start})", jinja) from None
    template = cfg.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


# Limits for rendering a chat template: a model file's template is untrusted input, and one that
# loops for ever or builds a gigabyte string must be refused with a message, never hang.
TEMPLATE_SECONDS = 5.0  # wall time for one rendering
TEMPLATE_MAX_CHARS = 4 << 20  # output (about a million tokens), and any one string or list the template builds


class TemplateLimitExceeded(Exception):
    pass


def _escapes_only(text: str) -> bool:
    """Whether every lone surrogate is a surrogateescape'd byte (U+DC80..U+DCFF)."""
    return all(not 0xD800 <= ord(ch) <= 0xDFFF or 0xDC80 <= ord(ch) <= 0xDCFF for ch in text)


class _TemplateLimits:
    """A time limit on the template's own code (a tracer on the frames Jinja compiles, checked on
    each line they run, so any loop counts) and an output size limit. The tracer is this thread's
    only, and the previous one (a debugger, coverage) is put back after."""

    def __init__(self, seconds: float | None = None, max_chars: int | None = None):
        import time

        self.deadline = time.monotonic() + (TEMPLATE_SECONDS if seconds is None else seconds)
        self.max_chars = TEMPLATE_MAX_CHARS if max_chars is None else max_chars
        self.chars = 0
        self.lines = 0

    def add_output(self, n: int) -> None:
        self.chars += n
        if self.chars > self.max_chars:
            raise TemplateLimitExceeded(f"its output exceeds {self.max_chars} characters")

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines % 256 == 0:
                import time

                if time.monotonic() > self.deadline:
                    raise TemplateLimitExceeded(f"it ran longer than {TEMPLATE_SECONDS:g} s (a loop too long?)")
        return self._local

    def _global(self, frame, event, arg):
        if frame.f_code.co_filename == "<template>":
            return self._local
        return None

    def __enter__(self):
        import sys

        self._saved = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        import sys

        sys.settrace(self._saved)
        return False


def _checked_binop(left, operator, right):
    """`*`, `**` and `%` in a template, refused where the result would be huge."""
    import operator as op

    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > TEMPLATE_MAX_CHARS:
                raise TemplateLimitExceeded(f"it builds a sequence of {len(seq) * n} items")
        return op.mul(left, right)
    if operator == "**":
        if (isinstance(left, int) and isinstance(right, int) and abs(left) > 1
                and right > 0 and abs(left).bit_length() * right > 4096):
            raise TemplateLimitExceeded(f"it computes a number of about {abs(left).bit_length() * right} bits")
        return op.pow(left, right)
    if operator == "%":
        if isinstance(left, str):
            import re

            if any(int(w) > 4096 for w in re.findall(r"%[-+ #0]*(\d+)", left)):
                raise TemplateLimitExceeded("it formats with a huge width")
        return op.mod(left, right)
    raise TemplateLimitExceeded(f"operator {operator}")


def _jinja_env():
    """Jinja set up the way transformers renders chat templates."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # unlike jinja's own tojson: no HTML escaping, unicode kept
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class LimitedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context, operator, left, right):
            return _checked_binop(left, operator, right)

    def bounded(name, size_arg):
        original = env.filters[name]

        def f(value, *args, **kwargs):
            width = args[0] if args else kwargs.get(size_arg, 0)
            if isinstance(width, int) and width > TEMPLATE_MAX_CHARS:
                raise TemplateLimitExceeded(f"|{name}({width}) is too wide")
            return original(value, *args, **kwargs)
        env.filters[name] = f

    env = LimitedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    for name, arg in (("center", "width"), ("indent", "width"), ("truncate", "length"), ("wordwrap", "width")):
        bounded(name, arg)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
