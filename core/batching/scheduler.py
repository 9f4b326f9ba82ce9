"""Which sequences run in the next step, and how many tokens each feeds.

Each step: (1) waiting sequences are admitted, oldest first, while the batch has room and the
pool has blocks for their prompt (reusing cached blocks of a common prompt prefix); (2) every
running sequence gets its next tokens: one for a sequence that is decoding, a chunk of its prompt
for one still prefilling (chunks share a per-step token budget, so a long prompt does not stall
the decoding ones). When the pool runs dry the youngest sequence is preempted: its blocks are
released and it waits to be recomputed (its prefix is often still cached).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

from ..grammar import Grammar
from ..output_stream import OutputStream
from ..sampling import GREEDY, Sampler, SamplingParams
from .kv_manager import KVManager

STEP_TOKENS = 256  # tokens per forward pass: decode rows plus prefill chunks


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=lambda: GREEDY)
    max_tokens: int = 256
    stop: Seq[str] = ()
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
    logprobs: int | None = None  # each generated token's logprob and this many alternatives (None: off)
    prompt_logprobs: int | None = None  # likewise for the prompt's tokens (OpenAI's echo); max_tokens may be 0
    grammar: Grammar | None = None  # the answer keeps to it (structured output)


class Sequence:
    """One request's state: its tokens (prompt, then generated), how many have K/V in the pool,
    its block table, and its output stream."""

    _ids = itertools.count()

    def __init__(self, request: Request, tokenizer, eos_ids: set[int], ctx: int,
                 on_event: Callable[["Sequence", str, bool], None] | None = None):
        self.id = next(self._ids)  # arrival order: lower is older
        self.request = request
        self.tokens = list(request.prompt_ids)
        self.computed = 0  # tokens whose K/V are in the pool
        self.blocks: list[int] = []
        self.names: list[bytes] = []  # hashes of the leading full blocks
        self.n_ready = 0  # leading blocks known to be computed (and published)
        self.sampler = Sampler(request.sampling)
        self.constraint = None if request.grammar is None else request.grammar.constraint()
        self.out = OutputStream(tokenizer, set() if request.ignore_eos else eos_ids, request.stop,
                                min(request.max_tokens, ctx - len(request.prompt_ids)), len(request.prompt_ids),
                                request.sampling.stop_loops, request.logprobs)
        self.result = self.out.result
        if request.prompt_logprobs is not None:  # the first token has no context to be predicted from
            self.result.prompt_logprobs = [None]
        self.on_event = on_event
        self.preemptions = 0
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return self.out.finished

    @property
    def latency_s(self) -> float:
        return (self.out.finished_at or time.perf_counter()) - self.out.started


class Scheduler:
    def __init__(self, kv: KVManager, max_batch: int, step_tokens: int = STEP_TOKENS):
        self.kv, self.max_batch, self.step_tokens = kv, max_batch, max(step_tokens, 1)
        self.waiting: list[Sequence] = []  # oldest first
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        i = len(self.waiting)
        while i and self.waiting[i - 1].id > seq.id:
            i -= 1
        self.waiting.insert(i, seq)

    def remove(self, seq: Sequence) -> None:
        """Take seq out wherever it is; a running one's blocks go back to the pool."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's plan: (sequence, tokens it feeds), blocks allocated for them."""
        self._admit()
        while True:
            plan, budget = [], self.step_tokens
            for seq in sorted(self.running, key=lambda s: s.id):
                left = len(seq.tokens) - seq.computed
                n = 1 if left == 1 else min(left, budget)  # decoding rows always get their token
                if n <= 0:
                    continue
                if not self.kv.grow(seq, n):
                    self._preempt(max(self.running, key=lambda s: s.id))
                    break
                plan.append((seq, n))
                budget -= n
            else:
                return plan

    def _admit(self) -> None:
        """Waiting sequences join, oldest first, while there is a batch slot and blocks for their
        prompt (plus one block of headroom per running sequence, so decoding can go on)."""
        for seq in list(self.waiting):
            if len(self.running) >= self.max_batch:
                break
            ok = self.kv.admit(seq, reserve=len(self.running))
            if ok is None:
                continue
            if not ok:
                break  # first come, first served: nobody overtakes a sequence that does not fit
            if not seq.result.prefilled_tokens:
                seq.result.prefilled_tokens = seq.result.prompt_tokens - seq.computed
            self.waiting.remove(seq)
            self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Release a sequence's blocks and queue it again; it recomputes what it had (prompt and
        answer so far) when it is readmitted, from cached blocks where they survived."""
        self.running.remove(seq)
        self.kv.free(seq, forget_names=True)
        seq.preemptions += 1
        self.preemptions += 1
        self.add(seq)
