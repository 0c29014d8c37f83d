"""Flax (linen) building blocks shared by LLaDA and Dream: RMSNorm, Linear, rotary embedding, SwiGLU MLP.

Numerics follow the reference implementations exactly (see README "Exactness"): RMSNorm normalises in fp32 and
casts back before the weight multiply; linear layers accumulate in fp32 and round once (bias added before the
rounding, as a fused GEMM epilogue does; without a bias the GEMM itself rounds its fp32 sum); LLaDA rotates q/k
in fp32, Dream in the activation dtype.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fp8_matmul as F

Array = jax.Array


def matmul_precision(dtype: jnp.dtype) -> jax.lax.Precision:
    """fp32 mode must really be fp32 (GPUs would otherwise use TF32 for fp32 matmuls)."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: Array) -> Array:
        weight = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return y.astype(x.dtype) * weight


class Linear(nn.Module):
    """y = x @ kernel (+ bias); kernel is [in, out] (the transpose of PyTorch's layout). Where the params hold FP8
    leaves instead of a kernel ("w8" [out, in] e4m3 with "s8" its 128x128 block scales: `params.quantize_projections`)
    the input is quantised in 1x128 groups and the product is the dequantised one, accumulated in fp32
    (`fp8_linear`)."""

    features: int
    use_bias: bool
    dtype: jnp.dtype
    fp8: str = "xla"  # where FP8 leaves run: "pallas" (the GPU kernel, where it fits) or "xla" (the reference)

    @nn.compact
    def __call__(self, x: Array) -> Array:
        if self.has_variable("params", "w8"):
            w8, s8 = self.get_variable("params", "w8"), self.get_variable("params", "s8")
            if not self.use_bias:
                return fp8_linear(x, w8, s8, self.fp8, self.dtype)
            y = fp8_linear(x, w8, s8, self.fp8, jnp.float32)
            return (y + self.get_variable("params", "bias").astype(jnp.float32)).astype(self.dtype)
        kernel = self.param("kernel", nn.initializers.normal(0.02), (x.shape[-1], self.features), self.dtype)
        # Without a bias the GEMM emits the activation dtype itself: it still accumulates in fp32 and rounds once
        # (cuBLAS, XLA's Triton GEMMs and the CPU alike), but no fp32 [M, N] output is written and re-read by a
        # separate convert (1.6 ms of a Dream-7B batch-32 block step on an H200).
        y = jnp.einsum(
            "...i,io->...o",
            x,
            kernel,
            preferred_element_type=jnp.float32 if self.use_bias else self.dtype,
            precision=matmul_precision(self.dtype),
        )
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype).astype(jnp.float32)
        return y.astype(self.dtype)


def fp8_linear(x: Array, w8: Array, s8: Array, backend: str = "xla", out_dtype=jnp.float32) -> Array:
    """x [..., K] @ dequant(w8 [N, K], s8).T accumulated in fp32, x quantised in 1x128 groups first, rounded once
    to out_dtype: `pallas_kernels.fp8_matmul`'s kernel (backend "pallas", where its tiling fits the shape) or its
    XLA reference (exact dequantisation, an fp32 dot)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    xq, xs = F.quantize_activations(x2)
    n = w8.shape[0]
    if backend == "pallas" and F.kernel_fits(x2.shape[0], n, k):
        y = F.fp8_matmul(xq, xs, w8, s8, out_dtype=out_dtype, backend="pallas")
    else:
        y = F.fp8_matmul_reference(xq, xs, w8, s8, out_dtype=out_dtype)
    return y.reshape(*lead, n)


class SwiGLU(nn.Module):
    """down(silu(gate(h)) * up(h)); gate is LLaDA's ff_proj / Dream's gate_proj.

    fused: gate and up as one [d, 2F] kernel "gate_up_proj" (one wider GEMM; see `params.fuse_projections`)."""

    hidden: int
    dtype: jnp.dtype
    fused: bool = False

    @nn.compact
    def __call__(self, h: Array) -> Array:
        if self.fused:
            gate, up = jnp.split(Linear(2 * self.hidden, False, self.dtype, name="gate_up_proj")(h), 2, axis=-1)
        else:
            gate = Linear(self.hidden, False, self.dtype, name="gate_proj")(h)
            up = Linear(self.hidden, False, self.dtype, name="up_proj")(h)
        return Linear(h.shape[-1], False, self.dtype, name="down_proj")(jax.nn.silu(gate) * up)


# ----------------------------------------------------------------------------------------------- rotary
def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """theta^(-2i/d) as fp32 (computed in float64 and rounded once)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    return (1.0 / (theta**exponent)).astype(np.float32)


def rope_cos_sin(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
    """positions [..., T] int -> cos, sin [..., T, head_dim] fp32 (half-rotation layout: freqs repeated twice)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(head_dim, theta))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate_half(x: Array) -> Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: Array, cos: Array, sin: Array, fp32: bool) -> Array:
    """x [B, T, H, D]; cos/sin [B, T, D] fp32. fp32=True: LLaDA (rotate in fp32, round once)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    if fp32:
        xf = x.astype(jnp.float32)
        return (xf * cos + _rotate_half(xf) * sin).astype(x.dtype)
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    return x * cos + _rotate_half(x) * sin


TOKEN_TILE = 128  # tokens a batch-invariant linear layer runs at once (`tokenwise`)


def opaque_loop(n: int, body, carry):
    """fori_loop(0, n, body, carry) with a trip count XLA cannot see: it neither removes a loop of one trip nor
    unrolls a short one, so the body compiles to the same code in every program (a loop it inlined would be fused
    with its neighbours: other code, other rounding). Arrays the body indexes by the loop counter need at least 2
    entries (`stacked`): XLA turns an index into one entry into a plain read, again other code."""
    return jax.lax.fori_loop(0, jax.lax.optimization_barrier(jnp.int32(n)), body, carry)


def stacked(a: Array, n: int) -> Array:
    """a [n, ...] padded to at least 2 entries (repeating its first), for an `opaque_loop` body to index."""
    return a if n >= 2 else jnp.concatenate([a, a[:1]], axis=0)


def tokenwise(fn, *arrays: Array, tile: int = TOKEN_TILE):
    """fn over the tokens of arrays [B, n, ...] (each token's result its own, as in a linear layer or a norm), run
    `tile` tokens at a time in an `opaque_loop`: every call of fn sees [1, tile, ...] in the same loop body whatever
    B and n are, so a token's result does not depend on how many tokens share the call (a GEMM's blocking, and with
    it its reduction order, does: the batch-invariant mode's linear layers). Returns fn's output pytree with leading
    [B, n] again."""
    b, n = arrays[0].shape[:2]
    total = b * n
    tiles = -(-total // tile)

    def split(a: Array) -> Array:
        flat = a.reshape(total, *a.shape[2:])
        flat = jnp.pad(flat, [(0, tiles * tile - total)] + [(0, 0)] * (flat.ndim - 1))
        return stacked(flat.reshape(tiles, 1, tile, *a.shape[2:]), tiles)

    xs = tuple(split(a) for a in arrays)

    def one(i):
        return fn(*(jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in xs))

    shapes = jax.eval_shape(one, 0)
    out = jax.tree.map(lambda s: jnp.zeros((max(tiles, 2), *s.shape), s.dtype), shapes)

    def body(i, out):
        return jax.tree.map(lambda o, y: jax.lax.dynamic_update_index_in_dim(o, y, i, 0), out, one(i))

    out = opaque_loop(tiles, body, out)
    return jax.tree.map(
        lambda y: y[:tiles].reshape(tiles * tile, *y.shape[3:])[:total].reshape(b, n, *y.shape[3:]), out
    )
