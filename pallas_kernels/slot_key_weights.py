"""Per-key attention weights of the masked queries over a slot-addressed KV pool (Pallas, Triton lowering).

What it computes (ACache's affix probe)
---------------------------------------
For each batch row b and key position j < kv_lens[b]::

    weights[b, j] = sum_{h, t : q_mask[b, t]} softmax_j(scale * q[b, t, h] . k[b, j, h // G])

the softmax running over the row's keys j < kv_lens[b] only, summed over every query head h and every masked
query t.  Keys at j >= kv_lens[b], and rows with kv_lens 0 or no masked query, give zeros.

Layout (as `pallas_kernels.slot_attention`)
-------------------------------------------
* ``q``          [B, T, Hq, D]  (bf16; fp32 accepted; cast to the pool's dtype before the dot, as slot_attention)
* ``k_pool``     [P, Hkv, D]    physical slots of one layer (no values: the weights need only the keys)
* ``read_table`` [B, S] int32   key j of row b lives in slot ``read_table[b, j]``; entries at j >= kv_lens[b]
  are never read (they may hold anything, out-of-range slots included).
* ``q_mask``     [B, T] bool    the queries whose attention is summed.
* ``kv_lens``    [B] int32 <= S (clipped to [0, S]).
* GQA: Hq = G * Hkv.  The G query heads of a kv head are padded to next_pow2(G) and folded with block_q tokens
  into one dot dimension, so each key tile is loaded once per kv head.
* Result: [B, S] float32.

Two passes, no score array
--------------------------
Both passes run only the query blocks from the row's first masked query's to its last's, in place (no copy of q).
1. The log-sum-exp of each (query, head) over the row's keys, from `slot_attention.slot_log_sum_exp` (the slot
   kernel without its V tiles and P V dots), its q_starts the first masked query and its q_lens one past the last.
2. This module's kernel: one program per (key tile, kv head, batch row).  It gathers its block_k keys through the
   table, then loops over the query tiles of the row's span: s = k_tile @ q_tile^T in fp32,
   p = exp(s - lse) with unmasked queries and keys >= kv_lens zeroed, summed over the query rows into a
   [block_k] vector.  A tile whose first key is >= kv_lens[b] runs no loop and writes zeros.  The [B, Hkv, S]
   partials are summed over kv heads by XLA.

The scores are never written: the cost is two passes over the row's real keys and masked span, instead of fp32
scores [B, Hkv, G, T, S] at the table's full width read three times.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._util import check_attention_tiles, next_pow2
from pallas_kernels.slot_attention import slot_log_sum_exp

try:  # Triton lowering (deprecated since jax 0.11 but present in 0.11.2).
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

__all__ = ["BlockSizes", "slot_key_weights", "slot_key_weights_reference"]

_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """Tile sizes of the key-weights kernel.

    Attributes:
      block_q: query TOKENS per inner-loop tile (power of two); the tile has block_q * next_pow2(Hq // Hkv) rows,
        which must be >= 16 (the smallest dot).
      block_k: keys per program (power of two, >= 16).
      num_warps, num_stages: Triton launch parameters.
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_attention_tiles("BlockSizes", self.block_q, self.block_k, self.num_warps, self.num_stages)

    @classmethod
    def get_default(cls, *, q_len: int, kv_len: int, q_heads: int, kv_heads: int) -> "BlockSizes":
        """128 query rows (slot_attention's full-forward tile; 64 tokens x 8 padded heads would hold a 64 x 512 fp32
        score tile in registers) against 64 keys; both shrunk to the problem, down to the 16 a dot needs."""
        gp = next_pow2(q_heads // kv_heads)
        block_q = max(1, min(128 // gp, next_pow2(q_len)))
        while block_q * gp < 16:
            block_q *= 2
        block_k = min(64, max(16, next_pow2(kv_len)))
        return cls(block_q=block_q, block_k=block_k, num_warps=4, num_stages=2)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
def _key_weights_kernel(
    lens_ref,
    tbl_ref,
    lse_ref,
    q_ref,
    k_ref,
    out_ref,
    *,
    group: int,
    group_pad: int,
    block_q: int,
    block_k: int,
    q_len_max: int,
    q_heads: int,
    kv_heads: int,
    qk_scale: float,
):
    j = pl.program_id(0)
    kvh = pl.program_id(1)
    head_dim = q_ref.shape[-1]
    rows = block_q * group_pad

    kv_len = lens_ref[0]
    q_first = lens_ref[1]  # first masked query (0 when none)
    q_end = lens_ref[2]  # one past the last masked query (0 when none)

    kpos = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
    kmask = kpos < kv_len
    cols = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    # The table row is padded to whole tiles, so the slice is in bounds; masked entries are never dereferenced.
    slots = plgpu.load(tbl_ref.at[pl.ds(j * block_k, block_k)], mask=kmask, other=0)
    k_rows = slots * kv_heads + kvh  # row in the [P*Hkv, D] view
    k = plgpu.load(k_ref.at[k_rows[:, None], cols], mask=kmask[:, None], other=0.0)

    r = jnp.arange(rows, dtype=jnp.int32)
    tr = lax.div(r, jnp.int32(group_pad))  # token of each row within the tile
    g = lax.rem(r, jnp.int32(group_pad))  # head within the group
    h = kvh * group + g  # query head
    oob = q_len_max * q_heads  # out-of-range row: never touched

    i_lo = lax.div(q_first, jnp.int32(block_q))
    i_hi = lax.div(q_end + (block_q - 1), jnp.int32(block_q))
    i_hi = jnp.where(j * block_k < kv_len, i_hi, i_lo)  # a tile past the row's keys: no loop, zeros

    def q_tile(i, acc):
        t = i * block_q + tr
        in_bounds = (t < q_len_max) & (g < group)
        q_rows = jnp.where(in_bounds, t * q_heads + h, oob)  # row in the [T*Hq, D] view
        # lse is +inf at unmasked queries (and rows without keys): their probabilities are exp2(-inf) = 0.
        lse = plgpu.load(lse_ref.at[q_rows], mask=in_bounds, other=jnp.inf)
        row_ok = lse < jnp.inf
        q = plgpu.load(q_ref.at[q_rows[:, None], cols], mask=row_ok[:, None], other=0.0).astype(k.dtype)
        # keys in the dot's M dimension: the column sums become reductions over the last axis, as slot_attention's
        s = plgpu.dot(k, q, trans_b=True) * qk_scale  # [block_k, rows] fp32, base-2 logits
        p = jnp.where(kmask[:, None] & row_ok[None, :], jnp.exp2(s - lse[None, :]), 0.0)
        return acc + p.sum(axis=-1)

    out_ref[...] = lax.fori_loop(i_lo, i_hi, q_tile, jnp.zeros((block_k,), jnp.float32))


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def _shape_str(x):
    return f"{tuple(x.shape)} {jnp.dtype(x.dtype).name}"


def _validate(q, k_pool, read_table, q_mask, kv_lens):
    if q.ndim != 4 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point [B, T, Hq, D], got q {_shape_str(q)}")
    B, T, Hq, D = q.shape
    if k_pool.ndim != 3 or not jnp.issubdtype(k_pool.dtype, jnp.floating):
        raise ValueError(f"k_pool must be floating point [P, Hkv, D], got k_pool {_shape_str(k_pool)}")
    Hkv, Dk = k_pool.shape[1:]
    if Dk != D:
        raise ValueError(f"head_dim mismatch: q {_shape_str(q)}, k_pool {_shape_str(k_pool)}")
    if Hq % Hkv:
        raise ValueError(
            f"q heads ({Hq}) must be a multiple of kv heads ({Hkv}): q {_shape_str(q)}, k_pool {_shape_str(k_pool)}"
        )
    if read_table.ndim != 2 or read_table.shape[0] != B or not jnp.issubdtype(read_table.dtype, jnp.integer):
        raise ValueError(f"read_table must be int32 [B, S] with B={B}, got read_table {_shape_str(read_table)}")
    if q_mask.shape != (B, T) or q_mask.dtype != jnp.bool_:
        raise ValueError(f"q_mask must be bool [B, T]=[{B}, {T}], got q_mask {_shape_str(q_mask)}")
    if kv_lens.shape != (B,) or not jnp.issubdtype(kv_lens.dtype, jnp.integer):
        raise ValueError(f"kv_lens must be int32 [B]=[{B}], got kv_lens {_shape_str(kv_lens)}")
    return B, T, Hq, D, Hkv, read_table.shape[1]


# --------------------------------------------------------------------------------------------
# Pallas wrapper
# --------------------------------------------------------------------------------------------
def _query_span(q_mask):
    """[B] first masked query and one past the last (both 0 for a row without one)."""
    T = q_mask.shape[1]
    has = q_mask.any(axis=1)
    first = jnp.where(has, jnp.argmax(q_mask, axis=1), 0).astype(jnp.int32)
    end = jnp.where(has, T - jnp.argmax(q_mask[:, ::-1], axis=1), 0).astype(jnp.int32)
    return first, end


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret"))
def _slot_key_weights_pallas(q, k_pool, read_table, q_mask, kv_lens, *, scale, block_sizes, interpret):
    B, T, Hq, D, Hkv, S = _validate(q, k_pool, read_table, q_mask, kv_lens)
    bs = block_sizes
    group = Hq // Hkv
    group_pad = next_pow2(group)
    kv_lens = jnp.clip(kv_lens.astype(jnp.int32), 0, S)
    q_first, q_end = _query_span(q_mask)
    # Pass 1: per-(query, head) log-sum-exp over the row's keys, in base 2; +inf where no probability is wanted.
    # Both passes start at the row's first masked query (its query block): the queries before it cost nothing and
    # are not moved (a gather to query 0 would copy the whole [B, T] query buffer every layer).
    lse = slot_log_sum_exp(q, k_pool, read_table, q_end, kv_lens, q_starts=q_first, scale=scale, interpret=interpret)
    ok = q_mask[:, None, :] & jnp.isfinite(lse)  # [B, Hq, T]
    lse = jnp.where(ok, lse * _LOG2E, jnp.inf)
    lse = jnp.swapaxes(lse, 1, 2).reshape(B, T * Hq)  # the kernel's row order t * Hq + h

    nk = pl.cdiv(S, bs.block_k)
    table = jnp.pad(read_table.astype(jnp.int32), ((0, 0), (0, nk * bs.block_k - S)))
    lens = jnp.stack([kv_lens, q_first, q_end], axis=1)  # [B, 3]
    P = k_pool.shape[0]

    kernel = functools.partial(
        _key_weights_kernel,
        group=group,
        group_pad=group_pad,
        block_q=bs.block_q,
        block_k=bs.block_k,
        q_len_max=T,
        q_heads=Hq,
        kv_heads=Hkv,
        qk_scale=float(scale) * _LOG2E,
    )
    out = pl.pallas_call(
        kernel,
        grid=(nk, Hkv, B),
        in_specs=[
            pl.BlockSpec((None, 3), lambda j, h, b: (b, 0)),
            pl.BlockSpec((None, nk * bs.block_k), lambda j, h, b: (b, 0)),
            pl.BlockSpec((None, T * Hq), lambda j, h, b: (b, 0)),
            pl.BlockSpec((None, T * Hq, D), lambda j, h, b: (b, 0, 0)),
            pl.BlockSpec((P * Hkv, D), lambda j, h, b: (0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, bs.block_k), lambda j, h, b: (b, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, nk * bs.block_k), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="slot_key_weights",
    )(lens, table, lse, q.reshape(B, T * Hq, D), k_pool.reshape(P * Hkv, D))
    return out.sum(axis=1)[:, :S]


# --------------------------------------------------------------------------------------------
# Reference (pure jnp)
# --------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("scale",))
def _reference_impl(q, k_pool, read_table, q_mask, kv_lens, *, scale):
    B, T, Hq, D, Hkv, S = _validate(q, k_pool, read_table, q_mask, kv_lens)
    kmask = jnp.arange(S)[None, :] < jnp.clip(kv_lens, 0, S)[:, None]  # [B, S]
    k = jnp.take(k_pool, jnp.where(kmask, read_table, 0), axis=0)  # [B, S, Hkv, D]; unread entries: slot 0
    qg = q.astype(k_pool.dtype).reshape(B, T, Hkv, Hq // Hkv, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    scores = jnp.where(kmask[:, None, None, None, :], scores * scale, -jnp.inf)
    # ACache's _probe_part: softmax over the row's keys, summed over the masked queries and all heads.
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = m + jnp.log(jnp.maximum(jnp.sum(jnp.exp(scores - m), axis=-1, keepdims=True), 1e-30))
    weights = jnp.where(q_mask[:, None, None, :, None], jnp.exp(scores - lse), 0.0)
    return jnp.sum(weights, axis=(1, 2, 3))


def slot_key_weights_reference(
    q: jax.Array,
    k_pool: jax.Array,
    read_table: jax.Array,
    q_mask: jax.Array,
    kv_lens: jax.Array,
    *,
    scale: float | None = None,
) -> jax.Array:
    """Pure-jnp reference of :func:`slot_key_weights` (fp32 scores of the gathered keys; ACache's probe math)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _reference_impl(q, k_pool, read_table, q_mask, kv_lens, scale=float(scale))


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------
def slot_key_weights(
    q: jax.Array,
    k_pool: jax.Array,
    read_table: jax.Array,
    q_mask: jax.Array,
    kv_lens: jax.Array,
    *,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """The attention weight each key of a row gets from the row's masked queries, summed over queries and heads:
    [B, S] float32, zero at j >= kv_lens[b] (see the module docstring).  The Pallas kernels; interpret=True runs
    them on the CPU; `slot_key_weights_reference` is the pure-jnp version.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}")
    B, T, Hq, D, Hkv, S = _validate(q, k_pool, read_table, q_mask, kv_lens)
    if T == 0 or S == 0:
        return jnp.zeros((B, S), jnp.float32)
    # the default tiling is resolved here, not in the cached trace (as slot_attention)
    if block_sizes is None:
        block_sizes = BlockSizes.get_default(q_len=T, kv_len=S, q_heads=Hq, kv_heads=Hkv)
    group_pad = next_pow2(Hq // Hkv)
    if block_sizes.block_q * group_pad < 16:
        raise ValueError(
            f"block_sizes.block_q * next_pow2(Hq/Hkv) must be >= 16, got {block_sizes.block_q} * {group_pad}"
        )
    return _slot_key_weights_pallas(
        q,
        k_pool,
        read_table,
        q_mask,
        kv_lens,
        scale=float(scale),
        block_sizes=block_sizes,
        interpret=bool(interpret),
    )
