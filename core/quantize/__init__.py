"""Quantize a whole model into a Hugging Face folder (`brisk quantize`); the flow is in pipeline.py."""
from .options import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, METHODS, QuantOptions
from .pipeline import LayerStats, QuantSummary, quantize_model
from .recipes import AWQ_FEED, awq_groups, fold_scales

__all__ = ["AWQ_FEED", "DEFAULT_SAMPLES", "DEFAULT_SEQ_LEN", "METHODS", "LayerStats", "QuantOptions",
           "QuantSummary", "awq_groups", "fold_scales", "quantize_model"]
