"""The one parser of the speculation options (--draft, --draft-k, --lookahead): every check on
their values and their combination, with its message, before any model loads. The command line
(generate, chat, bench, serve) and make_speculator both call parse_draft_options."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import BriskError, InvalidValue
from ..model_path import is_hub_id, resolve_local

HEADS = "heads:"  # --draft heads:PATH, draft heads written by `brisk distill`
SELF_METHODS = {"self:int8": "int8", "self:int4": "int4"}
K_RULE = "must be a positive integer or auto"

# Tokens one tree pass may hold (the pending token and the nodes), for every tree drafter: beyond it
# float32 passes leave the native kernels' batch-invariant products (native.F32_MAX_ROWS) and greedy
# could drift from plain decoding.
MAX_TREE = 64


@dataclass(frozen=True)
class Shape:
    """A lookahead round's size: window W, n-gram size N, n-grams verified G."""
    window: int
    ngram: int
    guesses: int

    def __str__(self) -> str:
        return f"{self.window},{self.ngram},{self.guesses}"

    @property
    def nodes(self) -> int:
        """The tree's drafted nodes at most: the window's levels and G full n-grams."""
        return (self.ngram - 1) * (self.window + self.guesses)


@dataclass(frozen=True)
class DraftOptions:
    """The speculation options, checked. draft: --draft as given; k: a positive K or "auto";
    shape: --lookahead (None: auto); heads: heads:PATH's folder (None for other drafters)."""
    draft: str
    k: int | str = "auto"
    shape: Shape | None = None
    heads: str | None = None


def parse_draft_options(draft: str | None, draft_k: str | int | None = "auto",
                        lookahead: str | None = None) -> DraftOptions | None:
    """Check --draft, --draft-k and --lookahead together (None: no --draft). A
    heads:PATH that is no heads folder fails here too: its config is cheap to read, the model may
    not be."""
    if lookahead is not None and draft != "lookahead":
        raise BriskError("--lookahead needs --draft lookahead")
    if draft is None:
        if draft_k not in (None, "auto"):
            raise BriskError("--draft-k needs --draft")
        return None
    k = parse_k(draft_k)
    if draft == "lookahead":
        if k != "auto":
            raise InvalidValue("draft_k", k, "", template="{option} does not apply to --draft lookahead "
                               "(it drafts trees; --lookahead W,N,G sets their size)")
        return DraftOptions(draft, k, shape=parse_lookahead(lookahead))
    if draft.startswith(HEADS):
        from .heads_file import read_config

        path = parse_heads(draft, k)
        read_config(path)
        return DraftOptions(draft, k, heads=path)
    if draft.startswith("self:") and draft not in SELF_METHODS:
        raise InvalidValue("draft", draft, "", template=f"{{option}} {draft}: use self:int8 or self:int4")
    if draft != "ngram" and draft not in SELF_METHODS and not is_hub_id(draft):  # a draft model's file
        resolve_local(draft)
    return DraftOptions(draft, k)


def parse_k(value: str | int | None) -> int | str:
    """--draft-k: a positive integer or "auto" (None: auto)."""
    if value is None or value == "auto":
        return "auto"
    try:
        k = int(value)
    except (TypeError, ValueError):
        raise InvalidValue("draft_k", value, K_RULE) from None
    if k < 1:
        raise InvalidValue("draft_k", value, K_RULE)
    return k


def parse_lookahead(value: str | None) -> Shape | None:
    """`--lookahead W,N,G` -> Shape (None: not given); one-line errors for bad values."""
    if value is None:
        return None
    parts = str(value).replace(" ", "").split(",")
    try:
        w, n, g = (int(p) for p in parts)
    except ValueError:
        raise InvalidValue("lookahead", value, "", template=f"{{option}} {value}: give three integers W,N,G "
                           "(window, n-gram size, n-grams verified), e.g. 5,3,2") from None
    if w < 0 or n < 2 or g < 1:
        raise InvalidValue("lookahead", value, "", template=f"{{option}} {value}: needs W >= 0, N >= 2, G >= 1")
    shape = Shape(w, n, g)
    if shape.nodes + 1 > MAX_TREE:
        raise InvalidValue("lookahead", value, "", template=f"{{option}} {value}: a round would run up to "
                           f"(N-1)(W+G)+1 = {shape.nodes + 1} tokens; at most {MAX_TREE}")
    return shape


def parse_heads(draft: str, k: int | str) -> str:
    """`heads:PATH` and a parsed --draft-k -> PATH. A number K is a fixed tree of the stored tree's
    first K nodes (K tokens drafted per round, as K means for chains); auto lets the TreePolicy
    pick among a few sizes, or plain steps."""
    path = draft[len(HEADS):]
    if not path.strip():
        raise InvalidValue("draft", draft, "", template="{option} heads:PATH needs the folder `brisk distill` "
                           "wrote, e.g. heads:smol-heads")
    if k != "auto" and k > MAX_TREE - 1:
        raise InvalidValue("draft_k", k, "", template=f"{{option}} {k}: a heads tree of K nodes runs with the pending "
                           f"token in one pass of at most {MAX_TREE} tokens, so K <= {MAX_TREE - 1}")
    return path
