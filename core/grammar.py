"""Structured output: answers held to a grammar (a JSON schema, any JSON object, a Lark grammar or
llama.cpp's GBNF), by masking the logits of every token that would break it.

llguidance does the grammar work (chosen over xgrammar by bench/grammar_engines.py: a new schema
compiles in about a millisecond at any vocabulary size, no dependencies); this module gives it
brisk's vocabulary (each token's bytes; special tokens marked so they never spell text), keeps
compiled grammars for reuse, and wraps one matcher per sequence (Constraint): the mask of the next
token, the tokens taken, drafts cut to what the grammar allows and rows masked for verification.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import replace

import numpy as np
import torch

from .errors import BriskError, InvalidValue

KINDS = ("json_object", "json_schema", "lark", "gbnf", "regex")
MAX_GRAMMAR_CHARS = 1 << 20  # a schema or grammar text: what one request may ask the engine to compile
_CACHE_SIZE = 64  # compiled grammars kept per vocabulary (a server sees the same schemas again and again)


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise BriskError("structured output needs llguidance (pip install llguidance)") from None
    return llguidance


class Vocabulary:
    """A tokenizer as llguidance sees it, with the grammars compiled against it. Built on first use
    (the token bytes of a 262k vocabulary take about a second) and kept on the tokenizer."""

    def __init__(self, tokenizer, n_vocab: int):
        llg = _llguidance()
        self.n_vocab = n_vocab
        specials = set(tokenizer.special_ids) | set(range(tokenizer.vocab_size, n_vocab))
        spelled: dict[bytes, int] = {}
        tokens = []
        for i in range(n_vocab):
            if i in specials:  # llguidance's convention: 0xFF then the name; never matched as text
                text = tokenizer.backend.id_to_token(i) if i < tokenizer.vocab_size else f"<pad{i}>"
                tokens.append(b"\xff" + (text or f"<{i}>").encode())
            else:
                b = tokenizer.token_bytes(i)
                tokens.append(b)
                if b:
                    spelled.setdefault(b, i)
        longest = max((len(b) for b in spelled), default=1)

        def encode(text) -> list[int]:
            """text's ids, spelling exactly its bytes (llguidance needs that: SentencePiece's
            encode adds a leading space); greedy longest match when the tokenizer's own does not."""
            data = text if isinstance(text, bytes) else text.encode("utf-8")
            ids = tokenizer.encode(data.decode("utf-8", "replace"), add_special=False)
            if b"".join(tokens[i] for i in ids) == data:
                return ids
            out, at = [], 0
            while at < len(data):
                for n in range(min(longest, len(data) - at), 0, -1):
                    t = spelled.get(data[at:at + n])
                    if t is not None:
                        out.append(t)
                        at += n
                        break
                else:
                    at += 1  # a byte no token spells: left out
            return out

        class Wrapped:  # what llguidance.TokenizerWrapper reads
            eos_token_id = min(tokenizer.eos_ids) if tokenizer.eos_ids else 0
            bos_token_id = tokenizer.bos_id
            special_token_ids = sorted(specials)

        Wrapped.tokens = tokens
        Wrapped.__call__ = lambda self, s: encode(s)
        eos = sorted(tokenizer.eos_ids) or None
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(Wrapped()), n_vocab=n_vocab, eos_token=eos)
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer, n_vocab: int) -> "Vocabulary":
        vocab = getattr(tokenizer, "_grammar_vocabulary", None)
        if vocab is None or vocab.n_vocab != n_vocab:
            vocab = cls(tokenizer, n_vocab)
            tokenizer._grammar_vocabulary = vocab
        return vocab

    def compile(self, kind: str, source, field: str = "grammar") -> "Grammar":
        """A grammar of `kind` from source (a schema as a dict or JSON text, a grammar's text);
        InvalidValue naming `field` when the engine cannot compile it."""
        llg = _llguidance()
        text = _grammar_text(llg, kind, source, field)
        key = (kind, text)
        with self._lock:
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
                return Grammar(self, matcher)
        matcher = llg.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InvalidValue(field, None, "", template=f"{{option}}: {_what(kind)} does not compile: "
                                                         f"{_first_line(matcher.get_error())}")
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return Grammar(self, matcher)


def _what(kind: str) -> str:
    return {"json_schema": "the JSON schema", "json_object": "the JSON grammar", "lark": "the Lark grammar",
            "gbnf": "the GBNF grammar", "regex": "the regular expression"}[kind]


def _first_line(message: str) -> str:
    """An engine's message as one line (regex errors come over several, with a caret line)."""
    parts = [p.strip() for p in (message or "unknown error").splitlines()]
    return " ".join(p for p in parts if p.strip("^ "))[:300]


def _grammar_text(llg, kind: str, source, field: str) -> str:
    """llguidance's grammar text for a source of this kind."""
    if kind not in KINDS:
        raise InvalidValue(field, kind, f"kind must be one of {', '.join(KINDS)}")
    size = len(source) if isinstance(source, str) else len(json.dumps(source)) if source is not None else 0
    if size > MAX_GRAMMAR_CHARS:
        raise InvalidValue(field, f"{size} characters", f"must be at most {MAX_GRAMMAR_CHARS} characters")
    try:
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema(bounded({"type": "object"}))
        if kind == "json_schema":
            schema = json.loads(source) if isinstance(source, str) else source
            if not isinstance(schema, dict):
                raise InvalidValue(field, schema, "must be a JSON schema (an object)")
            return llg.LLMatcher.grammar_from_json_schema(bounded(schema))
        if not isinstance(source, str) or not source.strip():
            raise InvalidValue(field, source, "must be a non-empty text")
        if kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(source))
            except Exception as e:  # GbnfToLarkError, and bare Exceptions (an unknown rule)
                raise ValueError(str(e)) from None
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(source)
        return llg.LLMatcher.grammar_from_lark(source)
    except (ValueError, TypeError, KeyError, RecursionError) as e:  # not JSON, GBNF that does not convert
        raise InvalidValue(field, None, "", template=f"{{option}}: {_what(kind)} is not valid: "
                                                     f"{_first_line(str(e) or type(e).__name__)}") from None


NUMBER_LIMIT = 10 ** 15 - 1  # what an unbounded JSON number may reach: 15 integer digits (llama.cpp: 16)
# between JSON tokens: a space, or one line break and an indent (llama.cpp's rule too)
WHITESPACE = "(?:[ ]|\n[ \t]{0,20})?"


def bounded(schema: dict) -> dict:
    """The schema as brisk compiles it: unbounded integers and numbers within +-NUMBER_LIMIT and
    the whitespace between tokens bounded. Small models asked for JSON otherwise run on in digits
    or blank lines to the token limit (llama.cpp's JSON grammars cap both too). A copy; the
    caller's schema is not changed, nor any whitespace rule it sets itself."""
    out = _bounded_numbers(schema)
    if isinstance(out, dict):
        out["x-guidance"] = {"whitespace_pattern": WHITESPACE, **(out.get("x-guidance") or {})}
    return out


def _bounded_numbers(schema, depth: int = 0):
    if depth > 64:  # deeper than any real schema: left as it is (the engine bounds its own work)
        return schema
    if isinstance(schema, list):
        return [_bounded_numbers(x, depth + 1) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded_numbers(v, depth + 1) for k, v in schema.items()}
    kinds = out.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "integer" in kinds or "number" in kinds:
        if not any(k in out for k in ("minimum", "exclusiveMinimum")):
            out["minimum"] = -NUMBER_LIMIT
        if not any(k in out for k in ("maximum", "exclusiveMaximum")):
            out["maximum"] = NUMBER_LIMIT
    return out


def grammar_kind(text: str) -> str:
    """A grammar file's kind: GBNF (llama.cpp's, rules with ::=) or Lark."""
    return "gbnf" if "::=" in text else "lark"


class Grammar:
    """A compiled grammar; constraint() starts one sequence's walk through it."""

    def __init__(self, vocab: Vocabulary, matcher):
        self.vocab, self._matcher = vocab, matcher

    def constraint(self) -> "Constraint":
        return Constraint(self.vocab, self._matcher.deep_copy())


class Constraint:
    """One sequence's place in its grammar. The matcher never sees a token it would refuse
    (llguidance's matcher is dead for good after one): sampled tokens come from masked logits, and
    drafts are cut to what it accepts before they are verified."""

    def __init__(self, vocab: Vocabulary, matcher):
        self.vocab, self.matcher = vocab, matcher
        self._bits = torch.zeros((vocab.n_vocab + 31) // 32, dtype=torch.int32)  # llguidance writes here
        self._bytes = self._bits.numpy().view(np.uint8)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with every token the grammar does not allow next at -inf (a new float32
        tensor). On the CPU the mask is applied by numpy, on one thread: torch would spread these
        few microseconds of work over its pool and wait on it."""
        m = self.matcher
        m.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        if m.is_error():
            raise BriskError(f"structured output failed: {_first_line(m.get_error())}")
        n = logits.shape[-1]
        allowed = np.unpackbits(self._bytes, bitorder="little")[:n].view(bool)
        if logits.device.type == "cpu":
            return torch.from_numpy(np.where(allowed, logits.float().numpy(), np.float32("-inf")))
        keep = torch.from_numpy(allowed).to(logits.device, non_blocking=True)
        return torch.where(keep, logits.float(), float("-inf"))

    def argmax(self, logits: torch.Tensor) -> int:
        """Greedy's next token under the grammar: the model's own argmax when the grammar allows it
        (the usual case: a check of one token, no mask), else the masked argmax."""
        best = int(logits.argmax())
        if self.matcher.is_stopped() or self.matcher.validate_tokens([best]) == 1:
            if not self.matcher.is_stopped() or best in self.vocab.tokenizer.eos_tokens:
                return best
        return int(self.mask(logits).argmax())

    def take(self, tokens: list[int]) -> None:
        """Tokens the sequence now holds (each allowed by the mask it was drawn with)."""
        if self.matcher.is_stopped():  # the grammar is complete: only an end of turn was allowed
            return
        if tokens and not self.matcher.consume_tokens(tokens):
            raise BriskError(f"structured output failed: {_first_line(self.matcher.get_error())}")

    def fit(self, draft):
        """A chain draft cut to the tokens the grammar accepts from here (a tree is not drafted)."""
        n = self.matcher.validate_tokens(draft.tokens) if draft.tokens else 0
        if n == len(draft.tokens):
            return draft
        return replace(draft, tokens=draft.tokens[:n], q=None if draft.q is None else draft.q[:n])

    def mask_rows(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """logits [K+1, V] after the pending token and each draft, each row masked with the
        grammar's state there; the matcher ends where it started."""
        rows = [self.mask(logits[0])]
        if not drafts:  # a view: one more parallel torch op per step costs the decode step more than it
            return rows[0][None]  # takes (torch's idle workers spin into the native kernels' time)
        for i, d in enumerate(drafts):
            self.take([d])
            rows.append(self.mask(logits[i + 1]))
        self.matcher.rollback(len(drafts))
        return torch.stack(rows)


def constrained_token(constraint: Constraint, sampler, logits: torch.Tensor, seen) -> int:
    """The next token under a grammar, taken by it: greedy without penalties checks the model's own
    argmax (no mask unless the grammar refuses it); otherwise the sampler draws from masked logits."""
    if sampler.params.greedy and seen is None:
        token = constraint.argmax(logits)
    else:
        token = sampler(constraint.mask(logits), seen)
    constraint.take([token])
    return token
