"""One sequence's output: sampled tokens in, text out, and the rules that end it.

The single-stream session, the batching engine and speculative decoding all feed their tokens
through an OutputStream, so EOS, stop strings, the token budget, the detokenizer's flush and the
timings mean the same everywhere.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from .logprobs import TokenLogprob, token_logprobs
from .tokenizer import IncrementalDecoder


@dataclass
class GenerationResult:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens actually run; fewer when the cache had a prefix
    finish_reason: str = ""  # "eos", "stop", "length", "loop" or "interrupted"
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    spec: dict | None = None  # speculative decoding's counters, when a drafter was used
    logprobs: list[TokenLogprob] | None = None  # one per token in `tokens` (and the end token), when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (None for the first)

    @property
    def prefill_tps(self) -> float:
        return self.prefilled_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # The first token comes from prefill; decode speed counts the steps after it.
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"text": self.text, "prompt_tokens": self.prompt_tokens, "prefilled_tokens": self.prefilled_tokens,
                "generated_tokens": len(self.tokens), "finish_reason": self.finish_reason,
                "ttft_s": round(self.ttft_s, 4), "prefill_tok_s": round(self.prefill_tps, 2),
                "decode_tok_s": round(self.decode_tps, 2), **({"spec": self.spec} if self.spec else {})}


class StopMatcher:
    """Withholds text that might be the start of a stop string, so none is ever printed."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[:min(hits)], True
        keep = 0  # longest tail of buf that is a prefix of some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class LoopGuard:
    """Spots an answer stuck in a loop: its last tokens are one unit of `period` <= MAX_PERIOD tokens
    repeated, over at least MIN_SPAN tokens and at least REPEATS times. Small models do this under
    greedy and sampled decoding alike ("Paris - Paris - Paris - ..." to the token limit); an exact
    repeat of that length is almost never what an answer means (a list of zeros is the exception:
    the flag that turns it off says so). O(MAX_PERIOD) per token: one run length per period."""

    MAX_PERIOD, MIN_SPAN, REPEATS = 64, 32, 3

    def __init__(self):
        self.tokens: list[int] = []
        self.runs = [0] * (self.MAX_PERIOD + 1)  # runs[p]: trailing tokens equal to the one p before

    def push(self, token: int) -> bool:
        """Record the next token; True when the tail has become a loop."""
        t, runs = self.tokens, self.runs
        t.append(token)
        n = len(t)
        for p in range(1, min(self.MAX_PERIOD, n - 1) + 1):
            runs[p] = runs[p] + 1 if t[n - 1 - p] == token else 0
            if runs[p] >= max(self.MIN_SPAN, (self.REPEATS - 1) * p):
                return True
        return False


class OutputStream:
    """EOS ends a sequence unseen; stop strings are held back and cut; the budget (max tokens, or
    what the context leaves) ends it; text leaves in pieces as the detokenizer completes them.
    With stop_loops, a repetition loop (LoopGuard) ends it too. With logprobs (k alternatives,
    0: only the chosen token's), each kept token's logprob is computed from the logits it came from.
    Timings: first token from `started` (prefill), decode from the first token to the end."""

    def __init__(self, tokenizer, eos_ids: set[int], stop: Sequence[str], budget: int, prompt_tokens: int,
                 stop_loops: bool = False, logprobs: int | None = None):
        self.result = GenerationResult(prompt_tokens=prompt_tokens, logprobs=None if logprobs is None else [])
        self.top_logprobs = logprobs
        self.loops = LoopGuard() if stop_loops else None
        self.decoder, self.stopper = IncrementalDecoder(tokenizer), StopMatcher(stop)
        self.eos_ids, self.budget = eos_ids, budget
        self.started = time.perf_counter()
        self.first_token_at = self.finished_at = 0.0

    @property
    def finished(self) -> bool:
        return bool(self.result.finish_reason)

    def push(self, token: int, logits=None) -> str:
        """The next sampled token (and the raw logits [V] it was drawn from, for its logprob);
        returns the text it completes ("" while held back). When it ends the sequence, `finished`
        is set and the returned text includes the flushed tail."""
        res = self.result
        if not self.first_token_at:
            self.first_token_at = time.perf_counter()
            res.ttft_s = res.prefill_s = self.first_token_at - self.started
        if res.logprobs is not None:  # the end token's too: scoring a text asks how likely it ends there
            res.logprobs += token_logprobs(logits[None], [token], self.top_logprobs)
        if token in self.eos_ids:
            return self.finish("eos")
        res.tokens.append(token)
        piece, stopped = self.stopper.feed(self.decoder.push(token))
        res.text += piece
        if stopped:
            return piece + self.finish("stop")
        if len(res.tokens) >= self.budget:
            return piece + self.finish("length")
        if self.loops is not None and self.loops.push(token):
            return piece + self.finish("loop")
        return piece

    def finish(self, reason: str) -> str:
        """End the sequence ("eos", "stop", "length", "loop", "interrupted", "cancelled"); returns the
        text still held back, which eos, length and loop release (a tail that was not a stop)."""
        res = self.result
        res.finish_reason = reason
        self.finished_at = time.perf_counter()
        res.decode_s = self.finished_at - (self.first_token_at or self.finished_at)
        tail = ""
        if reason in ("eos", "length", "loop"):
            tail, _ = self.stopper.feed(self.decoder.flush())
            tail += self.stopper.flush()
            res.text += tail
        return tail
