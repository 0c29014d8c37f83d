"""The K/V cache of a batch laid out as fixed-length sequence buffers, and where a forward writes into it.

`KVCache` holds rotated K and V of every layer at every position of a [B, S] buffer: stacked [L, B, S, Hkv, D]
arrays (run by a lax.scan over stacked params) or tuples of L arrays [B, S, Hkv, D] (the unrolled layer loop's
layout: each layer's attention reads its own buffer in place, where XLA copied a stacked cache's layer slice:
0.08 / 0.86 / 3.46 ms more per LLaDA-8B block step at batch 1 / 8 / 32 on an H200).

`CacheWrite` says where a forward's window goes: contiguously at `offset`, or at `slots` [B, n] of a gathered
window (its tokens need not be contiguous: ACache's anchors and request positions); `mask` [B, n] False = that
entry is not written (the old K/V stay).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.config import ModelConfig
from dllm_jax.transformer.attention import attend
from dllm_jax.transformer.params import Params, is_unrolled

Array = jax.Array
Buffers = Array | tuple[Array, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Position j of row b holds the K/V that the token at buffer index j had the last time a forward wrote it."""

    k: Buffers
    v: Buffers

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
    def for_params(cls, params: Params, config: ModelConfig, batch: int, length: int) -> "KVCache":
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

    def write(self, i, k: Array, v: Array, where: "CacheWrite") -> "KVCache":
        """Layer i's buffers with the window's k/v [B, n, Hkv, D] written as `where` says."""
        return KVCache(write_layer(self.k, i, k, where), write_layer(self.v, i, v, where))

    def with_layer(self, i: int, k_buf: Array, v_buf: Array) -> "KVCache":
        """Per-layer buffers with layer i's replaced (a kernel that wrote them in place)."""
        return KVCache(self.k[:i] + (k_buf,) + self.k[i + 1 :], self.v[:i] + (v_buf,) + self.v[i + 1 :])

    def keys(self, i, rows: Array | None = None) -> Array:
        """Layer i's keys [B, S, Hkv, D] (rows: of those rows only)."""
        return self.k[i] if rows is None else self.k[i][rows]

    def skips_queries(self, kernels) -> bool:
        """Whether `attend` takes a q_len and skips the queries past it (no: every query of the window runs)."""
        return False

    def attend(self, i, q: Array, key_mask: Array | None, kernels) -> Array:
        """Layer i's attention of q [B, n, Hq, D] over the whole buffer (key_mask [B, S] masks keys)."""
        return attend(q, self.k[i], self.v[i], key_mask, kernels.attention, kernels.interpret)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheWrite:
    offset: Array | int | None = 0
    slots: Array | None = None  # [B, n] int32
    mask: Array | None = None  # [B, n] bool

    @classmethod
    def at(cls, offset: Array | int, mask: Array | None = None) -> "CacheWrite":
        return cls(offset, None, mask)

    @classmethod
    def scatter(cls, slots: Array, mask: Array | None = None) -> "CacheWrite":
        return cls(None, slots, mask)


WRITE_AT_ZERO = CacheWrite()  # the default: the window's K/V written from position 0


def written_window(buf: Array, offset: Array | int, n: int) -> Array:
    """What a contiguous window of n tokens holds in one layer's buffer [B, S, ...] (the old K/V a masked write
    keeps)."""
    return jax.lax.dynamic_slice_in_dim(buf, jnp.asarray(offset, jnp.int32), n, axis=1)


def write_layer(buf: Buffers, i, window: Array, write: CacheWrite) -> Buffers:
    """Layer i's buffer with `window` [B, n, Hkv, D] written as `write` says (in place under jit: no copy of the
    whole cache per layer)."""
    per_layer = isinstance(buf, tuple)
    layer = buf[i]
    if write.slots is None:
        offset = jnp.asarray(write.offset, jnp.int32)
        if write.mask is not None:  # keep what the window must not overwrite
            window = jnp.where(write.mask[:, :, None, None], window, written_window(layer, offset, window.shape[1]))
        if per_layer:
            new = jax.lax.dynamic_update_slice(layer, window.astype(layer.dtype), (0, offset, 0, 0))
            return buf[:i] + (new,) + buf[i + 1 :]
        return jax.lax.dynamic_update_slice(buf, window[None].astype(buf.dtype), (i, 0, offset, 0, 0))
    # a gathered window: masked entries are sent past the buffer's end, which the scatter drops, so a slot may
    # appear twice in a window as long as at most one of its entries writes
    rows = jnp.arange(window.shape[0])[:, None]
    slots = write.slots if write.mask is None else jnp.where(write.mask, write.slots, layer.shape[1])
    if per_layer:
        return buf[:i] + (layer.at[rows, slots].set(window.astype(layer.dtype), mode="drop"),) + buf[i + 1 :]
    return buf.at[i, rows, slots].set(window.astype(buf.dtype), mode="drop")
