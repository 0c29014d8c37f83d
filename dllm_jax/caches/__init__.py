"""Cache techniques, one module each, behind the `CacheStrategy` interface (caches/base.py)."""

from dllm_jax.caches.acache import AnchoredRefresh
from dllm_jax.caches.base import CacheStrategy, DecodeInputs
from dllm_jax.caches.bicache import ShallowReuse
from dllm_jax.caches.dual import DualCache
from dllm_jax.caches.full import NoCache
from dllm_jax.caches.lacache import FirstLayerCache
from dllm_jax.caches.prefix import PrefixCache

STRATEGIES = {"none": NoCache(), "first_layer": FirstLayerCache(), "prefix": PrefixCache(), "dual": DualCache()}


def strategy_for(cache: str, affix: str = "none", depth: int | None = None) -> CacheStrategy:
    """The loop's strategy: the Fast-dLLM cache mode, wrapped by ACache (affix="anchors") or BiCache
    (affix="shallow", reusing the prefix in layers < depth)."""
    if affix == "anchors":
        return AnchoredRefresh(STRATEGIES[cache])
    if affix == "shallow":
        return ShallowReuse(STRATEGIES[cache], depth)
    return STRATEGIES[cache]


__all__ = ["STRATEGIES", "AnchoredRefresh", "CacheStrategy", "DecodeInputs", "DualCache", "FirstLayerCache",
           "NoCache", "PrefixCache", "ShallowReuse", "strategy_for"]
