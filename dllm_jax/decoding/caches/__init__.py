"""Cache techniques, one module each, behind the `CacheStrategy` interface (`base.py`)."""

from dllm_jax.decoding.caches.acache import AnchoredRefresh
from dllm_jax.decoding.caches.base import CacheStrategy, DecodeInputs
from dllm_jax.decoding.caches.bicache import ShallowReuse
from dllm_jax.decoding.caches.dual import DualCache
from dllm_jax.decoding.caches.full import NoCache
from dllm_jax.decoding.caches.lacache import FirstLayerCache
from dllm_jax.decoding.caches.prefix import PrefixCache

STRATEGIES = {"none": NoCache(), "first_layer": FirstLayerCache(), "prefix": PrefixCache(), "dual": DualCache()}


def strategy_for(mode: str, affix: str = "none", depth: int | None = None) -> CacheStrategy:
    """The loop's strategy: the Fast-dLLM cache mode, wrapped by ACache (affix "anchors") or BiCache (affix
    "shallow", reusing the prefix in layers < depth)."""
    if affix == "anchors":
        return AnchoredRefresh(STRATEGIES[mode])
    if affix == "shallow":
        return ShallowReuse(STRATEGIES[mode], depth)
    return STRATEGIES[mode]


__all__ = [
    "STRATEGIES",
    "AnchoredRefresh",
    "CacheStrategy",
    "DecodeInputs",
    "DualCache",
    "FirstLayerCache",
    "NoCache",
    "PrefixCache",
    "ShallowReuse",
    "strategy_for",
]
