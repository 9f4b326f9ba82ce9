"""Continuous batching: many sequences share one model call per step and one paged KV pool.

Each step the scheduler (1) admits waiting sequences while the batch has room and the pool has
blocks for their prompt, reusing cached blocks of a common prompt prefix; (2) gives every
running sequence its next tokens: one for a sequence that is decoding, a chunk of its prompt
for one still prefilling (chunks share a per-step token budget, so a long prompt does not stall
the decoding ones); (3) runs them all in one forward pass; (4) samples each sequence that
reached the end of its tokens with its own sampling parameters, and retires finished ones at
once, returning their blocks. When the pool runs dry the youngest sequence is preempted: its
blocks are released and it waits to be recomputed (its prefix is often still cached).

Engine is single-threaded and driven by step(); EngineThread runs it in the background for the
HTTP server, taking submissions and cancellations from other threads.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

import torch

from .errors import BriskError
from .generate import GenerationResult, StopMatcher
from .paged_cache import BLOCK_SIZE, PagedStep, Row, block_hash
from .sampling import GREEDY, Sampler, SamplingParams
from .tokenizer import IncrementalDecoder

STEP_TOKENS = 256  # tokens per forward pass: decode rows plus prefill chunks


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=lambda: GREEDY)
    max_tokens: int = 256
    stop: Seq[str] = ()
    ignore_eos: bool = False  # benchmarks: always generate max_tokens


class Sequence:
    """One request's state: its tokens (prompt, then generated), how many have K/V in the pool,
    its block table, and the text produced so far."""

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
        self.decoder, self.stopper = IncrementalDecoder(tokenizer), StopMatcher(request.stop)
        self.eos_ids = set() if request.ignore_eos else eos_ids
        self.budget = min(request.max_tokens, ctx - len(request.prompt_ids))
        self.result = GenerationResult(prompt_tokens=len(request.prompt_ids))
        self.on_event = on_event
        self.arrival = time.perf_counter()
        self.first_token_at = self.finished_at = 0.0
        self.preemptions = 0
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return bool(self.result.finish_reason)

    @property
    def latency_s(self) -> float:
        return (self.finished_at or time.perf_counter()) - self.arrival

    def seen(self, device) -> torch.Tensor | None:
        """The ids the repetition penalty looks at (prompt and answer), as Session passes them."""
        if self.request.sampling.repetition_penalty == 1.0:
            return None
        return torch.tensor(self.tokens, device=device)


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


class Engine:
    def __init__(self, llm, max_batch: int = 16, kv_tokens: int | None = None,
                 block_size: int = BLOCK_SIZE, step_tokens: int = STEP_TOKENS, prefix_sharing: bool = True):
        if max_batch < 1:
            raise BriskError(f"max batch {max_batch}: must be >= 1")
        self.llm, self.model, self.device = llm, llm.model, llm.device
        self.ctx = llm.ctx
        n_blocks = -(-(kv_tokens or default_kv_tokens(llm.ctx)) // block_size)
        n_blocks = max(n_blocks, -(-self.ctx // block_size) + 1)  # always room for one full-context sequence
        self.pool = self.model.new_pool(n_blocks, block_size)
        self.max_batch, self.step_tokens, self.prefix_sharing = max_batch, max(step_tokens, 1), prefix_sharing
        self.waiting: list[Sequence] = []  # oldest first
        self.running: list[Sequence] = []
        self.stats = EngineStats()

    # ---------------------------------------------------------------- requests
    def make_sequence(self, request: Request, on_event=None) -> Sequence:
        """Check a request and wrap it (no engine state is touched: any thread may call this)."""
        n = len(request.prompt_ids)
        if n == 0:
            raise BriskError("the prompt is empty")
        if n >= self.ctx:
            raise BriskError(f"the prompt is {n} tokens but the context is {self.ctx}")
        if request.max_tokens < 1:
            raise BriskError(f"max_tokens must be >= 1, got {request.max_tokens}")
        return Sequence(request, self.llm.tokenizer, self.llm.eos_ids, self.ctx, on_event)

    def add(self, request: Request | Sequence) -> Sequence:
        seq = request if isinstance(request, Sequence) else self.make_sequence(request)
        self._enqueue(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Drop a request wherever it is; its blocks go back to the pool."""
        if seq in self.running:
            self.running.remove(seq)
            self._free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not seq.finished:
            self._finish(seq, "cancelled")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
        self._admit()
        plan = self._plan()
        if not plan:
            return []
        rows = [Row(seq.tokens[seq.computed:seq.computed + n], seq.computed, seq.blocks,
                    want_logits=seq.computed + n == len(seq.tokens)) for seq, n in plan]
        decoding = [n == 1 and seq.computed >= len(seq.request.prompt_ids) for seq, n in plan]
        logits = self.model.forward_batch(PagedStep.build(self.pool, rows, self.device))
        events, j = [], 0
        greedy = logits.argmax(-1).tolist() if logits.shape[0] else []
        for (seq, n), row in zip(plan, rows):
            seq.computed += n
            self._publish(seq)
            if not row.want_logits:
                continue
            p = seq.request.sampling
            token = greedy[j] if p.greedy and p.repetition_penalty == 1.0 else seq.sampler(logits[j], seq.seen(self.device))
            j += 1
            events.append(self._accept(seq, token))
        self._track_memory()
        for seq, _, done in events:
            if done:
                self.running.remove(seq)
                self._free(seq)
        dt = time.perf_counter() - t0
        st = self.stats
        st.steps, st.step_s = st.steps + 1, st.step_s + dt
        st.prefilled_tokens += sum(n for (_, n), d in zip(plan, decoding) if not d)  # prompts, recomputation
        if all(decoding):
            st.decode_steps, st.decode_s, st.decode_tokens = st.decode_steps + 1, st.decode_s + dt, st.decode_tokens + len(plan)
        for seq, piece, done in events:
            if seq.on_event is not None:
                seq.on_event(seq, piece, done)
        return events

    def _admit(self) -> None:
        """Waiting sequences join, oldest first, while there is a batch slot and blocks for their
        prompt (plus one block of headroom per running sequence, so decoding can go on)."""
        bs = self.pool.block_size
        for seq in list(self.waiting):
            if len(self.running) >= self.max_batch:
                break
            n = len(seq.tokens)
            if not seq.names:  # the full blocks before the last token, which is always computed
                parent = None
                for i in range((n - 1) // bs):
                    parent = block_hash(parent, seq.tokens[i * bs:(i + 1) * bs])
                    seq.names.append(parent)
            shared: list[int] = []
            if self.prefix_sharing:
                shared, pending = self.pool.lookup(seq.names)
                if pending:  # another sequence is computing this prefix right now: wait a step for it
                    continue
            need = self.pool.blocks_for(n) - len(shared)
            revived = sum(1 for b in shared if self.pool.refs[b] == 0)  # cached blocks count as free
            if need + revived + len(self.running) > self.pool.n_free:
                break  # first come, first served: nobody overtakes a sequence that does not fit
            self.pool.share(shared)
            seq.blocks = shared + self.pool.allocate(need)
            seq.n_ready, seq.computed = len(shared), len(shared) * bs
            self.stats.shared_tokens += seq.computed
            if not seq.result.prefilled_tokens:
                seq.result.prefilled_tokens = seq.result.prompt_tokens - seq.computed
            if self.prefix_sharing:  # announce the prompt blocks about to be computed
                for i in range(len(shared), len(seq.names)):
                    self.pool.name(seq.blocks[i], seq.names[i], ready=False)
            self.waiting.remove(seq)
            self.running.append(seq)

    def _plan(self) -> list[tuple[Sequence, int]]:
        """Tokens for each running sequence this step, with blocks for them; preempts the youngest
        sequence (and plans again) when the pool cannot cover everyone."""
        while True:
            plan, budget = [], self.step_tokens
            for seq in sorted(self.running, key=lambda s: s.id):
                left = len(seq.tokens) - seq.computed
                n = 1 if left == 1 else min(left, budget)  # decoding rows always get their token
                if n <= 0:
                    continue
                need = self.pool.blocks_for(seq.computed + n) - len(seq.blocks)
                if need > self.pool.n_free:
                    self._preempt(max(self.running, key=lambda s: s.id))
                    break
                seq.blocks += self.pool.allocate(max(need, 0))
                plan.append((seq, n))
                budget -= n
            else:
                return plan

    def _preempt(self, seq: Sequence) -> None:
        """Release a sequence's blocks and queue it again; it recomputes what it had (prompt and
        answer so far) when it is readmitted, from cached blocks where they survived."""
        self.running.remove(seq)
        self._free(seq)
        seq.names, seq.preemptions = [], seq.preemptions + 1
        self.stats.preemptions += 1
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        i = len(self.waiting)
        while i and self.waiting[i - 1].id > seq.id:
            i -= 1
        self.waiting.insert(i, seq)

    def _free(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks, seq.computed, seq.n_ready = [], 0, 0

    def _publish(self, seq: Sequence) -> None:
        """Blocks this step filled become shareable: named (prompt blocks were named at
        admission, waiting to be computed) and marked ready."""
        if not self.prefix_sharing:
            return
        bs = self.pool.block_size
        while (seq.n_ready + 1) * bs <= seq.computed:
            i = seq.n_ready
            if i < len(seq.names):
                self.pool.mark_ready(seq.blocks[i])
            else:
                seq.names.append(block_hash(seq.names[-1] if seq.names else None, seq.tokens[i * bs:(i + 1) * bs]))
                self.pool.name(seq.blocks[i], seq.names[i], ready=True)
            seq.n_ready += 1

    # ---------------------------------------------------------------- tokens -> text
    def _accept(self, seq: Sequence, token: int) -> tuple[Sequence, str, bool]:
        """Session.stream's rules, per sequence: EOS ends it unseen, stop strings are held back
        and cut, max_tokens (or the context) ends it; text leaves in pieces as it is decoded."""
        res, now = seq.result, time.perf_counter()
        if not seq.first_token_at:
            seq.first_token_at = now
            res.ttft_s = res.prefill_s = now - seq.arrival
        if token in seq.eos_ids:
            return seq, self._finish(seq, "eos"), True
        seq.tokens.append(token)
        res.tokens.append(token)
        piece, stopped = seq.stopper.feed(seq.decoder.push(token))
        res.text += piece
        if stopped:
            return seq, piece + self._finish(seq, "stop"), True
        if len(res.tokens) >= seq.budget:
            return seq, piece + self._finish(seq, "length"), True
        return seq, piece, False

    def _finish(self, seq: Sequence, reason: str) -> str:
        """Mark seq finished; returns the text still held back (a tail that was not a stop)."""
        res = seq.result
        res.finish_reason = reason
        seq.finished_at = time.perf_counter()
        res.decode_s = seq.finished_at - (seq.first_token_at or seq.finished_at)
        tail = ""
        if reason in ("eos", "length"):
            tail, _ = seq.stopper.feed(seq.decoder.flush())
            tail += seq.stopper.flush()
            res.text += tail
        return tail

    def _track_memory(self) -> None:
        """Peak blocks in use, and peak tokens held (shared blocks counted once): the gap is
        what paging wastes, the unfilled end of each sequence's last block."""
        bs, fill = self.pool.block_size, {}
        for seq in self.running:
            for i, b in enumerate(seq.blocks):
                fill[b] = max(fill.get(b, 0), min(bs, max(seq.computed - i * bs, 0)))
        st = self.stats
        st.peak_blocks, st.peak_tokens = max(st.peak_blocks, self.pool.n_used), max(st.peak_tokens, sum(fill.values()))


def default_kv_tokens(ctx: int) -> int:
    """Pool size when none is given: two full contexts, at least 16k tokens (pages that are never
    touched cost no memory on the CPU)."""
    return max(2 * ctx, 16384)


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
