"""The model as pure functions: layers, parameters, attention, the FFN, the K/V cache and `forward`."""

from dllm_jax.transformer.kernels import XLA, KernelChoice, Kernels
from dllm_jax.transformer.kv_cache import CacheWrite, KVCache
from dllm_jax.transformer.modeling import ForwardOutput, WindowChunks, forward
from dllm_jax.transformer.params import init_params, param_shapes, stack_layers, unstack_layers

__all__ = [
    "XLA",
    "CacheWrite",
    "ForwardOutput",
    "KVCache",
    "KernelChoice",
    "Kernels",
    "WindowChunks",
    "forward",
    "init_params",
    "param_shapes",
    "stack_layers",
    "unstack_layers",
]
