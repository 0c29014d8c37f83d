"""The layer loop on fused kernels: `modeling.forward(..., norm_rope_backend="pallas")`, opt-in.

The same layers and arithmetic as the XLA path of `modeling.forward`, meant to run fewer kernels per layer (issue 7:
at a block step each small kernel costs a few microseconds however little it reads). Measured on the H200 it saves
nothing (bench/NOTES.md v12): XLA already fuses each residual add into the reduction kernel of its split-K GEMM, and
that reduction stays a kernel of its own in front of these. Kept, tested, for a GEMM that reduces in-kernel.
  * every residual add is done by the kernel of the RMSNorm that follows it (`pallas_kernels/residual_rmsnorm.py`).
    The residual stream is carried as (x, delta): a sublayer's output `delta` is added by the next norm's kernel,
    the FFN's by the next layer's attention norm (the last layer's by a plain add before the final norm);
  * RoPE of q and k and the K/V cache write are one kernel (`pallas_kernels/rope_kv_write.py`) that writes the
    layer's cache buffer in place.
Roundings are those of the XLA path (bf16 sums, fp32 norm statistics, the same RoPE roundings); only the fp32
summation order inside a norm differs. Needs per-layer params (`unstack_layers`, the GPU layout) and, with a cache,
per-layer cache buffers (`KVCache.for_params`): the deferred residual changes the loop carry's structure, which a
`lax.scan` over stacked layers cannot carry, and the kernel writes one layer's buffer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dllm_jax.attention import Backend, attend
from dllm_jax.config import ModelConfig
from dllm_jax.modeling import Block, KVCache, is_unrolled, pallas_mlp, use_pallas_ffn
from pallas_kernels.residual_rmsnorm import residual_rmsnorm
from pallas_kernels.rope_kv_write import rope_kv_write

Array = jax.Array


def run_layers(params: dict, config: ModelConfig, block: Block, x: Array, cos: Array, sin: Array, *,
               key_mask: Array | None, cache: KVCache | None, cache_offset: Array | int,
               write_mask: Array | None, return_kv: bool, attention_backend: Backend, ffn_backend: str
               ) -> tuple[Array, KVCache | None, tuple[Array, Array] | None]:
    """All layers of `modeling.forward` on embedded tokens x [B, n, d]: the final hidden state (before the final
    norm), the updated cache (None without one) and, with return_kv, the fresh (k, v) [L, B, n, Hkv, D]."""
    if not is_unrolled(params["layers"]):
        raise ValueError("norm_rope_backend='pallas' needs per-layer params (dllm_jax.modeling.unstack_layers, the "
                         "GPU layout of dllm_jax.load): the stacked layout runs a lax.scan")
    if cache is not None and not cache.per_layer:
        raise ValueError("norm_rope_backend='pallas' needs a per-layer KVCache (KVCache.for_params)")
    interpret = jax.default_backend() != "gpu"
    c = config
    b, n, d = x.shape

    def add_norm(x: Array, delta: Array | None, scale: Array) -> tuple[Array, Array]:
        s, h = residual_rmsnorm(x.reshape(b * n, d), None if delta is None else delta.reshape(b * n, d), scale,
                                eps=c.rms_eps, interpret=interpret)
        return s.reshape(b, n, d), h.reshape(b, n, d)

    def ffn(layer_params: dict, i: int, h: Array) -> Array:
        if use_pallas_ffn(c, ffn_backend, b * n):
            return pallas_mlp(params, layer_params, i, h, ffn_backend)
        return block.apply({"params": layer_params}, h, method=Block.ffn)

    ck = list(cache.k) if cache is not None else None
    cv = list(cache.v) if cache is not None else None
    fresh: list[tuple[Array, Array]] = []
    delta: Array | None = None  # the last sublayer's output, not yet added to x
    for i, lp in enumerate(params["layers"]):
        x, h = add_norm(x, delta, lp["attn_norm"]["scale"])
        qkv = block.apply({"params": lp}, h, method=Block.qkv_projection)
        if cache is None:
            q, k, v = block.apply({"params": lp}, qkv, cos, sin, method=Block.split_rotate)
            attn = attend(q, k, v, key_mask, attention_backend)
        else:
            q, ck[i], cv[i] = rope_kv_write(qkv, cos, sin, ck[i], cv[i], cache_offset, write_mask,
                                            q_heads=c.n_heads, kv_heads=c.n_kv_heads, rope_fp32=c.rope_fp32,
                                            interpret=interpret)
            if return_kv:  # what the window left in its slots (the old K/V where write_mask is False)
                offset = jnp.asarray(cache_offset, jnp.int32)
                k = jax.lax.dynamic_slice_in_dim(ck[i], offset, n, axis=1)
                v = jax.lax.dynamic_slice_in_dim(cv[i], offset, n, axis=1)
            attn = attend(q, ck[i], cv[i], key_mask, attention_backend)
        if return_kv:
            fresh.append((k, v))
        o = block.apply({"params": lp}, attn, method=Block.attn_projection)
        if c.fp8_ffn:  # the FP8 FFN adds both residuals itself (its RMSNorm kernel takes o)
            from dllm_jax import fp8

            x, delta = fp8.ffn_residual(params, c, lp, i, x, attn_out=o), None
        else:
            x, h = add_norm(x, o, lp["ffn_norm"]["scale"])
            delta = ffn(lp, i, h)
    if delta is not None:
        x = x + delta
    kv: Any = None
    if return_kv:
        kv = (jnp.stack([k for k, _ in fresh]), jnp.stack([v for _, v in fresh]))
    return x, (KVCache(tuple(ck), tuple(cv)) if cache is not None else None), kv
