"""Drafters over a tensor-parallel target (--tp N) that are built from the target itself: a
self-draft (--draft self:int8|int4) is the target's shard on each rank quantized, run on every
rank in step with the target, in the target's own cache (each rank's over its KV heads); trained
heads (--draft heads:PATH) run on rank 0 alone, over the output layer's rows for their draft
vocabulary gathered from the ranks once (docs/internals.md says why)."""
from __future__ import annotations

import copy
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

from .. import tensor_parallel
from ..kernel_passes import apply_device_kernels
from .heads_net import output_rows

# the hooks a module's forward runs: the copy registers its own collectives (connect)
_FORWARD_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                  "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")


def self_draft(target: tensor_parallel.ShardedTransformer, method: str) -> tensor_parallel.ShardedTransformer:
    """Rank 0's self-draft; every other rank builds its own from its shard at the same time."""
    return tensor_parallel.everywhere(_quantized_shard_copy, target, method)


def _quantized_shard_copy(target: tensor_parallel.ShardedTransformer, method: str) -> nn.Module:
    """The rank's shard with its linear layers (the output layer's part included) quantized, as
    quantized_copy does for a whole model: it splits as the target does, so it takes the same
    collectives. A row-parallel layer's int8 scales span the rank's part of a row (the draft
    only proposes: the target verifies every token)."""
    from ...quant.linear import quantize_model

    draft = _sharing_copy(target)
    quantize_model(draft, method, head=True)
    tensor_parallel.connect(draft)
    apply_device_kernels(draft, draft.model.norm.weight.device)
    return draft.eval()


def _sharing_copy(m: nn.Module) -> nn.Module:
    """m's module tree copied, its tensors and other attributes shared (no float copy), without
    its forward hooks."""
    c = copy.copy(m)
    c._parameters, c._buffers = dict(m._parameters), dict(m._buffers)
    c._modules = {name: None if s is None else _sharing_copy(s) for name, s in m._modules.items()}
    for hooks in _FORWARD_HOOKS:
        if hooks in vars(m):
            c.__dict__[hooks] = OrderedDict()
    return c


def head_rows(target: tensor_parallel.ShardedTransformer, vocab: torch.Tensor) -> torch.Tensor:
    """The output layer's rows for the token ids `vocab` [n] as float32 [n, dim] on rank 0, from
    the ranks' parts of the vocabulary: each rank gives the rows in its part and zeros for the
    rest, and an all-reduce adds them (exact: one rank's row plus zeros)."""
    return tensor_parallel.everywhere(_vocab_rows, target, vocab.cpu())


def _vocab_rows(net: tensor_parallel.ShardedTransformer, vocab: torch.Tensor) -> torch.Tensor:
    per = net.lm_head.out_features  # every rank's part is as long (the last one padded)
    local = vocab.to(net.model.norm.weight.device) - net.__dict__["_tp"].rank * per
    mine = (local >= 0) & (local < per)
    rows = output_rows(net, torch.where(mine, local, 0), torch.float32) * mine[:, None]
    dist.all_reduce(rows)
    return rows


def embedder(target: tensor_parallel.ShardedTransformer):
    """How rank 0 looks up the pending token's embedding for the heads: from its own table where
    every rank holds it whole, else (a GGUF's table split by vocabulary: a lookup is an
    all-reduce) on every rank."""
    if isinstance(target.model.embed_tokens, tensor_parallel.VocabShardEmbedding):
        return lambda ids: tensor_parallel.everywhere(_embed, target, ids.cpu()).to(ids.device)
    return target.embed


def _embed(net: tensor_parallel.ShardedTransformer, ids: torch.Tensor) -> torch.Tensor:
    return net.embed(ids.to(net.model.norm.weight.device))
