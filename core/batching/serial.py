"""`brisk serve --draft`: requests one at a time through the speculative decode loop.

Drafts pay where a decode step is bound by reading the weights: a pass over a few more tokens
costs little more than one over the pending token. Continuous batching fills that same pass with
other sequences' tokens instead, so the two compete for it; with a drafter the server runs one
sequence at a time (generate.Session with the Speculator, its contiguous KV cache kept between
requests so a shared prompt prefix is not recomputed) and queues the others, oldest first.
SerialEngine answers EngineThread as Engine does; its events are the same.
"""
from __future__ import annotations

import time

import torch

from ..generate import Session
from .engine import Engine, EngineStats, new_sequence
from .scheduler import Request, Sequence


class SerialEngine:
    def __init__(self, llm, speculator):
        self.llm, self.ctx = llm, llm.ctx
        self.session = Session(llm, speculator)
        self.kv = self.session.cache
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # at most one
        self.stats = EngineStats()
        self._tokens = None  # the running sequence's token generator

    def make_sequence(self, request: Request, on_event=None) -> Sequence:
        return new_sequence(self.llm, self.ctx, request, on_event)

    def add(self, request: Request | Sequence) -> Sequence:
        seq = request if isinstance(request, Sequence) else self.make_sequence(request)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self._end()
        if not seq.finished:
            seq.out.finish("cancelled")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    run = Engine.run  # batch mode: every request to the end

    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, str, bool]]:
        """The running sequence's next token (a new sequence's: its prefill, then its first)."""
        t0 = time.perf_counter()
        if not self.running:
            if not self.waiting:
                return []
            seq = self.waiting.pop(0)
            self.running = [seq]
            if seq.request.prompt_logprobs is not None:
                seq.result.prompt_logprobs = self.session.prompt_logprobs(seq.request.prompt_ids,
                                                                          seq.request.prompt_logprobs)
                if seq.out.budget == 0:  # echo with max_tokens 0: nothing to generate
                    return self._done(seq, seq.out.finish("length"), t0)
            self._tokens = self.session.tokens(seq.request.prompt_ids, seq.sampler, seq.out.budget, seq.constraint)
            self.stats.prefilled_tokens += self.session.prefilled
        seq = self.running[0]
        token, logits = next(self._tokens)
        piece = seq.out.push(token, logits)
        if seq.result.finish_reason != "eos":  # EOS ends the sequence unseen
            seq.tokens.append(token)
        self.stats.decode_tokens += 1
        return self._done(seq, piece, t0)

    def _done(self, seq: Sequence, piece: str, t0: float) -> list[tuple[Sequence, str, bool]]:
        """Count the step and report its event; a finished sequence leaves."""
        if seq.finished:
            self._end()
        st = self.stats
        st.steps, st.step_s = st.steps + 1, st.step_s + time.perf_counter() - t0
        if seq.on_event is not None:
            seq.on_event(seq, piece, seq.finished)
        return [(seq, piece, seq.finished)]

    def _end(self) -> None:
        if self._tokens is not None:
            self._tokens.close()
        self._tokens, self.running = None, []
