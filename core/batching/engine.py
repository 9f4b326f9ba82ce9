"""Continuous batching: many sequences share one model call per step and one paged KV pool.

The engine loop: the scheduler plans the step (scheduler.py), the step's rows run in one forward
over the paged KV, each sequence that reached the end of its tokens samples with its own
parameters and feeds its output stream, and finished sequences leave at once, returning their
blocks. Engine is single-threaded and driven by step(); EngineThread runs it in the background for
the HTTP server, taking submissions and cancellations from other threads.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import torch

from ..errors import BriskError, InvalidValue, PromptTooLong
from ..kv import PagedKV, PagedStep, Row
from ..kv.paged import BLOCK_SIZE
from ..cuda_graph import graphs_enabled
from .block_pool import BlockPool
from .decode_graphs import DecodeGraphs
from .kv_manager import KVManager
from .scheduler import STEP_TOKENS, Request, Scheduler, Sequence
from ..grammar import constrained_token
from ..logprobs import token_logprobs
from ..sampling import Seen


@dataclass
class EngineStats:
    steps: int = 0
    step_s: float = 0.0
    decode_steps: int = 0  # steps made of decode rows only
    decode_s: float = 0.0
    decode_tokens: int = 0
    prefilled_tokens: int = 0
    shared_tokens: int = 0  # prompt tokens found in cached blocks instead of computed
    preemptions: int = 0
    peak_blocks: int = 0  # most blocks referenced at once
    peak_tokens: int = 0  # most tokens held at once

    def to_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def default_kv_tokens(ctx: int) -> int:
    """Pool size when none is given: two full contexts, at least 16k tokens (pages that are never
    touched cost no memory on the CPU)."""
    return max(2 * ctx, 16384)


def new_sequence(llm, ctx: int, request: Request, on_event=None) -> Sequence:
    """A request checked against the model's context and wrapped as a Sequence."""
    n = len(request.prompt_ids)
    if n == 0:
        raise BriskError("the prompt is empty")
    if n >= ctx:
        raise PromptTooLong(n, ctx)
    if request.max_tokens < (0 if request.prompt_logprobs is not None else 1):  # 0: score the prompt only
        raise InvalidValue("max_tokens", request.max_tokens, "must be >= 1")
    return Sequence(request, llm.tokenizer, llm.eos_ids, ctx, on_event)


class Engine:
    def __init__(self, llm, max_batch: int = 16, kv_tokens: int | None = None,
                 block_size: int = BLOCK_SIZE, step_tokens: int = STEP_TOKENS, prefix_sharing: bool = True,
                 fixed_decode: bool | None = None):
        """fixed_decode: run decode-only steps at fixed shapes (decode_graphs.py); None: where they
        replay as CUDA graphs (cuda_graph.graphs_enabled)."""
        if max_batch < 1:
            raise BriskError(f"max batch {max_batch}: must be >= 1")
        self.llm, self.model, self.device = llm, llm.model, llm.device
        self.ctx = llm.ctx
        n_blocks = -(-(kv_tokens or default_kv_tokens(llm.ctx)) // block_size)
        n_blocks = max(n_blocks, -(-self.ctx // block_size) + 1)  # always room for one full-context sequence
        cfg, w = llm.config, self.model.model.norm.weight
        # one block more than the pool hands out: where fixed-shape steps' padding rows write
        self.kv = PagedKV(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_blocks + 1, block_size, w.dtype, w.device,
                          llm.kv_type)
        self.kv.first_use([n_blocks])
        self.pool = BlockPool(n_blocks, block_size)
        graphs = graphs_enabled(w.device, self.model)
        if fixed_decode is None:
            fixed_decode = graphs
        self.decode_graphs = DecodeGraphs(self.model, self.kv, n_blocks, self.ctx, graphs) if fixed_decode else None
        self.kv_manager = KVManager(self.pool, self.kv, prefix_sharing)
        self.scheduler = Scheduler(self.kv_manager, max_batch, step_tokens)
        self.stats = EngineStats()

    @property
    def waiting(self) -> list[Sequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    # ---------------------------------------------------------------- requests
    def make_sequence(self, request: Request, on_event=None) -> Sequence:
        """Check a request and wrap it (no engine state is touched: any thread may call this)."""
        return new_sequence(self.llm, self.ctx, request, on_event)

    def add(self, request: Request | Sequence) -> Sequence:
        seq = request if isinstance(request, Sequence) else self.make_sequence(request)
        self.scheduler.add(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Drop a request wherever it is; its blocks go back to the pool."""
        self.scheduler.remove(seq)
        if not seq.finished:
            seq.out.finish("cancelled")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def run(self, requests: list[Request]) -> list[Sequence]:
        """Generate for all requests (batch mode); sequences come back in the requests' order."""
        seqs = [self.add(r) for r in requests]
        while self.has_work():
            self.step()
        return seqs

    # ---------------------------------------------------------------- the step
    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, str, bool]]:
        """One forward pass. Returns (sequence, new text, finished) for the sequences that moved."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan:
            return []
        rows = [Row(seq.tokens[seq.computed:seq.computed + n], seq.computed, seq.blocks, _logits_wanted(seq, n))
                for seq, n in plan]
        decoding = [n == 1 and seq.computed >= len(seq.request.prompt_ids) for seq, n in plan]
        if self.decode_graphs is not None and all(decoding) and DecodeGraphs.takes(rows):
            logits = self.decode_graphs(rows)
        else:
            step = PagedStep.build(self.kv, rows, self.device)
            logits = self.model(step.tokens[None], step.positions, step, logit_rows=step.logit_rows)[0]
        starts = [0, *itertools.accumulate(r.n_logits for r in rows)]  # each row's logits: starts[i]:starts[i+1]
        ends = [starts[i + 1] - 1 for i, (seq, n) in enumerate(plan) if seq.computed + n == len(seq.tokens)]
        greedy = logits.argmax(-1).tolist() if ends else []  # every row: no gathered copy of the logits
        events = []
        for i, ((seq, n), row) in enumerate(zip(plan, rows)):
            if seq.result.prompt_logprobs is not None:
                _prompt_logprobs(seq, logits[starts[i]:starts[i + 1]])
            seq.computed += n
            self.kv_manager.publish(seq)
            if seq.computed < len(seq.tokens):  # a prompt chunk before the last
                continue
            if seq.out.budget == 0:  # echo with max_tokens 0: the prompt was all there was to score
                events.append((seq, seq.out.finish("length"), True))
                continue
            p, end = seq.request.sampling, starts[i + 1] - 1
            seen = Seen.of(seq.tokens, len(seq.request.prompt_ids), self.device) if p.penalized else None
            if seq.constraint is not None:  # structured output: the grammar decides what may come
                token = constrained_token(seq.constraint, seq.sampler, logits[end], seen)
            else:
                token = greedy[end] if p.greedy and seen is None else seq.sampler(logits[end], seen)
            piece = seq.out.push(token, logits[end])
            if seq.result.finish_reason != "eos":  # EOS ends the sequence unseen
                seq.tokens.append(token)
            events.append((seq, piece, seq.finished))
        self._track_memory()
        for seq, _, done in events:
            if done:
                self.scheduler.remove(seq)
        dt = time.perf_counter() - t0
        st = self.stats
        st.steps, st.step_s = st.steps + 1, st.step_s + dt
        st.prefilled_tokens += sum(n for (_, n), d in zip(plan, decoding) if not d)  # prompts, recomputation
        if all(decoding):
            st.decode_steps, st.decode_s, st.decode_tokens = st.decode_steps + 1, st.decode_s + dt, st.decode_tokens + len(plan)
        st.shared_tokens, st.preemptions = self.kv_manager.shared_tokens, self.scheduler.preemptions
        for seq, piece, done in events:
            if seq.on_event is not None:
                seq.on_event(seq, piece, done)
        return events

    def _track_memory(self) -> None:
        st = self.stats
        st.peak_blocks = max(st.peak_blocks, self.pool.n_used)
        st.peak_tokens = max(st.peak_tokens, self.kv_manager.held(self.running))


def _logits_wanted(seq: Sequence, n: int) -> int:
    """How many of a row's n positions need logits: the last, where the sequence samples next;
    every one of a prompt chunk whose tokens' logprobs were asked for (echo)."""
    if seq.result.prompt_logprobs is not None and seq.computed < len(seq.request.prompt_ids):
        return n
    return 1 if seq.computed + n == len(seq.tokens) else 0


def _prompt_logprobs(seq: Sequence, logits: torch.Tensor) -> None:
    """Record the logprobs of the prompt tokens that this row's logits [n, V] predicted (the row
    at position p predicts token p + 1); a row recomputed after a preemption adds nothing."""
    prompt, start, got = seq.request.prompt_ids, seq.computed, seq.result.prompt_logprobs
    m = min(logits.shape[0], len(prompt) - 1 - start)
    if m > 0 and len(got) == start + 1:
        got += token_logprobs(logits[:m], prompt[start + 1:start + 1 + m], seq.request.prompt_logprobs)


class EngineThread:
    """Runs an Engine on a background thread. submit() and cancel() may be called from any
    thread; each sequence's on_event(seq, text, finished) is called from the engine thread."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: list[tuple[str, Sequence]] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="brisk-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, on_event) -> Sequence:
        seq = self.engine.make_sequence(request, on_event)
        with self._cv:
            self._inbox.append(("add", seq))
            self._cv.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        with self._cv:
            self._inbox.append(("cancel", seq))
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join()

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._inbox and not engine.has_work() and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                ops, self._inbox = self._inbox, []
            for op, seq in ops:
                engine.add(seq) if op == "add" else engine.cancel(seq)
            try:
                engine.step()
            except Exception as e:  # fail every request in flight rather than hang them
                for seq in engine.running + engine.waiting:
                    seq.error = f"{type(e).__name__}: {e}"
                    engine.cancel(seq)
                    if seq.on_event is not None:
                        seq.on_event(seq, "", True)
