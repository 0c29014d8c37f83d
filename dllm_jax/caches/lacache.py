"""LaCache's exact first-layer memoisation (`cache="first_layer"`): full forwards at every step, with layer 1's
work on the tokens outside the current block done once per block.

Within a block's steps the token ids outside the block do not change, so in layer 1 (the model's first layer,
index 0 here) their embeddings, their normed, projected and rotated q/k/v, and their queries' attention over the
keys outside the block are the same at every step. A block start computes them for the whole buffer and keeps,
for every query row, the online-softmax state over the outside keys (running max m, normaliser l, unnormalised
output o, fp32). A step then
  * embeds and projects only the block's tokens;
  * gives every row the block keys' contribution merged into its cached state (the flash-attention merge), and
    the block's own rows attention over every key;
  * runs layer 1's o_proj and FFN, and layers 2..L, on the whole buffer as the uncached forward does.
The result is what a full layer 1 computes (exactly, up to the float order of the merge), so the tokens are the
uncached ones (tests/test_lacache.py). The saving is layer 1's q/k/v GEMM and its outside x outside attention per
step, a few percent of a forward (the paper: 10.59 -> 10.54 s alone); its FP8 FFN is `fp8_ffn` / --fp8-ffn.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.attention import attend_reference
from dllm_jax.caches.base import DecodeInputs, block_logit_index
from dllm_jax.layers import rope_cos_sin
from dllm_jax.modeling import Block, embed, forward, is_fused, is_unrolled, layer_finish

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FirstLayerMemo:
    """Layer 1's state of the whole buffer; the block's slots are rewritten at every step."""

    embedded: Array  # [B, T, d] token embeddings (EmbedCache)
    q: Array  # [B, T, Hq, D] rotated queries (RoPECache)
    k: Array  # [B, T, Hkv, D] rotated keys
    v: Array  # [B, T, Hkv, D]
    m: Array  # [B, T, Hq] float32: each query row's running max over the keys outside the block (FACache)
    l: Array  # [B, T, Hq] float32: its softmax normaliser
    o: Array  # [B, T, Hq, D] float32: its unnormalised output


def _first_layer(params):
    layers = params["layers"]
    return layers[0] if is_unrolled(layers) else jax.tree.map(lambda a: a[0], layers)


def _scores(q: Array, k: Array) -> Array:
    """q [B, n, Hq, D], k [B, s, Hkv, D] -> fp32 scores [B, n, Hq, s] (grouped-query heads)."""
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    s = jnp.einsum("bnkgd,bskd->bnkgs", q.reshape(b, n, hkv, hq // hkv, d), k, preferred_element_type=jnp.float32,
                   precision=prec)
    return s.reshape(b, n, hq, k.shape[1]) * (1.0 / d**0.5)


def _pv(p: Array, v: Array) -> Array:
    """p [B, n, Hq, s] fp32, v [B, s, Hkv, D] -> [B, n, Hq, D] fp32."""
    b, n, hq, s = p.shape
    hkv = v.shape[2]
    prec = jax.lax.Precision.HIGHEST if v.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    out = jnp.einsum("bnkgs,bskd->bnkgd", p.reshape(b, n, hkv, hq // hkv, s).astype(v.dtype), v,
                     preferred_element_type=jnp.float32, precision=prec)
    return out.reshape(b, n, hq, v.shape[-1])


def online_softmax_state(q: Array, k: Array, v: Array, key_mask: Array) -> tuple[Array, Array, Array]:
    """(m, l, o) of every query over the keys where key_mask [B, s] holds; a row without such keys gets m = -inf,
    l = 0, o = 0 (the merge's identity)."""
    s = jnp.where(key_mask[:, None, None, :], _scores(q, k), -jnp.inf)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
    return m, jnp.sum(p, axis=-1), _pv(p, v)


def merge_keys(m: Array, l: Array, o: Array, q: Array, k: Array, v: Array, key_mask: Array | None) -> Array:
    """Attention output of queries q whose state over some keys is (m, l, o), over those keys plus k/v."""
    s = _scores(q, k)
    if key_mask is not None:
        s = jnp.where(key_mask[:, None, None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    old = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
    l_new = l * old + jnp.sum(p, axis=-1)
    o_new = o * old[..., None] + _pv(p, v)
    return o_new / jnp.where(l_new > 0, l_new, 1.0)[..., None]


@dataclasses.dataclass(frozen=True)
class FirstLayerCache:
    name: str = "first_layer"
    window_steps = False  # every forward covers the whole buffer (exact)

    def init(self, params, config, inp: DecodeInputs, x):
        b, t = x.shape
        hq, hkv, d = config.n_heads, config.n_kv_heads, config.head_dim
        z = lambda *s: jnp.zeros(s, config.jnp_dtype)  # noqa: E731
        return FirstLayerMemo(z(b, t, config.d_model), z(b, t, hq, d), z(b, t, hkv, d), z(b, t, hkv, d),
                              jnp.zeros((b, t, hq), jnp.float32), jnp.zeros((b, t, hq), jnp.float32),
                              jnp.zeros((b, t, hq, d), jnp.float32))

    def block_start(self, params, config, inp: DecodeInputs, state, x, block_start):
        """Layer 1 of the whole buffer, and each row's state over the keys outside the new block."""
        block = Block(config, fused=is_fused(params["layers"]))
        cos, sin = rope_cos_sin(inp.positions, config.head_dim, config.rope_theta)
        e = embed(params, x).astype(config.jnp_dtype)
        q, k, v = block.apply({"params": _first_layer(params)}, e, cos, sin, method=Block.qkv)
        idx = jnp.arange(x.shape[1])
        outside = inp.key_mask & ((idx < block_start) | (idx >= block_start + inp.block_length))[None]
        m, l, o = online_softmax_state(q, k, v, outside)
        return self.step(params, config, inp, FirstLayerMemo(e, q, k, v, m, l, o), x, block_start)

    def step(self, params, config, inp: DecodeInputs, state: FirstLayerMemo, x, block_start):
        bl = inp.block_length
        block = Block(config, fused=is_fused(params["layers"]))
        first = _first_layer(params)
        tokens = jax.lax.dynamic_slice_in_dim(x, block_start, bl, axis=1)
        positions = jax.lax.dynamic_slice_in_dim(inp.positions, block_start, bl, axis=1)
        cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta)
        e_blk = embed(params, tokens).astype(config.jnp_dtype)
        q_blk, k_blk, v_blk = block.apply({"params": first}, e_blk, cos, sin, method=Block.qkv)

        def put(buf, window):
            return jax.lax.dynamic_update_slice_in_dim(buf, window.astype(buf.dtype), block_start, axis=1)

        memo = dataclasses.replace(state, embedded=put(state.embedded, e_blk), q=put(state.q, q_blk),
                                   k=put(state.k, k_blk), v=put(state.v, v_blk))
        blk_mask = jax.lax.dynamic_slice_in_dim(inp.key_mask, block_start, bl, axis=1)
        # every row: its cached state over the outside keys merged with the block's keys ...
        attn = merge_keys(memo.m, memo.l, memo.o, memo.q, k_blk, v_blk, blk_mask).astype(config.jnp_dtype)
        # ... but the block's own rows attend over everything (their queries changed)
        own = attend_reference(q_blk, memo.k, memo.v, inp.key_mask)
        attn = put(attn, own)
        h = layer_finish(params, config, block, first, 0, memo.embedded, attn, inp.ffn_backend)
        at = block_logit_index(inp, block_start, 0, x.shape[0])
        out = forward(params, config, None, inp.positions, hidden=h, key_mask=inp.attn_mask,
                      layer_range=(1, config.n_layers), logits_at=at, **inp.kernels)
        return out.logits, memo
