"""The generation loop: prefill what the cache lacks, then decode, one token per step or, with a
speculator, a verified run of drafted tokens per step.

A Session owns one KV cache and remembers which token ids it holds, so a follow-up prompt that
shares a prefix with them (the next chat turn) only prefills the new tokens.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch

from . import progress
from .cuda_graph import decode_step, verify_pass
from .spec.drafter import Draft
from .errors import BriskError, PromptTooLong
from .grammar import Constraint, Grammar, constrained_token
from .logprobs import TokenLogprob, token_logprobs
from .model import LAST
from .output_stream import GenerationResult, OutputStream
from .sampling import Sampler, SamplingParams, Seen, extend_seen

PREFILL_CHUNK = 512  # long prompts are prefilled in pieces: bounded activation memory


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefill(model, kv, ids: list[int], start: int, device, return_hidden: bool = False):
    """Run ids[start:] at their positions (in chunks); the logits after the last one (and, with
    return_hidden, its final-norm hidden state: (logits [V], hidden [dim]))."""
    for s in range(start, len(ids), PREFILL_CHUNK):
        out = model(torch.tensor([ids[s:s + PREFILL_CHUNK]], device=device), s, kv, logit_rows=LAST,
                    return_hidden=return_hidden)
        if len(ids) - start > PREFILL_CHUNK:  # a long prompt: minutes on a small CPU, said as it goes
            progress.report("prompt tokens read", min(s + PREFILL_CHUNK, len(ids)) - start, len(ids) - start)
    return (out[0][0, -1], out[1][0, -1]) if return_hidden else out[0, -1]


class Session:
    def __init__(self, llm, speculator=None):
        self.llm = llm
        self.speculator = speculator  # a spec.speculator.Speculator: drafts tokens, the model checks them
        self.cache = llm.new_cache()
        self.ids: list[int] = []  # the tokens whose K/V the cache holds, in order
        self.last: GenerationResult | None = None
        self.prefilled = 0  # the tokens the last prefill ran (the rest of its prompt was in the cache)
        self._step = None  # the one-token step on this cache (its CUDA graphs), made on first use
        self._verify = None  # the verifying pass on this cache (its CUDA graphs), likewise

    def reset(self) -> None:
        self.ids = []

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], return_hidden: bool = False):
        """Bring the cache to exactly prompt_ids; return the logits after its last token (and its
        final-norm hidden state, with return_hidden)."""
        keep = min(common_prefix(self.ids, prompt_ids), len(prompt_ids) - 1)
        out = prefill(self.llm.model, self.cache, prompt_ids, keep, self.llm.device, return_hidden)
        self.ids = list(prompt_ids)
        self.prefilled = len(prompt_ids) - keep
        return out

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int = 256,
               stop: Sequence[str] = (), logprobs: int | None = None, grammar: Grammar | None = None) -> Iterator[str]:
        """Yield text pieces as they are generated; the summary is in self.last afterwards (with
        each token's logprob and `logprobs` alternatives, unless None). grammar: the answer keeps
        to it (grammar.py)."""
        if not prompt_ids:
            raise BriskError("the prompt is empty")
        ctx = self.cache.max_len
        if len(prompt_ids) >= ctx:
            raise PromptTooLong(len(prompt_ids), ctx, limit=self.llm.config.max_seq_len)
        out = OutputStream(self.llm.tokenizer, self.llm.eos_ids, stop, min(max_tokens, ctx - len(prompt_ids)),
                           len(prompt_ids), sampling.stop_loops, logprobs)
        res = self.last = out.result
        tokens = self.tokens(prompt_ids, Sampler(sampling), out.budget,
                             None if grammar is None else grammar.constraint())
        res.prefilled_tokens = self.prefilled
        if self.speculator is not None:
            res.spec = self.speculator.stats
        try:
            for token, logits in tokens:
                piece = out.push(token, logits)
                if piece:
                    yield piece
                if out.finished:
                    break
        except (GeneratorExit, KeyboardInterrupt):  # Ctrl-C, in the consumer's hands or mid-step here
            out.finish("interrupted")  # timed, so the speed of what was generated is still reported
            raise
        finally:
            tokens.close()

    @torch.inference_mode()
    def prompt_logprobs(self, prompt_ids: list[int], k: int) -> list[TokenLogprob | None]:
        """Each prompt token's logprob given the ones before (None for the first) and the k most
        likely there (OpenAI's echo): the prompt runs again with every position's logits, and the
        cache is left holding it."""
        out: list[TokenLogprob | None] = [None]
        for s in range(0, len(prompt_ids), PREFILL_CHUNK):
            chunk = prompt_ids[s:s + PREFILL_CHUNK]
            logits = self.llm.model(torch.tensor([chunk], device=self.llm.device), s, self.cache)[0]
            targets = prompt_ids[s + 1:s + 1 + len(chunk)]
            out += token_logprobs(logits[:len(targets)], targets, k) if targets else []
        self.ids = list(prompt_ids)
        return out

    @torch.inference_mode()
    def tokens(self, prompt_ids: list[int], sampler: Sampler, budget: int,
               constraint: Constraint | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Prefill prompt_ids (now), then the generated tokens one by one, each with the target's
        raw logits [V] it was drawn from (valid until the next is asked for), for a caller that
        makes its own text of them (stream(); brisk serve --draft) and stops asking within
        `budget`. With a constraint (grammar.py) every token keeps to its grammar. The
        speculator's counters restart (speculator.stats)."""
        sp = self.speculator
        if sp is not None and sp.drafter.tree and not hasattr(self.cache, "keep_path"):
            raise BriskError(f"--draft {sp.drafter.name} drafts trees, which need a contiguous KV cache "
                             "(single-stream generation)")
        hidden_needed = sp is not None and sp.needs_hidden
        logits = self.prefill(prompt_ids, return_hidden=hidden_needed)
        logits, hidden = logits if hidden_needed else (logits, None)
        seen = Seen.of(prompt_ids, len(prompt_ids), self.llm.device) if sampler.params.penalized else None
        if sp is not None:
            sp.new_stats()
        token = sampler(logits, seen) if constraint is None else constrained_token(constraint, sampler, logits, seen)
        return self._tokens(token, sampler, seen, budget, (logits, hidden), constraint)

    def _tokens(self, token: int, sampler: Sampler, seen: Seen | None, budget: int,
                first: tuple, constraint: Constraint | None) -> Iterator[tuple[int, torch.Tensor]]:
        """The generated tokens, one by one. A token enters the cache only when the consumer asks
        for the next one, so the cache never holds the last token handed out (self.ids is what it
        holds). Each step verifies the speculator's drafts, if any, in the same pass that runs the
        pending token (a graph replay on CUDA); without drafts the step is a plain decode step
        (likewise), unless the drafter needs the hidden states. A tree draft is one pass with its
        ancestor mask, after which the accepted path's K/V move to the slots a chain would have used.
        first: the prefill's (logits, hidden) of the prompt's last token, for the drafter. Under a
        grammar, chains are cut to what it accepts and each row is masked before verification;
        tree drafters do not draft (a tree's rows would each need the grammar's state there)."""
        sp, ids, cache = self.speculator, self.ids, self.cache
        step = self._decode_step()
        hidden_needed = sp is not None and sp.needs_hidden
        yield token, first[0]
        emitted = 1
        if sp is not None:
            sp.start(ids, cache)  # catching up with the prompt is not a per-token cost
            sp.observe_prefill(*first)
        while True:
            if seen is not None:  # the penalties see the context, then each draft
                seen = extend_seen(seen, [token])
            draft, drafts = None, []
            if sp is not None and constraint is not None and sp.drafter.tree:
                draft = Draft([])
            elif sp is not None:  # room: what the budget and the cache leave after the pending token
                slots = cache.max_len - len(ids) - 1
                draft = sp.propose(ids + [token], min(budget - emitted, slots) - 1, sampler, seen, slots)
                if constraint is not None:
                    draft = constraint.fit(draft)
            drafts = draft.tokens if draft is not None else []
            start, tree, hidden = len(ids), bool(drafts) and draft.parents is not None, None
            if drafts or hidden_needed:
                logits, hidden = self._verify_pass()([token] + drafts, start, draft.parents if tree else None,
                                                     hidden_needed)
            else:
                logits = step(token, start)[None]
            ids.append(token)
            if sp is None:
                path = []
                token = sampler(logits[0], seen) if constraint is None else constrained_token(constraint, sampler,
                                                                                         logits[0], seen)
            else:
                held = logits if constraint is None else constraint.mask_rows(logits, drafts)
                path, token = sp.verify(draft, held, sampler, seen)
                if tree:
                    cache.keep_path(start, [start + 1 + i for i in path])
                sp.accept(draft, path)
                sp.observe(draft, logits, hidden, path)
            accepted = [drafts[i] for i in path]
            if constraint is not None and sp is not None:
                constraint.take(accepted + [token])
            row = 0  # logits[1 + node] follow draft node `node`; logits[0] the pending token
            for i, d in zip(path, accepted):
                yield d, logits[row]
                row = 1 + i
                emitted += 1
                ids.append(d)
            if seen is not None and accepted:
                seen = extend_seen(seen, accepted)
            yield token, logits[row]
            emitted += 1

    def _decode_step(self):
        """One step's function for this session's cache (on CUDA its captured graphs: kept)."""
        if self._step is None:
            self._step = decode_step(self.llm.model, self.cache)
        return self._step

    def _verify_pass(self):
        """The verifying pass's function for this session's cache (kept, as _decode_step's)."""
        if self._verify is None:
            self._verify = verify_pass(self.llm.model, self.cache)
        return self._verify

