"""The generation loop: prefill what the cache lacks, then decode one token per step.

A Session owns one KV cache and remembers which token ids it holds, so a follow-up prompt that
shares a prefix with them (the next chat turn) only prefills the new tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from .cuda_graph import decode_step
from .errors import BriskError
from .sampling import Sampler, SamplingParams
from .tokenizer import IncrementalDecoder

PREFILL_CHUNK = 512  # long prompts are prefilled in pieces: bounded activation memory


@dataclass
class GenerationResult:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens actually run; fewer when the cache had a prefix
    finish_reason: str = ""  # "eos", "stop", "length" or "interrupted"
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    spec: dict | None = None  # speculative decoding's counters, when a drafter was used

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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Session:
    def __init__(self, llm, speculator=None):
        self.llm = llm
        self.speculator = speculator  # a speculative.Speculator: drafts tokens, the model checks them
        self.cache = llm.new_cache()
        self.ids: list[int] = []  # the tokens whose K/V the cache holds, in order
        self.last: GenerationResult | None = None
        self._step = None  # the one-token step on this cache (its CUDA graphs), made on first use

    def reset(self) -> None:
        self.cache.truncate(0)
        self.ids = []

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """Bring the cache to exactly prompt_ids; return the logits after its last token."""
        keep = min(common_prefix(self.ids, prompt_ids), len(prompt_ids) - 1)
        self.cache.truncate(keep)
        model, dev = self.llm.model, self.llm.device
        logits = None
        for s in range(keep, len(prompt_ids), PREFILL_CHUNK):
            chunk = torch.tensor([prompt_ids[s:s + PREFILL_CHUNK]], device=dev)
            logits = model(chunk, self.cache, last_only=True)
        self.ids = list(prompt_ids)
        self._prefilled = len(prompt_ids) - keep
        return logits[0, -1]

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int = 256,
               stop: Sequence[str] = ()) -> Iterator[str]:
        """Yield text pieces as they are generated; the summary is in self.last afterwards."""
        if not prompt_ids:
            raise BriskError("the prompt is empty")
        ctx = self.cache.max_len
        if len(prompt_ids) >= ctx:
            raise BriskError(f"the prompt is {len(prompt_ids)} tokens but the context is {ctx} "
                             f"(shorten it or raise --ctx, up to the model's {self.llm.config.max_seq_len})")
        sampler = Sampler(sampling)
        penalize = sampling.repetition_penalty != 1.0
        res = self.last = GenerationResult(prompt_tokens=len(prompt_ids))
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids)
        res.prefilled_tokens = self._prefilled
        decoder = IncrementalDecoder(self.llm.tokenizer)
        stopper = StopMatcher(stop)
        eos, model, dev = self.llm.eos_ids, self.llm.model, self.llm.device
        budget = min(max_tokens, ctx - len(prompt_ids))
        seen = torch.tensor(prompt_ids, device=dev) if penalize else None
        token = sampler(logits, seen)
        res.ttft_s = res.prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        res.finish_reason = "length"
        tokens = (self._tokens(token, sampler, seen, budget) if self.speculator is None
                  else self.speculator.tokens(self, token, sampler, seen, budget))
        try:
            with model.decoding():
                for token in tokens:
                    if token in eos:
                        res.finish_reason = "eos"
                        break
                    res.tokens.append(token)
                    piece, stopped = stopper.feed(decoder.push(token))
                    if piece:
                        res.text += piece
                        yield piece
                    if stopped:
                        res.finish_reason = "stop"
                        break
                    if len(res.tokens) >= budget:
                        break
        except GeneratorExit:  # the consumer stopped early (Ctrl-C in chat)
            res.finish_reason = "interrupted"
            raise
        finally:
            tokens.close()  # leaves the cache holding exactly self.ids
            res.decode_s = time.perf_counter() - t1
        if res.finish_reason in ("eos", "length"):
            tail, _ = stopper.feed(decoder.flush())
            tail += stopper.flush()
            if tail:
                res.text += tail
                yield tail

    def _tokens(self, token: int, sampler: Sampler, seen: torch.Tensor | None, budget: int) -> Iterator[int]:
        """Plain decoding as a stream of tokens. A token enters the cache only when the consumer
        asks for the next one, so the cache never holds the last token handed out."""
        dev = self.llm.device
        step = self._decode_step()
        while True:
            yield token
            logits = step(token, len(self.ids))
            self.ids.append(token)
            if seen is not None:
                seen = torch.cat([seen, torch.tensor([token], device=dev)])
            token = sampler(logits, seen)

    def _decode_step(self):
        """One step's function for this session's cache (on CUDA its captured graphs: kept)."""
        if self._step is None:
            self._step = decode_step(self.llm.model, self.cache)
        return self._step
