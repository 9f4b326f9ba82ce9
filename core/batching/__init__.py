"""Continuous batching, split as vLLM v1 splits it (scaled down): the block pool's bookkeeping
(block_pool.py), each sequence's block table and prefix hashes (kv_manager.py), what runs next
(scheduler.py), and the loop that runs it (engine.py). The K/V tensors are the paged KV's (core/kv).
serial.py: one request at a time through the speculative loop instead (brisk serve --draft)."""
from .block_pool import BlockPool, block_hash
from .engine import Engine, EngineStats, EngineThread, default_kv_tokens
from .scheduler import Request, Sequence
from .serial import SerialEngine

__all__ = ["BlockPool", "Engine", "EngineStats", "EngineThread", "Request", "Sequence", "SerialEngine", "block_hash",
           "default_kv_tokens"]
