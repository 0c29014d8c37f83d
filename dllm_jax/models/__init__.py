"""Per-family knowledge: checkpoint name tables, config writers and chat templates (one file per family)."""

from dllm_jax.models import dream, llada
from dllm_jax.models.base import ParamMapping, TensorRule

FAMILIES = {"llada": llada.FAMILY, "dream": dream.FAMILY}

__all__ = ["FAMILIES", "ParamMapping", "TensorRule", "dream", "llada"]
