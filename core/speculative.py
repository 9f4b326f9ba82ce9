"""Speculative decoding: a cheap drafter proposes K tokens, the model checks them in one pass.

A round: the drafter guesses d1..dK after the pending token t; the target runs [t, d1..dK] in a
single forward pass, which gives its distribution after each prefix; the longest prefix of
drafts the target agrees with is kept, plus one token of the target's own (the correction at the
first rejection, or a bonus after the last draft). Both KV caches roll back past the first
rejected draft, so each round yields 1..K+1 tokens for one target pass.

Greedy: a draft is kept when it is the target's argmax, so the output is plain greedy decoding's.
Sampling: standard speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023):
keep d with probability min(1, p(d)/q(d)), else sample from max(0, p - q) renormalized. The
output is then distributed exactly as the target's. p and q are both `probabilities()` of their
logits (temperature, top-k/p, min-p, repetition penalty applied alike); the n-gram drafter's q is
a point mass on its guess.

Drafters: another checkpoint with the same tokenizer (ModelDrafter), a quantized copy of the
target built at load (`self:int8`, `self:int4`), or prompt lookup (NgramDrafter: continue the
latest earlier occurrence of the text's last few tokens; no model at all).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from .cuda_graph import decode_step
from .errors import BriskError, InvalidValue
from .generate import common_prefix, prefill
from .kv import ContiguousKV
from .sampling import SamplingParams, apply_repetition_penalty, extend_seen, probabilities

K_MAX = 12  # most drafts per round for --draft-k auto: beyond it acceptance^K makes drafts worthless


# ---------------------------------------------------------------- drafters

class Drafter:
    """Guesses continuations. `bucket` names the kind of guess available now (the K policy keeps
    acceptance statistics per bucket; None: no guess at all), `propose` makes up to k guesses."""

    name = "drafter"

    def start(self, ids: list[int], kv) -> None:
        """A generation begins: the target's cache `kv` holds `ids` (the prompt). Catch up with
        it, outside the timed rounds (it is not a per-token cost)."""

    def bucket(self, ctx: list[int]) -> int | None:
        return 0

    def propose(self, ctx: list[int], k: int, params: SamplingParams, gen: torch.Generator,
                seen: torch.Tensor | None) -> tuple[list[int], torch.Tensor | None]:
        """Up to k tokens to follow ctx, and the distributions they were drawn from ([n, V], or
        None for point masses). seen: the ids the repetition penalty looks at."""
        raise NotImplementedError

    def capacity(self) -> int:
        return 1 << 62


class ModelDrafter(Drafter):
    """A smaller model with its own KV cache, kept in step with the target's accepted tokens.

    share_cache (a quantized copy of the target: same layers and shapes): draft in the target's
    own cache instead. The context's K/V are then the target's, exact, and nothing needs a
    prefill or a catch-up; the draft's K/V for its guesses are overwritten by the verifying pass,
    which writes the same positions before it reads them.
    """

    def __init__(self, model, max_len: int, vocab_size: int, name: str = "model", share_cache: bool = False):
        self.model, self.name, self.share_cache = model, name, share_cache
        self.cache = None if share_cache else ContiguousKV.for_model(model, max_len)
        self.max_len = max_len
        self.ids: list[int] = []  # the tokens whose K/V the draft cache holds
        self.vocab_size = vocab_size  # the target's: draft logits are cut or padded to it
        self.device = model.model.norm.weight.device

    def capacity(self) -> int:
        return self.max_len

    def bucket(self, ctx):
        return 0 if len(ctx) < self.max_len else None  # a draft with a shorter context stops

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        V = self.vocab_size
        if logits.shape[-1] > V:  # padded vocabularies differ in size; the tokenizers agree
            return logits[..., :V]
        if logits.shape[-1] < V:
            return torch.nn.functional.pad(logits, (0, V - logits.shape[-1]), value=float("-inf"))
        return logits

    def sync(self, ctx: list[int]) -> torch.Tensor:
        """Bring the cache to ctx (rolling back what the target rejected, running what is
        missing); returns the logits after ctx's last token."""
        # shared: the target's cache holds ctx[:-1], its accepted tokens
        keep = len(ctx) - 1 if self.share_cache else min(common_prefix(self.ids, ctx), len(ctx) - 1)
        if len(ctx) - keep == 1:  # the steady state: one token, a decode step (a graph on CUDA)
            logits = self._step()(ctx[-1], keep)
        else:
            logits = prefill(self.model, self.cache, ctx, keep, self.device)
        self.ids = list(ctx)
        return logits

    def _step(self):
        """The draft model's one-token step on the cache it drafts in (captured graphs on CUDA)."""
        if getattr(self, "_step_cache", None) is not self.cache:
            self._step_fn, self._step_cache = decode_step(self.model, self.cache), self.cache
        return self._step_fn

    def start(self, ids, kv):
        if self.share_cache:
            self.cache = kv
        elif 0 < len(ids) < self.max_len:
            self.sync(ids)

    def propose(self, ctx, k, params, gen, seen):
        logits = self.sync(ctx)  # one token in steady state (two after a round all accepted)
        out, qs = [], []
        while True:
            logits = self._logits(logits.float())
            if seen is not None:
                logits = apply_repetition_penalty(logits, extend_seen(seen, out), params.repetition_penalty)
            if params.greedy:
                tok = int(logits.argmax())
            else:
                q = probabilities(logits, params)
                tok = int(torch.multinomial(q.cpu(), 1, generator=gen))
                qs.append(q)
            out.append(tok)
            if len(out) == k:
                return out, (torch.stack(qs) if qs else None)
            logits = self._step()(tok, len(self.ids))
            self.ids.append(tok)


class NgramDrafter(Drafter):
    """Prompt lookup decoding: the longest n-gram (n <= max_n) that ends the text and occurred
    before predicts that what followed it then follows again. Strong where the answer copies
    its input (rewrites, summaries, code edits); no extra model, almost no time."""

    name = "ngram"

    def __init__(self, max_n: int = 4):
        self.max_n = max_n
        self.index: list[dict[tuple, int]] = [{} for _ in range(max_n + 1)]  # n-gram -> end of its latest occurrence
        self.ids: list[int] = []  # the text indexed so far
        self.indexed = 0  # n-grams ending at positions < indexed are in the index
        self._match: tuple[int, int] = (0, 0)  # (n, end) found by the last bucket() call

    def _sync(self, ctx: list[int]) -> None:
        n = self.indexed
        if len(ctx) < n or ctx[:n] != self.ids[:n]:  # a new text, not a continuation: start over
            self.index = [{} for _ in range(self.max_n + 1)]
            self.indexed = n = 0
        self.ids = ctx
        # Index every n-gram ending before the last position: each then has a continuation,
        # and the text's own final n-gram is not found as a match of itself.
        for end in range(max(n, 1), len(ctx)):
            for size in range(1, min(self.max_n, end) + 1):
                self.index[size][tuple(ctx[end - size:end])] = end
        self.indexed = max(n, len(ctx))

    def bucket(self, ctx):
        """The length of the longest match: longer matches are likelier to be right."""
        self._sync(ctx)
        for size in range(min(self.max_n, len(ctx)), 0, -1):
            end = self.index[size].get(tuple(ctx[-size:]))
            if end is not None:
                self._match = (size, end)
                return size
        self._match = (0, 0)
        return None

    def propose(self, ctx, k, params, gen, seen):
        size, end = self._match
        return (list(ctx[end:end + k]) if size else []), None


# ---------------------------------------------------------------- how many tokens to draft

class KPolicy:
    """Drafts per round: fixed, or ("auto") the K that maximizes expected tokens per second.

    Per bucket and draft position i it keeps decayed counts of how often draft i was accepted
    once drafts 1..i-1 were: a_i. A round of K drafts then yields E = 1 + a_1 + a_1 a_2 + ...
    tokens (acceptance comes in runs: a_i grows with i, which a single rate would miss). Its
    cost is K draft steps plus one target pass over K+1 tokens, both timed as generation goes
    (how much more a pass over several tokens costs than over one depends on the device).
    K = 0, plain decoding, wins when drafts are not accepted often enough; while a bucket sits at
    0 its counts fade towards the prior, so it is tried again now and then and can recover.
    """

    # Pseudo-counts added to the first position's (accepted, tried): hopeful (5 in 6), so that a
    # drafter gets tried, and light, so that a few rounds overrule it. Each later position's prior
    # is the estimate for the one before it: a position seldom reached is not assumed better.
    PRIOR = (1.0, 1.2)
    DECAY = 0.95  # per round of the bucket: recent text counts more
    FADE = 0.97  # per round a bucket is not drafted for

    def __init__(self, k: int | str = "auto", k_max: int = K_MAX):
        self.auto = k == "auto"
        self.k_fixed = 0 if self.auto else int(k)
        self.k_max = k_max if self.auto else self.k_fixed
        self.counts: dict[int, list[list[float]]] = {}  # bucket -> per position [accepted, tried]
        self.verify_s: dict[int, float] = {}  # tokens per target pass -> seconds (EMA)
        self.draft_s = 0.0  # seconds per drafted token (EMA)

    def acceptance(self, bucket: int, n: int) -> list[float]:
        """For drafts 0..n-1: the chance each is accepted when the drafts before it were."""
        c = self.counts.get(bucket) or [[0.0, 0.0]] * n
        out, prior = [], self.PRIOR[0] / self.PRIOR[1]
        for acc, tried in c[:n]:
            prior = (acc + prior * self.PRIOR[1]) / (tried + self.PRIOR[1])
            out.append(prior)
        return out

    def _verify_cost(self, n: int) -> float:
        """Seconds of a target pass over n tokens: timed, or interpolated between the nearest
        timed sizes, or (beyond the largest) as much as it. Optimistic on purpose: an untimed
        size gets tried and timed; the cost is not linear in n (on a CPU a pass over 2 tokens
        can cost as much as one over 5), so no slope is assumed."""
        if n in self.verify_s:
            return self.verify_s[n]
        below = max(m for m in self.verify_s if m < n)  # 1 is always timed first
        above = min((m for m in self.verify_s if m > n), default=None)
        if above is None:
            return self.verify_s[below]
        f = (n - below) / (above - below)
        return (1 - f) * self.verify_s[below] + f * self.verify_s[above]

    def choose(self, bucket: int, limit: int) -> int:
        limit = min(limit, self.k_max)
        if not self.auto or limit <= 0:
            return max(0, min(self.k_fixed, limit))
        if 1 not in self.verify_s:
            return 0  # time a plain step first: every choice is measured against it
        if not self.draft_s:
            return min(4, limit)  # a first round, to time the drafter
        best_k, best_rate = 0, 1.0 / self.verify_s[1]
        expected, run = 1.0, 1.0
        for k, a in enumerate(self.acceptance(bucket, limit), start=1):
            run *= a
            expected += run
            rate = expected / (k * self.draft_s + self._verify_cost(k + 1))
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0 and bucket in self.counts:
            self.counts[bucket] = [[a * self.FADE, t * self.FADE] for a, t in self.counts[bucket]]
        return best_k

    def record(self, bucket: int, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        n = drafted + 1
        old = self.verify_s.get(n)
        self.verify_s[n] = verify_s if old is None else 0.8 * old + 0.2 * verify_s
        if not drafted:
            return
        per = draft_s / drafted
        self.draft_s = per if self.draft_s == 0 else 0.8 * self.draft_s + 0.2 * per
        c = self.counts.setdefault(bucket, [[0.0, 0.0] for _ in range(max(self.k_max, 1))])
        for i, pos in enumerate(c):
            pos[0] *= self.DECAY
            pos[1] *= self.DECAY
            if i <= accepted and i < drafted:  # tried: the first `accepted` and the one rejected
                pos[1] += 1
                pos[0] += i < accepted


# ---------------------------------------------------------------- verification

def acceptance_probability(p_x: float, q_x: float) -> float:
    """Rejection sampling's rule: keep a draft drawn from q with probability min(1, p/q)."""
    return min(1.0, p_x / q_x) if q_x > 0 else 1.0


def verify(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, params: SamplingParams,
           gen: torch.Generator, seen: torch.Tensor | None) -> tuple[int, int]:
    """logits [K+1, V]: the target after each prefix of [t, d1..dK]. Returns (how many drafts are
    kept, the target's next token after them)."""
    k = len(drafts)
    if seen is not None:  # each position sees the drafts before it, as plain decoding would
        logits = torch.stack([apply_repetition_penalty(logits[i], extend_seen(seen, drafts[:i]), params.repetition_penalty)
                              for i in range(k + 1)])
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()
        n = 0
        while n < k and best[n] == drafts[n]:
            n += 1
        return n, best[n]
    p = probabilities(logits, params).cpu()
    u = torch.rand(k, generator=gen).tolist()
    for i, x in enumerate(drafts):
        qi = q[i].cpu() if q is not None else None
        q_x = float(qi[x]) if qi is not None else 1.0
        if u[i] < acceptance_probability(float(p[i, x]), q_x):
            continue
        if qi is not None:
            residual = (p[i] - qi).clamp_(min=0)
        else:  # q is a point mass on x
            residual = p[i].clone()
            residual[x] = 0
        if residual.sum() <= 0:  # p == q up to rounding: rejection was a fluke of float error
            residual = p[i]
        return i, int(torch.multinomial(residual, 1, generator=gen))
    return k, int(torch.multinomial(p[k], 1, generator=gen))


# ---------------------------------------------------------------- the decode loop

@dataclass
class Draft:
    """A round's guesses: the tokens, the distributions they were drawn from (None: point masses
    or greedy), the K policy's bucket, and when drafting ended (to time the verifying pass)."""
    tokens: list[int]
    q: torch.Tensor | None = None
    bucket: int | None = None
    seconds: float = 0.0
    done_at: float = 0.0


class Speculator:
    """The generation loop (generate.Session) asks it, each step: propose() drafts after the
    context; the loop runs the pending token and the drafts in one target pass; verify() says how
    many drafts stand and the target's next token; accept() records the round."""

    def __init__(self, drafter: Drafter, k: int | str = "auto"):
        if k != "auto" and (not isinstance(k, int) or k < 1):
            raise InvalidValue("draft_k", k, "must be a positive integer or auto")
        self.drafter, self.k = drafter, k
        self.policy = KPolicy(k)  # kept across generations: what it learned about costs carries over
        self.stats: dict = self.new_stats()

    def new_stats(self) -> dict:
        """Counters for one generation (the loop attaches them to its result)."""
        self.stats = {"drafter": self.drafter.name, "k": self.k, "rounds": 0, "drafted": 0, "accepted": 0,
                      "acceptance_rate": 0.0, "mean_accepted": 0.0}
        return self.stats

    def start(self, ids: list[int], kv) -> None:
        """The target's cache `kv` holds the prompt `ids`; drafting begins."""
        self.drafter.start(ids, kv)

    def propose(self, ctx: list[int], room: int, sampler, seen: torch.Tensor | None) -> Draft:
        """Drafts to follow ctx (the context and the pending token): at most `room`."""
        bucket = self.drafter.bucket(ctx)
        k = self.policy.choose(bucket, min(room, self.drafter.capacity() - len(ctx) - 1)) if bucket is not None else 0
        t0 = time.perf_counter()
        tokens, q = self.drafter.propose(ctx, k, sampler.params, sampler.generator, seen) if k > 0 else ([], None)
        t1 = time.perf_counter()
        return Draft(tokens, q, bucket, t1 - t0, t1)

    def verify(self, draft: Draft, logits: torch.Tensor, sampler, seen: torch.Tensor | None) -> tuple[int, int]:
        """logits [len(draft)+1, V] from the target pass; (drafts kept, the target's next token)."""
        return verify(logits, draft.tokens, draft.q, sampler.params, sampler.generator, seen)

    def accept(self, draft: Draft, n: int) -> None:
        """Record a round: the K policy learns acceptance and costs, the counters add up."""
        self.policy.record(draft.bucket, len(draft.tokens), n, draft.seconds, time.perf_counter() - draft.done_at)
        if draft.tokens:
            st = self.stats
            st["rounds"] += 1
            st["drafted"] += len(draft.tokens)
            st["accepted"] += n
            st["acceptance_rate"] = round(st["accepted"] / st["drafted"], 4)
            st["mean_accepted"] = round(st["accepted"] / st["rounds"], 3)


# ---------------------------------------------------------------- `brisk bench --draft`

BENCH_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def bench_rows(llm, speculator: Speculator, n_gen: int, reps: int) -> list:
    """Greedy generation of up to n_gen tokens from one chat prompt, plain then speculative:
    speculation's speed depends on the text, so both rows decode real text (the tg row of
    `brisk bench` feeds back argmaxes of random context)."""
    import statistics

    from .benchmark import BenchRow, peak_memory
    from .generate import Session
    from .sampling import GREEDY

    ids = llm.prompt_ids(BENCH_PROMPT)
    rows = []
    for sp in (None, speculator):
        s = Session(llm, speculator=sp)
        results = []
        for i in range(reps + 1):  # the first run warms up (and lets --draft-k auto learn the costs)
            list(s.stream(ids, GREEDY, n_gen))
            results.append(s.last)
        results = results[1:]
        speeds = [r.decode_tps for r in results]
        med = statistics.median(speeds)
        test, acc = f"tg{n_gen} text", None
        if sp is not None:
            drafted = sum(r.spec["drafted"] for r in results)
            acc = sum(r.spec["accepted"] for r in results) / drafted if drafted else 0.0
            test = f"tg{n_gen} {sp.drafter.name} K={sp.k}, {acc:.0%} acc."
        rows.append(BenchRow(model=llm.name, device=str(llm.device), dtype=str(llm.dtype).removeprefix("torch."),
                             quant=llm.quantization,
                             test=test, tok_s=med, spread=(max(speeds) - min(speeds)) / 2,
                             ttft_s=statistics.median(r.ttft_s for r in results),
                             model_bytes=llm.load_info.param_bytes, gb_s=llm.load_info.param_bytes * med / 1e9,
                             peak_mem_bytes=peak_memory(llm.device), acceptance=acc))
    return rows


# ---------------------------------------------------------------- building one from a --draft spec

SELF_METHODS = {"self:int8": "int8", "self:int4": "int4"}


def parse_k(value: str | int | None) -> int | str:
    if value is None or value == "auto":
        return "auto"
    try:
        k = int(value)
    except (TypeError, ValueError):
        raise InvalidValue("draft_k", value, "must be a positive integer or auto") from None
    if k < 1:
        raise InvalidValue("draft_k", value, "must be a positive integer or auto")
    return k


def make_speculator(llm, draft: str, k: str | int | None = "auto") -> Speculator:
    """`draft`: "ngram", "self:int8", "self:int4", or a model brisk can load (path, hub id, GGUF)."""
    k = parse_k(k)
    if draft == "ngram":
        return Speculator(NgramDrafter(), k)
    if draft in SELF_METHODS:
        if llm.quantization != "none":
            # Its layers are already int4/int8/4-bit: a copy at the same or more bits drafts no
            # faster than the model verifies, and brisk has no fast kernel below 4 bits.
            raise BriskError(f"--draft {draft}: {llm.name} is already quantized ({llm.quantization}), so a "
                             "quantized copy of it would not be faster; load it with --quantize none for a "
                             "self-draft, or use --draft ngram or a smaller model")
        return Speculator(ModelDrafter(quantized_copy(llm.model, SELF_METHODS[draft], llm.ctx),
                                       llm.ctx, llm.config.vocab_size, name=draft, share_cache=True), k)
    if draft.startswith("self:"):
        raise InvalidValue("draft", draft, "", template=f"{{option}} {draft}: use self:int8 or self:int4")
    from .llm import LLM

    other = LLM.load(draft, device=str(llm.device), dtype=str(llm.dtype).removeprefix("torch."), ctx=llm.ctx)
    check_pair(llm, other)
    return Speculator(ModelDrafter(other.model, other.ctx, llm.config.vocab_size, name=other.name), k)


def check_pair(target, draft) -> None:
    """Refuse a draft whose tokenizer differs from the target's; warn when it is not smaller."""
    diff = target.tokenizer.describe_difference(draft.tokenizer)
    if diff:
        raise BriskError(f"draft {draft.name} cannot draft for {target.name}: their tokenizers differ ({diff})")
    t, d = _n_params(target.model), _n_params(draft.model)
    if d >= t:
        warnings.warn(f"draft {draft.name} ({d / 1e6:.3g}M parameters) is not smaller than {target.name} "
                      f"({t / 1e6:.3g}M): speculative decoding will likely be slower than plain decoding",
                      stacklevel=3)


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def quantized_copy(model, method: str, max_len: int):
    """A second Transformer sharing the target's embeddings and norms, with quantized linears.

    Built on the meta device and handed the target's tensors (no float copy is made); then each
    linear, the output head included (it is a fifth of a small model's bytes), is replaced by its
    quantized version.
    """
    from ..quant.linear import quantize_model
    from .kernel_passes import apply_device_kernels
    from .model import Transformer

    with torch.device("meta"):
        draft = Transformer(model.cfg)
    draft.load_state_dict(model.state_dict(), assign=True)
    draft.rope_factors = model.rope_factors
    draft.setup_rope(max_len, model.model.norm.weight.device)
    quantize_model(draft, method, head=True)
    apply_device_kernels(draft, draft.model.norm.weight.device)
    return draft.eval().requires_grad_(False)
