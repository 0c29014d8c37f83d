"""One batch, one call: the jitted denoising loop, its samplers and its cache techniques."""

from dllm_jax.decoding.config import Anchors, CacheConfig, GenerationConfig, NaiveReuse, Schedule, Shallow
from dllm_jax.decoding.generate import GenerationOutput, answer_tokens, generate

__all__ = [
    "Anchors",
    "CacheConfig",
    "GenerationConfig",
    "GenerationOutput",
    "NaiveReuse",
    "Schedule",
    "Shallow",
    "answer_tokens",
    "generate",
]
