"""dllm-jax: a JAX/Pallas inference engine for diffusion language models (LLaDA, Dream)."""

from dllm_jax.config import ConfigError, ModelConfig
from dllm_jax.checkpoint import CheckpointError
from dllm_jax.loading import DEFAULT_MODEL_DIR, Model, load
from dllm_jax.modeling import ForwardOutput, KVCache, forward, init_params
from dllm_jax.generate import GenerationConfig, GenerationOutput, answer_tokens, generate

__all__ = [
    "CheckpointError", "ConfigError", "DEFAULT_MODEL_DIR", "ForwardOutput", "GenerationConfig", "GenerationOutput",
    "KVCache", "Model", "ModelConfig", "answer_tokens", "forward", "generate", "init_params", "load",
]
__version__ = "0.1.0"
