"""Rebuild a HF `tokenizers.Tokenizer` from the vocabulary a GGUF file stores as metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of one:
  tokenizer.ggml.model   "gpt2" (byte-level BPE, merges given) or "llama" (SentencePiece BPE,
                         merges implied by the token scores, byte-fallback tokens <0xNN>)
  tokenizer.ggml.tokens / token_type / scores / merges / pre (pre-tokenizer name)
The aim is to split text exactly as llama.cpp (and the model's original tokenizer) does.
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .errors import FileError, UnsupportedFormat

# tokenizer.ggml.token_type values (the same numbers SentencePiece uses)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes, named by tokenizer.ggml.pre (as llama.cpp names them).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2 is Llama 3's split with single digits.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Each entry: the regexes applied one after the other (each piece split again by the next).
_PRE_SPLITS = {
    "gpt-2": [_GPT2_SPLIT], "default": [_GPT2_SPLIT],
    # StarCoder-family vocabularies were trained with every digit on its own.
    "smollm": [r"\p{N}", _GPT2_SPLIT], "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "refact": [r"\p{N}", _GPT2_SPLIT], "codeshell": [r"\p{N}", _GPT2_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT], "llama3": [_LLAMA3_SPLIT], "llama-v3": [_LLAMA3_SPLIT],
    "smaug-bpe": [_LLAMA3_SPLIT], "dbrx": [_LLAMA3_SPLIT], "falcon3": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT], "deepseek-r1-qwen": [_QWEN2_SPLIT], "megrez": [_QWEN2_SPLIT],
}


def build_tokenizer(meta: dict) -> Tokenizer:
    """The tokenizer a GGUF's metadata describes. BOS is not added here (the caller decides)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise FileError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise FileError("GGUF tokenizer.ggml.tokens must be a list of strings")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    _check_list(meta, "tokenizer.ggml.token_type", types, len(tokens), int)
    _check_list(meta, "tokenizer.ggml.scores", meta.get("tokenizer.ggml.scores"), len(tokens), (int, float))
    if not isinstance(kind, str) or kind not in ("gpt2", "llama"):
        raise UnsupportedFormat(f"GGUF tokenizer model {kind!r:.40} is not supported (supported: gpt2, llama)")
    try:
        tk = _byte_level_bpe(meta, tokens) if kind == "gpt2" else _sentencepiece_bpe(meta, tokens, types)
        _add_whole_tokens(tk, tokens, types)
    except (TypeError, ValueError, OverflowError, Exception) as e:
        if isinstance(e, FileError):
            raise
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise FileError(f"GGUF tokenizer could not be built from its metadata ({reason})") from None
    return tk


def _check_list(meta: dict, key: str, values, n: int, kind) -> None:
    """A per-token array: absent, or one value of the right type for each token."""
    if values is None or key not in meta:
        return
    if not isinstance(values, list) or len(values) != n:
        raise FileError(f"GGUF {key} must list one value for each of the {n} tokens, "
                        f"has {len(values) if isinstance(values, list) else type(values).__name__}")
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
        raise FileError(f"GGUF {key} holds values of the wrong type")


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated spelling keeps its first id, as llama.cpp does
    return vocab


def _byte_level_bpe(meta: dict, tokens: list[str]) -> Tokenizer:
    raw = meta.get("tokenizer.ggml.merges") or []
    merges = [tuple(m.split(" ", 1)) for m in raw if isinstance(m, str)] if isinstance(raw, list) else []
    bad = next((i for i, m in enumerate(merges) if len(m) != 2 or not all(m)), None)
    if not isinstance(raw, list) or len(merges) != len(raw) or bad is not None:
        at = f" (entry {bad}: {raw[bad]!r:.40})" if bad is not None and len(merges) == len(raw) else ""
        raise FileError(f"GGUF tokenizer.ggml.merges must be strings 'left right'{at}")
    tk = Tokenizer(models.BPE(vocab=_vocab(tokens), merges=merges))
    pre = meta.get("tokenizer.ggml.pre") or "default"
    # An unknown name gets GPT-2's split: right for the many vocabularies derived from it.
    splits = _PRE_SPLITS.get(pre, [_GPT2_SPLIT])
    if splits == [_GPT2_SPLIT]:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece_bpe(meta: dict, tokens: list[str], types: list[int]) -> Tokenizer:
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and not isinstance(unk_id, bool) and 0 <= unk_id < len(tokens) else None
    tk = Tokenizer(models.BPE(vocab=_vocab(tokens), merges=_spm_merges(tokens, types, scores),
                              unk_token=unk, fuse_unk=True, byte_fallback=True))
    # SentencePiece writes spaces as U+2581 and (add_dummy_prefix) puts one before the text.
    # The Prepend normalizer runs on every stretch of text between special tokens, which is
    # llama.cpp's rule (a space prefix after each special token) and SentencePiece's own
    # (a text starting with a space still gets the prefix).
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    norm = [normalizers.Replace(" ", "\u2581")]
    if prefix:
        norm.insert(0, normalizers.Prepend("\u2581"))
    tk.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        dec.append(decoders.Strip(" ", 1, 0))  # drop the dummy prefix again
    tk.decoder = decoders.Sequence(dec)
    return tk


def _spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """The merges SentencePiece BPE applies implicitly.

    SentencePiece joins the adjacent pair whose concatenation is the best-scoring normal piece.
    As ranked BPE merges: every split of a normal piece into two normal pieces, best score
    first. On equal scores SentencePiece takes the leftmost pair; ranking the longer left part
    first gets the same result for the runs of spaces that share a score (llama's -1e9).
    """
    normal = {t for t, ty in zip(tokens, types) if ty == NORMAL}
    ranked = []
    for tok, ty, score in zip(tokens, types, scores):
        if ty != NORMAL or len(tok) < 2:
            continue
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in normal and right in normal:
                ranked.append((-score, -i, i - len(tok), left, right))
    ranked.sort()
    return [(r[3], r[4]) for r in ranked]


def _add_whole_tokens(tk: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens become special added tokens, user-defined ones plain added
    tokens: both are then matched whole in the raw text and never split (llama.cpp does the
    same). They keep their ids because their spelling is already in the model's vocabulary."""
    special = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)
