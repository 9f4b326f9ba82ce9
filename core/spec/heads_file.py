"""Draft heads on disk: the HEADS folder `brisk distill` writes and --draft heads:PATH reads, and
the fingerprint that ties it to its base model.

HEADS is a folder:
  heads.safetensors  "weight", "token_weight" [K, dim, dim], "bias" [K, dim] (float32),
                     "vocab" [n] (int64, sorted: the draft vocabulary)
  config.json        {"format": "brisk-draft-heads", "version", "kind", "n_heads", "dims",
                      "base_model": {"name", "fingerprint", ...}, "accuracy", "tree", ...}
Nothing is pickled. The fingerprint is a hash of the base model's tensor names and shapes as
brisk's float model has them (vocabulary size included): the same for a model however it is
loaded (a Q4_1 GGUF, `--quantize none`, its HF folder), different for any other shape. Heads are
refused, in one line naming both models, on a model whose fingerprint differs.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..errors import BriskError, FileError
from .heads_net import DraftHeads

FORMAT = "brisk-draft-heads"
VERSION = 1
KIND = "medusa-resblock-token"  # residual SiLU heads over (hidden state, pending token)
WEIGHTS = "heads.safetensors"
CONFIG = "config.json"


def fingerprint(cfg) -> str:
    """A hash of the tensor names and shapes of the float model `cfg` describes (vocabulary size
    included): independent of how the weights are stored or quantized at load."""
    from ..model import Transformer

    with torch.device("meta"):
        net = Transformer(cfg)
    shapes = sorted((k, list(v.shape)) for k, v in net.state_dict().items())
    blob = json.dumps({"vocab_size": cfg.vocab_size, "tensors": shapes}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_base(config: dict, llm, path) -> None:
    """Refuse heads trained for another model, in one line naming both."""
    base = config.get("base_model", {})
    mine = fingerprint(llm.checkpoint.config)  # the whole model's (under --tp, llm.config holds a rank's heads)
    if base.get("fingerprint") != mine:
        raise BriskError(f"draft heads {path} were trained for {base.get('name', 'another model')} "
                         f"(fingerprint {base.get('fingerprint')}), not for {llm.name} "
                         f"(fingerprint {mine}): distill heads for it with "
                         f"`brisk distill`")


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
