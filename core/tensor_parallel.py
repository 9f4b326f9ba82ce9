"""Tensor parallelism (`--tp N`, `LLM.load(..., tp=N)`): one model over N ranks of
torch.distributed (gloo on the CPU, NCCL on CUDA), Megatron-style; CPU ranks on one host add and
gather the layers' outputs through shared memory (core/tp_shm.py).

- q/k/v and gate/up are split by output columns (whole heads, as evenly as they go; KV heads
  split across ranks, or each rank keeps those its query heads read: heads_of); a GGUF's blocks
  likewise, cut in the file's layout and then interleaved, o/down at block boundaries;
  o_proj and down_proj by input rows, then one all-reduce each (a forward hook, so the modules
  keep their kinds and the device passes still swap in their kernels per shard); the output
  head by vocabulary, its logits all-gathered. The embedding and norms are replicated. An MoE
  layer: each expert split as the MLP is, the router replicated, one all-reduce of the layer's
  output. A GPTQ/AWQ/bitsandbytes/MXFP4 checkpoint's layers are cut the same way earlier, in the
  checkpoint's own tensors before they are built (core/tp_quantized.py), and left as they are here.
- The sharded model reports its local head counts in its config, so every cache sized from it
  (LLM.new_cache, ContiguousKV.for_model, the batching engine's PagedKV) holds the rank's own KV heads.
- Rank 0 is the caller: it tokenizes, samples, schedules and drives the model. Each of its forward
  passes first sends the step (tokens, positions, which cache; for a paged step its slots and block
  tables; tree paths kept since the last step) to the other ranks, which run the same pass on their
  shards and their own caches (`follow`), so code above the model does not know.
- A draft built from the target (a self-draft) is a sharded model too: every rank numbers its
  models in the order it builds them and each step names the one it runs; `everywhere` runs a
  function on every rank's counterpart of a model (building a draft, gathering rows).

Ranks come from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) where it
is set, else brisk starts ranks 1..N-1 itself (`start`, core/tp_follower.py) as children in
their own process group, killed when rank 0 exits.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from . import tp_shm
from .checkpoint import kept_layer, release_file_pages, trim_heap
from .errors import BriskError
from .kv import ContiguousKV, PagedKV, PagedStep
from .kernel_passes import NativeBlocksTransformer
from .model import MLP, MoE, Router, Transformer
from .tp_split import check_blocks, head_rows, heads_of, parts, span
from ..quant import gguf_blocks, gguf_types
from ..quant.gguf_types import Q8_0
from ..quant.gguf_linear import GGUFLinear
from ..quant.linear import Int8Linear, QuantEmbedding, QuantLinear, quantize_int8, quantize_linear
from ..quant.nf4 import BLOCKSIZE as NF4_BLOCK

# Collectives inside a pass: a rank that hangs this long ends the run.
STEP_TIMEOUT = timedelta(seconds=300)
# The followers' wait for rank 0's next step (a chat waits on its user): no practical limit.
IDLE_TIMEOUT = timedelta(days=7)


@dataclass
class Group:
    rank: int
    world: int
    control: object  # the process group the steps are sent on (IDLE_TIMEOUT)
    children: list  # the follower processes rank 0 started (empty under torchrun)
    shm: tp_shm.Segment | None = None  # the hot collectives' segment (CPU ranks on one host), else gloo

    def all_reduce(self, t: torch.Tensor) -> None:
        """t (contiguous) summed over the ranks, in place."""
        if self.shm is not None:
            self.shm.all_reduce(t)
        else:
            dist.all_reduce(t)

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's t (contiguous) side by side along the last dimension, in rank order."""
        if self.shm is not None:
            return self.shm.gather_columns(t)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=-1)


_group: Group | None = None
_spawned = False  # this process is a follower rank 0 started (not torchrun's)
PEER_FAILED = 3  # a follower's exit code when a collective failed because another rank did


def free_port() -> int:
    """A TCP port free now on this machine, found before any rank loads (a busy port fails at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def start(tp: int, load_args: dict) -> Group:
    """Join (torchrun, or a follower brisk started) or make (rank 0) the process group of tp ranks."""
    global _group
    if _group is not None:
        if _group.world != tp:
            raise BriskError(f"--tp {tp}: this process already runs with --tp {_group.world}")
        return _group
    children, store = [], None
    if under_torchrun() and not _spawned:
        world = int(os.environ["WORLD_SIZE"])
        if world != tp:
            raise BriskError(f"--tp {tp}: the launcher started {world} ranks (WORLD_SIZE)")
        rank = int(os.environ["RANK"])
    elif _spawned:  # a follower rank 0 started: it joins rank 0's store
        rank = int(os.environ["RANK"])
        store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), tp, is_master=False, timeout=STEP_TIMEOUT)
        store.add("joined", 1)
    else:
        rank, store = 0, _store(tp)
        port = store.port
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        children = [_spawn(r, tp, port, load_args) for r in range(1, tp)]
        _wait_for_followers(store, children)
    cuda = load_args.get("device", "auto") != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    backend = "nccl" if cuda else "gloo"
    try:
        if store is None:
            dist.init_process_group(backend, rank=rank, world_size=tp, timeout=STEP_TIMEOUT,
                                    init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
        else:
            dist.init_process_group(backend, rank=rank, world_size=tp, timeout=STEP_TIMEOUT, store=store)
        control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        shm = tp_shm.open_segment(rank, tp, STEP_TIMEOUT.total_seconds()) if backend == "gloo" else None
    except (RuntimeError, dist.DistError) as e:
        _shutdown(children)
        raise BriskError(f"--tp {tp}: the ranks could not connect ({first_line(e)})") from None
    _group = Group(rank, tp, control, children, shm)
    if rank == 0:  # under torchrun too: the followers wait for its stop
        atexit.register(_shutdown, children)
    return _group


def _store(world: int):
    """Rank 0's rendezvous on a port found free now, before any rank loads (a busy one fails at once)."""
    try:
        return dist.TCPStore("127.0.0.1", free_port(), world, is_master=True, wait_for_workers=False,
                             timeout=STEP_TIMEOUT)
    except (RuntimeError, dist.DistError) as e:
        raise BriskError(f"--tp {world}: no port for the ranks to meet on ({first_line(e)})") from None


def _wait_for_followers(store, children: list) -> None:
    """Until every follower has joined; one that ends first ends the run (no wait for a timeout)."""
    deadline = time.monotonic() + STEP_TIMEOUT.total_seconds()
    while store.add("joined", 0) < len(children):
        for r, p in enumerate(children, start=1):
            if p.poll() is not None:
                _shutdown(children)
                raise BriskError(f"--tp {len(children) + 1}: rank {r} ended while starting (exit code {p.returncode})")
        if time.monotonic() > deadline:
            _shutdown(children)
            raise BriskError(f"--tp {len(children) + 1}: the ranks did not start within {STEP_TIMEOUT.seconds} s")
        time.sleep(0.05)


def _spawn(rank: int, world: int, port: int, load_args: dict) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # start_new_session: rank 0 kills the child's whole group, and a Ctrl-C at the terminal reaches
    # rank 0 alone (which then stops the followers) instead of every rank at once
    return subprocess.Popen([sys.executable, "-m", "brisk.core.tp_follower", json.dumps(load_args)],
                            env=env, start_new_session=True, stdin=subprocess.DEVNULL)


def _shutdown(children: list) -> None:
    """Rank 0's exit: tell the followers to stop, make sure none is left, then end the process
    groups and the store (atexit runs this before the interpreter finalizes)."""
    told = _group is not None and _group.control is not None and dist.is_initialized() and _tell_stop(_group.control)
    deadline = time.monotonic() + (3 if told else 0)  # not told: no need to wait
    for p in children:
        with contextlib.suppress(Exception):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in children:
        if p.poll() is None:
            with contextlib.suppress(Exception):
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    _release()


def _tell_stop(control) -> bool:
    """Send the stop (as broadcast_object_list does: its size, then its pickle), waiting up to 1 s
    for it to go out: after a pass cut short the followers wait inside it, not for a step. Not from
    a Python thread: one still inside the collective when the interpreter finalizes is ended there
    by an unwind through torch's C++ frames, which aborts the process ("terminate called without
    an active exception"). The group's own C++ worker holds the send; it ends once the followers do."""
    payload = torch.frombuffer(bytearray(pickle.dumps(("stop",))), dtype=torch.uint8)
    try:
        works = [dist.broadcast(torch.tensor([payload.numel()]), src=0, group=control, async_op=True),
                 dist.broadcast(payload, src=0, group=control, async_op=True)]
        deadline = time.monotonic() + 1
        for work in works:
            work.wait(timedelta(seconds=max(0.01, deadline - time.monotonic())))
        return True
    except Exception:  # timed out, or the followers are gone
        return False


def _release() -> None:
    """End rank 0's process groups and, with them, the store it hosts, while the interpreter
    still runs: left to its teardown, gloo's and the store's C++ threads are joined (or not)
    in whatever order objects happen to be freed then. Their sends end with the followers, which
    are gone by now, so the joins do not wait."""
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    if _group is not None:
        _group.control = None  # the last reference: the group (and the store under it) is freed here


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def become_follower() -> None:
    """In a follower brisk started (tp_follower.py): join rank 0's store, and end when rank 0 is
    gone, even killed (no orphans)."""
    global _spawned
    _spawned = True
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="tp-parent-watch").start()


# ------------------------------------------------------------------ sharding


def check_shardable(cfg, world: int) -> None:
    """What this installment shards; refused by name before any rank loads weights twice."""
    if cfg.n_heads < world:
        raise BriskError(f"--tp {world}: the model's {cfg.n_heads} attention heads do not split over {world} ranks")
    dense = any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    if dense and cfg.ffn_dim % world:
        raise BriskError(f"--tp {world}: the MLP's width {cfg.ffn_dim} does not split over {world} ranks")
    if cfg.n_experts and cfg.expert_ffn_dim % world:
        raise BriskError(f"--tp {world}: each expert's width {cfg.expert_ffn_dim} does not split over {world} ranks")


def check_load(ckpt, world: int, quantize: str) -> None:
    """Refusals that need the checkpoint's header only, before any rank is started: the formats
    not sharded yet, a GGUF whose o/down blocks a rank's part of the columns would cut (where they
    are cut as blocks: not when --quantize widens the layer first), a GPTQ/AWQ/bitsandbytes/MXFP4
    layer whose groups or blocks it would (tp_quantized.check), and with --quantize nf4 a layer
    whose NF4 blocks it would."""
    cfg = ckpt.config
    check_shardable(cfg, world)
    if quantize == "nf4":
        _check_nf4_blocks(cfg, world)
    if ckpt.quant_config:
        from . import tp_quantized

        tp_quantized.check(ckpt, world)
        return
    if not all(isinstance(m, GGUFLinear) for m in ckpt.modules.values()):
        raise BriskError(f"--tp {world}: {ckpt.name} loads quantized in a format not sharded yet (float weights, "
                         "--quantize int8/int4/nf4, a GGUF's blocks on the CPU, GPTQ, AWQ, bitsandbytes and "
                         "MXFP4 are; "
                         "--quantize none loads a GGUF in float)")
    spans = {"o_proj": [(lo * cfg.head_dim, hi * cfg.head_dim) for lo, hi, _ in
                        (heads_of(cfg, r, world) for r in range(world))],
             "down_proj": [span(cfg.ffn_dim, r, world) for r in range(world)],
             "expert down_proj": [span(cfg.expert_ffn_dim, r, world) for r in range(world)]}
    for name, m in ckpt.modules.items():
        kind = ("expert " if ".experts." in name else "") + name.rsplit(".", 1)[-1]
        if kind in spans and not widened_before_cut(m, quantize):  # a GGUF's rows are whole blocks
            block = gguf_types.BY_ID[m.qtype].block_weights
            check_blocks(name, m.type_name, block, block, spans[kind], world)


def _check_nf4_blocks(cfg, world: int) -> None:
    """--quantize nf4 quantizes each float shard after the cut (quantize_at_load); it holds the
    single process's codes and block scales only where the whole layer's blocks of the row-major
    weight are the shard's: rows of whole blocks (q/k/v and gate/up read the model's width) and
    o/down's columns cut at block boundaries."""
    every = [parts(cfg, r, world) for r in range(world)]
    for prefix, p in every[0].items():
        spans = [(q[prefix].lo, q[prefix].hi) for q in every] if p.rows is None else []
        check_blocks(prefix, "NF4", NF4_BLOCK, spans[-1][1] if spans else cfg.dim, spans, world)


def widened_before_cut(layer: GGUFLinear, quantize: str) -> bool:
    """Whether --quantize int8|int4 has the single process quantize this GGUF layer from float (llm.
    quantize_at_load), so that a row-parallel one is widened whole before its columns are cut: int8
    always (a scale spans a whole row), int4 unless the 4-bit blocks carry over as they are."""
    if quantize == "int8":
        return True
    return quantize == "int4" and not (gguf_blocks.fits(layer.qtype, layer.in_features) and layer.qtype != Q8_0)


def _widened(layer: GGUFLinear) -> nn.Linear:
    """A GGUF layer in float32, as the single process widens it for --quantize."""
    out = nn.Linear(1, 1, bias=False)
    _set_linear(out, layer.dequantize(torch.float32), layer.bias)
    release_file_pages(layer)
    return out


def _set_linear(layer: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    layer.out_features, layer.in_features = weight.shape


def _kept_blocks(blocks: torch.Tensor, like: GGUFLinear, bias: torch.Tensor | None) -> GGUFLinear:
    """A GGUF shard's blocks (file layout) as a layer of like's type, interleaved for the kernels
    now that the rank holds only its part."""
    layer = kept_layer(blocks.contiguous(), like.qtype, blocks.shape[0],
                       blocks.shape[1] // gguf_types.BY_ID[like.qtype].block_bytes
                       * gguf_types.BY_ID[like.qtype].block_weights)
    release_file_pages(like)  # cut once: the whole layer is not read again
    layer.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    return layer


def _take_rows(layer: nn.Module, rows: torch.Tensor) -> nn.Module:
    """A column-parallel layer's output rows `rows` (a GGUF's rows are whole blocks in any format)."""
    if getattr(layer, "tp_cut", False):
        return layer
    bias = None if layer.bias is None else layer.bias[rows].clone()
    if isinstance(layer, GGUFLinear):
        return _kept_blocks(layer.blocks[rows], layer, bias)
    _set_linear(layer, layer.weight[rows], bias)  # indexing copies: the full tensor is freed once dropped
    return layer


def cut_checkpoint(ckpt, group: Group) -> set[str]:
    """A quantized checkpoint's layers cut to this rank's parts before the model is built (the
    kernels then pack the shard alone); the names of those cut, for shard to leave as they are."""
    if not ckpt.quant_config:
        return set()
    from . import tp_quantized

    return tp_quantized.cut(ckpt, group.rank, group.world)


def shard(net: Transformer, group: Group, quantize: str = "none", cut: set[str] = frozenset()) -> None:
    """Cut a loaded Transformer down to this rank's shard, in place. quantize int8|int4|nf4: each
    float shard then quantized as the whole layer would be (whole groups of 32 columns, NF4's whole
    blocks: check_load; an int8 row's scale from the whole row), so the ranks hold the
    single-process model's codes. A GGUF's
    kept blocks are cut as the file stores them (o/down by whole blocks of columns), then
    interleaved. `cut`: the layers cut_checkpoint already cut, left as they are."""
    cfg, rank, world = net.cfg, group.rank, group.world
    check_shardable(cfg, world)
    for name in cut:
        net.get_submodule(name).tp_cut = True
    for m in net.modules():
        if type(m) not in (nn.Linear, Router) and isinstance(m, nn.Linear):
            raise BriskError(f"--tp: {type(m).__name__} layers are not sharded yet (a float load only: "
                             "--quantize none, or a float checkpoint)")
    hd = cfg.head_dim
    q_lo, q_hi, kv = heads_of(cfg, rank, world)
    heads = q_hi - q_lo
    q_rows, kv_rows = head_rows(list(range(q_lo, q_hi)), hd), head_rows(kv, hd)
    f_lo, f_hi = span(cfg.ffn_dim, rank, world)
    e_lo, e_hi = span(cfg.expert_ffn_dim, rank, world)
    if quantize == "int4" and (heads * hd % GROUP or (f_hi - f_lo) % GROUP or (e_hi - e_lo) % GROUP):
        raise BriskError(f"--tp {world} with --quantize int4: a rank's part of o_proj ({heads * hd} columns) or "
                         f"down_proj ({f_hi - f_lo if not cfg.n_experts else e_hi - e_lo}) is not whole groups "
                         f"of {GROUP}")
    for block in net.model.layers:
        a, mlp = block.self_attn, block.mlp
        a.q_proj = _take_rows(a.q_proj, q_rows)
        a.k_proj, a.v_proj = _take_rows(a.k_proj, kv_rows), _take_rows(a.v_proj, kv_rows)
        # the bias once, on rank 0: the all-reduce adds every rank's part
        a.o_proj = _columns(a.o_proj, q_lo * hd, q_hi * hd, rank == 0, quantize)
        if a.sinks is not None:
            a.sinks = nn.Parameter(a.sinks[q_lo:q_hi].clone(), requires_grad=False)
        a.n_heads, a.n_kv = heads, len(kv)
        # an MoE layer: every expert cut as an MLP is, the router whole (each rank routes alike)
        for m, (lo, hi) in [(mlp, (f_lo, f_hi))] if isinstance(mlp, MLP) else [(e, (e_lo, e_hi)) for e in mlp.experts]:
            rows = torch.arange(lo, hi)
            m.gate_proj, m.up_proj = _take_rows(m.gate_proj, rows), _take_rows(m.up_proj, rows)
            m.down_proj = _columns(m.down_proj, lo, hi, rank == 0, quantize)
    if quantize in ("int8", "int4") and cfg.tie_embeddings and not isinstance(net.lm_head, GGUFLinear):
        # lookups read the whole quantized table, as a single process's do from its quantized head
        table = quantize_linear(net.lm_head, quantize, GROUP, keep_codes=True)
        net.model.embed_tokens = QuantEmbedding(table, net.model.norm.weight.dtype, owner=True)
    emb = net.model.embed_tokens
    # a table tied to a head kept quantized (a GGUF's blocks, a checkpoint's format)
    tied_quantized = isinstance(emb, QuantEmbedding) and emb.head is net.lm_head
    _shard_head(net, rank, world)
    if tied_quantized:  # lookups from the head's part of the vocabulary: no rank holds the whole table
        net.model.embed_tokens = VocabShardEmbedding(net.lm_head, rank, cfg.vocab_size, emb.dtype, owner=False)
    elif isinstance(emb, QuantEmbedding) and isinstance(emb.head, GGUFLinear) and emb.head is not net.lm_head:
        # an untied GGUF table, cut the same way
        per = -(-cfg.vocab_size // world)
        net.model.embed_tokens = VocabShardEmbedding(_vocab_part(emb.head, rank * per, per), rank, cfg.vocab_size,
                                                     emb.dtype, owner=True)
    net.cfg = replace(cfg, n_heads=heads, n_kv_heads=len(kv))
    trim_heap()  # the whole layers' copies (reordered q/k rows) and the cuts' temporaries are freed now
    net.__class__ = ShardedTransformer
    net.__dict__["_tp"] = group


def connect(net: ShardedTransformer) -> None:
    """The collectives, as forward hooks on the layers' final modules (call after any quantization
    at load, which replaces them): an all-reduce after o_proj and down_proj (an MoE layer: after
    the layer), the all-gather of the logits after the output layer. Numbers the model for the
    steps that name it."""
    _register(net)
    for block in net.model.layers:
        block.self_attn.o_proj.register_forward_hook(_all_reduce_output)
        # an MoE layer's output once, after its experts' partial outputs are weighted and added
        (block.mlp.down_proj if isinstance(block.mlp, MLP) else block.mlp).register_forward_hook(_all_reduce_output)
    net.lm_head.register_forward_hook(_gather_vocab(net.cfg.vocab_size))
    _table_follows_head(net)


def _table_follows_head(net: Transformer) -> None:
    """A GGUF's vocabulary-split table tied to the head, which --quantize int8|int4 has replaced
    since the cut: lookups read the quantized head's rows, as the single process's do."""
    emb = net.model.embed_tokens
    if isinstance(emb, VocabShardEmbedding) and "head" not in emb._modules and emb.head is not net.lm_head:
        net.model.embed_tokens = VocabShardEmbedding(net.lm_head, net.__dict__["_tp"].rank, net.cfg.vocab_size,
                                                     emb.dtype, owner=False)


GROUP = 32  # quantize_at_load's int4 group size: a column shard must hold whole groups


def _columns(layer: nn.Linear, lo: int, hi: int, keep_bias: bool, quantize: str) -> nn.Module:
    """A row-parallel layer's input columns lo:hi. int8 scales each output row by its whole row, so
    the shard is cut from the whole layer's codes (quantize_at_load then leaves it as it is); a
    GGUF's layer that one process quantizes from float is widened whole first."""
    if getattr(layer, "tp_cut", False):
        return layer
    if isinstance(layer, GGUFLinear) and widened_before_cut(layer, quantize):
        layer = _widened(layer)
    bias = layer.bias if keep_bias else None
    if isinstance(layer, GGUFLinear):  # whole blocks of columns (check_load refused the rest)
        t = gguf_types.BY_ID[layer.qtype]
        return _kept_blocks(layer.blocks[:, lo // t.block_weights * t.block_bytes:hi // t.block_weights * t.block_bytes],
                            layer, bias)
    if quantize == "int8":
        q, scales = quantize_int8(layer.weight)
        return Int8Linear(q[:, lo:hi].contiguous(), scales, bias)
    _set_linear(layer, layer.weight[:, lo:hi].contiguous(), bias)
    return layer


def _shard_head(net: Transformer, rank: int, world: int) -> None:
    """The output layer by vocabulary, in equal parts (the last padded with zero rows: an
    all-gather takes equal sizes), gathered and cut back to the vocabulary after each pass."""
    if getattr(net.lm_head, "tp_cut", False):  # a checkpoint's quantized head, cut by tp_quantized
        return
    vocab = net.cfg.vocab_size
    per = -(-vocab // world)
    lo, hi = min(rank * per, vocab), min((rank + 1) * per, vocab)
    if isinstance(net.lm_head, GGUFLinear):
        head = net.lm_head
        net.lm_head = _vocab_part(head, lo, per)
        net.lm_head.refine_top = head.refine_top
        return
    w = net.lm_head.weight
    part = w[lo:hi]
    if hi - lo < per:
        part = torch.cat([part, part.new_zeros(per - (hi - lo), w.shape[1])])
    elif w is not getattr(net.model.embed_tokens, "weight", None):  # tied: a view of the embedding's rows
        part = part.clone()
    _set_linear(net.lm_head, part, None)


def _vocab_part(table: GGUFLinear, lo: int, per: int) -> GGUFLinear:
    """Rows lo:lo+per of a GGUF table (the last part padded: zero bytes are zero weights in every
    block format)."""
    part = table.blocks[lo:lo + per]
    return _kept_blocks(torch.cat([part, part.new_zeros(per - part.shape[0], part.shape[1])]), table, None)


class VocabShardEmbedding(QuantEmbedding):
    """Token lookups from this rank's part of the vocabulary (rows rank*per.. of the table): a token
    outside it looks up zeros, and the all-reduce adds the one rank's row to the others' zeros, so
    every rank gets the exact row while holding 1/N of the table."""

    def __init__(self, part: QuantLinear, rank: int, vocab: int, dtype: torch.dtype, owner: bool):
        super().__init__(part, dtype, owner)
        self.lo, self.num_embeddings = rank * part.out_features, vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        mine = (local >= 0) & (local < self.head.out_features)
        out = self.head.rows(torch.where(mine, local, 0), self.dtype) * mine[..., None]
        return _all_reduce_output(self, None, out)


def _all_reduce_output(module, inputs, out: torch.Tensor) -> torch.Tensor:
    out = out.contiguous()
    _group.all_reduce(out)
    return out


def _gather_vocab(vocab: int):
    def hook(module, inputs, out: torch.Tensor) -> torch.Tensor:
        return _group.gather_columns(out.contiguous())[..., :vocab]
    return hook


# ------------------------------------------------------------------ running


_cache_keys = itertools.count()


class ShardedTransformer(NativeBlocksTransformer):
    """A Transformer holding one rank's shard. On rank 0 each pass is first sent to the followers
    (which run it through Transformer.forward on their own caches); a rank that fails mid-pass
    ends the run with one error naming it."""

    # each pass first sends its step to the other ranks: a captured CUDA graph cannot replay that
    graph_safe = False

    @property
    def ranks(self) -> int:
        return self.__dict__["_tp"].world

    def native_collectives(self):
        # on one host a rank's blocks run natively, the all-reduces inside the call; MoE layers, a
        # bias on o (rank 0's alone, added before the sum) and gloo stay with the torch blocks and
        # their hooks: the same choice on every rank
        shm = self.__dict__["_tp"].shm
        if shm is None or self.cfg.o_bias or any(isinstance(b.mlp, MoE) for b in self.model.layers):
            return False
        return shm

    def forward(self, tokens, start, kv, tree=None, logit_rows=None, return_hidden=False):
        group: Group = self.__dict__["_tp"]
        if group.rank != 0:
            return super().forward(tokens, start, kv, tree, logit_rows, return_hidden)
        if _broken:
            raise BriskError(f"--tp: the ranks were stopped after an error on rank 0 ({_broken[0]})")
        spec = _cache_spec(kv)  # before anything is sent: a refused cache leaves the followers waiting for a step
        with _one_pass(group):
            _send(("forward", self.__dict__["_tp_model"], spec, _dropped(), _dropped_models(), _moved_paths(),
                   _cpu(tokens), _cpu(start), _cpu(tree), _cpu(logit_rows), return_hidden))
            return super().forward(tokens, start, kv, tree, logit_rows, return_hidden)


def everywhere(fn, net: ShardedTransformer, *args):
    """fn(net's counterpart, *args) on every rank, rank 0's result returned: work on the shards
    outside a forward pass (a draft built from each rank's shard, rows gathered over the ranks).
    fn is a module-level function (sent by name), args plain values."""
    group: Group = net.__dict__["_tp"]
    if _broken:
        raise BriskError(f"--tp: the ranks were stopped after an error on rank 0 ({_broken[0]})")
    with _one_pass(group):
        _send(("call", fn, net.__dict__["_tp_model"], args))
        return fn(net, *args)


@contextlib.contextmanager
def _one_pass(group: Group):
    """Rank 0's side of a step every rank runs: Ctrl-C waits for its end, and a rank that fails
    inside it ends the run with one error naming it."""
    try:
        with _interrupt_after_pass():
            yield
    except RuntimeError as e:
        gone = _gone(group)
        if not gone and not _peer_failure(e):
            _stop_followers(group, e)
            raise  # not the ranks' failure: a bug shows as one
        raise BriskError(f"--tp: {gone} ended, so the run stops" if gone else
                         f"--tp: a rank stopped answering ({_reason(e)})") from None
    except Exception as e:
        _stop_followers(group, e)
        raise


def _cpu(t):
    return t.cpu() if torch.is_tensor(t) else t  # the steps go over gloo


_broken: list[str] = []  # rank 0's error that stopped the followers mid-pass


def _stop_followers(group: Group, e: BaseException) -> None:
    """Rank 0 failed inside a pass: the followers wait in its collectives and would hang until
    the step timeout, so they are ended now, and later passes refused with the cause."""
    _broken.append(first_line(e))
    _shutdown(group.children)  # under torchrun: its end of the groups makes the followers' collectives fail at once


@contextlib.contextmanager
def _interrupt_after_pass():
    """Ctrl-C during a pass takes effect once the pass is done on every rank: cut short on rank 0
    alone, it would leave the followers inside the pass (chat goes on after an interrupted answer)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    hit = []
    signal.signal(signal.SIGINT, lambda *_: hit.append(1))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hit:
        raise KeyboardInterrupt


def _peer_failure(e: RuntimeError) -> bool:
    """Whether a collective failed because another rank did (gloo raises plain RuntimeErrors)."""
    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(w in text for w in ("gloo", "nccl", "connection", "timed out"))


def _reason(e: BaseException) -> str:
    """gloo's message without its source path and advice: 'Read error ...: Connection reset by peer'."""
    return re.sub(r"^\[[^\]]*\]\s*", "", first_line(e)).split(". ")[0][:200]


def _gone(group: Group) -> str:
    """'rank k (how it ended)' for a follower rank 0 started that has ended, or ''. A rank that
    left because another one failed (PEER_FAILED) is named only when no other is."""
    time.sleep(0.2)  # a dying child's exit code shows a moment after its sockets close
    ended = [(r, p.returncode) for r, p in enumerate(group.children, start=1) if p.poll() is not None]
    ended.sort(key=lambda e: e[1] == PEER_FAILED)
    if not ended:
        return ""
    r, code = ended[0]
    return f"rank {r} ({f'killed by signal {-code}' if code < 0 else f'exit code {code}'})"


_model_keys = itertools.count()
_models: dict = {}  # a follower's sharded models by the number rank 0's go by (the target, drafts)
_pending_model_drops: list[int] = []


def _register(net: ShardedTransformer) -> None:
    """Number a sharded model: every rank builds the same models in the same order (the target at
    load, each draft through `everywhere`), so a step names the one it runs. Rank 0's end of a
    draft frees the followers' copies."""
    key = net.__dict__["_tp_model"] = next(_model_keys)
    if net.__dict__["_tp"].rank == 0:
        weakref.finalize(net, _pending_model_drops.append, key)  # sent with the next step
    else:
        _models[key] = net


def _dropped_models() -> list[int]:
    out = _pending_model_drops[:]
    del _pending_model_drops[:]
    return out


_pending_drops: list[int] = []


def _dropped() -> list[int]:
    """The caches rank 0 has freed since its last step: the followers free theirs."""
    out = _pending_drops[:]
    del _pending_drops[:]
    return out


def _cache_spec(kv) -> tuple:
    """What a follower needs to make (once) and find its own cache matching rank 0's: a contiguous
    cache's shape; a paged pool's shape and this step's slots and block tables (rank 0's scheduler
    decides them, so every rank's pool holds the same blocks)."""
    if isinstance(kv, ContiguousKV):
        if type(kv) is ContiguousKV:
            kv.__class__ = _MirroredKV
        k = kv.k[0]
        return "contiguous", _key(kv), len(kv.k), k.shape[1], k.shape[0], kv.max_len, kv.type
    if isinstance(kv, PagedStep):
        pool = kv.kv
        step = (_cpu(kv.slots), kv.n_decode, _cpu(kv.decode_blocks), _cpu(kv.decode_lens),
                [(s, t, p, _cpu(blocks)) for s, t, p, blocks in kv.prefills])
        return "paged", _key(pool), pool.k.shape[0], pool.k.shape[3], pool.n_blocks, pool.block_size, pool.type, step
    raise BriskError(f"--tp: the {type(kv).__name__} cache is not supported yet")


_pending_paths: list[tuple[int, int, list[int]]] = []


def _moved_paths() -> list[tuple[int, int, list[int]]]:
    """The tree paths rank 0 has kept in its caches since its last step (ContiguousKV.keep_path):
    each follower moves the same K/V in its own before the step runs."""
    out = _pending_paths[:]
    del _pending_paths[:]
    return out


class _MirroredKV(ContiguousKV):
    """Rank 0's contiguous cache: a tree step's accepted path, moved here, is moved on the
    followers too, sent with the next step (the first to read those slots)."""

    def keep_path(self, start: int, slots: list[int]) -> None:
        super().keep_path(start, slots)
        _pending_paths.append((_key(self), start, list(slots)))


def _key(cache) -> int:
    """The number rank 0's cache goes by on every rank; its end frees the followers' copies."""
    key = cache.__dict__.get("_tp_key")
    if key is None:
        key = cache.__dict__["_tp_key"] = next(_cache_keys)
        weakref.finalize(cache, _pending_drops.append, key)  # sent with the next step, never from a finalizer
    return key


def _send(step: tuple) -> None:
    dist.broadcast_object_list([step], src=0, group=_group.control)


def follow_and_exit(net: ShardedTransformer, head_dim: int) -> None:
    """A follower rank's end: follow rank 0, then leave (a failure of rank 0's side ends it quietly:
    rank 0 reports it)."""
    code = 0
    try:
        follow(net, head_dim)
    except (RuntimeError, dist.DistError):
        code = PEER_FAILED
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(code)


def follow(net: ShardedTransformer, head_dim: int) -> None:
    """A follower rank's life after loading: run rank 0's passes until it says stop."""
    group: Group = net.__dict__["_tp"]
    w = net.model.norm.weight
    caches: dict = {}
    with torch.inference_mode():
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=group.control)
            step = box[0]
            if step[0] == "stop":
                return
            if step[0] == "call":
                _, fn, model, args = step
                fn(_models[model], *args)
                continue
            _, model, spec, drops, model_drops, paths, tokens, start, tree, rows, hidden = step
            for key, first, slots in paths:  # before the drops: a path kept just before its cache ended
                if key in caches:
                    caches[key].keep_path(first, slots)
            for d in drops:
                caches.pop(d, None)
            for d in model_drops:
                _models.pop(d, None)
            run = _models[model]  # the target, or a draft built from its shard
            tokens = tokens.to(w.device)
            start = start.to(w.device) if torch.is_tensor(start) else start
            rows = rows.to(w.device) if torch.is_tensor(rows) else rows
            kv = _follower_cache(caches, spec, run.cfg.n_kv_heads, head_dim, w, tokens, start, rows)
            run(tokens, start, kv, None if tree is None else tree.to(w.device), rows, hidden)


def _follower_cache(caches: dict, spec: tuple, kv_heads: int, head_dim: int, w: torch.Tensor, tokens, positions,
                    rows):
    """The follower's cache for rank 0's `spec` (made on first sight): its contiguous cache, or a
    PagedStep over its pool with rank 0's slots and block tables; over its own kv_heads (a split
    of the heads that is not even gives ranks different counts)."""
    kind, key, layers = spec[:3]
    if kind == "contiguous":
        batch, max_len, kv_type = spec[4:]
        if key not in caches:
            caches[key] = ContiguousKV(layers, kv_heads, head_dim, max_len, w.dtype, w.device, batch, kv_type)
        return caches[key]
    n_blocks, block_size, kv_type, (slots, n_decode, dec_blocks, dec_lens, prefills) = spec[4:]
    if key not in caches:
        caches[key] = PagedKV(layers, kv_heads, head_dim, n_blocks, block_size, w.dtype, w.device, kv_type)
    pool = caches[key]
    # rank 0 zeroes a block when its pool hands it out; here, when a step first reads or writes it
    used = set() if dec_blocks is None else set(dec_blocks.unique().tolist())
    for _, _, _, blocks in prefills:
        used.update(blocks.tolist())
    pool.first_use(sorted(used))
    to = lambda t: None if t is None else t.to(w.device)  # noqa: E731
    return PagedStep(pool, tokens[0], positions, to(slots), n_decode, to(dec_blocks), to(dec_lens),
                     [(s, t, p, blocks.to(w.device)) for s, t, p, blocks in prefills], rows)
