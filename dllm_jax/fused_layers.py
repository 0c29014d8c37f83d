"""The layer loop on fused kernels: `modeling.forward(..., norm_rope_backend="pallas")`, opt-in, and the RoPE + K/V
write step that `norm_rope_backend="pallas_rope"` puts into the XLA layer loop.

The same layers and arithmetic as the XLA path of `modeling.forward`, meant to run fewer kernels per layer (issue 7:
at a block step each small kernel costs a few microseconds however little it reads). Measured on the H200 it saves
nothing (bench/NOTES.md v12): XLA already fuses each residual add into the reduction kernel of its split-K GEMM, and
that reduction stays a kernel of its own in front of these. Kept, tested, for a GEMM that reduces in-kernel.
  * every residual add is done by the kernel of the RMSNorm that follows it (`pallas_kernels/residual_rmsnorm.py`).
    The residual stream is carried as (x, delta): a sublayer's output `delta` is added by the next norm's kernel,
    the FFN's by the next layer's attention norm (the last layer's by a plain add before the final norm);
  * RoPE of q and k and the K/V cache write are one kernel (`pallas_kernels/rope_kv_write.py`) that writes the
    layer's cache buffer in place.
At a block step's few tokens (<= PARTIALS_MAX_TOKENS) the q/k/v projection reaches the RoPE kernel as split-K
partials (`linear_partials`: one batched GEMM), which the kernel sums itself: XLA's own split-K GEMM reduced them in
the three kernels that rotate q and write K and V, so one kernel replaces three (`rope_write`; bench/NOTES.md v14).
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
from pallas_kernels.residual_rmsnorm import linear_partials, residual_rmsnorm
from pallas_kernels.rope_kv_write import rope_kv_write

Array = jax.Array
# The q/k/v GEMM as QKV_SPLITS split-K partials up to this many tokens per forward (a block step at batch 1-2: 32
# per row). XLA splits LLaDA-8B's q/k/v GEMM 4 ways at M = 32 on the H200 (its optimised HLO); as a batched GEMM
# 2 ways was faster in the step (half the partials' bytes for the RoPE kernel to read): LLaDA-8B batch 1, 4.564 vs
# 4.607 ms per step in a loop with 4 (bench/NOTES.md v14). At batch 8 (256 tokens) the kernel on the rounded
# projection lost to XLA's three kernels (7.28 vs 7.23 ms per call of 8), so "pallas_rope" stops here.
PARTIALS_MAX_TOKENS = 64
QKV_SPLITS = 2


def rope_write(block: Block, config: ModelConfig, layer_params: dict, h: Array, cos: Array, sin: Array,
               k_buf: Array, v_buf: Array, offset: Array | int, write_mask: Array | None, interpret: bool
               ) -> tuple[Array, Array, Array]:
    """The q/k/v projection of the normalised input h [B, n, d], RoPE of q and k and the window's K/V written into
    one layer's buffers [B, S, Hkv, D] at `offset` (in place under jit): (q [B, n, Hq, D], k_buf, v_buf)."""
    c = config
    b, n, d = h.shape
    proj = layer_params.get("qkv_proj")  # the fused projection (unstack_layers' GPU layout)
    if proj is not None and b * n <= PARTIALS_MAX_TOKENS and d % QKV_SPLITS == 0:
        qkv = linear_partials(h.reshape(b * n, d), proj["kernel"], QKV_SPLITS).reshape(QKV_SPLITS, b, n, -1)
        extra = dict(bias=proj.get("bias"), out_dtype=h.dtype)
    else:
        qkv, extra = block.apply({"params": layer_params}, h, method=Block.qkv_projection), {}
    return rope_kv_write(qkv, cos, sin, k_buf, v_buf, jnp.asarray(offset, jnp.int32), write_mask, q_heads=c.n_heads,
                         kv_heads=c.n_kv_heads, rope_fp32=c.rope_fp32, interpret=interpret, **extra)


def written_window(k_buf: Array, v_buf: Array, offset: Array | int, n: int) -> tuple[Array, Array]:
    """What a window of n tokens left in its slots of one layer's buffers (the old K/V where write_mask was False)."""
    offset = jnp.asarray(offset, jnp.int32)
    return (jax.lax.dynamic_slice_in_dim(k_buf, offset, n, axis=1),
            jax.lax.dynamic_slice_in_dim(v_buf, offset, n, axis=1))


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
        if cache is None:
            qkv = block.apply({"params": lp}, h, method=Block.qkv_projection)
            q, k, v = block.apply({"params": lp}, qkv, cos, sin, method=Block.split_rotate)
            attn = attend(q, k, v, key_mask, attention_backend)
        else:
            q, ck[i], cv[i] = rope_write(block, c, lp, h, cos, sin, ck[i], cv[i], cache_offset, write_mask,
                                         interpret)
            if return_kv:
                k, v = written_window(ck[i], cv[i], cache_offset, n)
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
