"""Turning logits into the next token: greedy, temperature, top-k, top-p, min-p, repetition penalty,
presence and frequency penalties, logit bias."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling_params import GREEDY, MAX_LOGIT_BIAS, SamplingParams  # noqa: F401  (also imported from here)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style: divide positive and multiply negative logits of tokens already seen."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits.gather(-1, seen)
    logits = logits.clone()
    logits.scatter_(-1, seen, torch.where(picked > 0, picked / penalty, picked * penalty))
    return logits


@dataclass(frozen=True)
class Seen:
    """The ids the penalties look at: the context (prompt, then the answer so far) and where the
    answer starts in it (presence and frequency penalties count only the answer's tokens)."""
    ids: torch.Tensor
    start: int

    @classmethod
    def of(cls, ids: list[int], start: int, device=None) -> "Seen":
        return cls(torch.tensor(ids, dtype=torch.long, device=device), start)


def extend_seen(seen: Seen, extra: list[int]) -> Seen:
    """The penalties' ids with `extra` appended (drafts, the next context token)."""
    if not extra:
        return seen
    return Seen(torch.cat([seen.ids, torch.tensor(extra, dtype=seen.ids.dtype, device=seen.ids.device)]), seen.start)


def apply_presence_frequency(logits: torch.Tensor, generated: torch.Tensor, presence: float,
                             frequency: float) -> torch.Tensor:
    """OpenAI's: logits[t] -= presence * (c[t] > 0) + frequency * c[t], c counting `generated`."""
    if (presence == 0 and frequency == 0) or generated.numel() == 0:
        return logits
    counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
    counts.index_add_(0, generated.to(logits.device), torch.ones(generated.numel(), device=logits.device))
    return logits - (presence * (counts > 0) + frequency * counts).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    if not bias:
        return logits
    ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
    return logits.index_add(-1, ids, torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device))


def apply_penalties(logits: torch.Tensor, seen: Seen, p: SamplingParams) -> torch.Tensor:
    """All of p's changes to one position's logits [V] before sampling: the repetition penalty
    (over the whole context), presence and frequency penalties (over the answer), the logit bias."""
    logits = apply_repetition_penalty(logits, seen.ids, p.repetition_penalty)
    logits = apply_presence_frequency(logits, seen.ids[seen.start:], p.presence_penalty, p.frequency_penalty)
    return apply_logit_bias(logits, p.logit_bias)


def candidates(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens a draw can pick from one position's logits [V] and their probabilities after
    temperature and truncation (float32, summing to 1): (ids, probs) over the top_k tokens (those
    tied with the k-th too), in id order, or (None, probs [V]) where top_k is off. Past top_k the
    work is over those few: a whole-vocabulary sort and draw cost SmolLM2 (49k tokens) 6.5 ms a token
    and Gemma 3 (262k) 32 ms (bench/RESULTS.md)."""
    x = logits.float() / max(p.temperature, 1e-5)  # always a new tensor: the caller's logits stay
    ids = None
    k = p.top_k
    if k and k < x.shape[-1]:
        top = torch.topk(x, k + 1)  # one more: whether a token outside the k ties with the k-th
        if top.values[k] < top.values[k - 1]:
            ids = top.indices[:k].sort().values
        else:  # every token tied with the k-th stays
            ids = (x >= top.values[k - 1]).nonzero().squeeze(-1)
        x = x[ids]
    # in place wherever the result is the same: over a 262k vocabulary each fresh copy is 1 MiB of
    # heap, and a step that lands on untouched heap pages raises the process's peak memory
    probs = torch.softmax(x, dim=-1)
    del x
    if p.min_p > 0:
        probs.masked_fill_(probs < p.min_p * probs.amax(), 0.0)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True, stable=True)
        before = sorted_p.cumsum(dim=-1).sub_(sorted_p)  # mass strictly before each token
        before[0] = 0.0  # the most likely token always stays (a top_p under float32's least: 0)
        sorted_p.masked_fill_(before >= max(p.top_p, 1e-30), 0.0)
        del before
        probs.zero_().scatter_(-1, order, sorted_p)
        del sorted_p, order
    return ids, probs.div_(probs.sum())


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a distribution over the vocabulary ([V], on the CPU), drawn among its nonzero
    entries: torch.multinomial draws a random number for every entry it is given (13 ms over 262k)."""
    ids = probs.nonzero().squeeze(-1)
    return int(ids[torch.multinomial(probs[ids], 1, generator=generator)])


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from, after temperature and truncation (float32, [..., V]):
    candidates() of each row, as a whole vocabulary's. Speculative decoding filters target and
    draft alike with it."""
    rows = logits.reshape(-1, logits.shape[-1])
    out = torch.zeros(rows.shape, dtype=torch.float32, device=logits.device)
    for row, dense in zip(rows, out):
        ids, probs = candidates(row, p)
        if ids is None:
            dense.copy_(probs)
        else:
            dense[ids] = probs
    return out.view(logits.shape)


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params.validate()
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, seen: Seen | None = None) -> int:
        """logits: [V] for one position; seen: ids so far (for the penalties; None: none apply)."""
        if seen is not None:
            logits = apply_penalties(logits, seen, self.params)
        if self.params.greedy:
            return int(logits.argmax())
        ids, probs = candidates(logits, self.params)
        if ids is None:
            return draw(probs.cpu(), self.generator)
        return int(ids[torch.multinomial(probs.cpu(), 1, generator=self.generator)])
