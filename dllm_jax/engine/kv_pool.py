"""The paged KV pool on the device, and `PagedKV`: the view of it one batched forward reads and writes.

The pool is, per layer, K and V arrays of `num_pages * page_size` slots [S, Hkv, D], preallocated once from a byte
budget (`pool_pages`). `block_manager.BlockManager` hands out the pages on the host; nothing here knows about
requests.

`PagedKV` is what `transformer.forward` takes as its cache (it has the write / attend / keys / length methods of
`KVCache`), so the cache techniques of `decoding/caches` run on the pool unchanged:
  * writes address *buffer columns* (the decoding loop's [B, T] token buffer): `col_slots [B, T]` maps each column to
    the private slot it writes (S, past the pool's end, for columns that must not be written: pads and the shared
    affix, whose one stored copy serves every request);
  * reads address a *read list* per row: `read_slots [B, R]` (the first `read_len[b]` are the row's keys, in any
    order: attention does not depend on it). A shared affix is stored with K rotated at its own positions 0..A-1;
    placed at RoPE offset p it is read rotated by `read_delta = p` more (RoPE rotations compose), so one copy
    serves every placement: prefix (p = 0: no rotation at all), infix and suffix.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.config import ModelConfig
from dllm_jax.transformer.attention import attend_reference
from dllm_jax.transformer.kv_cache import CacheWrite
from dllm_jax.transformer.layers import apply_rope, rope_cos_sin
from pallas_kernels import slot_attention as sa

Array = jax.Array


def kv_bytes_per_token(config: ModelConfig) -> int:
    """K and V of one token in every layer."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * config.jnp_dtype.itemsize


def pool_pages(config: ModelConfig, page_size: int, budget_bytes: int) -> int:
    """How many pages of `page_size` tokens a byte budget holds."""
    return int(budget_bytes // (kv_bytes_per_token(config) * page_size))


def allocate_pool(config: ModelConfig, num_slots: int) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
    """Zeroed per-layer K and V pools [num_slots, Hkv, D] in the model's dtype."""
    shape = (num_slots, config.n_kv_heads, config.head_dim)
    make = jax.jit(lambda: tuple(jnp.zeros(shape, config.jnp_dtype) for _ in range(config.n_layers)))
    return make(), make()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
    k: tuple[Array, ...]  # L x [S, Hkv, D]
    v: tuple[Array, ...]
    col_slots: Array  # [B, T] int32: the slot each buffer column writes (S: never written)
    read_slots: Array  # [B, R] int32: the slots of each row's keys (the first read_len[b] are read)
    read_len: Array  # [B] int32
    read_delta: Array  # [B, R] int32: RoPE rotation applied at read time (a shared affix's placement offset)
    rope_theta: float = dataclasses.field(metadata=dict(static=True))
    rope_fp32: bool = dataclasses.field(metadata=dict(static=True))
    rotate: bool = dataclasses.field(metadata=dict(static=True))  # any nonzero read_delta in the batch

    @property
    def per_layer(self) -> bool:
        return True

    @property
    def length(self) -> int:
        return self.read_slots.shape[1]

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    def write(self, i: int, k: Array, v: Array, where: CacheWrite) -> "PagedKV":
        """Layer i's pool with the window's k/v [B, n, Hkv, D] written at its columns' private slots (in place under
        jit with the pool donated). Masked entries and unwritable columns are dropped."""
        n = k.shape[1]
        cols = where.slots if where.slots is not None else (
            jnp.asarray(where.offset, jnp.int32) + jnp.arange(n, dtype=jnp.int32))[None]
        slots = jnp.take_along_axis(self.col_slots, jnp.broadcast_to(cols, k.shape[:2]), axis=1)
        if where.mask is not None:
            slots = jnp.where(where.mask, slots, self.num_slots)
        flat = slots.reshape(-1)
        new_k = self.k[i].at[flat].set(k.reshape(-1, *k.shape[2:]).astype(self.k[i].dtype), mode="drop")
        new_v = self.v[i].at[flat].set(v.reshape(-1, *v.shape[2:]).astype(self.v[i].dtype), mode="drop")
        return dataclasses.replace(self, k=self.k[:i] + (new_k,) + self.k[i + 1:],
                                   v=self.v[:i] + (new_v,) + self.v[i + 1:])

    def keys(self, i: int) -> Array:
        """Layer i's keys of every row's read list [B, R, Hkv, D], rotated to their placement."""
        k = jnp.take(self.k[i], self.read_slots, axis=0)
        if not self.rotate:
            return k
        cos, sin = rope_cos_sin(self.read_delta, k.shape[-1], self.rope_theta)
        return apply_rope(k.astype(jnp.float32), cos, sin, fp32=True).astype(k.dtype)

    def read_mask(self) -> Array:
        return jnp.arange(self.length, dtype=jnp.int32)[None, :] < self.read_len[:, None]

    def attend(self, i: int, q: Array, key_mask: Array | None, kernels) -> Array:
        """Layer i's attention of q [B, n, Hq, D] over each row's read list. The pool defines the keys: a caller's
        key mask (over buffer columns) has no meaning here and must be None."""
        if key_mask is not None:
            raise ValueError("PagedKV reads its own key lists: decode with DecodeInputs.padded=False")
        if kernels.attention != "xla" and not self.rotate:  # the slot kernel reads the pool through the table
            b, n = q.shape[:2]
            return sa.slot_attention(q, self.k[i], self.v[i], self.read_slots, jnp.full((b,), n, jnp.int32),
                                     self.read_len, interpret=kernels.interpret)
        v = jnp.take(self.v[i], self.read_slots, axis=0)
        return attend_reference(q, self.keys(i), v, self.read_mask())
