"""Perplexity over a token sequence, and how far a model's next-token distributions are from a
base model's (mean KL divergence, top-1 agreement), as llama-perplexity's KL mode reports them.

Windows (Hugging Face's perplexity guide): windows of `ctx` tokens start every `stride` tokens;
each window scores only the tokens no earlier window scored, each predicted from everything before
it in its window (at least ctx - stride tokens of context once the first window is past). A
token that would be first in its window (stride == ctx) has no context there and is not scored;
the sequence's first token never is. The last window ends at the end of the sequence.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from .errors import BriskError, InvalidValue


def windows(n_tokens: int, ctx: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over n_tokens tokens."""
    if ctx < 2:
        raise InvalidValue("ctx", ctx, "must be >= 2 (a window needs at least 2 tokens)")
    if not 1 <= stride <= ctx:
        raise InvalidValue("stride", stride, f"must be between 1 and the window length ({ctx})")
    out, scored_to = [], 1  # position 0 has nothing before it
    for begin in range(0, n_tokens, stride):
        end = min(begin + ctx, n_tokens)
        first = max(scored_to, begin + 1)
        if first < end:
            out.append((begin, end, first))
        scored_to = max(scored_to, end)
        if end == n_tokens:
            break
    return out


@dataclass
class EvalResult:
    ctx: int
    stride: int
    windows: int
    tokens: int          # tokens scored
    nll: float           # mean negative log-likelihood per scored token (nats)
    ppl: float           # exp(nll)
    base_nll: float | None = None
    base_ppl: float | None = None
    ppl_ratio: float | None = None      # ppl / base_ppl
    kl_mean: float | None = None        # mean over scored tokens of KL(base || model), nats
    kl_median: float | None = None
    kl_p99: float | None = None
    kl_max: float | None = None
    top1_agreement: float | None = None  # share of scored tokens where both models' argmax agree

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _log_probs(llm, ids: list[int], first: int, vocab: int | None) -> torch.Tensor:
    """Log-probabilities [n, vocab] of the next token at window positions first-1 .. len(ids)-2
    (the predictions of ids[first:])."""
    with torch.inference_mode():
        logits = llm.model(torch.tensor([ids], device=llm.device), 0, llm.new_cache(len(ids)))[0, first - 1:len(ids) - 1]
    logits = logits.float()
    if vocab is not None:  # padded embedding rows beyond the tokenizer's vocabulary
        logits = logits[:, :vocab]
    return torch.log_softmax(logits, dim=-1).cpu()


def evaluate(llm, ids: list[int], ctx: int, stride: int, base=None,
             progress: Callable[[int, int], None] | None = None) -> EvalResult:
    """Perplexity of `llm` on `ids`; with `base` (an LLM sharing its tokenizer), also base's
    perplexity and KL(base || llm) per scored token. `progress(done, total)` after each window."""
    if len(ids) < 2:
        raise BriskError(f"the text is {len(ids)} token{'s' if len(ids) != 1 else ''} long; perplexity needs at least 2")
    if base is not None:
        diff = llm.tokenizer.describe_difference(base.tokenizer)
        if diff:
            raise BriskError(f"{llm.name} and {base.name} do not share a tokenizer ({diff})")
    for m in (llm, base):
        if m is not None and ctx > m.ctx:
            raise InvalidValue("ctx", ctx, f"must be at most {m.ctx} (more exceeds the context {m.name} "
                               "was loaded with)")
    # Distributions over the model's whole output layer, unless the two models' layers differ in
    # size (padding rows): then both over the tokenizer's vocabulary, renormalized.
    vocab = None
    if base is not None and base.config.vocab_size != llm.config.vocab_size:
        vocab = llm.tokenizer.vocab_size
    spans = windows(len(ids), ctx, stride)
    nll, base_nll, kls, agree = 0.0, 0.0, [], 0
    for i, (begin, end, first) in enumerate(spans):
        window = ids[begin:end]
        targets = torch.tensor(ids[first:end])[:, None]
        lp = _log_probs(llm, window, first - begin, vocab)
        nll -= lp.gather(1, targets).sum().item()
        if base is not None:
            blp = _log_probs(base, window, first - begin, vocab)
            base_nll -= blp.gather(1, targets).sum().item()
            # KL(P_base || P_model) = sum_v p_base (log p_base - log p_model)
            kls.append((blp.exp() * (blp - lp)).sum(dim=-1).clamp(min=0))
            agree += (blp.argmax(-1) == lp.argmax(-1)).sum().item()
        if progress:
            progress(i + 1, len(spans))
    n = sum(end - first for _, end, first in spans)
    res = EvalResult(ctx=ctx, stride=stride, windows=len(spans), tokens=n, nll=nll / n, ppl=math.exp(nll / n))
    if base is not None:
        kl = torch.cat(kls).double()
        res.base_nll = base_nll / n
        res.base_ppl = math.exp(res.base_nll)
        res.ppl_ratio = res.ppl / res.base_ppl
        res.kl_mean = kl.mean().item()
        res.kl_median = kl.median().item()
        res.kl_p99 = torch.quantile(kl, 0.99).item() if kl.numel() > 1 else kl.item()
        res.kl_max = kl.max().item()
        res.top1_agreement = agree / n
    return res
