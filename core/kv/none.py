"""No cache: each call's tokens attend to each other only (calibration runs whole sequences once)."""
from __future__ import annotations

import torch

from .base import KV, attention_masks, sdpa


class NoKV(KV):
    def begin(self, start, T, tree=None):
        if not isinstance(start, int) or start != 0:
            raise ValueError("NoKV runs whole sequences from position 0")
        self.T, self.tree, self._masks = T, tree, {}

    def attend(self, layer, q, k, v, window, scale, sinks=None):
        key = window if window and window < self.T else None
        if key not in self._masks:  # made once per step, shared by the layers
            pos = torch.arange(self.T, device=q.device)
            self._masks[key] = attention_masks(pos, self.T, key, self.tree)[key is not None]
        return sdpa(q, k, v, self._masks[key], scale, sinks).transpose(1, 2)
