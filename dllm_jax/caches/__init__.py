"""Cache techniques, one module each, behind the `CacheStrategy` interface (caches/base.py)."""

from dllm_jax.caches.acache import AnchoredRefresh
from dllm_jax.caches.base import CacheStrategy, DecodeInputs
from dllm_jax.caches.dual import DualCache
from dllm_jax.caches.full import NoCache
from dllm_jax.caches.prefix import PrefixCache

STRATEGIES = {"none": NoCache(), "prefix": PrefixCache(), "dual": DualCache()}


def strategy_for(cache: str, affix: str = "none") -> CacheStrategy:
    """The loop's strategy: the Fast-dLLM cache mode, wrapped by the affix cache when affix="anchors"."""
    return AnchoredRefresh(STRATEGIES[cache]) if affix == "anchors" else STRATEGIES[cache]


__all__ = ["STRATEGIES", "AnchoredRefresh", "CacheStrategy", "DecodeInputs", "DualCache", "NoCache", "PrefixCache",
           "strategy_for"]
