"""brisk's engine: load a model, generate, chat.

Names are imported lazily so that `brisk --help` and error paths do not pay for torch.
"""
from importlib import import_module

_EXPORTS = {"LLM": "llm", "Chat": "chat", "Session": "generate", "GenerationResult": "output_stream",
            "SamplingParams": "sampling", "GREEDY": "sampling", "BriskError": "errors"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(name)
