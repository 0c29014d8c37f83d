"""RoPE and the K/V cache write as one kernel at block steps (`Kernels.rope_write`, the GPU default in bf16).

At a block step's few tokens (<= ROPE_WRITE_MAX_TOKENS) the q/k/v projection reaches the kernel
(`pallas_kernels/rope_kv_write.py`) as split-K partials of one batched GEMM, which the kernel sums itself: XLA's own
split-K GEMM reduced them in the three kernels that rotate q and write K and V, so one kernel replaces three (a
batch-1 LLaDA-8B block step 1.023x faster on the H200). Needs per-layer params and per-layer cache buffers (the
kernel writes one layer's buffer in place) and a contiguous write. Same roundings as the XLA path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dllm_jax.config import ModelConfig
from dllm_jax.transformer.block import Block
from pallas_kernels.rope_kv_write import linear_partials, rope_kv_write

Array = jax.Array
# Up to this many tokens per forward (a block step at batch 1-2). At batch 8 (256 tokens) the kernel on the rounded
# projection lost to XLA's three kernels (7.28 vs 7.23 ms per call of 8 steps).
ROPE_WRITE_MAX_TOKENS = 64
# The q/k/v GEMM as this many split-K partials: XLA splits LLaDA-8B's q/k/v GEMM 4 ways at M = 32; 2 was faster in
# the step (half the partials' bytes for the kernel to read): 4.564 vs 4.607 ms per LLaDA-8B batch-1 step.
QKV_SPLITS = 2


def rope_write(
    block: Block,
    config: ModelConfig,
    layer_params: dict,
    h: Array,
    cos: Array,
    sin: Array,
    k_buf: Array,
    v_buf: Array,
    offset: Array | int,
    write_mask: Array | None,
    interpret: bool,
) -> tuple[Array, Array, Array]:
    """The q/k/v projection of the normalised input h [B, n, d], RoPE of q and k and the window's K/V written into
    one layer's buffers [B, S, Hkv, D] at `offset` (in place under jit): (q [B, n, Hq, D], k_buf, v_buf)."""
    c = config
    b, n, d = h.shape
    proj = layer_params.get("qkv_proj")  # the fused projection (the per-layer GPU layout)
    if proj is not None and b * n <= ROPE_WRITE_MAX_TOKENS and d % QKV_SPLITS == 0:
        qkv = linear_partials(h.reshape(b * n, d), proj["kernel"], QKV_SPLITS).reshape(QKV_SPLITS, b, n, -1)
        extra = dict(bias=proj.get("bias"), out_dtype=h.dtype)
    else:
        qkv, extra = block.apply({"params": layer_params}, h, method=Block.qkv_projection), {}
    return rope_kv_write(
        qkv,
        cos,
        sin,
        k_buf,
        v_buf,
        jnp.asarray(offset, jnp.int32),
        write_mask,
        q_heads=c.n_heads,
        kv_heads=c.n_kv_heads,
        rope_fp32=c.rope_fp32,
        interpret=interpret,
        **extra,
    )
