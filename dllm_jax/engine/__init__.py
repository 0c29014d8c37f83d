"""Serving engine: many requests over one paged KV pool with continuous batching and shared affixes stored once.
Modules: request, intake (checks at entry), block_manager, affix_index, kv_pool, scheduler, runner, engine: the loop."""

from dllm_jax.engine.engine import Engine, EngineConfig
from dllm_jax.engine.intake import AffixHandle, RequestError
from dllm_jax.engine.request import BlockOutput
from dllm_jax.engine.scheduler import QueueFull

__all__ = ["AffixHandle", "BlockOutput", "Engine", "EngineConfig", "QueueFull", "RequestError"]
