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
step, a few percent of a forward; LaCache's FP8 FFN is `config.fp8_ffn` / --fp8-ffn, and with weights="fp8_all"
layer 1 keeps its bf16 projections (the memo's layer).

Where the resolved kernels run the slot kernel (the GPU's default), layer 1's attention runs on it: the block
start takes the kernel's online-softmax state out over the outside keys, a step passes that state in and continues
it over the block's keys (`attention.attend_state`); elsewhere the same in jnp.

Why the memo does not compose with the prefix / dual caches (and so with a shared affix, which needs one): those
caches already skip every layer's work on the rows outside the block, layer 1's included, and a block row's
queries change at every step, so no part of layer 1 is left that the memo could keep.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.decoding.caches.base import DecodeInputs, block_logit_index
from dllm_jax.transformer import forward
from dllm_jax.transformer.attention import AttentionState, attend_state
from dllm_jax.transformer.block import Block, block_for, embed, layer_finish
from dllm_jax.transformer.layers import rope_cos_sin
from dllm_jax.transformer.params import is_unrolled

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FirstLayerMemo:
    """Layer 1's state of the whole buffer; the block's slots are rewritten at every step."""

    embedded: Array  # [B, T, d] token embeddings (EmbedCache)
    q: Array  # [B, T, Hq, D] rotated queries (RoPECache)
    k: Array  # [B, T, Hkv, D] rotated keys
    v: Array  # [B, T, Hkv, D]
    outside: AttentionState  # every query row's online-softmax state over the keys outside the block (FACache)


def _backend(inp: DecodeInputs) -> tuple[str, bool]:
    """Where layer 1's attention runs: the slot kernel (its online-softmax state in and out) where the resolved
    kernels use it, jnp elsewhere (`attention.attend_state`)."""
    return inp.kernels.attention, inp.kernels.interpret


def _first_layer(params):
    """Layer 0's params (its bf16 projections where the others are FP8: weights="fp8_all")."""
    layers = params["layers"]
    first = layers[0] if is_unrolled(layers) else jax.tree.map(lambda a: a[0], layers)
    return {**first, **params.get("attn_first", {})}


@dataclasses.dataclass(frozen=True)
class FirstLayerCache:
    name: str = "first_layer"
    window_steps = False  # every forward covers the whole buffer (exact)

    def init(self, params, config, inp: DecodeInputs, x):
        b, t = x.shape
        hq, hkv, d = config.n_heads, config.n_kv_heads, config.head_dim
        z = lambda *s: jnp.zeros(s, config.jnp_dtype)  # noqa: E731
        outside = AttentionState(
            jnp.zeros((b, hq, t), jnp.float32),
            jnp.zeros((b, hq, t), jnp.float32),
            jnp.zeros((b, t, hq, d), jnp.float32),
        )
        return FirstLayerMemo(z(b, t, config.d_model), z(b, t, hq, d), z(b, t, hkv, d), z(b, t, hkv, d), outside)

    def block_start(self, params, config, inp: DecodeInputs, state, x, block_start):
        """Layer 1 of the whole buffer, and each row's state over the keys outside the new block."""
        block = block_for(params, config)
        cos, sin = rope_cos_sin(inp.positions, config.head_dim, config.rope_theta)
        e = embed(params, x).astype(config.jnp_dtype)
        q, k, v = block.apply({"params": _first_layer(params)}, e, cos, sin, method=Block.qkv)
        idx = jnp.arange(x.shape[1])
        outside = inp.key_mask & ((idx < block_start) | (idx >= block_start + inp.block_length))[None]
        state = attend_state(q, k, v, outside, *_backend(inp), return_state=True)
        return self.step(params, config, inp, FirstLayerMemo(e, q, k, v, state), x, block_start)

    def step(self, params, config, inp: DecodeInputs, state: FirstLayerMemo, x, block_start):
        bl = inp.block_length
        block = block_for(params, config)
        first = _first_layer(params)
        tokens = jax.lax.dynamic_slice_in_dim(x, block_start, bl, axis=1)
        positions = jax.lax.dynamic_slice_in_dim(inp.positions, block_start, bl, axis=1)
        cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta)
        e_blk = embed(params, tokens).astype(config.jnp_dtype)
        q_blk, k_blk, v_blk = block.apply({"params": first}, e_blk, cos, sin, method=Block.qkv)

        def put(buf, window):
            return jax.lax.dynamic_update_slice_in_dim(buf, window.astype(buf.dtype), block_start, axis=1)

        memo = dataclasses.replace(
            state,
            embedded=put(state.embedded, e_blk),
            q=put(state.q, q_blk),
            k=put(state.k, k_blk),
            v=put(state.v, v_blk),
        )
        blk_mask = jax.lax.dynamic_slice_in_dim(inp.key_mask, block_start, bl, axis=1)
        # every row: its cached state over the outside keys continued over the block's keys ...
        attn = attend_state(memo.q, k_blk, v_blk, blk_mask, *_backend(inp), init_state=memo.outside)
        # ... but the block's own rows attend over everything (their queries changed)
        own = attend_state(q_blk, memo.k, memo.v, inp.key_mask, *_backend(inp))
        attn = put(attn, own)
        h = layer_finish(params, config, block, first, 0, memo.embedded, attn, inp.kernels)
        at = block_logit_index(inp, block_start, 0, x.shape[0])
        out = forward(
            params,
            config,
            h,
            inp.positions,
            key_mask=inp.attn_mask,
            layers=(1, config.n_layers),
            logits_at=at,
            kernels=inp.kernels,
        )
        return out.logits, memo
