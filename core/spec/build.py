"""A Speculator from the speculation options: the drafter they name, with its policy setting."""
from __future__ import annotations

from ..errors import BriskError, InvalidValue
from .options import SELF_METHODS, DraftOptions, parse_draft_options
from .speculator import Speculator


def make_speculator(llm, draft: str, k: str | int | None = "auto", lookahead: str | None = None) -> Speculator:
    """`draft`: "ngram", "lookahead", "heads:PATH", "self:int8", "self:int4", or a model brisk can
    load (path, hub id, GGUF). lookahead: "W,N,G" for --draft lookahead (default: auto, which sizes
    the tree by measured speed and falls back to plain decoding where it does not pay). heads:PATH:
    the draft heads `brisk distill` wrote for this model (k: see options.parse_heads)."""
    return build_speculator(llm, parse_draft_options(draft, k, lookahead))


def build_speculator(llm, opts: DraftOptions) -> Speculator:
    """The Speculator for options parse_draft_options checked; what needs the model is checked here."""
    draft, k = opts.draft, opts.k
    if draft == "lookahead":
        from .lookahead import LookaheadDrafter

        shape = opts.shape
        return Speculator(LookaheadDrafter([shape] if shape else None), "fixed" if shape else "auto")
    if opts.heads is not None:
        from .heads import HeadsDrafter

        size = None if k == "auto" else k
        drafter = HeadsDrafter(llm, opts.heads, None if size is None else [size])
        if size is not None and size > len(drafter.nodes):
            raise InvalidValue("draft_k", k, "", template=f"{{option}} {k}: the tree in {opts.heads} has "
                               f"{len(drafter.nodes)} nodes (`brisk distill --tree-nodes` sets it)")
        return Speculator(drafter, "auto" if size is None else "fixed")
    if draft == "ngram":
        from .ngram import NgramDrafter

        return Speculator(NgramDrafter(), k)
    from .model_drafter import ModelDrafter, check_pair, quantized_copy

    if draft in SELF_METHODS:
        if llm.quantization != "none":
            # Its layers are already int4/int8/4-bit: a copy at the same or more bits drafts no
            # faster than the model verifies, and brisk has no fast kernel below 4 bits.
            raise BriskError(f"--draft {draft}: {llm.name} is already quantized ({llm.quantization}), so a "
                             "quantized copy of it would not be faster; load it with --quantize none for a "
                             "self-draft, or use --draft ngram or a smaller model")
        if getattr(llm.model, "ranks", 1) > 1:
            from .tp_drafts import self_draft

            model = self_draft(llm.model, SELF_METHODS[draft])  # each rank's from its shard
        else:
            model = quantized_copy(llm.model, SELF_METHODS[draft], llm.ctx)
        return Speculator(ModelDrafter(model, llm.ctx, llm.config.vocab_size, name=draft, share_cache=True), k)
    from ..llm import LLM

    other = LLM.load(draft, device=str(llm.device), dtype=str(llm.dtype).removeprefix("torch."), ctx=llm.ctx)
    check_pair(llm, other)
    return Speculator(ModelDrafter(other.model, other.ctx, llm.config.vocab_size, name=other.name), k)
