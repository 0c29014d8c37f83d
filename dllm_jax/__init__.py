"""dllm-jax: a JAX/Pallas inference engine for diffusion language models (LLaDA, Dream)."""

from dllm_jax.config import ConfigError, ModelConfig
from dllm_jax.decoding import (
    Anchors,
    CacheConfig,
    GenerationConfig,
    GenerationOutput,
    NaiveReuse,
    Schedule,
    Shallow,
    answer_tokens,
    generate,
)
from dllm_jax.decoding.samplers import (
    Entropy,
    Factor,
    LowConfidence,
    MaskGitPlus,
    Origin,
    RandomRemasking,
    Threshold,
    TopKMargin,
)
from dllm_jax.engine import Engine, EngineConfig
from dllm_jax.io.checkpoint import CheckpointError
from dllm_jax.io.loading import DEFAULT_MODEL_DIR, Model, load
from dllm_jax.transformer import ForwardOutput, KernelChoice, KVCache, forward, init_params

__all__ = [
    "Anchors",
    "CacheConfig",
    "CheckpointError",
    "ConfigError",
    "DEFAULT_MODEL_DIR",
    "Engine",
    "EngineConfig",
    "Entropy",
    "Factor",
    "ForwardOutput",
    "GenerationConfig",
    "GenerationOutput",
    "KVCache",
    "KernelChoice",
    "LowConfidence",
    "MaskGitPlus",
    "Model",
    "ModelConfig",
    "NaiveReuse",
    "Origin",
    "RandomRemasking",
    "Schedule",
    "Shallow",
    "Threshold",
    "TopKMargin",
    "answer_tokens",
    "forward",
    "generate",
    "init_params",
    "load",
]
__version__ = "0.2.0"
