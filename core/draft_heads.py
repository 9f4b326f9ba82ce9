"""Medusa-style draft heads: K small heads on the model's last hidden state, head k guessing the
token k+2 places ahead (the model's own output layer already predicts the next one), and the
drafter that turns their top choices into a tree of candidates for one verifying pass.

A head is one residual SiLU block over the hidden state h_i of the row that chose the pending
token and that token's embedding e (known when drafting, unlike the tokens after it: Medusa's
heads see h_i only; giving them e too raised SmolLM2's held-out top-1 by a quarter, 18% -> 23%
for the first head on the same data): h' = h + silu(W h + U e + b), read out through the model's
own output layer restricted to a draft vocabulary (the tokens that carry nearly all of the model's
probability on the training text; `brisk distill` picks it). The heads own only W, U, b and that
list of token ids: a few MB. W and U start at zero, so an untrained head repeats the model's
next-token guess, and training only has to learn the shift.

On disk, HEADS is a folder:
  heads.safetensors  "weight", "token_weight" [K, dim, dim], "bias" [K, dim] (float32),
                     "vocab" [n] (int64, sorted: the draft vocabulary)
  config.json        {"format": "brisk-draft-heads", "version", "kind", "n_heads", "dims",
                      "base_model": {"name", "fingerprint", ...}, "accuracy", "tree", ...}
Nothing is pickled. The fingerprint is a hash of the base model's tensor names and shapes as
brisk's float model has them (vocabulary size included): the same for a model however it is
loaded (a Q4_1 GGUF, `--quantize none`, its HF folder), different for any other shape. Heads are
refused, in one line naming both models, on a model whose fingerprint differs.

The tree (Medusa's sparse trees): a node is a path of ranks (r0, r1, ...), meaning head 0's
r0-th choice, then head 1's r1-th choice, ...; it is kept when the target's own token agrees at
every step of the path. Nodes are added greedily in order of their estimated acceptance
probability, the product of the per-head top-r accuracies measured on held-out text, so any
prefix of the stored node list is the best tree of that size under that estimate.
"""
from __future__ import annotations

import hashlib
import heapq
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ..quant.linear import Int8Linear
from .errors import BriskError, FileError
from .drafting import MAX_TREE, Draft, Drafter

FORMAT = "brisk-draft-heads"
VERSION = 1
KIND = "medusa-resblock-token"  # residual SiLU heads over (hidden state, pending token)
WEIGHTS = "heads.safetensors"
CONFIG = "config.json"


# ---------------------------------------------------------------- the heads

class DraftHeads(nn.Module):
    """K residual SiLU blocks over a hidden state h_i and the embedding e of the token after it
    (the pending token, known when drafting), as stacked weights (one batched matmul for all
    heads). forward(h [..., dim], e [..., dim]) -> [K, ..., dim], what each head reads out."""

    def __init__(self, n_heads: int, dim: int):
        super().__init__()
        # zero: a new head is the model's own next-token guess, and learns the shift from there
        self.weight = nn.Parameter(torch.zeros(n_heads, dim, dim))
        self.token_weight = nn.Parameter(torch.zeros(n_heads, dim, dim))
        self.bias = nn.Parameter(torch.zeros(n_heads, dim))

    @property
    def n_heads(self) -> int:
        return self.weight.shape[0]

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        flat, fe = h.reshape(-1, h.shape[-1]), e.reshape(-1, e.shape[-1])
        z = (torch.einsum("nd,ked->kne", flat, self.weight) + torch.einsum("nd,ked->kne", fe, self.token_weight)
             + self.bias[:, None])
        out = flat + torch.nn.functional.silu(z)
        return out.reshape(self.n_heads, *h.shape)


def output_rows(model, vocab: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The model's output-layer rows for `vocab` [n] as a float tensor [n, dim], whatever the layer's
    format (a quantized layer dequantizes just those rows)."""
    head = model.lm_head
    ids = vocab.to(model.model.norm.weight.device)
    if hasattr(head, "rows"):  # QuantLinear (GGUF blocks, int4/int8, GPTQ, ...)
        return head.rows(ids, dtype)
    return head.weight.index_select(0, ids).to(dtype)


def head_logits(heads: DraftHeads, rows: torch.Tensor, h: torch.Tensor, e: torch.Tensor,
                softcap: float | None) -> torch.Tensor:
    """Logits [K, ..., n] over the draft vocabulary for hidden states h [..., dim] and the next
    tokens' embeddings e [..., dim]."""
    logits = heads(h, e) @ rows.T
    if softcap:  # as the model's own head does (Gemma): training and drafting see the same logits
        logits = torch.tanh(logits / softcap) * softcap
    return logits


# ---------------------------------------------------------------- fingerprint

def fingerprint(cfg) -> str:
    """A hash of the tensor names and shapes of the float model `cfg` describes (vocabulary size
    included): independent of how the weights are stored or quantized at load."""
    from .model import Transformer

    with torch.device("meta"):
        net = Transformer(cfg)
    shapes = sorted((k, list(v.shape)) for k, v in net.state_dict().items())
    blob = json.dumps({"vocab_size": cfg.vocab_size, "tensors": shapes}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_base(config: dict, llm, path) -> None:
    """Refuse heads trained for another model, in one line naming both."""
    base = config.get("base_model", {})
    if base.get("fingerprint") != fingerprint(llm.config):
        raise BriskError(f"draft heads {path} were trained for {base.get('name', 'another model')} "
                         f"(fingerprint {base.get('fingerprint')}), not for {llm.name} "
                         f"(fingerprint {fingerprint(llm.config)}): distill heads for it with "
                         f"`brisk distill`")


# ---------------------------------------------------------------- the static tree

def build_tree(accuracy: list[list[float]], budget: int) -> tuple[list[tuple[int, ...]], list[float]]:
    """Medusa's greedy sparse tree: up to `budget` nodes, each a path of ranks (r0, r1, ...), added
    in decreasing order of estimated acceptance, the product of accuracy[d][r_d] along the path
    (accuracy[k][r]: how often head k's r-th choice is the model's token). A node is only a
    candidate once its parent and its next-better sibling are in, so every prefix of the returned
    list is a valid tree (parents before children). Returns (nodes, their estimated probabilities)."""
    depth, ranks = len(accuracy), len(accuracy[0]) if accuracy else 0
    nodes, probs = [], []
    # entries: (-probability, path, the parent's probability); ties go to the smaller path
    heap = [(-accuracy[0][0], (0,), 1.0)] if depth and ranks else []
    while heap and len(nodes) < budget:
        neg, path, parent_p = heapq.heappop(heap)
        nodes.append(path)
        probs.append(-neg)
        d = len(path) - 1
        if path[-1] + 1 < ranks:  # the next sibling
            heapq.heappush(heap, (-parent_p * accuracy[d][path[-1] + 1], path[:-1] + (path[-1] + 1,), parent_p))
        if d + 1 < depth:  # the first child
            heapq.heappush(heap, (neg * accuracy[d + 1][0], path + (0,), -neg))
    return nodes, probs


def tree_parents(nodes: list[tuple[int, ...]]) -> list[int]:
    """parents[i]: the index of node i's parent in `nodes`, -1 for the root (the pending token)."""
    index = {p: i for i, p in enumerate(nodes)}
    return [index[p[:-1]] if len(p) > 1 else -1 for p in nodes]


def expected_length(probs: list[float]) -> float:
    """Tokens per verifying pass the estimate predicts: the target's own token plus each node's
    chance to be on the accepted path (nodes of one depth exclude each other)."""
    return 1.0 + sum(probs)


# ---------------------------------------------------------------- the file

def save(folder: Path, heads: DraftHeads, vocab: torch.Tensor, config: dict) -> None:
    """Write the two files into `folder` (the caller makes the folder appear atomically)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in heads.state_dict().items()}
    tensors["vocab"] = vocab.to(torch.int64).cpu().contiguous()
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": FORMAT})
    write_config(folder, config)


def write_config(folder: Path, config: dict) -> None:
    # one key a line, each value on its line: readable, and the long tables stay one line each
    lines = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in config.items()]
    (folder / CONFIG).write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")


def read_config(path: str | Path) -> tuple[Path, dict]:
    """(the folder, its config.json) after checking that it is a HEADS folder this brisk reads: a
    FileError otherwise. Cheap (no weights read): the command line calls it before loading a model."""
    path = Path(path).expanduser()
    if not path.is_dir():
        what = "not a folder" if path.exists() else "no such folder"
        raise FileError(f"{what} (draft heads are a folder written by `brisk distill`)", path)
    try:
        config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileError(f"no {CONFIG}: not a draft-heads folder", path) from None
    except (OSError, ValueError) as e:
        raise FileError(f"{CONFIG} unreadable ({e})", path) from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise FileError(f"{CONFIG} is not a {FORMAT} file", path)
    if config.get("version") != VERSION or config.get("kind") != KIND:
        raise FileError(f"draft heads version {config.get('version')} ({config.get('kind')}): this brisk reads "
                        f"version {VERSION} ({KIND})", path)
    # The fields the loader and the drafter index: a hand-edited file fails here in one line, not
    # with a KeyError deep in the drafter.
    try:
        tree, nodes = config["tree"], config["tree"]["nodes"]
        ok = (isinstance(config["n_heads"], int) and config["n_heads"] >= 1 and isinstance(config["dims"]["hidden"], int)
              and isinstance(tree["budget"], int) and tree["budget"] >= 1 and isinstance(nodes, list) and nodes
              and all(isinstance(n, list) and n and all(isinstance(r, int) and r >= 0 for r in n) for n in nodes)
              and _parents_first(nodes))
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise FileError(f"{CONFIG}: n_heads, dims.hidden or tree (nodes, budget) missing or malformed", path)
    return path, config


def _parents_first(nodes: list[list[int]]) -> bool:
    """Whether each node's parent (its path less the last rank) comes before it, as a tree needs."""
    earlier: set[tuple[int, ...]] = set()
    for n in nodes:
        if len(n) > 1 and tuple(n[:-1]) not in earlier:
            return False
        earlier.add(tuple(n))
    return True


def load(path: str | Path) -> tuple[dict, DraftHeads, torch.Tensor]:
    """(config, heads, vocab) from a HEADS folder; a FileError for anything that is not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path, config = read_config(path)
    try:
        t = load_file(str(path / WEIGHTS))
    except (OSError, SafetensorError) as e:
        raise FileError(f"{WEIGHTS} unreadable ({e})", path) from None
    K, dim = config["n_heads"], config["dims"]["hidden"]
    want = {"weight": (K, dim, dim), "token_weight": (K, dim, dim), "bias": (K, dim)}
    for name, shape in want.items():
        if name not in t or tuple(t[name].shape) != shape:
            raise FileError(f"{WEIGHTS}: {name} missing or not of shape {list(shape)}", path)
    vocab = t.get("vocab")
    if vocab is None or vocab.ndim != 1 or vocab.numel() == 0 or vocab.dtype not in (torch.int64, torch.int32):
        raise FileError(f"{WEIGHTS}: no draft vocabulary", path)
    heads = DraftHeads(K, dim)
    heads.load_state_dict({k: t[k] for k in want})
    return config, heads.requires_grad_(False), vocab


# ---------------------------------------------------------------- the drafter

class HeadsDrafter(Drafter):
    """Drafts trees from the heads (a tree drafter of core/drafting.py). The loop shows it every
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
        self.model = model  # its embedding: the heads read the pending token too
        self.dtype = w.dtype
        self.heads = heads.to(device=w.device, dtype=w.dtype)
        self.vocab = vocab.to(w.device)
        # The model's own output-layer rows for the draft vocabulary, as per-row int8 on brisk's
        # kernels: drafting reads them every round, and in float32 they cost SmolLM2 about half a
        # decode step (5.1 ms against 1.1 ms, 2 heads; the ranking moves only at near-ties).
        rows = output_rows(model, vocab, torch.float32)
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
        e = self.model.embed(ids).reshape(h.shape)
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
