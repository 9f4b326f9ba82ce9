"""`brisk distill`: train draft heads (core/spec/heads*.py) for a model by self-distillation.

1. Text: the model answers prompts (brisk's built-in set, core/distill_prompts.txt, or --data)
   with its own chat template, sampled at a moderate temperature, many at once through the
   batching engine. The frozen model's passes that generate an answer also give, at each of its
   positions, the final-norm hidden state and the model's own next-token distribution (caught
   at the output layer's input and output); the hidden states (float16) and each distribution's
   top `top_m` probabilities are kept. The model is loaded as it will be drafted for (the default
   load: a GGUF's weights stay quantized), so the heads learn the distributions they will be
   checked against.
2. Training: only the heads. Head k at position i reads hidden state h_i and the token i+1 (the
   pending token, when drafting) and is trained towards the model's distribution at position
   i+1+k (for the token i+2+k), KL(model || head) over a draft
   vocabulary (the tokens holding nearly all of the model's probability mass on the training
   text; reading out all 49k rows of SmolLM2's output layer would cost 6x more per step for
   tokens the model almost never picks). Prompts are split into training and held-out ones;
   progress shows the loss and each head's top-1 agreement with the model on held-out text.
3. The tree: per-head top-r accuracies on the held-out text give Medusa's greedy sparse tree;
   then (unless measure=False) a target pass is timed over T = 1..64 tree tokens and greedy
   decoding of held-out prompts is replayed against the tree to measure tokens per pass, and
   the tree size with the best measured tokens per second is stored as the default.

Resume: everything goes to OUT.partial/: the generated data in chunks, and every
`checkpoint_every` steps the heads, the optimizer state and the step (the batch order is a
function of the seed and the step, so nothing else is needed). Rerunning with the same
arguments resumes and gives byte-identical heads; other arguments start over (data generated
with the same data arguments is kept). OUT appears whole at the end (a temporary folder renamed).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from .distill_options import DistillOptions, DistillSummary, checked_out, load_prompts  # noqa: F401 (load_prompts: also from here)
from .errors import BriskError, FileError
from .files import write_text_atomic
from .spec import heads_file, heads_net, heads_tree
from .spec.heads import HeadsDrafter

_VERSION = 1  # bump when the same arguments would give other output: partial runs then restart
CHUNK_SAMPLES = 32  # generated answers saved together (what an interruption can lose)
PASS_SIZES = (1, 2, 4, 8, 16, 32, 64)  # tree sizes (incl. the pending token) whose pass is timed
BUDGETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)  # tree sizes replayed
RANKS = 10  # choices per head whose accuracy is measured (the tree's widest fan-out)

Report = Callable[..., None]


# ---------------------------------------------------------------- prompts

def prompt_ids(llm, prompt) -> list[int]:
    tok = llm.tokenizer
    if isinstance(prompt, str):
        return llm.prompt_ids(prompt)
    if not tok.has_chat_template:
        raise BriskError(f"{llm.name} has no chat template: give prompts as text, not messages")
    return tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=True), add_special=False)


def split_prompts(n: int, holdout: int) -> tuple[list[int], list[int]]:
    """(training, held-out) prompt indices: every holdout-th prompt is held out (the last one
    when there are fewer than holdout)."""
    held = [i for i in range(n) if i % holdout == holdout - 1] or [n - 1]
    return [i for i in range(n) if i not in set(held)], held


def sample_plan(n_prompts: int, opts: DistillOptions) -> list[tuple[int, bool]]:
    """Sample s -> (its prompt, held out?): the first ceil(samples / holdout) answer held-out
    prompts in turn, the rest the training prompts in turn."""
    train, held = split_prompts(n_prompts, opts.holdout)
    n_held = min(opts.samples - 1, max(1, math.ceil(opts.samples / opts.holdout)))
    return [(held[s % len(held)], True) if s < n_held else (train[(s - n_held) % len(train)], False)
            for s in range(opts.samples)]


# ---------------------------------------------------------------- the frozen model's view

@torch.inference_mode()
def hidden_states(model, ids: list[int], device) -> torch.Tensor:
    """Final-norm hidden states [len(ids), dim] (the output layer's input) in one causal pass,
    in chunks of 512 positions."""
    from .kv import ContiguousKV

    kv = ContiguousKV.for_model(model, len(ids))
    out = []
    for s in range(0, len(ids), 512):
        tok = torch.tensor([ids[s:s + 512]], device=device)
        kv.begin(s, tok.shape[1], None)
        out.append(model.model.norm(model.blocks(model.embed(tok), s, kv, None))[0])
    return torch.cat(out)


def top_probs(logits: torch.Tensor, m: int, softcap: float | None):
    """The m most likely next tokens and their probabilities, per row of logits [R, V]."""
    logits = logits.float()
    if softcap:  # as the model's own head does (Gemma)
        logits = torch.tanh(logits / softcap) * softcap
    return torch.softmax(logits, dim=-1).topk(min(m, logits.shape[-1]), dim=-1)


class _Tap:
    """A forward hook on the output layer while the engine generates: its input is the final-norm
    hidden state of each row the engine wants logits for, its output their logits, row r being
    the r-th event of the step. So the generating passes give the training features, and no
    second pass over the text is needed (it cost as much as a third of the generation)."""

    def __init__(self, model):
        self.rows = None
        self.handle = model.lm_head.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        self.rows = (args[0].reshape(-1, args[0].shape[-1]), out.reshape(-1, out.shape[-1]))

    def close(self):
        self.handle.remove()


class Data:
    """Positions of many sequences, concatenated: hidden [N, dim] float16, top_ids/top_p [N, M],
    next_token [N]; left[n]: how many positions of the same sequence follow n (head k needs k+1).
    parts: per sequence its features from position "start" on (the prompt's last token), and
    "tokens" (the whole sequence, prompt included)."""

    def __init__(self, parts: list[dict[str, torch.Tensor]]):
        self.hidden = torch.cat([p["hidden"] for p in parts])
        self.top_ids = torch.cat([p["top_ids"] for p in parts]).long()
        self.top_p = torch.cat([p["top_p"] for p in parts])
        self.left = torch.cat([torch.arange(len(p["hidden"]) - 1, -1, -1) for p in parts])
        # the token after each position (what the heads see with its hidden state); the last
        # position of a sequence may have none (it ended there), and trains no head anyway
        nxt = []
        for p in parts:
            n, start = len(p["hidden"]), p["start"]
            after = p["tokens"][start + 1:start + 1 + n]
            nxt.append(torch.tensor(after + [0] * (n - len(after)), dtype=torch.long))
        self.next_token = torch.cat(nxt)
        self.n = len(self.hidden)


# ---------------------------------------------------------------- partial runs

def _model_ident(ckpt) -> list:
    path = Path(ckpt.path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json", ".gguf"))
    return [str(path.resolve()), [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]]


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


class Partial:
    """OUT.partial/: manifest.json {data_key, chunks, train_key}, data/chunk_*.safetensors,
    train.safetensors (the last checkpoint) and output/ (the finished folder, just before it is
    renamed to OUT)."""

    def __init__(self, out: Path):
        self.dir = out.with_name(out.name + ".partial")
        self.manifest = self.dir / "manifest.json"

    def read(self) -> dict | None:
        try:
            info = json.loads(self.manifest.read_text())
            return info if isinstance(info, dict) else None
        except (OSError, ValueError):
            return None

    def open(self, data_key: str, report: Report) -> dict:
        """Keep a partial run whose data matches (resume), or start a clean one."""
        info = self.read()
        if self.dir.exists() and info is None and (not self.dir.is_dir() or any(self.dir.iterdir())):
            raise FileError("exists and is not a brisk partial run; remove it", self.dir)
        if info is not None and info.get("data_key") == data_key:
            return info
        if info is not None and info.get("chunks"):
            report("restart", reason="the unfinished run there used other data arguments or another model")
        shutil.rmtree(self.dir, ignore_errors=True)
        (self.dir / "data").mkdir(parents=True)
        info = {"data_key": data_key, "chunks": [], "train_key": None}
        self.write(info)
        return info

    def write(self, info: dict) -> None:
        write_text_atomic(self.manifest, json.dumps(info))

    def save_chunk(self, info: dict, index: list[int], parts: list[dict]) -> None:
        from safetensors.torch import save_file

        name = f"chunk_{len(info['chunks']):05d}.safetensors"
        tensors = {"index": torch.tensor(index, dtype=torch.int64),
                   "positions": torch.tensor([len(p["hidden"]) for p in parts], dtype=torch.int64),
                   "starts": torch.tensor([p["start"] for p in parts], dtype=torch.int64),
                   "tokens": torch.tensor([t for p in parts for t in p["tokens"]], dtype=torch.int64),
                   "token_counts": torch.tensor([len(p["tokens"]) for p in parts], dtype=torch.int64)}
        for k in ("hidden", "top_ids", "top_p"):
            tensors[k] = torch.cat([p[k] for p in parts]).contiguous()
        tmp = self.dir / "data" / (name + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, self.dir / "data" / name)
        info["chunks"].append(name)
        self.write(info)

    def load_chunks(self, info: dict) -> dict[int, dict]:
        """sample index -> its features (and tokens)."""
        from safetensors.torch import load_file

        out = {}
        for name in info["chunks"]:
            t = load_file(str(self.dir / "data" / name))
            pos, cnt, starts = t["positions"].tolist(), t["token_counts"].tolist(), t["starts"].tolist()
            p0 = c0 = 0
            for i, s in enumerate(t["index"].tolist()):
                out[s] = {k: t[k][p0:p0 + pos[i]] for k in ("hidden", "top_ids", "top_p")}
                out[s]["tokens"] = t["tokens"][c0:c0 + cnt[i]].tolist()
                out[s]["start"] = starts[i]
                p0, c0 = p0 + pos[i], c0 + cnt[i]
        return out

    @property
    def checkpoint(self) -> Path:
        return self.dir / "train.safetensors"


# ---------------------------------------------------------------- 1. the data

def generate_data(llm, prompts: list, plan: list[tuple[int, bool]], opts: DistillOptions, partial: Partial,
                  info: dict, report: Report) -> dict[int, dict]:
    """Every planned sample's features: those a previous run saved, the rest generated now."""
    from .batching import Engine
    from .batching.scheduler import Request
    from .sampling import SamplingParams

    done = partial.load_chunks(info)
    todo = [s for s in range(len(plan)) if s not in done]
    report("generate_start", total=len(plan), done=len(done))
    if not todo:
        return done
    ids = {}
    for s in todo:
        p = prompt_ids(llm, prompts[plan[s][0]])
        if len(p) + 2 > llm.ctx:
            raise BriskError(f"prompt {plan[s][0] + 1} is {len(p)} tokens, more than the context ({llm.ctx}) allows")
        ids[s] = p
    # eager steps: the tap is a forward hook, which a CUDA graph's replay would skip
    engine = Engine(llm, max_batch=opts.concurrency, fixed_decode=False)
    which, rows = {}, {}
    for s in todo:  # each answer's seed is its own: the text does not depend on what ran beside it
        params = SamplingParams(temperature=opts.temperature, top_k=0, top_p=opts.top_p, min_p=0.0,
                                seed=opts.seed * 1_000_003 + s, stop_loops=True)
        seq = engine.add(Request(ids[s], params, max_tokens=opts.max_tokens))
        which[id(seq)], rows[id(seq)] = s, []
    finished: list[tuple[int, dict]] = []
    tokens = 0

    def flush():
        finished.sort(key=lambda x: x[0])
        partial.save_chunk(info, [s for s, _ in finished], [f for _, f in finished])
        done.update(finished)
        finished.clear()

    tap = _Tap(llm.model)
    softcap = llm.config.final_softcap
    try:
        while engine.has_work():
            tap.rows = None
            events = engine.step()
            if not events:
                continue
            hidden, logits = tap.rows
            if len(hidden) != len(events):
                raise RuntimeError(f"engine step: {len(events)} sequences moved but {len(hidden)} logit rows")
            top = top_probs(logits, opts.top_m, softcap)
            hidden = hidden.float().clamp(-65504, 65504).half().cpu()
            top_ids, top_p = top.indices.int().cpu(), top.values.cpu()
            for r, (seq, _, ended) in enumerate(events):
                rows[id(seq)].append((hidden[r], top_ids[r], top_p[r]))
                if not ended:
                    continue
                # rows: positions P-1 (the prompt's last token) on, one per sampled token
                got = rows.pop(id(seq))
                feats = {k: torch.stack([g[i] for g in got]) for i, k in enumerate(("hidden", "top_ids", "top_p"))}
                feats.update(tokens=list(seq.tokens), start=len(seq.request.prompt_ids) - 1)
                finished.append((which[id(seq)], feats))
                tokens += len(seq.tokens) - len(seq.request.prompt_ids)
                report("generated", done=len(done) + len(finished), total=len(plan), tokens=tokens)
            if len(finished) >= CHUNK_SAMPLES:
                flush()
    finally:
        tap.close()
    if finished:
        flush()
    return done


def draft_vocabulary(data: Data, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` tokens with the most model probability over the training positions (all of
    them when size is 0 or covers the vocabulary), as sorted ids."""
    if size == 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    mass.index_add_(0, data.top_ids.reshape(-1), data.top_p.reshape(-1).double())
    # ties (tokens never seen) are broken by id: a stable sort keeps the order deterministic
    order = torch.sort(-mass, stable=True).indices[:size]
    return order.sort().values


# ---------------------------------------------------------------- 2. training

class Trainer:
    """The heads, their optimizer and the frozen output-layer rows; one step = one batch."""

    def __init__(self, llm, vocab: torch.Tensor, opts: DistillOptions):
        self.opts = opts
        self.K = opts.heads
        torch.manual_seed(opts.seed)  # nothing random in the heads' init (zeros); kept for clarity
        self.dev = llm.device  # data stays on the CPU; each batch moves to the model's device
        self.heads = heads_net.DraftHeads(opts.heads, llm.config.dim).to(self.dev)
        self.rows = heads_net.output_rows(llm.model, vocab, torch.float32)  # frozen, float
        self.softcap = llm.config.final_softcap
        self.model = llm.model
        self.vocab = vocab
        self.to_sub = torch.full((llm.config.vocab_size,), -1, dtype=torch.long)
        self.to_sub[vocab] = torch.arange(len(vocab))
        self.opt = torch.optim.AdamW(self.heads.parameters(), lr=opts.lr, weight_decay=0.0)
        self.warmup = max(1, min(100, opts.steps // 10))

    def lr_at(self, step: int) -> float:
        o = self.opts
        if step < self.warmup:
            return o.lr * (step + 1) / self.warmup
        f = (step - self.warmup) / max(1, o.steps - self.warmup)
        return o.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * f)))

    def batch(self, data: Data, step: int) -> torch.Tensor:
        """The positions of step `step`: epoch e's permutation (seeded by seed and e), cut in
        batches; a function of (seed, step) only, so a resumed run sees the same batches."""
        per_epoch = max(1, data.n // self.opts.batch)
        epoch, j = divmod(step, per_epoch)
        g = torch.Generator().manual_seed(self.opts.seed * 7919 + epoch)
        perm = torch.randperm(data.n, generator=g)
        return perm[j * self.opts.batch:(j + 1) * self.opts.batch]

    @torch.no_grad()
    def inputs(self, data: Data, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads' inputs at positions idx: hidden states and the next tokens' embeddings."""
        return data.hidden[idx].to(self.dev).float(), self.model.embed(data.next_token[idx].to(self.dev)).float()

    def targets(self, data: Data, idx: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Head k at positions idx: (valid rows, the target's sub-vocabulary ids [n, M], its
        probabilities [n, M] renormalized over the draft vocabulary)."""
        valid = data.left[idx] >= k + 1
        t = (idx + 1 + k).clamp(max=data.n - 1)
        sub = self.to_sub[data.top_ids[t]]
        p = data.top_p[t] * (sub >= 0)
        mass = p.sum(-1, keepdim=True)
        valid &= mass[:, 0] > 0
        return valid.to(self.dev), sub.clamp(min=0).to(self.dev), (p / mass.clamp(min=1e-30)).to(self.dev)

    def losses(self, data: Data, idx: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        """Sum over heads of the mean cross-entropy to the model's distribution, and each head's
        mean KL (cross-entropy minus the target's entropy) for display."""
        logq = torch.log_softmax(heads_net.head_logits(self.heads, self.rows, *self.inputs(data, idx), self.softcap),
                                 -1)
        total, kls = 0.0, []
        for k in range(self.K):
            valid, sub, p = self.targets(data, idx, k)
            if not valid.any():
                kls.append(0.0)
                continue
            ce = -(p * logq[k].gather(-1, sub)).sum(-1)[valid]
            total = total + ce.mean()
            with torch.no_grad():
                ent = -(p * p.clamp(min=1e-30).log()).sum(-1)[valid]
                kls.append(float((ce - ent).mean()))
        return total, kls

    def step(self, data: Data, step: int) -> list[float]:
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(step)
        loss, kls = self.losses(data, self.batch(data, step))
        self.opt.zero_grad(set_to_none=True)
        if torch.is_tensor(loss):
            loss.backward()
            self.opt.step()
        return kls

    @torch.no_grad()
    def evaluate(self, data: Data, limit: int | None = None, ranks: int = RANKS) -> dict:
        """On (the first `limit` positions of) held-out data: per head, the mean KL and how often
        the model's own top-1 token is the head's r-th choice (r < ranks)."""
        n = data.n if limit is None else min(limit, data.n)
        hits = torch.zeros(self.K, ranks, dtype=torch.float64)
        counts = torch.zeros(self.K, dtype=torch.float64)
        kl_sum = torch.zeros(self.K, dtype=torch.float64)
        ranks = min(ranks, len(self.vocab))
        for s in range(0, n, 1024):
            idx = torch.arange(s, min(n, s + 1024))
            logits = heads_net.head_logits(self.heads, self.rows, *self.inputs(data, idx), self.softcap)
            logq = torch.log_softmax(logits, -1)
            best = self.vocab[logits.topk(ranks, dim=-1).indices.cpu()].to(self.dev)  # [K, n, ranks] token ids
            for k in range(self.K):
                valid, sub, p = self.targets(data, idx, k)
                if not valid.any():
                    continue
                want = data.top_ids[(idx + 1 + k).clamp(max=data.n - 1), 0].to(self.dev)  # the model's top-1 there
                hits[k] += (best[k] == want[:, None])[valid].double().sum(0).cpu()
                counts[k] += int(valid.sum())
                ce = -(p * logq[k].gather(-1, sub)).sum(-1)
                ent = -(p * p.clamp(min=1e-30).log()).sum(-1)
                kl_sum[k] += float((ce - ent)[valid].double().sum())
        acc = (hits / counts.clamp(min=1)[:, None])
        return {"accuracy": [[round(float(a), 5) for a in row] + [0.0] * (RANKS - ranks) for row in acc],
                "top1": [round(float(a), 4) for a in acc[:, 0]],
                "top5": [round(float(a), 4) for a in acc[:, :5].sum(1)],
                "kl": [round(float(v), 4) for v in kl_sum / counts.clamp(min=1)],
                "positions": int(counts[0])}

    # ------------------------------------------------------------ checkpoints
    def save(self, path: Path, step: int, key: str, extra: dict) -> None:
        from safetensors.torch import save_file

        tensors = {k: v.detach().cpu() for k, v in self.heads.state_dict().items()}
        for i, st in self.opt.state_dict()["state"].items():
            for name, t in st.items():
                tensors[f"opt.{i}.{name}"] = (t.reshape(-1) if t.ndim == 0 else t).cpu()
        meta = {"key": key, "step": str(step), "extra": json.dumps(extra)}
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        os.replace(tmp, path)

    def load(self, path: Path, key: str) -> tuple[int, dict] | None:
        """The step and extra info a checkpoint with this key holds (restoring heads and optimizer),
        or None when there is no usable checkpoint."""
        from safetensors import safe_open

        if not path.is_file():
            return None
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                if meta.get("key") != key:
                    return None
                t = {k: f.get_tensor(k) for k in f.keys()}
        except Exception:  # a torn or foreign file: start over rather than fail
            return None
        self.heads.load_state_dict({k: t[k] for k in self.heads.state_dict()})
        sd = self.opt.state_dict()
        state = {}
        for i in range(len(sd["param_groups"][0]["params"])):
            names = {k.split(".", 2)[2]: v for k, v in t.items() if k.startswith(f"opt.{i}.")}
            if names:
                state[i] = {k: (v.reshape(()) if k == "step" else v.to(self.dev)) for k, v in names.items()}
        self.opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
        return int(meta["step"]), json.loads(meta.get("extra", "{}"))


def train(trainer: Trainer, data: Data, held: Data, partial: Partial, key: str, opts: DistillOptions,
          report: Report, summary: DistillSummary) -> dict:
    """Run (or resume) the steps; returns the last held-out evaluation's summary."""
    from .device import torch_gets_the_threads

    start, extra = trainer.load(partial.checkpoint, key) or (0, {})
    summary.resumed_step = start
    if start:
        report("resume", step=start, total=opts.steps)
    report("train_start", total=opts.steps, done=start, evaluation=extra.get("eval"))
    t0 = time.perf_counter()
    recent: list[list[float]] = []
    with torch_gets_the_threads():
        for step in range(start, opts.steps):
            recent.append(trainer.step(data, step))
            report("step", step=step + 1, total=opts.steps, loss=sum(recent[-1]) / trainer.K)
            if (step + 1) % opts.checkpoint_every == 0 or step + 1 == opts.steps:
                ev = trainer.evaluate(held, limit=4096)
                loss = sum(map(sum, recent)) / (len(recent) * trainer.K)
                extra = {"eval": ev, "loss": loss, "seconds": extra.get("seconds", 0.0) + time.perf_counter() - t0}
                t0 = time.perf_counter()
                recent = []
                trainer.save(partial.checkpoint, step + 1, key, extra)
                report("checkpoint", step=step + 1, total=opts.steps, loss=loss, evaluation=ev)
    summary.loss = extra.get("loss", 0.0)
    summary.train_seconds = extra.get("seconds", 0.0)
    return extra


# ---------------------------------------------------------------- 3. the tree

@torch.inference_mode()
def pass_costs(llm, nodes: list[tuple[int, ...]], sizes=PASS_SIZES, reps: int = 5) -> dict[int, float]:
    """Seconds of one target pass over T tokens (the pending token and T-1 tree nodes, with the
    tree's attention mask) after a 128-token context, median of `reps`."""
    from .kv import ContiguousKV
    from .kv.base import ancestor_mask

    model, dev = llm.model, llm.device
    ctx = 128
    kv = ContiguousKV.for_model(model, ctx + max(sizes) + 1)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, llm.config.vocab_size, (1, n), generator=g).to(dev)  # noqa: E731
    model(rand(ctx), 0, kv)
    out = {}
    for T in sizes:
        if T - 1 > len(nodes):
            break
        tree = None if T == 1 else ancestor_mask(heads_tree.tree_parents(nodes[:T - 1]), dev)
        toks = rand(T)
        times = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            model(toks, ctx, kv, tree=tree)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[T] = sorted(times[1:])[len(times[1:]) // 2]
    return out


def interpolate(costs: dict[int, float], T: int) -> float:
    if T in costs:
        return costs[T]
    below = max(t for t in costs if t < T)
    above = min((t for t in costs if t > T), default=None)
    if above is None:
        return costs[below] * T / below  # beyond the largest timed size: proportional
    f = (T - below) / (above - below)
    return (1 - f) * costs[below] + f * costs[above]


@torch.inference_mode()
def replay(llm, drafter: HeadsDrafter, nodes: list[tuple[int, ...]], sequences: list[tuple[list[int], int]],
           budgets=BUDGETS) -> dict[int, float]:
    """Tokens per verifying pass that greedy decoding with the tree's first b nodes would get, for
    each budget b: greedy answers (sequences: (ids, prompt length)) are replayed round by round, a
    node kept when its token is the greedy answer's at its depth (what greedy tree verification
    keeps), the heads reading the hidden state of the row that chose the pending token and the
    pending token itself."""
    budgets = [b for b in budgets if b <= len(nodes)]
    ranks = 1 + max(r for n in nodes for r in n)
    produced = {b: 0 for b in budgets}
    passes = {b: 0 for b in budgets}
    for ids, P in sequences:
        if len(ids) <= P:
            continue
        H = hidden_states(llm.model, ids, llm.device)[P - 1:-1]  # row j - 1 chose token j, for j = P..
        logits = drafter.logits(H, ids[P:])
        top = drafter.vocab[logits.topk(ranks, -1).indices].permute(1, 0, 2).tolist()  # [j - P][head][rank]
        for b in budgets:
            children: dict[tuple, list[tuple]] = {}
            for n in nodes[:b]:
                children.setdefault(n[:-1], []).append(n)
            j = P  # the pending token's index
            while j < len(ids):
                guess, node, d = top[j - P], (), 0
                while j + d + 1 < len(ids):
                    want = ids[j + d + 1]
                    nxt = next((c for c in children.get(node, ()) if guess[d][c[-1]] == want), None)
                    if nxt is None:
                        break
                    node, d = nxt, d + 1
                produced[b] += d + 1
                passes[b] += 1
                j += d + 1
    return {b: round(produced[b] / max(1, passes[b]), 4) for b in budgets}


def draft_seconds(drafter: HeadsDrafter, reps: int = 50) -> float:
    """The drafter's work for one round (a hidden state to the tree's tokens), median of reps."""
    h = torch.randn(drafter.heads.weight.shape[-1], generator=torch.Generator().manual_seed(0))
    h = h.to(device=drafter.vocab.device, dtype=drafter.dtype)
    times = []
    for _ in range(reps):
        drafter.hidden = h
        t = time.perf_counter()
        drafter.propose_tree([0], len(drafter.nodes))
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2]


def greedy_answers(llm, prompts: list, n_tokens: int) -> list[tuple[list[int], int]]:
    from .batching import Engine
    from .batching.scheduler import Request
    from .sampling import GREEDY

    reqs = [Request(prompt_ids(llm, p), GREEDY, max_tokens=n_tokens) for p in prompts]
    seqs = Engine(llm, max_batch=len(reqs)).run(reqs)
    return [(list(s.tokens), len(s.request.prompt_ids)) for s in seqs]


# ---------------------------------------------------------------- the whole run

def distill(model: str | None, out: str | Path, opts: DistillOptions, force: bool = False,
            report: Report | None = None, device: str = "auto") -> DistillSummary:
    """Train draft heads for `model` (anything LLM.load takes) into the folder `out`."""
    from .llm import LLM

    t_start = time.perf_counter()
    report = report or (lambda event, **info: None)
    opts = opts.checked()
    out = checked_out(out, force)
    prompts = load_prompts(opts.data)
    report("loading", model=model or "default")
    llm = LLM.load(model, device=device)
    fp = heads_file.fingerprint(llm.config)
    plan = sample_plan(len(prompts), opts)
    data_key = _digest({"v": _VERSION, "model": _model_ident(llm.checkpoint), "fingerprint": fp,
                        "prompts": [p if isinstance(p, str) else json.dumps(p) for p in prompts],
                        "opts": opts.data_fields(), "device": str(llm.device), "dtype": str(llm.dtype)})
    train_key = _digest({"data": data_key, "opts": opts.train_fields()})
    partial = Partial(out)
    info = partial.open(data_key, report)
    summary = DistillSummary(llm.name, str(out), opts.heads, samples=len(plan))
    held_prompts = sorted({p for p, held in plan if held})
    report("prompts", prompts=len(prompts), held_out=len(held_prompts), samples=len(plan))

    t0 = time.perf_counter()
    feats = generate_data(llm, prompts, plan, opts, partial, info, report)
    summary.data_seconds = time.perf_counter() - t0
    data = Data([feats[s] for s in range(len(plan)) if not plan[s][1]])
    held = Data([feats[s] for s in range(len(plan)) if plan[s][1]])
    del feats
    vocab = draft_vocabulary(data, opts.vocab, llm.config.vocab_size)
    in_vocab = torch.zeros(llm.config.vocab_size, dtype=torch.bool)
    in_vocab[vocab] = True
    summary.train_tokens, summary.held_out_tokens, summary.vocab = data.n, held.n, len(vocab)
    summary.vocab_coverage = round(float(in_vocab[held.top_ids[:, 0]].float().mean()), 4)
    report("data_ready", train=data.n, held_out=held.n, vocab=len(vocab), coverage=summary.vocab_coverage)

    if info.get("train_key") != train_key:  # other training arguments: the data stays, the steps go
        partial.checkpoint.unlink(missing_ok=True)
        info["train_key"] = train_key
        partial.write(info)
    trainer = Trainer(llm, vocab, opts)
    train(trainer, data, held, partial, train_key, opts, report, summary)
    summary.steps = opts.steps

    report("measure", what="held-out accuracy")
    from .device import torch_gets_the_threads

    with torch.no_grad(), torch_gets_the_threads():
        ev = trainer.evaluate(held)
    summary.top1, summary.top5, summary.held_out_kl = ev["top1"], ev["top5"], ev["kl"]
    nodes, probs = heads_tree.build_tree(ev["accuracy"], opts.tree_nodes)
    summary.estimated_tokens_per_pass = round(heads_tree.expected_length(probs), 3)
    heads = trainer.heads.requires_grad_(False)
    config = {
        "format": heads_file.FORMAT, "version": heads_file.VERSION, "kind": heads_file.KIND, "n_heads": opts.heads,
        "dims": {"hidden": llm.config.dim, "vocab": llm.config.vocab_size, "draft_vocab": len(vocab)},
        "base_model": {"name": llm.name, "fingerprint": fp, "architecture": llm.config.arch,
                       "quantization": llm.quantization},
        "accuracy": {"held_out_positions": ev["positions"], "top1": ev["top1"], "by_rank": ev["accuracy"],
                     "kl": ev["kl"], "vocab_coverage": summary.vocab_coverage},
        "tree": {"nodes": [list(n) for n in nodes], "probs": [round(p, 6) for p in probs],
                 "budget": min(16, len(nodes)), "estimated_tokens_per_pass": summary.estimated_tokens_per_pass},
        "measured": None,
        "training": {**asdict(opts), "train_positions": data.n, "held_out_positions": held.n,
                     "loss": round(summary.loss, 5), "seconds": round(summary.train_seconds, 1)},
    }
    staging = partial.dir / "output"
    shutil.rmtree(staging, ignore_errors=True)
    heads_file.save(staging, heads, vocab, config)
    if opts.measure:  # through the drafter as generation will use it, read back from the files
        config["tree"]["budget"], config["measured"] = choose_budget(
            llm, HeadsDrafter(llm, staging), nodes, [prompts[i] for i in held_prompts], opts, report, summary)
        heads_file.write_config(staging, config)
    report("writing", out=str(out))
    if out.exists():  # --force: the old folder goes only once the new one is complete
        os.replace(out, partial.dir / "replaced")
    os.replace(staging, out)
    shutil.rmtree(partial.dir, ignore_errors=True)
    summary.tree_budget = config["tree"]["budget"]
    summary.tree_nodes = [list(n) for n in nodes[:summary.tree_budget]]
    summary.seconds = time.perf_counter() - t_start
    return summary


def choose_budget(llm, drafter: HeadsDrafter, nodes, held_prompts: list, opts: DistillOptions, report: Report,
                  summary: DistillSummary) -> tuple[int, dict]:
    """The tree size with the most tokens per second: measured tokens per pass (greedy replay on
    held-out prompts) over the timed cost of a pass of that size plus the drafter's own work.
    Returns it and what was measured (also put in the summary)."""
    report("measure", what="pass cost per tree size")
    costs = pass_costs(llm, nodes)
    draft_s = draft_seconds(drafter)
    report("measure", what="greedy replay on held-out prompts")
    sims = greedy_answers(llm, held_prompts[:opts.sim_prompts], opts.sim_tokens)
    measured = replay(llm, drafter, nodes, sims)
    rates = {b: tokens / (interpolate(costs, b + 1) + draft_s) for b, tokens in measured.items()}
    best = max(rates, key=lambda b: (rates[b], -b))
    summary.pass_ms = {str(T): round(c * 1000, 2) for T, c in costs.items()}
    summary.draft_ms = round(draft_s * 1000, 3)
    summary.measured_tokens_per_pass = {str(b): v for b, v in measured.items()}
    summary.predicted_speedup = round(rates[best] * costs[1], 3)
    return best, {"tokens_per_pass": summary.measured_tokens_per_pass, "pass_ms": summary.pass_ms,
                  "draft_ms": summary.draft_ms, "device": str(llm.device),
                  "predicted_speedup": summary.predicted_speedup}
