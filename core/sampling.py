"""Turning logits into the next token: greedy, temperature, top-k, top-p, min-p, repetition penalty."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidValue


# Defaults for models that recommend none (no generation_config.json, no general.sampling.* keys).
# Cooler than llama.cpp's (0.8 / 40 / 0.95 / 0.05): on small models those derail answers. Measured
# (bench/sampling.py, 5 factual questions x 20 seeds, 2026-11-25): Gemma 3 270M right 42% -> 58%
# and looping 21% -> 0%; SmolLM2-135M right 78% -> 79%, looping 4% -> 9% (the loop stop ends those).
@dataclass
class SamplingParams:
    temperature: float = 0.3  # 0 means greedy
    top_k: int = 40  # 0 disables
    top_p: float = 0.9  # 1 disables
    min_p: float = 0.1  # 0 disables
    repetition_penalty: float = 1.0  # 1 disables
    seed: int | None = None
    # Not a sampling rule, but it travels with them per request: end the answer when it falls into
    # an exact repetition loop (output_stream.LoopGuard). Off in the API, on in generate and chat.
    stop_loops: bool = False

    def validate(self) -> "SamplingParams":
        if not (self.temperature >= 0):
            raise InvalidValue("temperature", self.temperature, "must be >= 0")
        if self.top_k < 0:
            raise InvalidValue("top_k", self.top_k, "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidValue("top_p", self.top_p, "must be in (0, 1]")
        if not 0 <= self.min_p < 1:
            raise InvalidValue("min_p", self.min_p, "must be in [0, 1)")
        if not self.repetition_penalty > 0:
            raise InvalidValue("repetition_penalty", self.repetition_penalty, "must be > 0")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams(temperature=0.0)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style: divide positive and multiply negative logits of tokens already seen."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits.gather(-1, seen)
    logits = logits.clone()
    logits.scatter_(-1, seen, torch.where(picked > 0, picked / penalty, picked * penalty))
    return logits


def extend_seen(seen: torch.Tensor, extra: list[int]) -> torch.Tensor:
    """The repetition penalty's ids with `extra` appended (drafts, the next context token)."""
    return torch.cat([seen, torch.tensor(extra, dtype=seen.dtype, device=seen.device)]) if extra else seen


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from, after temperature and truncation (float32, [..., V]).

    Exposed on its own so speculative decoding can filter target and draft alike.
    """
    logits = logits.float() / max(p.temperature, 1e-5)
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= p.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return probs / probs.sum(dim=-1, keepdim=True)


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params.validate()
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> int:
        """logits: [V] for one position; seen: ids so far (for the repetition penalty)."""
        if seen is not None:
            logits = apply_repetition_penalty(logits, seen, self.params.repetition_penalty)
        if self.params.greedy:
            return int(logits.argmax())
        probs = probabilities(logits, self.params).cpu()
        return int(torch.multinomial(probs, 1, generator=self.generator))
