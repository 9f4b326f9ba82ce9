"""The draft-model drafter: another checkpoint with the target's tokenizer (--draft MODEL), or a
quantized copy of the target built at load (--draft self:int8, self:int4) that drafts in the
target's own cache."""
from __future__ import annotations

import warnings

import torch

from ..cuda_graph import decode_step
from ..errors import BriskError
from ..generate import common_prefix, prefill
from ..kv import ContiguousKV
from ..sampling import apply_penalties, draw, extend_seen, probabilities
from .drafter import Drafter


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
                logits = apply_penalties(logits, extend_seen(seen, out), params)
            if params.greedy:
                tok = int(logits.argmax())
            else:
                q = probabilities(logits, params)
                tok = draw(q.cpu(), gen)
                qs.append(q)
            out.append(tok)
            if len(out) == k:
                return out, (torch.stack(qs) if qs else None)
            logits = self._step()(tok, len(self.ids))
            self.ids.append(tok)


def check_pair(target, draft) -> None:
    """Refuse a draft whose tokenizer differs from the target's; warn when it is not smaller."""
    diff = target.tokenizer.describe_difference(draft.tokenizer)
    if diff:
        raise BriskError(f"draft {draft.name} cannot draft for {target.name}: their tokenizers differ ({diff})")
    t, d = _n_params(target.model), _n_params(draft.model)
    if d >= t:
        warnings.warn(f"draft {draft.name} ({d / 1e6:.3g}M parameters) is not smaller than {target.name} "
                      f"({t / 1e6:.3g}M): speculative decoding will likely be slower than plain decoding",
                      stacklevel=4)  # the caller of make_speculator (via build_speculator)


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def quantized_copy(model, method: str, max_len: int):
    """A second Transformer sharing the target's embeddings and norms, with quantized linears.

    Built on the meta device and handed the target's tensors (no float copy is made); then each
    linear, the output head included (it is a fifth of a small model's bytes), is replaced by its
    quantized version.
    """
    from ...quant.linear import quantize_model
    from ..kernel_passes import apply_device_kernels
    from ..model import Transformer

    with torch.device("meta"):
        draft = Transformer(model.cfg)
    draft.load_state_dict(model.state_dict(), assign=True)
    draft.rope_factors = model.rope_factors
    draft.setup_rope(max_len, model.model.norm.weight.device)
    quantize_model(draft, method, head=True)
    apply_device_kernels(draft, draft.model.norm.weight.device)
    return draft.eval().requires_grad_(False)
