"""Bidirectional attention over contiguous K/V, with a backend switch, and the grouped-query helpers.

`attend` is what the model calls inside every layer (`kernels.attention` picks the backend, resolved once per
program by `Kernels.resolve`):
- "xla": the plain-jnp reference (fp32 scores and softmax; probabilities cast to the value dtype for the PV
  product, as both the eager and the flash reference paths do). Runs everywhere. Over the engine's paged pool the same
  math runs as an online softmax over key chunks, only as many as the longest read list needs (`attend_slot_chunks`).
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` (GPU only, bf16).
- "pallas": the slot-addressed Pallas kernel (`pallas_kernels.slot_attention`), GPU; interpreted on CPU in tests.
- "cudnn_pallas": the Pallas kernel for short query windows (block steps) over at most PALLAS_MAX_ROWS K/V streams,
  cuDNN otherwise (full forwards, large MHA batches): each where it was measured faster on the H200 (block steps
  1.6-3.9% faster than cuDNN at batch 1; cuDNN 8% faster at LLaDA batch 16 and ~1.5x at full forwards).
- "invariant": the batch-invariant mode's (`attend_segments`): a query's result is bit-identical whatever shares
  its call (other rows, other queries, padding keys, where its keys sit): queries QUERY_TILE at a time, each row's
  valid keys packed in order and reduced KEY_CHUNK at a time by an online softmax, so every reduction has one
  shape and one order wherever the query comes from (a full forward, a block step, the engine's paged pool).
- "invariant_slot": the same guarantee through the slot kernel (`attend_slots`, the mode's GPU path): one program
  per row, query tile and KV head, its tiles fixed by the model's heads alone and the keys in one KV split, in order.

Grouped-query attention has one helper pair here (`grouped_scores`, `grouped_values`): every jnp path of the
package (the reference attention, ACache's probe, LaCache's online-softmax state) goes through it.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.transformer.layers import matmul_precision, opaque_loop, stacked
from pallas_kernels import slot_attention as sa
from pallas_kernels.slot_attention import AttentionState, merge_states

Array = jax.Array
BACKENDS = ("xla", "cudnn", "pallas", "cudnn_pallas", "invariant", "invariant_slot")
SHORT_QUERY = 64  # "cudnn_pallas": query windows up to this long go to the Pallas kernel ...
PALLAS_MAX_ROWS = 256  # ... when batch x kv heads is at most this
QUERY_TILE = 16  # "invariant": queries of a row attended at once (a block step's or a window chunk's)
KEY_CHUNK = 128  # "invariant": keys reduced at once, in order (and `attend_slot_chunks`' chunk)
LOOP_MIN_WIDTH = 256  # `attend_slot_chunks` reads a wider table in a loop of chunks, a narrower one whole

__all__ = [
    "AttentionState",
    "KeySegment",
    "attend",
    "attend_segments",
    "attend_slots",
    "attend_slot_chunks",
    "attend_reference",
    "grouped_scores",
    "grouped_values",
    "merge_states",
    "softmax_state",
]


def grouped_scores(q: Array, k: Array) -> Array:
    """q [B, T, Hq, D], k [B, S, Hkv, D] -> scaled fp32 scores [B, Hkv, G, T, S] (G = Hq / Hkv query heads share a
    K/V head)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum(
        "btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32, precision=matmul_precision(q.dtype)
    )
    return scores * (1.0 / d**0.5)


def grouped_values(p: Array, v: Array) -> Array:
    """p [B, Hkv, G, T, S] (probabilities or unnormalised weights), v [B, S, Hkv, D] -> fp32 [B, T, Hq, D]; p is
    cast to v's dtype first (what the flash kernels do)."""
    b, hkv, g, t, _ = p.shape
    out = jnp.einsum(
        "bkgts,bskd->btkgd",
        p.astype(v.dtype),
        v,
        preferred_element_type=jnp.float32,
        precision=matmul_precision(v.dtype),
    )
    return out.reshape(b, t, hkv * g, v.shape[-1])


def _masked(scores: Array, key_mask: Array | None) -> Array:
    return scores if key_mask is None else jnp.where(key_mask[:, None, None, None, :], scores, -jnp.inf)


def _finite_max(scores: Array) -> Array:
    """Row max over keys, 0 where a row has no key (so exp(-inf - 0) = 0, never NaN)."""
    m = jnp.max(scores, axis=-1, keepdims=True)
    return jnp.where(jnp.isfinite(m), m, 0.0)


def attend_reference(q: Array, k: Array, v: Array, key_mask: Array | None) -> Array:
    """q [B, T, Hq, D], k/v [B, S, Hkv, D], key_mask [B, S] bool (True = attend) -> [B, T, Hq, D] in q.dtype.

    A row whose keys are all masked returns zeros (never NaN)."""
    scores = _masked(grouped_scores(q, k), key_mask)
    p = jnp.exp(scores - _finite_max(scores))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return grouped_values(p / jnp.where(denom > 0, denom, 1.0), v).astype(q.dtype)


def softmax_state(q: Array, k: Array, v: Array, key_mask: Array | None) -> AttentionState:
    """The online-softmax state of every query over the keys where key_mask [B, S] holds (the layout of
    `pallas_kernels.slot_attention.AttentionState`): a row without such keys gets m = -inf, l = 0, o = 0, the
    identity of `merge_states`. The output is o / l (`finish_state`)."""
    scores = _masked(grouped_scores(q, k), key_mask)
    b, t, hq, _ = q.shape
    m = jnp.max(scores, axis=-1)  # [B, Hkv, G, T]
    p = jnp.exp(scores - _finite_max(scores))
    return AttentionState(m.reshape(b, hq, t), jnp.sum(p, axis=-1).reshape(b, hq, t), grouped_values(p, v))


def finish_state(state: AttentionState, dtype) -> Array:
    """o / l of a state (zeros where no key was seen), in dtype."""
    l = jnp.swapaxes(state.l, 1, 2)[..., None]  # noqa: E741  [B, T, Hq, 1]
    return (state.o / jnp.where(l > 0, l, 1.0)).astype(dtype)


def _attend_cudnn(q: Array, k: Array, v: Array, key_mask: Array | None) -> Array:
    if key_mask is None:
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    # cuDNN rejects a mask broadcast over queries ([B,1,1,S]): materialise [B, 1, T, S]
    mask = jnp.broadcast_to(key_mask[:, None, None, :], (q.shape[0], 1, q.shape[1], k.shape[1]))
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")


def _attend_pallas(
    q: Array,
    k: Array,
    v: Array,
    key_mask: Array | None,
    interpret: bool,
    init_state: AttentionState | None = None,
    return_state: bool = False,
) -> Array | AttentionState:
    b, s = k.shape[:2]
    q_lens = jnp.full((b,), q.shape[1], jnp.int32)
    state = dict(init_state=init_state, return_state=return_state, interpret=interpret)
    if key_mask is None:  # the contiguous fast path: slots computed in-kernel, no table
        return sa.slot_attention(q, k, v, None, q_lens, jnp.full((b,), s, jnp.int32), **state)
    k_pool, v_pool, table, kv_lens = packed_slots(k, v, key_mask)  # valid keys first, in order
    return sa.slot_attention(q, k_pool, v_pool, table, q_lens, kv_lens, **state)


def packed_slots(k: Array, v: Array, key_mask: Array | None) -> tuple[Array, Array, Array, Array]:
    """Contiguous k/v [B, S, Hkv, D] as the slot kernel's pool [B * S, Hkv, D] (K and V), with a read table [B, S]
    listing each row's valid keys first, in order (a stable argsort of ~mask; every key where there is no mask),
    and their count [B]."""
    b, s, hkv, d = k.shape
    if key_mask is None:
        order, lens = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), jnp.full((b,), s, jnp.int32)
    else:
        order = jnp.argsort(~key_mask, axis=1, stable=True).astype(jnp.int32)
        lens = key_mask.sum(axis=1).astype(jnp.int32)
    table = order + (jnp.arange(b, dtype=jnp.int32) * s)[:, None]
    return k.reshape(b * s, hkv, d), v.reshape(b * s, hkv, d), table, lens


def attend_state(
    q: Array,
    k: Array,
    v: Array,
    key_mask: Array | None,
    backend: str,
    interpret: bool,
    init_state: AttentionState | None = None,
    return_state: bool = False,
) -> Array | AttentionState:
    """Attention of q [B, T, Hq, D] over the keys k/v [B, S, Hkv, D] where key_mask [B, S] holds, continuing
    init_state (q's online-softmax state over other keys): the output in q.dtype, or the state (return_state).
    Backends that run the slot kernel ("pallas", "cudnn_pallas") pass the state in and out of it; the others
    compute `softmax_state` and `merge_states` in jnp (the reference)."""
    if backend in ("pallas", "cudnn_pallas"):
        return _attend_pallas(q, k, v, key_mask, interpret, init_state, return_state)
    state = softmax_state(q, k, v, key_mask)
    if init_state is not None:
        state = merge_states(init_state, state)
    return state if return_state else finish_state(state, q.dtype)


class KeySegment(NamedTuple):
    """Keys a query reads, in order: k, v [B, S, Hkv, D] and valid [B, S] bool (None: all)."""

    k: Array
    v: Array
    valid: Array | None = None


def _chunks(segment: KeySegment) -> tuple[Array, Array, Array]:
    """A segment's keys, values and validity as [B, S / KEY_CHUNK, KEY_CHUNK, ...]: each row's valid keys first, in
    order (a row's keys then fill the same chunks wherever its buffer put them), then padding. Always through the
    same sort and gather, even where the keys are packed already: XLA simplifies a program around a constant mask
    differently (measured: other rounding on the CPU), so every caller's program has one shape."""
    k, v, valid = segment
    b, s = k.shape[:2]
    valid = jnp.ones((b, s), bool) if valid is None else valid
    order = jnp.argsort(~valid, axis=1, stable=True)
    k = jnp.take_along_axis(k, order[:, :, None, None], axis=1)
    v = jnp.take_along_axis(v, order[:, :, None, None], axis=1)
    valid = jnp.take_along_axis(valid, order, axis=1)
    pad = -s % KEY_CHUNK
    k, v = (jnp.pad(a, [(0, 0), (0, pad), (0, 0), (0, 0)]) for a in (k, v))
    valid = jnp.pad(valid, [(0, 0), (0, pad)])
    return tuple(a.reshape(b, (s + pad) // KEY_CHUNK, KEY_CHUNK, *a.shape[2:]) for a in (k, v, valid))


def _by_heads(a: Array) -> Array:
    """[B, Hkv, G, T] -> [B, T, Hq, 1]: per-query statistics in grouped_values' layout."""
    b, hkv, g, t = a.shape
    return jnp.moveaxis(a, 3, 1).reshape(b, t, hkv * g)[..., None]


def _online_step(state: tuple[Array, Array, Array], scores: Array, v: Array) -> tuple[Array, Array, Array]:
    """One key chunk's masked scores [B, Hkv, G, T, S] and values [B, S, Hkv, D] into an online-softmax state (m, l
    [B, Hkv, G, T], o [B, T, Hq, D] unnormalised): `attend_segments`' and `attend_slot_chunks`' loop body."""
    m, l, o = state  # noqa: E741
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # no key yet: exp(-inf - 0) = 0, never NaN
    p = jnp.exp(scores - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)  # exactly 1 when the chunk adds nothing, 0 before the first key
    return m_new, alpha * l + jnp.sum(p, axis=-1), _by_heads(alpha) * o + grouped_values(p, v)


def attend_segments(q: Array, segments: Sequence[KeySegment]) -> Array:
    """Attention of q [B, n, Hq, D] over the keys of `segments`, read one after another -> [B, n, Hq, D] in q.dtype
    (zeros where a query has no key). Batch invariant: every dot and reduction a query's result goes through has the
    same shape (one row's [QUERY_TILE] queries x [KEY_CHUNK] keys) and the same order (its valid keys, packed, chunk
    by chunk) however many rows, queries or padding keys share the call: one row and query tile at a time, an
    online softmax over the key chunks (an all-padding chunk leaves its state exactly as it was). Slower than
    `attend_reference` (loops of small dots): the mode's price."""
    b, n, hq, d = q.shape
    hkv = segments[0].k.shape[2]
    ks, vs, valids = (jnp.concatenate(a, axis=1) for a in zip(*(_chunks(s) for s in segments)))
    n_chunks = ks.shape[1]
    ks, vs, valids = (
        stacked(jnp.moveaxis(stacked(jnp.moveaxis(a, 1, 0), n_chunks), 0, 1), b) for a in (ks, vs, valids)
    )
    tiles = -(-n // QUERY_TILE)
    qt = jnp.pad(q, [(0, 0), (0, tiles * QUERY_TILE - n), (0, 0), (0, 0)])
    qt = stacked(qt.reshape(b * tiles, 1, QUERY_TILE, hq, d), b * tiles)

    def tile(i: Array, out: Array) -> Array:
        q_tile, row = jax.lax.dynamic_index_in_dim(qt, i, keepdims=False), i // tiles
        keys = [jax.lax.dynamic_index_in_dim(a, row, keepdims=False) for a in (ks, vs, valids)]

        def chunk(c, state):
            k, v, valid = (jax.lax.dynamic_index_in_dim(a, c, keepdims=True) for a in keys)
            return _online_step(state, _masked(grouped_scores(q_tile, k), valid), v)

        stats = jnp.full((1, hkv, hq // hkv, QUERY_TILE), -jnp.inf, jnp.float32)
        state = (stats, jnp.zeros_like(stats), jnp.zeros((1, QUERY_TILE, hq, d), jnp.float32))
        _, l, o = opaque_loop(n_chunks, chunk, state)  # noqa: E741
        l = _by_heads(l)  # noqa: E741
        return jax.lax.dynamic_update_index_in_dim(out, (o / jnp.where(l > 0, l, 1.0)).astype(q.dtype), i, 0)

    out = opaque_loop(b * tiles, tile, jnp.zeros(qt.shape, q.dtype))  # [B * tiles, 1, QUERY_TILE, Hq, D]
    return out[: b * tiles].reshape(b, tiles * QUERY_TILE, hq, d)[:, :n]


def invariant_tiles(q_heads: int, kv_heads: int) -> sa.BlockSizes:
    """The slot kernel's tiling in the batch-invariant mode: a block step's (32 query rows for MHA, 64 for GQA) for
    every call, whatever its batch, query count or key count, and one KV split (the heuristic's split count is what
    depends on the batch)."""
    return sa.BlockSizes(sa.default_block_q(32, q_heads, kv_heads), 64, num_warps=4, num_stages=2, kv_splits=1)


def attend_slots(segments: Sequence[tuple[Array, ...]], interpret: bool = False) -> Array:
    """The "invariant_slot" attention: each segment (q [B, n, Hq, D], a K and a V pool [P, Hkv, D], a read table
    [B, S] listing each row's keys in order, and their count [B]) through the slot kernel at `invariant_tiles`, its
    state returned; the states merged in order and normalised by XLA, the same ops in every caller (an empty
    segment's state is merge_states' identity, exactly), so a query's result does not depend on its call."""
    state = None
    for q, k, v, table, lens in segments:
        tiles = invariant_tiles(q.shape[2], k.shape[1])
        q_lens = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
        s = sa.slot_attention(q, k, v, table, q_lens, lens, return_state=True, block_sizes=tiles, interpret=interpret)
        state = s if state is None else merge_states(state, s)
    return finish_state(state, segments[0][0].dtype)


def attend_slot_chunks(
    k: Array, v: Array, lists: Sequence[tuple[Array, Array, Array]], key_chunk: int = KEY_CHUNK
) -> Array:
    """XLA's attention over a K and a V pool [P, Hkv, D] read through per-row tables: each of `lists` (q [B, n, Hq,
    D], a read table [B, S] listing each row's keys, their count [B]) scored by its own queries, one softmax over all
    of them. A table wider than LOOP_MIN_WIDTH is read key_chunk entries at a time by an online softmax whose loop
    runs only the chunks the longest row needs (the trip count is data; one loop for all such tables): a call costs
    the keys its rows read, not the tables' width (the engine's tables are max_model_len wide whatever the traffic).
    A narrower table is gathered whole (a loop costs compile time: ~35% more warm-up for a tiny engine). Zeros where
    a query has no key."""
    states = [
        softmax_state(q, jnp.take(k, t, axis=0), jnp.take(v, t, axis=0), jnp.arange(t.shape[1]) < lens[:, None])
        for q, t, lens in lists
        if t.shape[1] <= LOOP_MIN_WIDTH
    ]
    if wide := [x for x in lists if x[1].shape[1] > LOOP_MIN_WIDTH]:
        states.append(_chunk_loop(k, v, wide, key_chunk))
    state = states[0]
    for other in states[1:]:
        state = merge_states(state, other)
    return finish_state(state, lists[0][0].dtype)


def _chunk_loop(k: Array, v: Array, lists: Sequence[tuple[Array, Array, Array]], key_chunk: int) -> AttentionState:
    """The online-softmax state of `attend_slot_chunks`' wide lists: one loop over each list's live chunks in turn."""
    b, n, hq, d = lists[0][0].shape
    hkv = k.shape[1]
    qs = jnp.stack([q for q, _, _ in lists])
    tables = [jnp.pad(t, [(0, 0), (0, -t.shape[1] % key_chunk)]) for _, t, _ in lists]
    starts = jnp.asarray(np.cumsum([0] + [t.shape[1] // key_chunk for t in tables])[:-1], jnp.int32)
    table, lens = jnp.concatenate(tables, axis=1), jnp.stack([ln for _, _, ln in lists])  # [B, sum S], [lists, B]
    trips = -(-jnp.max(lens, axis=1, initial=0) // key_chunk)  # [lists] the chunks each list runs
    ends = jnp.cumsum(trips)
    at = jnp.arange(key_chunk, dtype=jnp.int32)[None, :]

    def chunk(c: Array, state: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        j = jnp.sum(c >= ends)  # the list this trip reads, and its chunk there
        i = c - (ends[j] - trips[j])
        slots = jax.lax.dynamic_slice_in_dim(table, (starts[j] + i) * key_chunk, key_chunk, axis=1)
        scores = _masked(grouped_scores(qs[j], jnp.take(k, slots, axis=0)), i * key_chunk + at < lens[j][:, None])
        return _online_step(state, scores, jnp.take(v, slots, axis=0))

    stats = jnp.full((b, hkv, hq // hkv, n), -jnp.inf, jnp.float32)
    empty = (stats, jnp.zeros_like(stats), jnp.zeros((b, n, hq, d), jnp.float32))
    m, l, o = jax.lax.fori_loop(0, ends[-1], chunk, empty)  # noqa: E741
    return AttentionState(m.reshape(b, hq, n), l.reshape(b, hq, n), o)


def attend(
    q: Array, k: Array, v: Array, key_mask: Array | None, backend: str = "xla", interpret: bool = False
) -> Array:
    """Attention of q over k/v with the named backend (see the module docstring); interpret runs the Pallas kernel
    interpreted (the CPU)."""
    if backend == "cudnn_pallas":  # shapes are static: the choice is made once per traced forward
        short = q.shape[1] <= SHORT_QUERY and q.shape[0] * k.shape[2] <= PALLAS_MAX_ROWS
        backend = "pallas" if short else "cudnn"
    if backend == "xla":
        return attend_reference(q, k, v, key_mask)
    if backend == "cudnn":
        return _attend_cudnn(q, k, v, key_mask)
    if backend == "pallas":
        return _attend_pallas(q, k, v, key_mask, interpret)
    if backend == "invariant":
        return attend_segments(q, [KeySegment(k, v, key_mask)])
    if backend == "invariant_slot":  # always through the table, even unmasked: one program shape
        return attend_slots([(q, *packed_slots(k, v, key_mask))], interpret)
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
