"""The LLaDA / Dream transformer as a pure function of (params, tokens, positions, mask, cache).

`forward` runs a window of tokens (or hidden states) through a range of layers: under `jax.lax.scan` over stacked
layer weights (compile time does not grow with depth), or as an unrolled loop over per-layer weights (the GPU
default, see `params.py`). With a cache the window's K/V are written into it and every query attends over the
whole cache: that is all the cache techniques of `dllm_jax.decoding.caches` need from the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dllm_jax.config import ModelConfig
from dllm_jax.transformer.attention import attend
from dllm_jax.transformer.block import Block, block_for, block_qkv, embed, final_hidden_to_logits, layer_finish
from dllm_jax.transformer.kernels import XLA, Kernels
from dllm_jax.transformer.kv_cache import WRITE_AT_ZERO, CacheWrite, KVCache
from dllm_jax.transformer.layers import rope_cos_sin
from dllm_jax.transformer.params import Params, is_unrolled, select_layers
from dllm_jax.transformer.rope_write import ROPE_WRITE_MAX_TOKENS, rope_write

Array = jax.Array
# probe(q [B,n,Hq,D] rotated, the cache, the layer index) -> [B,S] float32, summed over layers (ACache's probe); the
# hook reads the keys it needs from the cache (cache.keys(i): [B,S,Hkv,D]) only when it scores anything
ProbeFn = Callable[[Array, Any, Any], Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    logits: Array | None  # [B, n or m, V] in the activation dtype (None with output_hidden)
    cache: Any  # the updated cache when one was given
    kv: tuple[Array, Array] | None  # per-layer fresh (k, v) [L, B, n, Hkv, D] with return_kv (no cache)
    probe: Array | None = None  # [B, S] float32: the probe hook's per-layer results summed over layers
    hidden: Array | None = None  # [B, n, d] the last layer's output before the final norm, with output_hidden


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowChunks:
    """Run a cached forward's window `size` tokens at a time, and only its first `live` tokens' chunks: a window
    padded to one fixed width costs what its live part costs (the serving engine pads every block start to
    max_model_len, so one program serves every window length). In each layer every live chunk's K/V are written
    before any chunk attends, so the result is the unchunked forward's. Entries past the live chunks keep their
    input hidden state (their outputs must not be read) and write nothing. half_tail (per-layer weights): a live
    tail of at most half a chunk runs as a half chunk (`chunk_counts`), for a second copy of the layer in the
    program (compile time)."""

    size: int = dataclasses.field(metadata=dict(static=True))
    live: Array | int = 0  # int32: window entries 0..live-1 carry work
    half_tail: bool = dataclasses.field(default=False, metadata=dict(static=True))


def _cols(a: Array, start: Array, size: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(a, start, size, axis=1)


def _chunk_write(write: CacheWrite, start: Array, size: int) -> CacheWrite:
    """Where a chunk of the window (its entries start..start+size-1) writes."""
    mask = None if write.mask is None else _cols(write.mask, start, size)
    if write.slots is not None:
        return CacheWrite.scatter(_cols(write.slots, start, size), mask)
    return CacheWrite.at(jnp.asarray(write.offset, jnp.int32) + start, mask)


def chunk_counts(chunks: WindowChunks) -> tuple[Array, Array]:
    """(full, tail): the live window as `full` chunks of chunks.size, then `tail` (0 or 1) half chunk where the
    rest fits in one and chunks.half_tail (the unrolled forward's padding; the scanned one runs whole chunks)."""
    c, live = chunks.size, jnp.asarray(chunks.live, jnp.int32)
    h = c // 2 if c % 2 == 0 and chunks.half_tail else 0
    rest = live % c
    tail = ((rest > 0) & (rest <= h)).astype(jnp.int32)
    return live // c + ((rest > 0) & (tail == 0)).astype(jnp.int32), tail


def layer_loop(fn, carry, layers, layer_ids: range):
    """lax.scan over stacked layer params, or an unrolled python loop over a tuple of per-layer params (static layer
    index), with the same (carry, stacked per-layer outputs) result. layer_ids: the absolute indices."""
    if not is_unrolled(layers):
        return jax.lax.scan(fn, carry, (layers, jnp.asarray(layer_ids, jnp.int32)))
    outs = []
    for i, layer_params in zip(layer_ids, layers):
        carry, out = fn(carry, (layer_params, i))
        outs.append(out)
    stacked = None if not outs or outs[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *outs)
    return carry, stacked


def forward(
    params: Params,
    config: ModelConfig,
    inputs: Array,
    positions: Array,
    *,
    key_mask: Array | None = None,
    cache: Any = None,
    write: CacheWrite = WRITE_AT_ZERO,
    logits_at: Array | None = None,
    layers: tuple[int, int] | None = None,
    output_hidden: bool = False,
    return_kv: bool = False,
    probe: ProbeFn | None = None,
    chunks: WindowChunks | None = None,
    kernels: Kernels = XLA,
) -> ForwardOutput:
    """Run the model on a window.

    inputs: token ids [B, n] int, or the hidden state [B, n, d] entering the first layer of `layers`.
    positions: [B, n] int32 RoPE positions (absolute, per row).
    Without a cache: bidirectional attention among the n tokens, keys masked by key_mask [B, n]; return_kv gives
    every layer's fresh (k, v). With a cache (a `KVCache` of length S, or any object with its write/attend/keys
    methods): the window's K/V are written where `write` says, then every query attends over all S positions,
    masked by key_mask [B, S]; the updated cache is returned.
    logits_at: [B, m] window indices where logits are needed (None: every position).
    layers: (start, stop) runs only those layers (cache buffers keep their absolute layer index); output_hidden
    returns the last run layer's output (before the final norm) instead of logits. With these a forward can be
    split at a layer (BiCache's shallow-layer reuse, LaCache's first-layer memo).
    probe: with a cache, called in every layer on the rotated q, the cache and the layer index; the sum over layers
    comes back as ForwardOutput.probe (ACache's one-shot anchor probe).
    chunks: with a cache, the window runs in fixed chunks, only its live ones (`WindowChunks`); n must be a
    multiple of chunks.size.
    """
    b, n = positions.shape
    start, stop = layers if layers is not None else (0, config.n_layers)
    if not 0 <= start <= stop <= config.n_layers:
        raise ValueError(f"layers {layers} are not within the model's {config.n_layers} layers")
    if return_kv and cache is not None:
        raise ValueError("return_kv is for forwards without a cache (with one, read the cache)")
    if probe is not None and cache is None:
        raise ValueError("probe needs a cache (it reads each layer's K buffer)")
    if chunks is not None and (cache is None or n % chunks.size):
        raise ValueError(f"chunks need a cache and a window ({n}) that is a multiple of the chunk ({chunks.size})")
    block = block_for(params, config, kernels)
    inputs = jnp.asarray(inputs)
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta)
    if jnp.issubdtype(inputs.dtype, jnp.integer):
        x = embed(params, inputs).astype(config.jnp_dtype)
    else:
        x = inputs.astype(config.jnp_dtype)
    layer_params, layer_ids = select_layers(params["layers"], start, stop)

    def output(x, cache=None, kv=None, probed=None):
        if output_hidden:
            return ForwardOutput(None, cache, kv, probed, x)
        return ForwardOutput(final_hidden_to_logits(params, config, x, logits_at, kernels), cache, kv, probed)

    def finish(lp, i, x, attn):
        return layer_finish(params, config, block, lp, i, x, attn, kernels)

    def qkv(lp, i, x, positions, cos, sin):
        return block_qkv(block, lp, x, positions, cos, sin, kernels, params, i)

    if cache is None:

        def layer(x, inputs):
            lp, i = inputs
            q, k, v = qkv(lp, i, x, positions, cos, sin)
            x = finish(lp, i, x, attend(q, k, v, key_mask, kernels.attention, kernels.interpret))
            return x, ((k, v) if return_kv else None)

        x, kv = layer_loop(layer, x, layer_params, layer_ids)
        return output(x, kv=kv)

    if isinstance(cache, KVCache) and cache.per_layer and not is_unrolled(params["layers"]):
        raise ValueError(
            "a per-layer KVCache needs per-layer (unrolled) params: the scanned loop indexes the cache "
            "with a traced layer index; use KVCache.for_params(params, ...)"
        )
    # one kernel for the projection's reduction, RoPE and the K/V write: block-step windows written contiguously
    fused_write = (
        chunks is None
        and not config.fp8_proj  # the fused kernel reads a bf16 projection
        and kernels.rope_write
        and isinstance(cache, KVCache)
        and cache.per_layer
        and write.slots is None
        and b * n <= ROPE_WRITE_MAX_TOKENS
    )

    def layer_cached(carry, inputs):
        x, cache, probed = carry
        lp, i = inputs
        if fused_write:
            h = block.apply({"params": lp}, x, method=Block.qkv_in)
            q, kb, vb = rope_write(
                block, config, lp, h, cos, sin, cache.k[i], cache.v[i], write.offset, write.mask, kernels.interpret
            )
            cache = cache.with_layer(i, kb, vb)
        else:
            q, k, v = qkv(lp, i, x, positions, cos, sin)
            cache = cache.write(i, k, v, write)
        if probe is not None:
            probed = probed + probe(q, cache, i)
        x = finish(lp, i, x, cache.attend(i, q, key_mask, kernels))
        return (x, cache, probed), None

    def layer_chunked(carry, inputs):
        x, cache, probed = carry
        lp, i = inputs
        c = chunks.size
        live_chunks = (jnp.asarray(chunks.live, jnp.int32) + c - 1) // c

        def chunk_qkv(start):
            return qkv(lp, i, *(_cols(a, start, c) for a in (x, positions, cos, sin)))

        def project(j, state):  # every live chunk's K/V first: any query may attend any key of the window
            cache, qs = state
            q, k, v = chunk_qkv(j * c)
            cache = cache.write(i, k, v, _chunk_write(write, j * c, c))
            return cache, jax.lax.dynamic_update_slice_in_dim(qs, q, j * c, axis=1)

        q_chunk = jax.eval_shape(chunk_qkv, 0)[0]
        qs = jnp.zeros((b, n) + q_chunk.shape[2:], q_chunk.dtype)
        cache, qs = jax.lax.fori_loop(0, live_chunks, project, (cache, qs))
        if probe is not None:
            probed = probed + probe(qs, cache, i)

        def attend_chunk(j, x):
            start = j * c
            out = finish(lp, i, _cols(x, start, c), cache.attend(i, _cols(qs, start, c), key_mask, kernels))
            return jax.lax.dynamic_update_slice_in_dim(x, out.astype(x.dtype), start, axis=1)

        return (jax.lax.fori_loop(0, live_chunks, attend_chunk, x), cache, probed), None

    def chunked_unrolled(x, cache, probed):
        """layer_chunked's result with one loop a layer instead of two: a chunk's attention in layer i and its
        projection into layer i + 1 run in the same iteration (on a GPU every iteration of a loop whose trip count
        is data waits for its predicate on the host), and one query buffer serves every layer (iteration j reads
        chunk j's layer-i queries before writing its layer-(i + 1) ones). A cache that `skips_queries` attends once
        a layer, before the loop, over every live chunk: each row's keys are read once, not once a chunk (closed16's
        11 chunks on an H100: 66.2 -> 56.8 ms of block-start attention a call, with both read lists in one kernel),
        for one more buffer the size of the query window. With chunks.half_tail a window pads c / 4 tokens less on
        average."""
        c, h = chunks.size, chunks.size // 2 if chunks.half_tail else 0
        full, tail = chunk_counts(chunks)
        q_len = full * c + tail * h
        whole = cache.skips_queries(kernels)
        layers = list(zip(layer_params, layer_ids))

        def project(lp, i, start, size, x, cache, qs):
            q, k, v = qkv(lp, i, *(_cols(a, start, size) for a in (x, positions, cos, sin)))
            cache = cache.write(i, k, v, _chunk_write(write, start, size))
            return cache, jax.lax.dynamic_update_slice_in_dim(qs, q.astype(qs.dtype), start, axis=1)

        def chunk_loop(body, state):
            """body(start, size, state) over the full chunks, then the half tail (one predicate: a cond)."""
            state = jax.lax.fori_loop(0, full, lambda j, s: body(j * c, c, s), state)
            return jax.lax.cond(tail > 0, lambda s: body(full * c, h, s), lambda s: s, state) if h else state

        (lp0, i0) = layers[0]
        q_chunk = jax.eval_shape(lambda: qkv(lp0, i0, *(a[:, :c] for a in (x, positions, cos, sin)))[0])
        qs = jnp.zeros((b, n) + q_chunk.shape[2:], q_chunk.dtype)
        cache, qs = chunk_loop(lambda start, size, s: project(lp0, i0, start, size, x, *s), (cache, qs))
        for at, (lp, i) in enumerate(layers):
            if probe is not None:
                probed = probed + probe(qs, cache, i)
            following = layers[at + 1] if at + 1 < len(layers) else None
            attn = cache.attend(i, qs, key_mask, kernels, q_len=q_len) if whole else None

            def step(start, size, state, lp=lp, i=i, following=following, attn=attn):
                x, cache, qs = state
                if attn is None:
                    a = cache.attend(i, _cols(qs, start, size), key_mask, kernels)
                else:  # (its rows past the live chunks are undefined: never read)
                    a = _cols(attn, start, size)
                out = finish(lp, i, _cols(x, start, size), a)
                x = jax.lax.dynamic_update_slice_in_dim(x, out.astype(x.dtype), start, axis=1)
                if following is not None:
                    cache, qs = project(*following, start, size, x, cache, qs)
                return x, cache, qs

            x, cache, qs = chunk_loop(step, (x, cache, qs))
        return x, cache, probed

    probed0 = jnp.zeros((b, cache.length), jnp.float32) if probe is not None else None
    if chunks is not None and is_unrolled(layer_params) and len(layer_params):
        x, cache, probed = chunked_unrolled(x, cache, probed0)
        return output(x, cache, probed=probed)
    body = layer_cached if chunks is None else layer_chunked
    (x, cache, probed), _ = layer_loop(body, (x, cache, probed0), layer_params, layer_ids)
    return output(x, cache, probed=probed)
