"""The LLaDA / Dream transformer as a pure function of (params, tokens, positions, mask, cache).

Both families are pre-norm llama-style decoders run WITHOUT a causal mask. A `Block` is a linen module applied
functionally; the layers run under `jax.lax.scan` over stacked layer weights (compile time does not grow with
depth), or as an unrolled loop over per-layer weights (the GPU default: no per-layer weight slices). Attention
is a hook (`attend_fn`) so that the cache techniques decide which keys a layer sees without any branch inside the
block.

Param tree (leaves in the config dtype; kernels are [in, out]; this is the stacked layout of the converted format
and the CPU; on a GPU `dllm_jax.load` makes "layers" a tuple of per-layer trees with q/k/v fused into
"qkv_proj" and gate/up into "mlp.gate_up_proj", see `unstack_layers` and `fuse_projections`):
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
# probe(q [B,n,Hq,D], k buffer [B,S,Hkv,D]) -> [B,S] float32, summed over layers (forward's `probe`)
ProbeFn = Callable[[Array, Array], Array]


class Block(nn.Module):
    """One pre-norm layer. fused: the layer's params hold q/k/v as one "qkv_proj" and gate/up as one
    "mlp.gate_up_proj" (`fuse_projections`); the arithmetic per output column is the same."""

    config: ModelConfig
    fused: bool = False

    def setup(self) -> None:
        c, dt = self.config, self.config.jnp_dtype
        self.attn_norm = RMSNorm(c.rms_eps, dt)
        if self.fused:
            self.qkv_proj = Linear(sum(projection_widths(c)), c.qkv_bias, dt)
        else:
            self.q_proj = Linear(c.n_heads * c.head_dim, c.qkv_bias, dt)
            self.k_proj = Linear(c.n_kv_heads * c.head_dim, c.qkv_bias, dt)
            self.v_proj = Linear(c.n_kv_heads * c.head_dim, c.qkv_bias, dt)
        self.o_proj = Linear(c.d_model, False, dt)
        self.ffn_norm = RMSNorm(c.rms_eps, dt)
        self.mlp = SwiGLU(c.mlp_hidden, dt, fused=self.fused)

    def qkv(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        """Rotated q [B,n,Hq,D], k [B,n,Hkv,D] and v [B,n,Hkv,D] of the block input x [B,n,d]."""
        return self.split_rotate(self.qkv_projection(self.qkv_in(x)), cos, sin)

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

    def attn_residual(self, x: Array, attn: Array) -> Array:
        return x + self.attn_projection(attn)

    def attn_projection(self, attn: Array) -> Array:
        """o_proj of the attention output [B, n, heads, head_dim] -> [B, n, d]."""
        b, n = attn.shape[:2]
        return self.o_proj(attn.reshape(b, n, -1))

    def ffn_in(self, x: Array) -> Array:
        return self.ffn_norm(x)

    def ffn(self, h: Array) -> Array:
        """The SwiGLU FFN of an already normalised input (no residual)."""
        return self.mlp(h)

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

    k, v: [L, B, S, Hkv, D] (stacked), or tuples of L arrays [B, S, Hkv, D] (per layer: the unrolled layer loop's
    layout; each layer's attention then reads its own buffer in place, where XLA copied a stacked cache's layer
    slice for the attention call: 0.08 / 0.86 / 3.46 ms more per LLaDA-8B block step at batch 1 / 8 / 32 on an
    H200, bench/NOTES.md v4).
    Position j of row b holds the K/V that the token at buffer index j had the last time a forward wrote it.
    """

    k: Array | tuple[Array, ...]
    v: Array | tuple[Array, ...]

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, length: int, per_layer: bool = False) -> "KVCache":
        shape = (batch, length, config.n_kv_heads, config.head_dim)
        if per_layer:
            def make():
                return tuple(jnp.zeros(shape, config.jnp_dtype) for _ in range(config.n_layers))
            return cls(make(), make())
        shape = (config.n_layers, *shape)
        return cls(jnp.zeros(shape, config.jnp_dtype), jnp.zeros(shape, config.jnp_dtype))

    @classmethod
    def for_params(cls, params: "Params", config: ModelConfig, batch: int, length: int) -> "KVCache":
        """Zeros in the layout that suits the params: per layer for unrolled layers, stacked for a scan."""
        return cls.zeros(config, batch, length, per_layer=is_unrolled(params["layers"]))

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, (tuple, list))

    @property
    def length(self) -> int:
        return self.k[0].shape[1] if self.per_layer else self.k.shape[2]

    def stacked(self) -> "KVCache":
        """The same cache as [L, B, S, Hkv, D] arrays."""
        return KVCache(jnp.stack(self.k), jnp.stack(self.v)) if self.per_layer else self


def _cache_write(buf: Array | tuple[Array, ...], i, offset: Array, window: Array) -> Array | tuple[Array, ...]:
    """Layer i's buffer with `window` [B, n, Hkv, D] written at sequence offset `offset` (in place under jit)."""
    if isinstance(buf, tuple):
        new = jax.lax.dynamic_update_slice(buf[i], window.astype(buf[i].dtype), (0, offset, 0, 0))
        return buf[:i] + (new,) + buf[i + 1:]
    return jax.lax.dynamic_update_slice(buf, window[None].astype(buf.dtype), (i, 0, offset, 0, 0))


def _cache_scatter(buf: Array | tuple[Array, ...], i, slots: Array, write_mask: Array | None, window: Array
                   ) -> Array | tuple[Array, ...]:
    """Layer i's buffer with `window` [B, n, Hkv, D] written at the slots [B, n] of a gathered window. Entries
    whose write_mask is False are not written at all (sent past the buffer's end, which the scatter drops), so
    a slot may appear twice in a window as long as at most one of its entries writes."""
    rows = jnp.arange(window.shape[0])[:, None]
    length = buf[i].shape[1] if isinstance(buf, tuple) else buf.shape[2]
    if write_mask is not None:
        slots = jnp.where(write_mask, slots, length)
    if isinstance(buf, tuple):
        new = buf[i].at[rows, slots].set(window.astype(buf[i].dtype), mode="drop")
        return buf[:i] + (new,) + buf[i + 1:]
    return buf.at[i, rows, slots].set(window.astype(buf.dtype), mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    logits: Array  # [B, n or m, V] in the activation dtype
    cache: KVCache | None  # the updated cache when one was given
    kv: tuple[Array, Array] | None  # per-layer fresh (k, v) [L, B, n, Hkv, D] when return_kv=True
    probe: Array | None = None  # [B, S] float32: the probe hook's per-layer results summed over layers
    hidden: Array | None = None  # [B, n, d] the last layer's output before the final norm, with output_hidden


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


def layer_finish(params: Params, config: ModelConfig, block: Block, layer_params: Params, i, x: Array, attn: Array,
                 ffn_backend: FfnBackend = "xla") -> Array:
    """Layer i's output from its input x [B, n, d] and attention output attn [B, n, Hq, D]: the residual o_proj,
    then the residual FFN (bf16, the weight-streaming kernel for short windows, or FP8 past layer 1)."""
    b, n = x.shape[:2]
    if not config.fp8_ffn and use_pallas_ffn(config, ffn_backend, b * n):
        x = block.apply({"params": layer_params}, x, attn, method=Block.attn_residual)
        h = block.apply({"params": layer_params}, x, method=Block.ffn_in)
        return x + pallas_mlp(params, layer_params, i, h, ffn_backend)
    if not config.fp8_ffn:
        return block.apply({"params": layer_params}, x, attn, method=Block.finish)
    from dllm_jax import fp8  # FP8 FFN in layers >= 2 (LaCache); layer 1 in the activation dtype

    # the residual add x + o_proj(attn) is left to the FP8 FFN (fused into its RMSNorm kernel on the GPU)
    o = block.apply({"params": layer_params}, attn, method=Block.attn_projection)
    return fp8.ffn_residual(params, config, layer_params, i, x, attn_out=o)


def forward(
    params: Params,
    config: ModelConfig,
    tokens: Array | None,
    positions: Array,
    *,
    key_mask: Array | None = None,
    cache: KVCache | None = None,
    cache_offset: Array | int = 0,
    write_mask: Array | None = None,
    logits_at: Array | None = None,
    return_kv: bool = False,
    write_slots: Array | None = None,
    probe: ProbeFn | None = None,
    layer_range: tuple[int, int] | None = None,
    hidden: Array | None = None,
    output_hidden: bool = False,
    attention_backend: Backend = "xla",
    ffn_backend: FfnBackend = "xla",
    norm_rope_backend: NormRopeBackend = "xla",
) -> ForwardOutput:
    """Run the model on a window of tokens.

    tokens, positions: [B, n] int32 (positions are the RoPE positions: absolute, per row).
    Without a cache: bidirectional attention among the n tokens, keys masked by key_mask [B, n].
    With a cache (length S): the window's K/V are written into buffer slots [cache_offset, cache_offset + n)
    (only where write_mask [B, n] is True, if given), then every query attends over all S buffer slots,
    masked by key_mask [B, S]. The updated cache is returned.
    logits_at: [B, m] indices into the window; logits only there (None: every position).
    write_slots: [B, n] int32 buffer slots of a gathered window (its tokens need not be contiguous, e.g. the
    anchors and request positions of the affix cache): the window's K/V are written there instead of at
    cache_offset; entries whose write_mask is False are not written (a slot may repeat if at most one entry
    writes it). XLA's RoPE and write (no fused RoPE/write kernel).
    probe: with a cache, called in every layer as probe(q [B, n, Hq, D] rotated, layer K buffer [B, S, Hkv, D])
    -> [B, S] float32; the sum over layers comes back as ForwardOutput.probe (the affix cache's one-shot anchor
    probe; caches/acache.py).
    layer_range: (start, stop): run only layers start..stop-1 (cache buffers keep their absolute layer index).
    hidden: [B, n, d] the input of layer `start` instead of the embedded tokens (tokens may then be None).
    output_hidden: return the last run layer's output (ForwardOutput.hidden, before the final norm) instead of
    logits. With these a forward can be split at a layer (the shallow-layer reuse of caches/bicache.py).
    ffn_backend: "pallas" runs the FFN's three GEMMs with the weight-streaming kernel
    (`pallas_kernels/skinny_matmul.py`, which indexes the stacked weights itself) when the window has few tokens
    (B * n <= 64, where it was measured faster) and the FFN is not FP8; otherwise XLA. "mgpu": the same with the
    Mosaic GPU kernel (`pallas_kernels/stream_matmul_mgpu.py`; bf16 only; 1.1-1.5 TB/s, slower than XLA once
    unrolled: bench/NOTES.md v3). Interpreted off the GPU.
    norm_rope_backend: "pallas" runs each residual add with the RMSNorm after it as one kernel, and RoPE with the
    K/V cache write as one kernel (`dllm_jax.fused_layers`; per-layer params and cache only; interpreted off the
    GPU); "pallas_rope" only the latter, in this layer loop, for windows of at most `fused_layers.PARTIALS_MAX_TOKENS`
    tokens (block steps) over a per-layer cache, fed by the q/k/v GEMM's split-K partials (`fused_layers.rope_write`;
    larger windows run the XLA ops, which were faster there); "xla" the plain-jnp ops; "auto" (generate's default)
    "pallas_rope" where it applies on a GPU in bf16 (a per-layer cache, a block step's window), else "xla".
    params["layers"] may be stacked ([L, ...] leaves: a lax.scan over layers) or a tuple of per-layer trees
    (`unstack_layers`: an unrolled python loop, no per-layer slicing of stacked weights).
    """
    b, n = positions.shape
    block = Block(config, fused=is_fused(params["layers"]))
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta)
    if hidden is not None:
        x = hidden.astype(config.jnp_dtype)
    else:
        x = embed(params, jnp.asarray(tokens, jnp.int32)).astype(config.jnp_dtype)
    if norm_rope_backend not in NORM_ROPE_BACKENDS:
        raise ValueError(f"unknown norm_rope_backend {norm_rope_backend!r}; expected one of {NORM_ROPE_BACKENDS}")
    if (write_slots is not None or probe is not None) and (cache is None or norm_rope_backend in ("pallas",
                                                                                                "pallas_rope")):
        raise ValueError("write_slots and probe need a cache and XLA's RoPE and cache write (norm_rope_backend "
                         f"'xla' or 'auto'), got cache={'set' if cache is not None else None}, "
                         f"norm_rope_backend={norm_rope_backend!r}")
    start, stop = layer_range if layer_range is not None else (0, config.n_layers)
    if not 0 <= start <= stop <= config.n_layers:
        raise ValueError(f"layer_range {layer_range} is not within the model's {config.n_layers} layers")
    if (start, stop) != (0, config.n_layers) and norm_rope_backend == "pallas":
        raise ValueError("layer_range needs the layer loop of this function (norm_rope_backend != 'pallas')")
    layers, layer_ids = select_layers(params["layers"], start, stop)

    def finish_output(x):
        if output_hidden:
            return None, x
        return final_hidden_to_logits(params, config, x, logits_at), None
    if norm_rope_backend == "pallas":
        from dllm_jax.fused_layers import run_layers

        x, new_cache, kv = run_layers(params, config, block, x, cos, sin, key_mask=key_mask, cache=cache,
                                      cache_offset=cache_offset, write_mask=write_mask, return_kv=return_kv,
                                      attention_backend=attention_backend, ffn_backend=ffn_backend)
        logits, hid = finish_output(x)
        return ForwardOutput(logits, new_cache, kv, hidden=hid)

    def attend_fresh(q, k, v):
        return attend(q, k, v, key_mask, attention_backend)

    def finish(layer_params, i, x, attn):
        return layer_finish(params, config, block, layer_params, i, x, attn, ffn_backend)

    if cache is None:
        def layer(x, inputs):
            layer_params, i = inputs
            q, k, v = block.apply({"params": layer_params}, x, cos, sin, method=Block.qkv)
            x = finish(layer_params, i, x, attend_fresh(q, k, v))
            return x, ((k, v) if return_kv else None)

        x, kv = layer_loop(layer, x, layers, layer_ids)
        logits, hid = finish_output(x)
        return ForwardOutput(logits, None, kv, hidden=hid)

    offset = jnp.asarray(cache_offset, jnp.int32)
    if cache.per_layer and not is_unrolled(params["layers"]):
        raise ValueError("a per-layer KVCache needs per-layer (unrolled) params: the scanned loop indexes the "
                         "cache with a traced layer index; use KVCache.for_params(params, ...)")

    if norm_rope_backend == "pallas_rope" and not cache.per_layer:
        raise ValueError("norm_rope_backend='pallas_rope' needs a per-layer KVCache (KVCache.for_params with "
                         "per-layer params): its kernel writes one layer's buffer in place")
    from dllm_jax.fused_layers import PARTIALS_MAX_TOKENS, rope_write, written_window  # (imports modeling)

    # the RoPE kernel: block-step windows only (NOTES v14), written contiguously
    rope_kernel = write_slots is None and b * n <= PARTIALS_MAX_TOKENS and (
        norm_rope_backend == "pallas_rope"
        or (norm_rope_backend == "auto" and cache.per_layer and jax.default_backend() == "gpu"
            and config.dtype == "bfloat16"))

    def rotate_and_write(layer_params, i, x, ck, cv):
        """Rotated q, the carried buffers with layer i's window written (in place under jit) and, with return_kv,
        what the window left in its slots (the old K/V where write_mask is False)."""
        if rope_kernel:  # one kernel: the projection's split-K reduction, RoPE and the K/V write
            h = block.apply({"params": layer_params}, x, method=Block.qkv_in)
            q, kb, vb = rope_write(block, config, layer_params, h, cos, sin, ck[i], cv[i], offset, write_mask,
                                   interpret=jax.default_backend() != "gpu")
            fresh = written_window(kb, vb, offset, n) if return_kv else None
            return q, ck[:i] + (kb,) + ck[i + 1:], cv[:i] + (vb,) + cv[i + 1:], fresh
        q, k, v = block.apply({"params": layer_params}, x, cos, sin, method=Block.qkv)
        if write_mask is not None and write_slots is None:  # keep the cached K/V the window must not overwrite
            old_k, old_v = written_window(ck[i], cv[i], offset, n)
            wm = write_mask[:, :, None, None]
            k, v = jnp.where(wm, k, old_k), jnp.where(wm, v, old_v)
        # In-place update of layer i's window in the carried buffers (no copy of the whole cache per layer).
        if write_slots is not None:
            ck = _cache_scatter(ck, i, write_slots, write_mask, k)
            cv = _cache_scatter(cv, i, write_slots, write_mask, v)
        else:
            ck, cv = _cache_write(ck, i, offset, k), _cache_write(cv, i, offset, v)
        return q, ck, cv, ((k, v) if return_kv else None)

    def layer_cached(carry, inputs):
        x, ck, cv, probed = carry
        layer_params, i = inputs
        q, ck, cv, fresh = rotate_and_write(layer_params, i, x, ck, cv)
        if probe is not None:
            probed = probed + probe(q, ck[i])
        attn = attend(q, ck[i], cv[i], key_mask, attention_backend)
        x = finish(layer_params, i, x, attn)
        return (x, ck, cv, probed), fresh

    probed0 = jnp.zeros((b, cache.length), jnp.float32) if probe is not None else None
    (x, ck, cv, probed), kv = layer_loop(layer_cached, (x, tuple(cache.k) if cache.per_layer else cache.k,
                                                         tuple(cache.v) if cache.per_layer else cache.v, probed0),
                                         layers, layer_ids)
    logits, hid = finish_output(x)
    return ForwardOutput(logits, KVCache(ck, cv), kv, probed, hid)


def is_unrolled(layers: Params | tuple) -> bool:
    """Whether a "layers" entry is the per-layer layout (a tuple of trees) rather than stacked [L, ...] leaves."""
    return isinstance(layers, (tuple, list))


def select_layers(layers: Params | tuple, start: int, stop: int) -> tuple[Params | tuple, range]:
    """Layers start..stop-1 of a "layers" entry (a tuple slice, or stacked leaves sliced on their first axis) and
    their absolute indices."""
    if is_unrolled(layers):
        return tuple(layers[start:stop]), range(start, stop)
    if (start, stop) != (0, jax.tree.leaves(layers)[0].shape[0]):
        layers = jax.tree.map(lambda a: a[start:stop], layers)
    return layers, range(start, stop)


def layer_loop(fn, carry, layers, layer_ids: range):
    """lax.scan over stacked layer params, or an unrolled python loop over a tuple of per-layer params (static
    layer index), with the same (carry, stacked per-layer outputs) result. layer_ids: the absolute indices."""
    if not is_unrolled(layers):
        return jax.lax.scan(fn, carry, (layers, jnp.asarray(layer_ids, jnp.int32)))
    outs = []
    for i, layer_params in zip(layer_ids, layers):
        carry, out = fn(carry, (layer_params, i))
        outs.append(out)
    stacked = None if not outs or outs[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *outs)
    return carry, stacked


def unstack_layers(params: Params, fuse: bool = True) -> Params:
    """The same params with "layers" as a tuple of per-layer trees (run by an unrolled loop in `forward`), with
    the projections fused (`fuse_projections`) unless fuse=False. The caller's tree is not modified.

    Why: inside lax.scan every layer's weights are a dynamic slice of the stacked arrays, and XLA may copy a slice
    before a GEMM or custom call reads it (bench/NOTES.md, issue 7). Per-layer arrays need no slice. Costs a
    longer compile (one copy of the layer per layer)."""
    if is_unrolled(params["layers"]):
        return params
    return unstack_layers_in_place({**params, "layers": jax.tree.map(lambda a: a, params["layers"])}, fuse)


def unstack_layers_in_place(params: Params, fuse: bool = True) -> Params:
    """`unstack_layers` on a params dict the caller owns: "layers" is popped from it and each stacked leaf is
    dropped as soon as it is fused and split, so when nothing else holds the stacked arrays the peak is one fused
    leaf over the model, not a second copy of it (`dllm_jax.load`: LLaDA-8B's gate/up, 6.4 GB, not 16 GB)."""
    layers = params.pop("layers")
    if fuse:
        layers = fuse_projections(layers, consume=True)
    flat, treedef = jax.tree.flatten(layers)
    del layers
    n = flat[0].shape[0]
    per_layer: list[list[Any]] = [[] for _ in range(n)]
    for j in range(len(flat)):
        leaf, flat[j] = flat[j], None
        for i in range(n):
            per_layer[i].append(leaf[i])
        del leaf
    layers = [jax.tree.unflatten(treedef, leaves) for leaves in per_layer]
    if "mlp_fp8" in layers[0]:  # the FP8 kernel's weight-scale tables, built once here rather than every step
        from dllm_jax.fp8 import with_kernel_scales

        layers = [{**lp, "mlp_fp8": with_kernel_scales(lp["mlp_fp8"])} for lp in layers]
    params["layers"] = tuple(layers)
    return params


def stack_layers(params: Params, config: ModelConfig | None = None) -> Params:
    """The inverse of `unstack_layers`: "layers" as stacked [L, ...] leaves with separate projections (a no-op
    if already stacked). Fused layers need the config (the q/k/v widths)."""
    layers = params["layers"]
    if not is_unrolled(layers):
        return params
    if "mlp_fp8" in layers[0]:  # drop the kernel-layout scale tables that unstack_layers added
        from dllm_jax.fp8 import without_kernel_scales

        layers = [{**lp, "mlp_fp8": without_kernel_scales(lp["mlp_fp8"])} for lp in layers]
    stack = np.stack if all(isinstance(a, np.ndarray) for a in jax.tree.leaves(layers)) else jnp.stack
    stacked = jax.tree.map(lambda *a: stack(a), *layers)
    if is_fused(stacked):
        if config is None:
            raise ValueError("stack_layers needs the model config to split fused projections")
        stacked = split_projections(stacked, config)
    return {**params, "layers": stacked}


# ------------------------------------------------------------------------------------- fused projections
# q/k/v share their input, and so do gate/up: one wider GEMM reads the same weight bytes with fewer launches and
# more output tiles in flight (issue 7). Fused kernels are the parts concatenated along the output axis.
FUSED_ATTENTION = ("qkv_proj", ("q_proj", "k_proj", "v_proj"))
FUSED_MLP = ("gate_up_proj", ("gate_proj", "up_proj"))


def projection_widths(config: ModelConfig) -> tuple[int, int, int]:
    """Output widths of q, k and v (their order in the fused qkv_proj)."""
    kv = config.n_kv_heads * config.head_dim
    return config.n_heads * config.head_dim, kv, kv


def is_fused(layers: Params | tuple) -> bool:
    first = layers[0] if is_unrolled(layers) else layers
    return FUSED_ATTENTION[0] in first


def _concat_last(parts: list[Any]) -> Any:
    """Concatenate along the last axis, emptying `parts` as it goes: a numpy part is dropped once copied, so the
    peak is the result plus one part when nothing else holds them (host loading of an 8B model)."""
    if not all(isinstance(p, np.ndarray) for p in parts):
        out = jnp.concatenate(parts, axis=-1)
        parts.clear()
        return out
    out = np.empty(parts[0].shape[:-1] + (sum(p.shape[-1] for p in parts),), parts[0].dtype)
    col = 0
    while parts:
        part = parts.pop(0)
        out[..., col:col + part.shape[-1]] = part
        col += part.shape[-1]
        del part
    return out


def _fuse_group(tree: Params, fused_name: str, names: tuple[str, ...], consume: bool) -> Params:
    out = {k: v for k, v in tree.items() if k not in names}
    modules = [tree.pop(n) if consume else tree[n] for n in names]
    out[fused_name] = {leaf: _concat_last([m.pop(leaf) if consume else m[leaf] for m in modules])
                       for leaf in list(modules[0])}
    return out


def fuse_projections(layers: Params, consume: bool = False) -> Params:
    """A layers tree (stacked [L, ...] or one layer's) with q/k/v as "qkv_proj" and, where the layer has its bf16
    FFN, gate/up as "mlp.gate_up_proj". consume=True empties the given dicts while fusing (lower peak memory)."""
    if is_fused(layers):
        return layers
    out = _fuse_group(layers, *FUSED_ATTENTION, consume)
    if "mlp" in out:  # FP8 layers keep their own e4m3 FFN tree
        out["mlp"] = _fuse_group(out["mlp"], *FUSED_MLP, consume)
    return out


def split_projections(layers: Params, config: ModelConfig) -> Params:
    """The inverse of `fuse_projections` (slices of the fused leaves along the last axis)."""
    if not is_fused(layers):
        return layers

    def split(tree, fused_name, names, widths):
        out = {k: v for k, v in tree.items() if k != fused_name}
        bounds = np.cumsum((0,) + tuple(widths))
        for name, lo, hi in zip(names, bounds[:-1], bounds[1:]):
            out[name] = {leaf: a[..., lo:hi] for leaf, a in tree[fused_name].items()}
        return out

    out = split(layers, *FUSED_ATTENTION, projection_widths(config))
    if "mlp" in out and FUSED_MLP[0] in out["mlp"]:
        out["mlp"] = split(out["mlp"], *FUSED_MLP, (config.mlp_hidden, config.mlp_hidden))
    return out


FfnBackend = str  # "xla" | "pallas" (Triton-lowered skinny GEMM) | "mgpu" (Mosaic GPU streaming GEMM)
FFN_BACKENDS = ("xla", "pallas", "mgpu")
NormRopeBackend = str  # "xla" | "pallas" | "pallas_rope" (dllm_jax.fused_layers) | "auto"
NORM_ROPE_BACKENDS = ("xla", "pallas", "pallas_rope", "auto")


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
    stacked = not is_unrolled(params["layers"])
    mlp = params["layers"]["mlp"] if stacked else layer_params["mlp"]
    idx = layer_index if stacked else None

    def mm(x, name):
        w = mlp[name]["kernel"]
        if ffn_backend == "mgpu":
            return stream_matmul(x, w, idx, interpret=interpret)
        return skinny_matmul(x, w, None, idx, interpret=interpret)

    h2 = h.reshape(b * n, d)
    if FUSED_MLP[0] in mlp:
        gate, up = jnp.split(mm(h2, FUSED_MLP[0]), 2, axis=-1)
    else:
        gate, up = mm(h2, "gate_proj"), mm(h2, "up_proj")
    act = jax.nn.silu(gate) * up
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
