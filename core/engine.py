"""LLM: a loaded model, its tokenizer and where it runs. The entry point of the Python API."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .checkpoint import Checkpoint, load_checkpoint
from .device import pick_device, pick_dtype
from .errors import BriskError
from .model import Transformer


@dataclass
class LoadInfo:
    seconds: float
    param_bytes: int
    file_bytes: int


class LLM:
    def __init__(self, model: Transformer, tokenizer, ckpt: Checkpoint, device: torch.device,
                 dtype: torch.dtype, ctx: int, load_info: LoadInfo):
        self.model, self.tokenizer, self.checkpoint = model, tokenizer, ckpt
        self.config = model.cfg
        self.device, self.dtype, self.ctx, self.load_info = device, dtype, ctx, load_info
        self.name = ckpt.name
        self.eos_ids = set(tokenizer.eos_ids)  # includes generation_config.json's eos_token_id

    @classmethod
    def load(cls, model: str | None = None, device: str = "auto", dtype: str = "auto",
             ctx: int | None = None) -> "LLM":
        t0 = time.perf_counter()
        dev = pick_device(device)
        dt = pick_dtype(dtype, dev)
        ckpt = load_checkpoint(model)
        net = build_model(ckpt, dev, dt)
        ctx = min(ctx or 4096, ckpt.config.max_seq_len)
        if ctx < 16:
            raise BriskError(f"--ctx {ctx}: too small")
        net.setup_rope(ctx, dev)
        info = LoadInfo(time.perf_counter() - t0, sum(p.numel() * p.element_size() for p in net.parameters()),
                        ckpt.file_bytes)
        ckpt.tensors = {}  # the model owns the weights now
        return cls(net, ckpt.tokenizer, ckpt, dev, dt, ctx, info)

    def new_cache(self):
        return self.model.new_cache(self.ctx)

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits for every position of ids, from a fresh cache (tests, eval)."""
        cache = self.model.new_cache(max(len(ids), 1))
        return self.model(torch.tensor([ids], device=self.device), cache)[0].float()


    # ------------------------------------------------------------ convenience API

    def prompt_ids(self, prompt: str, raw: bool = False, system: str | None = None) -> list[int]:
        """Token ids for a one-shot prompt: through the chat template unless raw or there is none."""
        if not prompt.strip():
            raise BriskError("the prompt is empty")
        tok = self.tokenizer
        if raw or not tok.has_chat_template:
            return tok.encode(prompt, add_special=True)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special=False)

    def stream(self, prompt: str, sampling=None, max_tokens: int = 256, stop=(), raw: bool = False,
               session=None):
        """Yield the answer's text pieces; the GenerationResult is in session.last afterwards."""
        from .generate import Session
        from .sampling import SamplingParams

        session = session or Session(self)
        yield from session.stream(self.prompt_ids(prompt, raw), sampling or SamplingParams(), max_tokens, stop)

    def generate(self, prompt: str, sampling=None, max_tokens: int = 256, stop=(), raw: bool = False):
        from .generate import Session

        session = Session(self)
        for _ in self.stream(prompt, sampling, max_tokens, stop, raw, session):
            pass
        return session.last

def build_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> Transformer:
    """Build on the meta device, then hand each tensor over once (no second full copy)."""
    cfg = ckpt.config
    with torch.device("meta"):
        net = Transformer(cfg)
    expected = set(net.state_dict().keys())
    tensors = ckpt.tensors
    if cfg.tie_embeddings or "lm_head.weight" not in tensors:
        if "model.embed_tokens.weight" not in tensors:
            raise BriskError(f"{ckpt.name}: checkpoint has no embedding weights")
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    missing = sorted(expected - tensors.keys())
    if missing:
        raise BriskError(f"{ckpt.name}: checkpoint lacks {len(missing)} weights, e.g. {missing[0]}")
    state = {}
    converted: dict[int, torch.Tensor] = {}
    for k in expected:
        t = tensors[k]
        key = id(t)
        if key not in converted:  # tied weights stay shared
            converted[key] = t.to(device=device, dtype=dtype)
        state[k] = converted[key]
    try:
        net.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise BriskError(f"{ckpt.name}: weights do not match config.json ({str(e).splitlines()[-1].strip()})") from None
    if "rope_freqs" in ckpt.extra:
        net.rope_factors = ckpt.extra["rope_freqs"]
    if cfg.tie_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    return net.eval().requires_grad_(False)
