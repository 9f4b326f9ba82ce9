"""Drafters over a tensor-parallel target (--tp N) that are built from the target itself: a
self-draft (--draft self:int8|int4) is the target's shard on each rank quantized, run on every
rank in step with the target, in the target's own cache (each rank's over its KV heads)."""
from __future__ import annotations

import copy
from collections import OrderedDict

from torch import nn

from .. import tensor_parallel
from ..kernel_passes import apply_device_kernels

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
