"""The one cache of a layer's native.NativeWeight (the kernels' descriptor of its tensors): built on
first use, dropped whenever the layer's tensors may have moved. Every layer the native kernels run
(GGUF, int8, int4, zero-point, float) takes it from here."""
from __future__ import annotations

from . import native


class LazyNativeWeight:
    """Mixin for an nn.Module (put it before the module class): `_native()` is the layer's
    NativeWeight, made by `_build_native()` on first use and again after a move between devices or
    dtypes (`_apply`: the descriptor holds raw pointers) or where `_native_stale(nw)` says a tensor
    was replaced by assignment, which `_apply` does not see."""

    def _build_native(self) -> native.NativeWeight:
        raise NotImplementedError

    def _native_stale(self, nw: native.NativeWeight) -> bool:
        return False

    def _native(self) -> native.NativeWeight:
        nw = self.__dict__.get("_native_weight")  # not an attribute: nn.Module's __setattr__ stays out of it
        if nw is None or self._native_stale(nw):
            nw = self.__dict__["_native_weight"] = self._build_native()
        return nw

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_native_weight", None)
        return super()._apply(fn, recurse)
