"""One pre-norm llama-style layer (`Block`, a linen module applied functionally), the embedding and the head.

Both families run WITHOUT a causal mask. The layer is split into the pieces the forward and the cache techniques
compose: q/k/v with RoPE (`Block.qkv`), the attention output projection, and the FFN half (`layer_finish`: bf16
SwiGLU, or the FP8 FFN past layer 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dllm_jax.config import ModelConfig
from dllm_jax.transformer import ffn
from dllm_jax.transformer.kernels import XLA, Kernels
from dllm_jax.transformer.layers import (
    Linear,
    RMSNorm,
    SwiGLU,
    apply_rope,
    fp8_linear,
    matmul_precision,
    rope_cos_sin,
    tokenwise,
)
from dllm_jax.transformer.params import Params, is_fused, projection_widths

Array = jax.Array


class Block(nn.Module):
    """One pre-norm layer. fused: the layer's params hold q/k/v as one "qkv_proj" and gate/up as one
    "mlp.gate_up_proj" (`params.fuse_projections`); the arithmetic per output column is the same."""

    config: ModelConfig
    fused: bool = False
    fp8: str = "xla"  # where FP8 projections run (`Kernels.fp8`)

    def setup(self) -> None:
        c, dt = self.config, self.config.jnp_dtype
        self.attn_norm = RMSNorm(c.rms_eps, dt)
        if self.fused:
            self.qkv_proj = Linear(sum(projection_widths(c)), c.qkv_bias, dt, self.fp8)
        else:
            self.q_proj = Linear(c.n_heads * c.head_dim, c.qkv_bias, dt, self.fp8)
            self.k_proj = Linear(c.n_kv_heads * c.head_dim, c.qkv_bias, dt, self.fp8)
            self.v_proj = Linear(c.n_kv_heads * c.head_dim, c.qkv_bias, dt, self.fp8)
        self.o_proj = Linear(c.d_model, False, dt, self.fp8)
        self.ffn_norm = RMSNorm(c.rms_eps, dt)
        self.mlp = SwiGLU(c.mlp_hidden, dt, fused=self.fused)

    def qkv(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        """Rotated q [B,n,Hq,D], k [B,n,Hkv,D] and v [B,n,Hkv,D] of the block input x [B,n,d]."""
        return self.split_rotate(self.qkv_projection(self.attn_norm(x)), cos, sin)

    def qkv_in(self, x: Array) -> Array:
        return self.attn_norm(x)

    def qkv_projection(self, h: Array) -> Array:
        """The normalised input's q, k and v as one [B, n, (Hq + 2 Hkv) * D] array (q heads, k heads, v heads):
        the fused projection's own output, or the three concatenated."""
        if self.fused:
            return self.qkv_proj(h)
        return jnp.concatenate([self.q_proj(h), self.k_proj(h), self.v_proj(h)], axis=-1)

    def split_rotate(self, qkv: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        """`qkv_projection`'s output as rotated q, rotated k and v."""
        c = self.config
        b, n, _ = qkv.shape
        wq, wk, _ = projection_widths(c)
        q, k, v = jnp.split(qkv, [wq, wq + wk], axis=-1)
        q = q.reshape(b, n, c.n_heads, c.head_dim)
        k = k.reshape(b, n, c.n_kv_heads, c.head_dim)
        v = v.reshape(b, n, c.n_kv_heads, c.head_dim)
        return apply_rope(q, cos, sin, c.rope_fp32), apply_rope(k, cos, sin, c.rope_fp32), v

    def attn_projection(self, attn: Array) -> Array:
        """o_proj of the attention output [B, n, heads, head_dim] -> [B, n, d]."""
        b, n = attn.shape[:2]
        return self.o_proj(attn.reshape(b, n, -1))

    def finish(self, x: Array, attn: Array) -> Array:
        """Residual attention output projection, then the residual SwiGLU MLP."""
        x = x + self.attn_projection(attn)
        return x + self.mlp(self.ffn_norm(x))

    def __call__(self, x: Array, cos: Array, sin: Array, attend_fn) -> Array:
        q, k, v = self.qkv(x, cos, sin)
        return self.finish(x, attend_fn(q, k, v))


def block_for(params: Params, config: ModelConfig, kernels: Kernels = XLA) -> Block:
    return Block(config, fused=is_fused(params["layers"]), fp8=kernels.fp8)


def embed(params: Params, tokens: Array) -> Array:
    return jnp.take(params["embed"], tokens, axis=0)


def lm_head(params: Params, config: ModelConfig, h: Array, fp8: str = "xla") -> Array:
    if "lm_head_fp8" in params:  # weights="fp8_all"
        head = params["lm_head_fp8"]
        return fp8_linear(h, head["w8"], head["s8"], fp8, h.dtype)
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.einsum(
        "...d,dv->...v", h, w, preferred_element_type=jnp.float32, precision=matmul_precision(config.jnp_dtype)
    ).astype(h.dtype)


def at_layer(params: Params, layer_params: Params, i: Any, fn):
    """fn(the params of layer i): with FP8 projections (weights="fp8_all") layer 0 runs its bf16 ones
    ("attn_first"); the unrolled loop picks statically, the scan over stacked layers with a lax.cond on i."""
    if "attn_first" not in params:
        return fn(layer_params)
    first = {**layer_params, **params["attn_first"]}
    if isinstance(i, int):
        return fn(first if i == 0 else layer_params)
    return jax.lax.cond(i == 0, lambda: fn(first), lambda: fn(layer_params))


def block_qkv(
    block: Block,
    layer_params: Params,
    x: Array,
    positions: Array,
    cos: Array,
    sin: Array,
    kernels: Kernels,
    params: Params | None = None,
    i: Any = None,
) -> tuple:
    """`Block.qkv` of x [B, n, d] at positions [B, n] (cos / sin: their RoPE tables, computed once per forward) in
    layer i (params: the model's, for layer 0's bf16 projections beside FP8 ones: `at_layer`); token-tiled in the
    batch-invariant mode, which computes each tile's tables inside its tile."""
    if params is not None and "attn_first" in params:
        plain = lambda lp: block_qkv(block, lp, x, positions, cos, sin, kernels)  # noqa: E731
        return at_layer(params, layer_params, i, plain)
    if not kernels.batch_invariant:
        return block.apply({"params": layer_params}, x, cos, sin, method=Block.qkv)
    c = block.config

    def qkv(x, positions):
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        return block.apply({"params": layer_params}, x, cos, sin, method=Block.qkv)

    return tokenwise(qkv, x, positions)


def final_hidden_to_logits(
    params: Params, config: ModelConfig, x: Array, logits_at: Array | None, kernels: Kernels = XLA
) -> Array:
    if logits_at is not None:  # decoding only needs a few positions: skip the vocab head elsewhere
        x = jnp.take_along_axis(x, logits_at[:, :, None].astype(jnp.int32), axis=1)

    def head(x):
        x = RMSNorm(config.rms_eps, config.jnp_dtype).apply({"params": params["final_norm"]}, x)
        return lm_head(params, config, x, kernels.fp8)

    return tokenwise(head, x) if kernels.batch_invariant else head(x)


def layer_finish(
    params: Params,
    config: ModelConfig,
    block: Block,
    layer_params: Params,
    i: Any,
    x: Array,
    attn: Array,
    kernels: Kernels,
) -> Array:
    """Layer i's output from its input x [B, n, d] and attention output attn [B, n, Hq, D]: the residual o_proj,
    then the residual FFN (bf16, or FP8 past layer 1); token-tiled in the batch-invariant mode."""
    if kernels.batch_invariant:
        plain = dataclasses.replace(kernels, batch_invariant=False)
        return tokenwise(lambda x, a: layer_finish(params, config, block, layer_params, i, x, a, plain), x, attn)
    if not config.fp8_ffn:
        return block.apply({"params": layer_params}, x, attn, method=Block.finish)
    # the residual add x + o_proj(attn) is left to the FP8 FFN (fused into its RMSNorm kernel on the GPU)
    o = at_layer(params, layer_params, i, lambda lp: block.apply({"params": lp}, attn, method=Block.attn_projection))
    return ffn.fp8_ffn_residual(params, config, layer_params, i, x, o, kernels.fp8, kernels.interpret)
