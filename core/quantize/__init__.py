"""Quantize a whole model into a Hugging Face folder (`brisk quantize`); the flow is in pipeline.py."""
# options.py imports no torch, so `brisk quantize` checks its flags before loading the model stack;
# the pipeline and recipes (torch) load on first use.
from .options import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, METHODS, QuantOptions

_LAZY = {"LayerStats": "pipeline", "QuantSummary": "pipeline", "quantize_model": "pipeline",
         "AWQ_FEED": "recipes", "awq_groups": "recipes", "fold_scales": "recipes"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AWQ_FEED", "DEFAULT_SAMPLES", "DEFAULT_SEQ_LEN", "METHODS", "LayerStats", "QuantOptions",
           "QuantSummary", "awq_groups", "fold_scales", "quantize_model"]
