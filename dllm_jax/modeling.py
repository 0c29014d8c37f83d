"""The LLaDA / Dream transformer as a pure function of (params, tokens, positions, mask, cache).

Both families are pre-norm llama-style decoders run WITHOUT a causal mask. A `Block` is a linen module applied
functionally; the layers run under `jax.lax.scan` over stacked layer weights, so compile time does not grow with
depth. Attention is a hook (`attend_fn`) so that the cache techniques decide which keys a layer sees without any
branch inside the block.

Param tree (leaves in the config dtype; kernels are [in, out]):
    {"embed": [V, d],
     "layers": {"attn_norm": {"scale": [L, d]}, "q_proj": {"kernel": [L, d, Hq*D], "bias"?}, "k_proj", "v_proj",
                "o_proj": {"kernel": [L, Hq*D, d]}, "ffn_norm": {"scale": [L, d]},
                "mlp": {"gate_proj", "up_proj": {"kernel": [L, d, F]}, "down_proj": {"kernel": [L, F, d]}}},
     "final_norm": {"scale": [d]},
     "lm_head": [d, V]   (absent when the head is tied to the embedding)}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.attention import Backend, attend
from dllm_jax.config import ModelConfig
from dllm_jax.layers import Linear, RMSNorm, SwiGLU, apply_rope, rope_cos_sin

Array = jax.Array
Params = dict[str, Any]
# attend_fn(q [B,n,Hq,D], k [B,n,Hkv,D], v [B,n,Hkv,D]) -> attention output [B,n,Hq,D]
AttendFn = Callable[[Array, Array, Array], Array]


class Block(nn.Module):
    config: ModelConfig

    def setup(self) -> None:
        c, dt = self.config, self.config.jnp_dtype
        self.attn_norm = RMSNorm(c.rms_eps, dt)
        self.q_proj = Linear(c.n_heads * c.head_dim, c.qkv_bias, dt)
        self.k_proj = Linear(c.n_kv_heads * c.head_dim, c.qkv_bias, dt)
        self.v_proj = Linear(c.n_kv_heads * c.head_dim, c.qkv_bias, dt)
        self.o_proj = Linear(c.d_model, False, dt)
        self.ffn_norm = RMSNorm(c.rms_eps, dt)
        self.mlp = SwiGLU(c.mlp_hidden, dt)

    def qkv(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        """Rotated q [B,n,Hq,D], k [B,n,Hkv,D] and v [B,n,Hkv,D] of the block input x [B,n,d]."""
        c = self.config
        b, n, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).reshape(b, n, c.n_heads, c.head_dim)
        k = self.k_proj(h).reshape(b, n, c.n_kv_heads, c.head_dim)
        v = self.v_proj(h).reshape(b, n, c.n_kv_heads, c.head_dim)
        return apply_rope(q, cos, sin, c.rope_fp32), apply_rope(k, cos, sin, c.rope_fp32), v

    def attn_residual(self, x: Array, attn: Array) -> Array:
        b, n, _ = x.shape
        return x + self.o_proj(attn.reshape(b, n, -1))

    def ffn_in(self, x: Array) -> Array:
        return self.ffn_norm(x)

    def finish(self, x: Array, attn: Array) -> Array:
        """Residual attention output projection, then the residual SwiGLU MLP."""
        x = self.attn_residual(x, attn)
        return x + self.mlp(self.ffn_norm(x))

    def __call__(self, x: Array, cos: Array, sin: Array, attend_fn: AttendFn) -> Array:
        q, k, v = self.qkv(x, cos, sin)
        return self.finish(x, attend_fn(q, k, v))


# --------------------------------------------------------------------------------------------- caches
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Rotated K and V of every layer at every position of a fixed-length sequence buffer.

    k, v: [L, B, S, Hkv, D]. Position j of row b holds the K/V that the token at buffer index j had the last time
    a forward wrote it.
    """

    k: Array
    v: Array

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, length: int) -> "KVCache":
        shape = (config.n_layers, batch, length, config.n_kv_heads, config.head_dim)
        return cls(jnp.zeros(shape, config.jnp_dtype), jnp.zeros(shape, config.jnp_dtype))

    @property
    def length(self) -> int:
        return self.k.shape[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    logits: Array  # [B, n or m, V] in the activation dtype
    cache: KVCache | None  # the updated cache when one was given
    kv: tuple[Array, Array] | None  # per-layer fresh (k, v) [L, B, n, Hkv, D] when return_kv=True


# -------------------------------------------------------------------------------------------- forward
def embed(params: Params, tokens: Array) -> Array:
    return jnp.take(params["embed"], tokens, axis=0)


def lm_head(params: Params, config: ModelConfig, h: Array) -> Array:
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    prec = jax.lax.Precision.HIGHEST if config.jnp_dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    return jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32, precision=prec).astype(h.dtype)


def final_hidden_to_logits(params: Params, config: ModelConfig, x: Array, logits_at: Array | None) -> Array:
    if logits_at is not None:  # decoding only needs a few positions: skip the vocab head elsewhere
        x = jnp.take_along_axis(x, logits_at[:, :, None].astype(jnp.int32), axis=1)
    x = RMSNorm(config.rms_eps, config.jnp_dtype).apply({"params": params["final_norm"]}, x)
    return lm_head(params, config, x)


def forward(
    params: Params,
    config: ModelConfig,
    tokens: Array,
    positions: Array,
    *,
    key_mask: Array | None = None,
    cache: KVCache | None = None,
    cache_offset: Array | int = 0,
    write_mask: Array | None = None,
    logits_at: Array | None = None,
    return_kv: bool = False,
    attention_backend: Backend = "xla",
    ffn_backend: FfnBackend = "xla",
) -> ForwardOutput:
    """Run the model on a window of tokens.

    tokens, positions: [B, n] int32 (positions are the RoPE positions: absolute, per row).
    Without a cache: bidirectional attention among the n tokens, keys masked by key_mask [B, n].
    With a cache (length S): the window's K/V are written into buffer slots [cache_offset, cache_offset + n)
    (only where write_mask [B, n] is True, if given), then every query attends over all S buffer slots,
    masked by key_mask [B, S]. The updated cache is returned.
    logits_at: [B, m] indices into the window; logits only there (None: every position).
    ffn_backend: "pallas" runs the FFN's three GEMMs with the weight-streaming kernel
    (`pallas_kernels/skinny_matmul.py`, which indexes the stacked weights itself) when the window has few tokens
    (B * n <= 64, where it was measured faster) and the FFN is not FP8; otherwise XLA. "mgpu": the same with the
    Mosaic GPU kernel (`pallas_kernels/stream_matmul_mgpu.py`; bf16 only; not yet timed). Interpreted off the GPU.
    params["layers"] may be stacked ([L, ...] leaves: a lax.scan over layers) or a tuple of per-layer trees
    (`unstack_layers`: an unrolled python loop, no per-layer slicing of stacked weights).
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    b, n = tokens.shape
    block = Block(config)
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta)
    x = embed(params, tokens).astype(config.jnp_dtype)

    def attend_fresh(q, k, v):
        return attend(q, k, v, key_mask, attention_backend)

    def finish(layer_params, i, x, attn):
        if not config.fp8_ffn and use_pallas_ffn(config, ffn_backend, b * n):
            x = block.apply({"params": layer_params}, x, attn, method=Block.attn_residual)
            h = block.apply({"params": layer_params}, x, method=Block.ffn_in)
            return x + pallas_mlp(params, layer_params, i, h, ffn_backend)
        if not config.fp8_ffn:
            return block.apply({"params": layer_params}, x, attn, method=Block.finish)
        from dllm_jax import fp8  # FP8 FFN in layers >= 2 (LaCache); layer 1 in the activation dtype

        x = block.apply({"params": layer_params}, x, attn, method=Block.attn_residual)
        h = block.apply({"params": layer_params}, x, method=Block.ffn_in)
        return x + fp8.layer_mlp(params, config, layer_params, i, h)

    layer_ids = jnp.arange(config.n_layers, dtype=jnp.int32)
    if cache is None:
        def layer(x, inputs):
            layer_params, i = inputs
            q, k, v = block.apply({"params": layer_params}, x, cos, sin, method=Block.qkv)
            x = finish(layer_params, i, x, attend_fresh(q, k, v))
            return x, ((k, v) if return_kv else None)

        x, kv = layer_loop(layer, x, params["layers"], layer_ids)
        return ForwardOutput(final_hidden_to_logits(params, config, x, logits_at), None, kv)

    offset = jnp.asarray(cache_offset, jnp.int32)

    def layer_cached(carry, inputs):
        x, ck, cv = carry
        layer_params, i = inputs
        q, k, v = block.apply({"params": layer_params}, x, cos, sin, method=Block.qkv)
        if write_mask is not None:  # keep the cached K/V where the window must not overwrite them
            old_k = jax.lax.dynamic_slice_in_dim(ck[i], offset, n, axis=1)
            old_v = jax.lax.dynamic_slice_in_dim(cv[i], offset, n, axis=1)
            wm = write_mask[:, :, None, None]
            k, v = jnp.where(wm, k, old_k), jnp.where(wm, v, old_v)
        # In-place update of layer i's window in the carried buffers (no copy of the whole cache per layer).
        ck = jax.lax.dynamic_update_slice(ck, k[None].astype(ck.dtype), (i, 0, offset, 0, 0))
        cv = jax.lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), (i, 0, offset, 0, 0))
        attn = attend(q, ck[i], cv[i], key_mask, attention_backend)
        x = finish(layer_params, i, x, attn)
        return (x, ck, cv), ((k, v) if return_kv else None)

    (x, ck, cv), kv = layer_loop(layer_cached, (x, cache.k, cache.v), params["layers"], layer_ids)
    return ForwardOutput(final_hidden_to_logits(params, config, x, logits_at), KVCache(ck, cv), kv)


def layer_loop(fn, carry, layers, layer_ids):
    """lax.scan over stacked layer params, or an unrolled python loop over a tuple of per-layer params (static
    layer index), with the same (carry, stacked per-layer outputs) result."""
    if not isinstance(layers, (tuple, list)):
        return jax.lax.scan(fn, carry, (layers, layer_ids))
    outs = []
    for i, layer_params in enumerate(layers):
        carry, out = fn(carry, (layer_params, i))
        outs.append(out)
    stacked = None if outs[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *outs)
    return carry, stacked


def unstack_layers(params: Params) -> Params:
    """The same params with "layers" as a tuple of per-layer trees (run by an unrolled loop in `forward`).

    Why: inside lax.scan every layer's weights are a dynamic slice of the stacked arrays, and XLA may copy a slice
    before a GEMM or custom call reads it (bench/NOTES.md, issue 7). Per-layer arrays need no slice. Costs a
    longer compile (one copy of the layer per layer)."""
    if isinstance(params["layers"], (tuple, list)):
        return params
    return unstack_layers_in_place(dict(params))


def unstack_layers_in_place(params: Params) -> Params:
    """`unstack_layers` on a params dict the caller owns: "layers" is popped from it and each stacked leaf is
    dropped as soon as it is split, so when nothing else holds the stacked arrays the peak is one stacked leaf
    over the model, not a second copy of it (`dllm_jax.load`: LLaDA-8B 3.2 GB instead of 16 GB)."""
    flat, treedef = jax.tree.flatten(params.pop("layers"))
    n = flat[0].shape[0]
    per_layer: list[list[Any]] = [[] for _ in range(n)]
    for j in range(len(flat)):
        leaf, flat[j] = flat[j], None
        for i in range(n):
            per_layer[i].append(leaf[i])
        del leaf
    params["layers"] = tuple(jax.tree.unflatten(treedef, leaves) for leaves in per_layer)
    return params


def stack_layers(params: Params) -> Params:
    """The inverse of `unstack_layers`: "layers" as stacked [L, ...] leaves (a no-op if already stacked)."""
    layers = params["layers"]
    if not isinstance(layers, (tuple, list)):
        return params
    stack = np.stack if all(isinstance(a, np.ndarray) for a in jax.tree.leaves(layers)) else jnp.stack
    return {**params, "layers": jax.tree.map(lambda *a: stack(a), *layers)}


FfnBackend = str  # "xla" | "pallas" (Triton-lowered skinny GEMM) | "mgpu" (Mosaic GPU streaming GEMM)
FFN_BACKENDS = ("xla", "pallas", "mgpu")


def use_pallas_ffn(config: ModelConfig, ffn_backend: FfnBackend, tokens: int) -> bool:
    if ffn_backend not in FFN_BACKENDS:
        raise ValueError(f"unknown ffn_backend {ffn_backend!r}; expected one of {FFN_BACKENDS}")
    if ffn_backend == "mgpu":  # bf16/fp16 weights, <= 64 rows, N a multiple of 128 and K of 64
        d, f = config.d_model, config.mlp_hidden
        return (config.dtype in ("bfloat16", "float16") and tokens <= 64 and d % 128 == 0 and f % 128 == 0)
    from pallas_kernels import skinny_matmul as sm

    return (ffn_backend == "pallas" and sm.supported(tokens, config.d_model, config.mlp_hidden)
            and sm.supported(tokens, config.mlp_hidden, config.d_model))


def pallas_mlp(params: Params, layer_params: Params, layer_index, h: Array, ffn_backend: FfnBackend = "pallas"
               ) -> Array:
    """SwiGLU FFN with a weight-streaming GEMM: down(silu(gate(h)) * up(h)), each GEMM rounded once to h.dtype
    like `layers.Linear`. Stacked params: the kernel reads layer `layer_index` of the stack itself."""
    from pallas_kernels.skinny_matmul import skinny_matmul
    from pallas_kernels.stream_matmul_mgpu import stream_matmul

    b, n, d = h.shape
    interpret = jax.default_backend() != "gpu"
    stacked = not isinstance(params["layers"], (tuple, list))
    mlp = params["layers"]["mlp"] if stacked else layer_params["mlp"]
    idx = layer_index if stacked else None

    def mm(x, name):
        w = mlp[name]["kernel"]
        if ffn_backend == "mgpu":
            return stream_matmul(x, w, idx, interpret=interpret)
        return skinny_matmul(x, w, None, idx, interpret=interpret)

    h2 = h.reshape(b * n, d)
    act = jax.nn.silu(mm(h2, "gate_proj")) * mm(h2, "up_proj")
    return mm(act, "down_proj").reshape(b, n, d)


# ------------------------------------------------------------------------------------------ parameters
def param_shapes(config: ModelConfig) -> Params:
    """The param tree's shapes (jax.ShapeDtypeStruct leaves) without allocating anything."""
    shapes = jax.eval_shape(lambda: init_params(config.replace(fp8_ffn=False), jax.random.key(0)))
    if config.fp8_ffn:
        from dllm_jax import fp8

        shapes = fp8.fp8_param_shapes(shapes, config)
    return shapes


def init_params(config: ModelConfig, key: Array, std: float = 0.02) -> Params:
    """Random params in the config dtype (used by tests, benchmarks and training from scratch)."""
    if config.fp8_ffn:
        from dllm_jax import fp8

        return fp8.quantize_params(init_params(config.replace(fp8_ffn=False), key, std),
                                   config.replace(fp8_ffn=False))[0]
    dt = config.jnp_dtype
    k_embed, k_layers, k_head = jax.random.split(key, 3)
    d = config.d_model
    x = jnp.zeros((1, 1, d), dt)
    cos = jnp.zeros((1, 1, config.head_dim), jnp.float32)

    def init_layer(k):
        variables = Block(config).init(k, x, cos, cos, lambda q, kk, v: jnp.repeat(v, config.q_per_kv, axis=2))
        p = variables["params"]
        # normal(std) for every kernel, ones for norms; small random biases so tests exercise them
        leaves, tree = jax.tree_util.tree_flatten_with_path(p)
        keys = jax.random.split(k, len(leaves))
        out = []
        for (path, leaf), kk in zip(leaves, keys):
            name = jax.tree_util.keystr(path)
            if "scale" in name:
                out.append(jnp.ones_like(leaf))
            else:
                out.append((std * jax.random.normal(kk, leaf.shape, jnp.float32)).astype(dt))
        return jax.tree_util.tree_unflatten(tree, out)

    layers = jax.vmap(init_layer)(jax.random.split(k_layers, config.n_layers))
    params: Params = {
        "embed": (std * jax.random.normal(k_embed, (config.vocab_size, d), jnp.float32)).astype(dt),
        "layers": layers,
        "final_norm": {"scale": jnp.ones((d,), dt)},
    }
    if not config.tie_embeddings:
        params["lm_head"] = (std * jax.random.normal(k_head, (d, config.vocab_size), jnp.float32)).astype(dt)
    return params


def cast_params(params: Params, dtype: jnp.dtype) -> Params:
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
