"""Serving engine: many requests over one paged KV pool with continuous batching and shared affixes stored once.

One idea per module: request (a request's state), intake (checking and resolving a request where it enters),
block_manager (pages, refcounts, hashes), affix_index (finding shared spans), kv_pool (the device pool and its page
tables), scheduler (admission), runner (device inputs and the jitted calls), engine (the loop)."""

from dllm_jax.engine.engine import AffixHandle, Engine, EngineConfig, QueueFull, RequestError, enable_compile_cache
from dllm_jax.engine.request import BlockOutput

__all__ = ["AffixHandle", "BlockOutput", "Engine", "EngineConfig", "QueueFull", "RequestError", "enable_compile_cache"]
