"""Cache techniques, one module each, behind the `CacheStrategy` interface (caches/base.py)."""

from dllm_jax.caches.base import CacheStrategy, DecodeInputs
from dllm_jax.caches.dual import DualCache
from dllm_jax.caches.full import NoCache
from dllm_jax.caches.prefix import PrefixCache

STRATEGIES = {"none": NoCache(), "prefix": PrefixCache(), "dual": DualCache()}

__all__ = ["STRATEGIES", "CacheStrategy", "DecodeInputs", "DualCache", "NoCache", "PrefixCache"]
