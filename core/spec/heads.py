"""The trained-heads drafter (--draft heads:PATH): the heads' top choices (heads_net.py, read from
the folder of heads_file.py) filled into a prefix of their static tree (heads_tree.py), a tree of
candidates for one verifying pass."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from ...quant.linear import Int8Linear
from ..errors import FileError
from .drafter import MAX_TREE, Draft, Drafter
from .heads_file import check_base, load
from .heads_net import output_rows
from .heads_tree import tree_parents


class HeadsDrafter(Drafter):
    """Drafts trees from the heads (a tree drafter of drafter.py). The loop shows it every
    pass (observe): the hidden state of the row whose logits chose the pending token is what the
    heads read, with the pending token. propose_tree() fills the static tree's first nodes (a
    TreePolicy option: a node count) with the heads' choices; propose() gives a chain (each
    head's first choice), for a loop that verifies chains.

    Until a hidden state has been observed it has no guess (propose_tree() returns None: the loop
    runs a plain step); each observed state serves one proposal."""

    name = "heads"
    tree = True
    needs_hidden = True

    def __init__(self, llm, path: str | Path, sizes: list[int] | None = None):
        """sizes: the tree sizes (node counts) offered to the TreePolicy; default: the one
        `brisk distill` measured best, and a few around it."""
        self.path = Path(path).expanduser()
        config, heads, vocab = load(self.path)
        check_base(config, llm, self.path)
        model = llm.model
        w = model.model.norm.weight
        if int(vocab.max()) >= llm.config.vocab_size or int(vocab.min()) < 0:
            raise FileError(f"draft vocabulary has ids outside the model's 0..{llm.config.vocab_size - 1}", self.path)
        if heads.weight.shape[-1] != llm.config.dim:  # the fingerprint agreed: only a hand-made file gets here
            raise FileError(f"heads of width {heads.weight.shape[-1]}, not the model's {llm.config.dim}", self.path)
        self.config = config
        self.dtype = w.dtype
        self.heads = heads.to(device=w.device, dtype=w.dtype)
        self.vocab = vocab.to(w.device)
        # The model's own output-layer rows for the draft vocabulary, as per-row int8 on brisk's
        # kernels: drafting reads them every round, and in float32 they cost a small model a large
        # share of a decode step (the ranking moves only at near-ties).
        if getattr(model, "ranks", 1) > 1:  # under --tp the heads run on rank 0: rows gathered once
            from .tp_drafts import embedder, head_rows

            rows, self.embed = head_rows(model, self.vocab), embedder(model)
        else:
            rows, self.embed = output_rows(model, vocab, torch.float32), model.embed
        self.readout = Int8Linear.from_float(SimpleNamespace(weight=rows, bias=None)).to(w.device)
        self.softcap = llm.config.final_softcap
        self.nodes = [tuple(n) for n in config["tree"]["nodes"]]
        # at most MAX_TREE tokens a pass: the nodes and the pending token
        best = min(config["tree"]["budget"], len(self.nodes), MAX_TREE - 1)
        self.sizes = sorted(set(sizes or [b for b in (1, 2, 4, 8, 16, 32, 64) if b < best] + [best]))
        self._shapes: dict[tuple[int, int], tuple[list[int], list[int], torch.Tensor, int]] = {}
        # [dim]: the row that chose the pending token. Used by one proposal only: a loop that
        # skipped observe() after a pass then gets no draft rather than a stale one.
        self.hidden: torch.Tensor | None = None

    def _shape(self, size: int, depth: int):
        """The static tree's first `size` nodes no deeper than `depth`: (node indices, parents,
        each node's flat index into the heads' top-r [K, ranks], ranks). Any such subset keeps
        parents before children (a node's ancestors come earlier and are shallower)."""
        key = (size, depth)
        if key not in self._shapes:
            keep = [n for n in self.nodes if len(n) <= min(depth, self.heads.n_heads)][:max(0, size)]
            ranks = 1 + max((r for n in keep for r in n), default=0)
            flat = torch.tensor([(len(n) - 1) * ranks + n[-1] for n in keep], dtype=torch.long,
                                device=self.vocab.device)
            self._shapes[key] = (keep, tree_parents(keep), flat, ranks)
        return self._shapes[key]

    def start(self, ids, kv) -> None:
        self.hidden = None  # a new generation: the last one's state says nothing about it

    def bucket(self, ctx):
        return 0 if self.hidden is not None else None

    def observe(self, draft, logits, hidden, path) -> None:
        """After a pass: hidden [1 + len(draft.tokens), dim] for [pending] + draft.tokens; the new
        pending token was chosen by the row of the last accepted node (`path`), or row 0."""
        # a copy: on CUDA the pass's output is a graph's buffer, which the next pass rewrites
        self.hidden = None if hidden is None else hidden[(path[-1] + 1) if path else 0].clone()

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, tokens) -> torch.Tensor:
        """[K, ..., n]: each head's logits over the draft vocabulary for hidden states h [..., dim]
        and the tokens that follow them (ids, shaped as h without its last dimension)."""
        ids = torch.as_tensor(tokens, device=h.device).reshape(-1)
        e = self.embed(ids).reshape(h.shape)  # the heads read the pending token too
        logits = self.readout(self.heads(h.to(self.dtype), e.to(self.dtype))).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def top_tokens(self, pending: int, ranks: int) -> torch.Tensor:
        """[K, ranks] token ids: each head's best guesses from the observed hidden state (consumed)
        and the pending token."""
        h, self.hidden = self.hidden, None
        return self.vocab[self.logits(h, [pending]).topk(ranks, dim=-1).indices]

    def tree_options(self) -> list[int]:
        return list(self.sizes)

    def expected_tokens(self, option: int) -> float | None:
        """Tokens a round with the tree's first `option` nodes emits on average, as `brisk distill`
        measured it through this drafter (config "measured"), else as its held-out accuracies
        predict (config "tree" "probs"); None where the file has neither."""
        measured = (self.config.get("measured") or {}).get("tokens_per_pass") or {}
        if str(option) in measured:
            return float(measured[str(option)])
        probs = self.config["tree"].get("probs")
        return 1.0 + sum(probs[:option]) if probs else None

    def propose_tree(self, ctx: list[int], option: int | None = None, depth: int = 1 << 30, size: int = 1 << 30,
                     params=None, gen=None, seen=None) -> Draft | None:
        """The round after ctx (ctx[-1] the pending token): the static tree's first `option` nodes
        (default: the size distill measured best), at most `depth` deep and `size` in all, each
        node holding its path's choice of its head. Point masses (q None), all candidates; None
        when there is nothing to draft from."""
        option = self.sizes[-1] if option is None else option
        keep, parents, flat, ranks = self._shape(min(option, size), depth)
        if self.hidden is None or not keep:
            return None
        tokens = self.top_tokens(ctx[-1], ranks).reshape(-1)[flat].tolist()
        return Draft(tokens, parents=list(parents))

    def propose(self, ctx, k, params, gen, seen):
        """A chain of up to k tokens (head d's first choice at depth d), as point masses (q None)."""
        if self.hidden is None or k <= 0:
            return [], None
        return self.top_tokens(ctx[-1], 1)[:min(k, self.heads.n_heads), 0].tolist(), None
