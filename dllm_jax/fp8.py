"""LaCache's precision half: e4m3 FFNs in every layer but the first (1x128 activation, 128x128 weight scales).

Param tree with `config.fp8_ffn`: the stacked bf16 `layers.mlp` is replaced by
    layers.mlp_fp8 = {"w_gu": [L, 2F, D] e4m3, "s_gu": [L, 2F/128, D/128] f32, "w_down": [L, D, F] e4m3,
                      "s_down": [L, D/128, F/128] f32}
    mlp_first      = the first layer's bf16 SwiGLU params (gate_proj/up_proj/down_proj kernels)
Entry 0 of mlp_fp8 exists only to keep the scan over layers uniform; layer 0 runs `mlp_first` (the paper keeps
the first layer's FFN in bf16). Weights are quantised once (conversion `--fp8-ffn` or `load(..., fp8_ffn=True)`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ConfigError, ModelConfig

GROUP = 128


def check_fp8_shapes(config: ModelConfig) -> None:
    if config.d_model % GROUP or config.mlp_hidden % GROUP:
        raise ConfigError(f"fp8_ffn needs d_model and mlp_hidden to be multiples of {GROUP}, got "
                          f"d_model={config.d_model}, mlp_hidden={config.mlp_hidden}")


def quantize_layer_mlp(mlp: dict) -> dict:
    """One layer's bf16 SwiGLU params ([in, out] kernels) -> the e4m3 dict of pallas_kernels.fp8_matmul."""
    from pallas_kernels.fp8_matmul import quantize_ffn_weights

    return quantize_ffn_weights(jnp.asarray(mlp["gate_proj"]["kernel"]), jnp.asarray(mlp["up_proj"]["kernel"]),
                                jnp.asarray(mlp["down_proj"]["kernel"]), layout="in_out")


def quantize_stacked_mlp(mlp: dict) -> tuple[dict, dict]:
    """Stacked bf16 mlp params [L, ...] -> (mlp_fp8 stacked [L, ...] as numpy, mlp_first as numpy).

    Layer by layer (a jitted per-layer quantiser): peak memory is one layer's worth of temporaries."""
    n_layers = np.shape(mlp["gate_proj"]["kernel"])[0]
    q1 = jax.jit(quantize_layer_mlp)
    parts = [jax.tree.map(np.asarray, q1(jax.tree.map(lambda a: a[i], mlp))) for i in range(n_layers)]
    stacked = {k: np.stack([p[k] for p in parts]) for k in parts[0]}
    first = jax.tree.map(lambda a: np.asarray(a[0]), mlp)
    return stacked, first


def quantize_params(params: dict, config: ModelConfig, on_device: bool = False) -> tuple[dict, ModelConfig]:
    """bf16 params -> params with FP8 FFNs in layers >= 2, and the config with fp8_ffn=True.

    on_device: quantise all layers at once on the accelerator (benchmarks: weights already live there);
    default: layer by layer into host numpy (conversion and loading: low peak memory).
    Unrolled (per-layer) params are stacked first, which briefly holds both layouts where they live: `load`
    quantises before it unstacks."""
    if config.fp8_ffn:
        return params, config
    check_fp8_shapes(config)
    from dllm_jax.modeling import is_unrolled, stack_layers, unstack_layers

    if is_unrolled(params["layers"]):  # unrolled layout: quantise stacked, hand back unrolled
        out, config = quantize_params(stack_layers(params, config), config, on_device)
        return unstack_layers(out), config
    layers = dict(params["layers"])
    mlp = layers.pop("mlp")
    if on_device:
        stacked = jax.jit(jax.vmap(quantize_layer_mlp))(mlp)
        first = jax.tree.map(lambda a: a[0], mlp)
    else:
        stacked, first = quantize_stacked_mlp(mlp)
    layers["mlp_fp8"] = stacked
    out = dict(params)
    out["layers"] = layers
    out["mlp_first"] = first
    return out, config.replace(fp8_ffn=True)


def fp8_param_shapes(shapes: dict, config: ModelConfig) -> dict:
    """bf16 param shapes -> the FP8-FFN tree's shapes (no allocation)."""
    check_fp8_shapes(config)
    L, d, f = config.n_layers, config.d_model, config.mlp_hidden
    sd = jax.ShapeDtypeStruct
    layers = dict(shapes["layers"])
    mlp = layers.pop("mlp")
    e4m3, f32 = jnp.float8_e4m3fn, jnp.float32
    layers["mlp_fp8"] = {"w_gu": sd((L, 2 * f, d), e4m3), "s_gu": sd((L, 2 * f // GROUP, d // GROUP), f32),
                         "w_down": sd((L, d, f), e4m3), "s_down": sd((L, d // GROUP, f // GROUP), f32)}
    out = dict(shapes)
    out["layers"] = layers
    out["mlp_first"] = jax.tree.map(lambda s: sd(s.shape[1:], s.dtype), mlp)
    return out


def fp8_backend() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def layer_mlp(params: dict, config: ModelConfig, layer_params: dict, layer_index: Any, h: jax.Array) -> jax.Array:
    """The FFN of one layer: bf16 SwiGLU for layer 0, FP8 for the rest (a lax.cond on the scan's traced index)."""
    from dllm_jax.layers import SwiGLU
    from pallas_kernels.fp8_matmul import fp8_ffn

    def first(h):
        return SwiGLU(config.mlp_hidden, config.jnp_dtype).apply({"params": params["mlp_first"]}, h)

    def rest(h):
        return fp8_ffn(h, layer_params["mlp_fp8"], backend=fp8_backend(), out_dtype=h.dtype)

    if isinstance(layer_index, int):  # the unrolled layer loop: a static choice, no conditional in the program
        return first(h) if layer_index == 0 else rest(h)
    return jax.lax.cond(layer_index == 0, first, rest, h)
