"""The paged KV pool's view for one batched forward (`PagedKV`), and its size per token.

The pool is, per layer, K and V of `num_pages * page_size` slots [S, Hkv, D] (`BlockManager` hands out the pages).
`PagedKV` is a `transformer.forward` cache (`KVCache`'s write / attend / keys / length): `decoding/caches` run on it
unchanged. Writes map buffer columns to private slots (`col_slots`; S: none). Reads go through two lists a row: the
shared affix's slots, then its own. The shared copy's K sit at positions 0..A-1; placed at p they read as rotated by
p more: <R(i) q, R(j + p) k> = <R(i - p) q, R(j) k>, so the query is rotated back by p (the batch-invariant jnp path
rotates the gathered keys): one copy serves every placement (p = 0: no rotation)."""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from dllm_jax.config import ModelConfig
from dllm_jax.transformer.attention import KeySegment, attend_segments, attend_slot_chunks, attend_slots
from dllm_jax.transformer.kv_cache import CacheWrite
from dllm_jax.transformer.layers import apply_rope, rope_cos_sin
from pallas_kernels import slot_attention as sa
from pallas_kernels.slot_key_weights import slot_key_weights

Array = jax.Array


def kv_bytes_per_token(config: ModelConfig) -> int:
    """K and V of one token in every layer."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * config.jnp_dtype.itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
    k: tuple[Array, ...]  # L x [S, Hkv, D]
    v: tuple[Array, ...]
    col_slots: Array  # [B, T] int32: the slot each buffer column writes (S: never written)
    shared_slots: Array  # [B, A] int32: the shared affix copy's slots a row reads (the first shared_len[b])
    shared_len: Array  # [B] int32
    shared_delta: Array  # [B] int32: the affix's RoPE offset in the row (its placement)
    own_slots: Array  # [B, R] int32: the row's private slots (the first own_len[b])
    own_len: Array  # [B] int32
    rope_theta: float = dataclasses.field(metadata=dict(static=True))
    rotate: bool = dataclasses.field(metadata=dict(static=True))  # any row with a nonzero shared_delta

    per_layer: ClassVar[bool] = True  # a tuple of layer arrays (like an unrolled KVCache)

    @property
    def length(self) -> int:
        """Width of the key index space of `keys` (what ACache's probe scores): the shared list."""
        return self.shared_slots.shape[1]

    def write(self, i: int, k: Array, v: Array, where: CacheWrite) -> "PagedKV":
        """Layer i's pool with the window's k/v [B, n, Hkv, D] written at its columns' private slots (in place under
        jit with the pool donated). Masked entries and unwritable columns are dropped."""
        cols = where.slots
        if cols is None:
            cols = (jnp.asarray(where.offset, jnp.int32) + jnp.arange(k.shape[1], dtype=jnp.int32))[None]
        slots = jnp.take_along_axis(self.col_slots, jnp.broadcast_to(cols, k.shape[:2]), axis=1)
        # XLA's scatters (a Pallas kernel lost on the H200: bench_pool_kernels.py); unwritten entries go past the end
        p, rows = self.k[i].shape[0], (slots if where.mask is None else jnp.where(where.mask, slots, -1)).reshape(-1)
        rows = jnp.where((rows >= 0) & (rows < p), rows, p + jnp.arange(rows.shape[0]))
        new_k, new_v = (a.at[rows].set(b.reshape(-1, *b.shape[2:]).astype(a.dtype), mode="drop", unique_indices=True)
                        for a, b in ((self.k[i], k), (self.v[i], v)))  # fmt: skip
        k, v = self.k[:i] + (new_k,) + self.k[i + 1 :], self.v[:i] + (new_v,) + self.v[i + 1 :]
        return dataclasses.replace(self, k=k, v=v)

    def shared_mask(self) -> Array:
        """[B, A]: which entries of the shared list are keys."""
        return jnp.arange(self.shared_slots.shape[1], dtype=jnp.int32)[None, :] < self.shared_len[:, None]

    def keys(self, i: int) -> Array:
        """Layer i's shared keys [B, A, Hkv, D], rotated to each row's placement (what ACache's probe scores)."""
        return self._rotated(jnp.take(self.k[i], self.shared_slots, axis=0), self.shared_delta)

    def skips_queries(self, kernels) -> bool:
        """Whether `attend` with a q_len costs only the queries before it (the slot kernel skips the rest)."""
        return kernels.attention not in ("xla", "invariant", "invariant_slot")

    def attend(self, i: int, q: Array, key_mask: Array | None, kernels, q_len: Array | None = None) -> Array:
        """Layer i's attention of q [B, n, Hq, D] over each row's two read lists (key_mask: must be None, the pool
        defines the keys). q_len (int32): only queries before it are needed (`skips_queries`: the rest undefined)."""
        if key_mask is not None:
            raise ValueError("PagedKV reads its own key lists: decode with DecodeInputs.padded=False")
        if kernels.attention == "xla":  # both lists in chunks up to the longest row's; the shared one's q rotated back
            shared = [(self._rotated(q, -self.shared_delta), self.shared_slots, self.shared_len)]
            lists = (shared if self.shared_slots.shape[1] else []) + [(q, self.own_slots, self.own_len)]
            return attend_slot_chunks(self.k[i], self.v[i], lists)
        if kernels.attention == "invariant":  # gathered, the shared list then the own list, key chunks in order
            own = jnp.arange(self.own_slots.shape[1], dtype=jnp.int32)[None, :] < self.own_len[:, None]
            shared = KeySegment(self.keys(i), jnp.take(self.v[i], self.shared_slots, axis=0), self.shared_mask())
            mine = KeySegment(*(jnp.take(a, self.own_slots, axis=0) for a in (self.k[i], self.v[i])), own)
            return attend_segments(q, [shared, mine])
        if kernels.attention == "invariant_slot":  # the batch-invariant mode's slot kernel: the two lists in order
            shared = [(self._rotated(q, -self.shared_delta), self.k[i], self.v[i], self.shared_slots, self.shared_len)]
            own = (q, self.k[i], self.v[i], self.own_slots, self.own_len)
            return attend_slots([*shared, own] if self.shared_slots.shape[1] else [own], kernels.interpret)
        # the slot kernel: both tables in one online softmax, the shared list scored by q rotated back by its placement
        # (over a whole window, q_len given, a pass over the padded width: only where some row places its affix past 0)
        q_lens = jnp.full(q.shape[:1], q.shape[1] if q_len is None else q_len, jnp.int32)
        own = (self.k[i], self.v[i], self.own_slots, q_lens, self.own_len)
        attend = functools.partial(sa.slot_attention, q, *own, interpret=kernels.interpret, rows_past_q_len="any")
        shared = sa.FirstList(self.shared_slots, self.shared_len) if self.shared_slots.shape[1] else None
        if shared is None or not self.rotate:
            return attend(first=shared)
        rotated = lambda s: attend(first=s._replace(q=self._rotated(q, -self.shared_delta)))  # noqa: E731
        if q_len is None:
            return rotated(shared)
        return jax.lax.cond(jnp.any(self.shared_delta), rotated, lambda s: attend(first=s), shared)

    def key_weights(self, i: int, q: Array, queries: Array, kernels) -> Array:
        """ACache's probe of layer i on the slot kernels: [B, A] each row's softmax over its shared list of its queries
        q [B, n, Hq, D] where `queries` [B, n], summed over them and the heads (`acache.row_importance_probe`'s). The
        conditional's branches return the weights: returning q would copy the whole window's queries every layer."""
        weights = functools.partial(slot_key_weights, k_pool=self.k[i], read_table=self.shared_slots, q_mask=queries,
                                    kv_lens=self.shared_len, interpret=kernels.interpret)  # fmt: skip
        if not self.rotate:  # (else a pass over the padded window only where some row places its affix past 0)
            return weights(q)
        rotated = lambda x: weights(self._rotated(x, -self.shared_delta))  # noqa: E731
        return jax.lax.cond(jnp.any(self.shared_delta), rotated, weights, q)

    def _rotated(self, x: Array, delta: Array) -> Array:
        """x [B, n, H, D] rotated by delta [B] more: the shared keys to their placement, or a query back from it."""
        if not self.rotate:
            return x
        cos, sin = rope_cos_sin(jnp.broadcast_to(delta[:, None], x.shape[:2]), x.shape[-1], self.rope_theta)
        return apply_rope(x.astype(jnp.float32), cos, sin, fp32=True).astype(x.dtype)
