"""Log-probabilities of tokens, as the OpenAI API reports them.

They are the model's own distribution: the log-softmax of the raw logits, before penalties,
temperature or truncation (what scoring a text means, and vLLM's default), so a token's logprob
is the same whether it was sampled, drafted and verified, or read from the prompt (`echo`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # alternatives per position (OpenAI's limit for chat)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the k most likely (id, logprob), most likely first


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """logits [N, V] (row i the distribution tokens[i] was drawn from or read against); the
    chosen tokens' logprobs and each row's k most likely."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    if k <= 0:
        return [TokenLogprob(t, c) for t, c in zip(tokens, chosen)]
    vals, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return [TokenLogprob(t, c, tuple(zip(i, v))) for t, c, i, v in zip(tokens, chosen, ids.tolist(), vals.tolist())]


def checked_count(value, name: str, limit: int = MAX_TOP_LOGPROBS) -> int:
    """A requested number of alternatives: an integer in [0, limit]."""
    from .errors import InvalidValue

    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise InvalidValue(name, value, f"must be an integer in [0, {limit}]")
    return value
