"""`brisk distill`'s options, output folder check and summary, apart from the pipeline (core/distill.py)
so that the command line can show the defaults and refuse bad values without importing torch."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from .errors import FileError, InvalidValue
from .files import read_user_text


@dataclass
class DistillOptions:
    # Defaults measured on SmolLM2-135M for a run of under 30 minutes on 2 CPU cores
    # (bench/history/readme-2026-11-27.md):
    # heads beyond the second were right too seldom to be worth their training time (held-out
    # top-1 33% / 14% / 8% / 6% with 4 heads; 2 heads trained longer did as well on the first two).
    heads: int = 2  # K: head k guesses the token k+2 ahead
    steps: int = 1800  # optimizer steps
    batch: int = 512  # positions per step
    lr: float = 2e-3  # peak; warmup then cosine decay to a tenth
    samples: int = 576  # generated answers (training + held-out)
    max_tokens: int = 256  # tokens per answer
    temperature: float = 0.7
    top_p: float = 0.95
    vocab: int = 8192  # draft vocabulary size (0: the whole vocabulary)
    top_m: int = 32  # model probabilities kept per position (the target, renormalized)
    holdout: int = 10  # every holdout-th prompt is held out
    tree_nodes: int = 64  # nodes of the stored tree (any prefix is a smaller tree)
    checkpoint_every: int = 100
    concurrency: int = 32  # answers generated at once
    seed: int = 0
    data: str | None = None  # prompts file (None: the built-in set)
    measure: bool = True  # time the passes and replay greedy decoding to pick the tree size
    sim_prompts: int = 8  # held-out prompts replayed
    sim_tokens: int = 128  # greedy tokens each

    def checked(self) -> "DistillOptions":
        for name, lo in (("heads", 1), ("steps", 1), ("batch", 1), ("samples", 2), ("max_tokens", 2),
                         ("top_m", 1), ("holdout", 2), ("tree_nodes", 1), ("checkpoint_every", 1),
                         ("concurrency", 1), ("vocab", 0), ("sim_prompts", 1), ("sim_tokens", 2)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise InvalidValue(name, v, f"must be an integer >= {lo}")
        if self.heads > 16:
            raise InvalidValue("heads", self.heads, "must be at most 16")
        if not self.lr > 0:
            raise InvalidValue("lr", self.lr, "must be > 0")
        if not self.temperature > 0:
            raise InvalidValue("temperature", self.temperature, "must be > 0 (the training text is sampled)")
        if not 0 < self.top_p <= 1:
            raise InvalidValue("top_p", self.top_p, "must be in (0, 1]")
        return self

    def data_fields(self) -> dict:
        """What the generated data depends on."""
        return {k: getattr(self, k) for k in ("samples", "max_tokens", "temperature", "top_p", "top_m", "holdout",
                                              "seed")}

    def train_fields(self) -> dict:
        """What the trained heads depend on, besides the data."""
        return {k: getattr(self, k) for k in ("heads", "steps", "batch", "lr", "vocab", "seed")}


def checked_out(out: str | Path, force: bool) -> Path:
    """The output folder, when it can be written: absent (or --force) and inside a folder that exists."""
    out = Path(out).expanduser()
    if out.exists() and not force:
        raise FileError("already exists (use --force to replace it)", out)
    if not out.parent.exists():
        raise FileError("no such folder", out.parent)
    return out


@dataclass
class DistillSummary:
    model: str
    out: str
    n_heads: int
    samples: int = 0
    train_tokens: int = 0  # positions trained on
    held_out_tokens: int = 0
    data_seconds: float = 0.0  # this run's share (a resumed run counts what it generated)
    train_seconds: float = 0.0
    steps: int = 0
    resumed_step: int = 0
    loss: float = 0.0  # last checkpoint's mean KL per head on the training batches
    held_out_kl: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)  # per head, held-out
    top5: list[float] = field(default_factory=list)
    vocab: int = 0
    vocab_coverage: float = 0.0  # share of the model's top-1 choices (held-out) inside the draft vocabulary
    tree_budget: int = 0
    tree_nodes: list = field(default_factory=list)
    estimated_tokens_per_pass: float = 0.0
    measured_tokens_per_pass: dict = field(default_factory=dict)  # tree size -> tokens per pass (replay)
    pass_ms: dict = field(default_factory=dict)  # tokens in the pass -> milliseconds
    draft_ms: float = 0.0  # the heads' work per round
    predicted_speedup: float = 0.0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


PROMPTS_NAME = "distill_prompts.txt"  # package data: prompts separated by blank lines


def load_prompts(path: str | Path | None) -> list:
    """Prompts: strings (sent through the chat template) or message lists. `path` None: the built-in
    set. A .jsonl file has one object a line with "prompt" (or "text") or "messages"; any other
    file is plain text, prompts separated by blank lines."""
    if path is None:
        text = resources.files(__package__).joinpath(PROMPTS_NAME).read_text(encoding="utf-8")
        return _paragraphs(text)
    path = Path(path).expanduser()
    raw = read_user_text(path)
    if path.suffix != ".jsonl":
        prompts = _paragraphs(raw)
    else:
        prompts = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise FileError(f"invalid JSON ({e.msg})", path, n) from None
            messages = obj.get("messages") if isinstance(obj, dict) else None
            if isinstance(messages, list) and messages:
                if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                           for m in messages):
                    raise FileError('each message needs a "role" and a "content" string', path, n)
                prompts.append(messages)
            elif isinstance(obj, dict) and isinstance(obj.get("prompt", obj.get("text")), str):
                prompts.append(obj.get("prompt", obj.get("text")))
            else:
                raise FileError('expected an object with "prompt", "text" or "messages"', path, n)
        prompts = [p for p in prompts if not isinstance(p, str) or p.strip()]
    if len(prompts) < 2:
        raise FileError("needs at least 2 prompts (some are held out to measure the heads)", path)
    return prompts


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]
