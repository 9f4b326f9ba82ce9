"""Token logprobs in the OpenAI API's two shapes: chat's `logprobs.content` (a list of entries with
the token's text, its bytes and its alternatives) and the legacy completions' `logprobs` (parallel
lists of tokens, logprobs, alternatives as {text: logprob} and text offsets)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a name for the hints only: core.logprobs imports torch, which `brisk --help` must not pay
    from ..core.logprobs import TokenLogprob


class TokenTexts:
    """Token ids to their text and bytes, memoised (a request's alternatives repeat)."""

    def __init__(self, tokenizer):
        self.tok, self._memo = tokenizer, {}

    def __call__(self, t: int) -> tuple[str, bytes]:
        hit = self._memo.get(t)
        if hit is None:
            raw = self.tok.token_bytes(t)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: spelled as OpenAI spells such tokens
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._memo[t] = (text, raw)
        return hit


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts, top: int) -> dict:
    def one(t: int, lp: float) -> dict:
        text, raw = texts(t)
        return {"token": text, "logprob": lp, "bytes": list(raw)}

    return {"content": [one(e.token, e.logprob) | {"top_logprobs": [one(t, v) for t, v in e.top[:top]]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob | None], tokens: list[int], texts: TokenTexts,
                        offset: int) -> dict:
    """entries[i] for tokens[i] (None: the prompt's first token, which nothing predicts); offset:
    where the first token's text starts in the choice's text. The chosen token is always among
    the alternatives, as OpenAI's are."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, e in zip(tokens, entries):
        text = texts(t)[0]
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(e.logprob)
        alts = {texts(a)[0]: v for a, v in e.top}
        alts.setdefault(text, e.logprob)
        out["top_logprobs"].append(alts)
    return out
