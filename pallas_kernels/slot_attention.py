"""Bidirectional flash attention over a slot-addressed KV pool (Pallas, Triton lowering).

Layout and semantics
--------------------
* ``q``        [B, Tq, Hq, D]   (bf16; fp32 accepted)
* ``k_pool``   [P, Hkv, D]      physical slots (one pool per layer); ``v_pool`` likewise
* ``read_table`` [B, S] int32   logical key position j of row b lives in slot ``read_table[b, j]``.
  Entries at j >= kv_lens[b] are never read (they may hold anything).
  ``read_table=None`` selects the *contiguous* special case: pools are [B, S, Hkv, D] and
  slot(b, j) = b * S + j is computed in the kernel (no table traffic).
* ``q_lens`` [B] int32 (rows t >= q_lens[b] give zeros, or the empty state), ``kv_lens`` [B] int32 <= S.
* GQA: Hq = G * Hkv, G in 1..8.  Query heads of one kv head are folded into the M dimension of the
  dots (rows = block_q tokens x next_pow2(G) heads), so each K/V tile is loaded once per kv head.
* No causal mask.  fp32 accumulation.  Natural-log online-softmax state (m, l, o):
  out = o / l,  m = running max of scaled logits (-inf where no key was seen), l = sum exp(s - m).
* ``init_state`` continues an earlier state: attention over KV = A u B equals
  ``slot_attention(.., B, init_state=slot_attention(.., A, return_state=True))``; ``merge_states``
  merges two states over disjoint key sets.

Kernel: one program per (q block, kv split, kv head, batch row).  The split over the KV length
(decode-style split-K) gives enough programs at block-step shapes (q_len 32, batch 1); the partial
states are merged by a second small Pallas kernel into the normalised output (or by XLA into a state
when one is requested).  With one split and no state requested the kernel writes the normalised
output directly in q.dtype.

The K/V gather is done inside the kernel: the table slice of a KV tile is loaded as an int32 vector
and used as a row index (``k_ref[rows, :]``), each row being a contiguous D-vector.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._util import check_attention_tiles, next_pow2
from pallas_kernels.gpu_info import H200_SMS

try:  # Triton lowering (deprecated since jax 0.11 but present in 0.11.2).
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

__all__ = [
    "AttentionState",
    "FirstList",
    "BlockSizes",
    "slot_attention",
    "slot_attention_reference",
    "slot_log_sum_exp",
    "finalize_state",
    "merge_states",
    "empty_state",
    "contiguous_read_table",
]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_M_INIT = -1e30  # finite start value of the running max inside the kernel (base-2 domain)
_NUM_SMS = H200_SMS  # only used by the split heuristic
# The split heuristic splits the KV length into one-tile splits, and only when the grid has at most SPLIT_BELOW_SMS
# programs. In a block step on the H200 (calls of 8 steps): one-tile splits beat 4-tile splits at batch 1 (LLaDA-8B
# 4.98 vs 5.04 ms, Dream-7B 4.45 vs 4.50: more programs in flight), and no split beat 2 at Dream's batch 8 (6.70 vs
# 6.79: 128 programs already nearly fill the GPU).
SPLIT_BELOW_SMS = _NUM_SMS // 2
# The split-K merge of the plain output path (weights exp(m - max m), the weighted sums over the splits, o / l) is one
# Pallas kernel instead of XLA's two fusions (a reduction for the weights, then the weighted sum): one launch fewer
# per layer of a block step (H200, per step in a loop: LLaDA-8B batch 1 4.585 vs 4.639 ms, Dream-7B batch 1 4.201
# vs 4.217; batch 8 does not split).
MERGE_BLOCK_ROWS = 8  # (token, head) rows per merge program: a block step's 1024 rows make 128 programs


class FirstList(NamedTuple):
    """Keys a call reads before its read_table's, in the same online softmax: attention over both lists without an
    `AttentionState` between two calls (the serving pool's shared affix copy, then a row's own slots)."""

    table: jax.Array  # [B, S1] int32: the slots, like read_table
    lens: jax.Array  # [B] int32 <= S1: how many of them each row reads
    q: jax.Array | None = None  # [B, Tq, Hq, D]: the queries to score them with (None: q; e.g. q rotated back by
    # the list's RoPE placement)


class AttentionState(NamedTuple):
    """Unnormalised online-softmax state (natural log convention)."""

    m: jax.Array  # [B, Hq, Tq] fp32 running max, -inf where no key seen
    l: jax.Array  # [B, Hq, Tq] fp32 normaliser
    o: jax.Array  # [B, Tq, Hq, D] fp32 unnormalised accumulator


def default_block_q(q_len: int, q_heads: int, kv_heads: int) -> int:
    """Query tokens per program: rows = block_q x next_pow2(G) of 32 (MHA) / 64 (GQA) at block steps, 128 in full
    forwards, and at least the 16 rows a dot needs."""
    gp = next_pow2(q_heads // kv_heads)
    rows = (32 if gp == 1 else 64) if q_len <= 64 else 128
    block_q = max(1, min(rows // gp, next_pow2(q_len)))
    while block_q * gp < 16:
        block_q *= 2
    return block_q


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """Tile sizes of the slot attention kernel.

    Attributes:
      block_q: query TOKENS per program (power of two); the program's M dimension is
        block_q * next_pow2(Hq // Hkv) rows.
      block_k: keys per inner-loop tile (power of two, >= 16).
      num_warps, num_stages: Triton launch parameters.
      kv_splits: number of splits of the KV length (split-K); None = heuristic.
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    kv_splits: int | None = None

    def __post_init__(self):
        check_attention_tiles("BlockSizes", self.block_q, self.block_k, self.num_warps, self.num_stages)
        if self.kv_splits is not None and (not isinstance(self.kv_splits, int) or self.kv_splits < 1):
            raise ValueError(f"BlockSizes.kv_splits must be None or >= 1, got {self.kv_splits!r}")

    @classmethod
    def get_default(
        cls, *, batch: int, q_len: int, kv_len: int, q_heads: int, kv_heads: int, head_dim: int
    ) -> "BlockSizes":
        """Heuristic defaults, from H200 sweeps (Triton lowering).

        Full forward (q_len > 64): 128 rows x 64 keys, 4 warps, 3 stages (8 warps was 15-35% slower).
        Block step (q_len <= 64; device times of `sweep_block_attention.py`): 32 rows for MHA (the 32
        tokens), 64 for GQA. MHA: when the grid is small enough to be split over the KV length, 128-key tiles (fewer
        programs and partials to merge) with no software pipelining when each split is one tile; up to 3 waves of
        programs 64-key tiles on 3 stages; beyond, 128-key tiles on 2 stages (v12's choice). GQA: 64-key tiles on 3
        stages, 128-key tiles while the grid is under one wave.
        """
        del head_dim
        gp = next_pow2(q_heads // kv_heads)
        small_q = q_len <= 64
        block_q = default_block_q(q_len, q_heads, kv_heads)
        nq = pl.cdiv(q_len, block_q)
        base = batch * kv_heads * nq  # programs before any KV split
        block_k, num_warps, num_stages = 64, 4, 3
        if small_q and gp == 1:
            if base <= SPLIT_BELOW_SMS:
                block_k = 128
            elif base >= 3 * _NUM_SMS:  # (32-key tiles on 3 stages won 7% here at kv 512 but lost 19% at kv 2048)
                block_k, num_stages = 128, 2
        elif small_q and SPLIT_BELOW_SMS < base < _NUM_SMS:
            block_k = 128
        block_k = min(block_k, max(16, next_pow2(kv_len)))
        bs = cls(block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages, kv_splits=None)
        if small_q and gp == 1 and base <= SPLIT_BELOW_SMS:  # split over the KV length: pipeline only multi-tile splits
            _, tiles_per_split = _choose_splits(bs, batch=batch, kv_heads=kv_heads, num_q_blocks=nq, kv_len=kv_len)
            bs = dataclasses.replace(bs, num_stages=1 if tiles_per_split == 1 else 2)
        return bs


def _choose_splits(bs: BlockSizes, *, batch, kv_heads, num_q_blocks, kv_len) -> tuple[int, int]:
    """Returns (kv_splits, tiles_per_split)."""
    n_tiles = max(1, pl.cdiv(kv_len, bs.block_k))
    if bs.kv_splits is not None:
        splits = min(bs.kv_splits, n_tiles)
    else:
        base = batch * kv_heads * num_q_blocks
        splits = 1
        if base <= SPLIT_BELOW_SMS:  # under half a wave: split KV up to ~2 waves (as few as one tile a split)
            splits = max(1, min(pl.cdiv(2 * _NUM_SMS, base), n_tiles, 16))
    tiles_per_split = pl.cdiv(n_tiles, splits)
    splits = pl.cdiv(n_tiles, tiles_per_split)
    return splits, tiles_per_split


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
def _slot_attention_kernel(
    lens_ref,
    *refs,
    contiguous: bool,
    first_list: int,
    has_q_start: bool,
    skip_dead_blocks: bool,
    state_out: bool,
    with_output: bool,
    group: int,
    group_pad: int,
    block_q: int,
    block_k: int,
    tiles_per_split: int,
    q_len_max: int,
    kv_len_max: int,
    q_heads: int,
    kv_heads: int,
    qk_scale: float,
):
    first_tbl_ref = first_q_ref = None
    if contiguous:
        tbl_ref = None
        q_ref, k_ref, v_ref, *out_refs = refs
    elif first_list == 2:  # a first list read with its own queries
        first_tbl_ref, first_q_ref, tbl_ref, q_ref, k_ref, v_ref, *out_refs = refs
    elif first_list == 1:  # ... with q
        first_tbl_ref, tbl_ref, q_ref, k_ref, v_ref, *out_refs = refs
    else:
        tbl_ref, q_ref, k_ref, v_ref, *out_refs = refs
    iq = pl.program_id(0)
    isplit = pl.program_id(1)
    kvh = pl.program_id(2)
    b = pl.program_id(3)
    head_dim = q_ref.shape[-1]
    rows = block_q * group_pad

    q_len = lens_ref[0]
    kv_len = lens_ref[1]
    first_len = lens_ref[2] if first_list else 0
    q_start = lens_ref[3 if first_list else 2] if has_q_start else 0  # rows t < q_start: as rows t >= q_len

    r = jnp.arange(rows, dtype=jnp.int32)
    t = iq * block_q + lax.div(r, jnp.int32(group_pad))  # token of each row
    g = lax.rem(r, jnp.int32(group_pad))  # head within the group
    h = kvh * group + g  # query head
    in_bounds = (t < q_len_max) & (g < group)
    row_ok = in_bounds & (t < q_len) & (t >= q_start)
    oob = q_len_max * q_heads  # out-of-range row: never touched
    q_rows = jnp.where(in_bounds, t * q_heads + h, oob)  # row in the [Tq*Hq, D] view
    cols = jnp.arange(head_dim, dtype=jnp.int32)[None, :]

    kv_dtype = k_ref.dtype

    def load_q(ref):
        return plgpu.load(ref.at[q_rows[:, None], cols], mask=row_ok[:, None], other=0.0).astype(kv_dtype)

    def tiles(length):
        return lax.div(length + (block_k - 1), jnp.int32(block_k))

    # the split's tiles in the index space of the first list's tiles, then the list's
    n_first = tiles(first_len) if first_list else 0
    start = isplit * tiles_per_split
    end = jnp.minimum(start + tiles_per_split, n_first + tiles(kv_len))
    live = (iq * block_q < q_len) & ((iq + 1) * block_q > q_start)
    end = jnp.where(live, end, start)  # whole q block empty: skip the work

    kidx = jnp.arange(block_k, dtype=jnp.int32)

    def tile(j, carry, masked: bool, q, tbl_ref, kv_len, kv_len_max):
        o_prev, m_prev, l_prev = carry if with_output else (None, *carry)
        kpos = j * block_k + kidx
        kmask = kpos < kv_len if masked else None
        if contiguous:
            slots = b * kv_len_max + kpos
        elif masked or kv_len_max % block_k:  # (a static-size slice must fit the table's block)
            tmask = kmask if masked else kpos < kv_len_max
            slots = plgpu.load(tbl_ref.at[pl.ds(j * block_k, block_k)], mask=tmask, other=0)
        else:
            slots = tbl_ref[pl.ds(j * block_k, block_k)]
        k_rows = slots * kv_heads + kvh
        if masked:
            k = plgpu.load(k_ref.at[k_rows[:, None], cols], mask=kmask[:, None], other=0.0)
        else:
            k = k_ref[k_rows[:, None], cols]
        s = plgpu.dot(q, k, trans_b=True) * qk_scale  # [rows, block_k] fp32, base-2 logits
        if masked:
            s = jnp.where(kmask[None, :], s, -jnp.inf)
        m_next = jnp.maximum(m_prev, s.max(axis=-1))
        alpha = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s - m_next[:, None])
        l_next = l_prev * alpha + p.sum(axis=-1)
        if not with_output:  # the log-sum-exp only: no V tile, no P V
            return m_next, l_next
        if masked:
            v = plgpu.load(v_ref.at[k_rows[:, None], cols], mask=kmask[:, None], other=0.0)
        else:
            v = v_ref[k_rows[:, None], cols]
        o_next = o_prev * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return o_next, m_next, l_next

    def run_list(carry, q, tbl_ref, kv_len, kv_len_max, lo, hi):
        """Tiles lo..hi-1 of one list (of kv_len keys): the full ones unmasked, the last one masked."""
        end_full = jnp.minimum(hi, lax.div(kv_len, jnp.int32(block_k)))
        body = functools.partial(tile, q=q, tbl_ref=tbl_ref, kv_len=kv_len, kv_len_max=kv_len_max)
        carry = lax.fori_loop(lo, end_full, functools.partial(body, masked=False), carry)
        return lax.fori_loop(jnp.maximum(lo, end_full), hi, functools.partial(body, masked=True), carry)

    m = jnp.full((rows,), _M_INIT, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    carry = ((jnp.zeros((rows, head_dim), jnp.float32),) if with_output else ()) + (m, l)
    q = None if first_list == 2 else load_q(q_ref)
    if first_list:  # one online softmax over both lists: no state between them leaves the program
        first_q = load_q(first_q_ref) if first_list == 2 else q
        first_max = first_tbl_ref.shape[-1]
        carry = run_list(carry, first_q, first_tbl_ref, first_len, first_max, start, jnp.minimum(end, n_first))
        start, end = jnp.maximum(start, n_first) - n_first, jnp.maximum(end, n_first) - n_first
        q = load_q(q_ref) if q is None else q
    carry = run_list(carry, q, tbl_ref, kv_len, kv_len_max, start, end)
    o, m, l = carry if with_output else (None, *carry)

    st_mask = in_bounds[:, None]
    if state_out:
        if with_output:
            o_ref, m_ref, l_ref = out_refs
            o = jnp.where(row_ok[:, None], o, 0.0).astype(o_ref.dtype)
            plgpu.store(o_ref.at[q_rows[:, None], cols], o, mask=st_mask)
        else:
            m_ref, l_ref = out_refs
        seen = row_ok & (l > 0.0)
        # m and l in o's row order (t * Hq + h): merging the splits is then elementwise over one layout
        plgpu.store(m_ref.at[q_rows], jnp.where(seen, m * _LN2, -jnp.inf), mask=in_bounds)
        plgpu.store(l_ref.at[q_rows], jnp.where(row_ok, l, 0.0), mask=in_bounds)
    else:
        (o_ref,) = out_refs
        ok = row_ok & (l > 0.0)
        inv = jnp.where(ok, 1.0 / jnp.where(ok, l, 1.0), 0.0)
        if skip_dead_blocks:  # a q block wholly past q_len writes nothing
            st_mask = st_mask & (iq * block_q < q_len)
        plgpu.store(o_ref.at[q_rows[:, None], cols], (o * inv[:, None]).astype(o_ref.dtype), mask=st_mask)


# --------------------------------------------------------------------------------------------
# State helpers (pure jnp)
# --------------------------------------------------------------------------------------------
def merge_states(a: AttentionState, b: AttentionState) -> AttentionState:
    """Merges two states over disjoint key sets: equals the state over their union."""
    m = jnp.maximum(a.m, b.m)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    wa = jnp.where(jnp.isneginf(a.m), 0.0, jnp.exp(a.m - m_safe))
    wb = jnp.where(jnp.isneginf(b.m), 0.0, jnp.exp(b.m - m_safe))
    l = wa * a.l + wb * b.l
    wa_o = jnp.swapaxes(wa, 1, 2)[..., None]  # [B, Tq, Hq, 1]
    wb_o = jnp.swapaxes(wb, 1, 2)[..., None]
    o = wa_o * a.o + wb_o * b.o
    return AttentionState(m, l, o)


def _merge_split_rows(m, l, o):
    """m, l [N, B, Tq, Hq], o [N, B, Tq, Hq, D] (the kernel's row order) -> (m, l, o) over all N splits, in that
    order. In one layout the merge is a reduction over N plus elementwise ops (the state's [B, Hq, Tq] layout cost
    two transposes and two more small kernels per call: ~6 us of a block step's attention)."""
    mx = jnp.max(m, axis=0)
    m_safe = jnp.where(jnp.isneginf(mx), 0.0, mx)
    w = jnp.where(jnp.isneginf(m), 0.0, jnp.exp(m - m_safe[None]))
    return mx, jnp.sum(w * l, axis=0), jnp.sum(w[..., None] * o, axis=0)


def _merge_kernel(m_ref, l_ref, o_ref, out_ref, *, splits: int, rows: int, block_r: int):
    i = pl.program_id(0)
    r = i * block_r + jnp.arange(block_r, dtype=jnp.int32)
    live = r < rows
    cols = jnp.arange(o_ref.shape[-1], dtype=jnp.int32)[None, :]
    ms = [plgpu.load(m_ref.at[s, r], mask=live, other=-jnp.inf) for s in range(splits)]
    mx = functools.reduce(jnp.maximum, ms)
    m_safe = jnp.where(jnp.isneginf(mx), 0.0, mx)
    l_sum = jnp.zeros((block_r,), jnp.float32)
    o_sum = jnp.zeros((block_r, o_ref.shape[-1]), jnp.float32)
    for s in range(splits):  # the order of _merge_split_rows: weight, then l and o accumulated split by split
        w = jnp.where(jnp.isneginf(ms[s]), 0.0, jnp.exp(ms[s] - m_safe))
        l_s = plgpu.load(l_ref.at[s, r], mask=live, other=0.0)
        o_s = plgpu.load(o_ref.at[s, r[:, None], cols], mask=live[:, None], other=0.0).astype(jnp.float32)
        l_sum = l_sum + w * l_s
        o_sum = o_sum + w[:, None] * o_s
    ok = l_sum > 0
    out = jnp.where(ok[:, None], o_sum / jnp.where(ok, l_sum, 1.0)[:, None], 0.0)
    plgpu.store(out_ref.at[r[:, None], cols], out.astype(out_ref.dtype), mask=live[:, None])


def _merge_normalise_pallas(m, l, o, dtype, *, interpret: bool) -> jax.Array:
    """The split-K partials (m, l [N, B, Tq, Hq], o [N, B, Tq, Hq, D]) -> the normalised output [B, Tq, Hq, D] in
    dtype, as `_normalise(*_merge_split_rows(...)[1:], dtype)` computes it, in one kernel."""
    splits, b, tq, hq, d = o.shape
    rows = b * tq * hq
    block_r = MERGE_BLOCK_ROWS
    out = pl.pallas_call(
        functools.partial(_merge_kernel, splits=splits, rows=rows, block_r=block_r),
        grid=(pl.cdiv(rows, block_r),),
        in_specs=[
            pl.BlockSpec((splits, rows), lambda i: (0, 0)),
            pl.BlockSpec((splits, rows), lambda i: (0, 0)),
            pl.BlockSpec((splits, rows, d), lambda i: (0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((rows, d), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, d), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="slot_attention_merge",
    )(m.reshape(splits, rows), l.reshape(splits, rows), o.reshape(splits, rows, d))
    return out.reshape(b, tq, hq, d)


def _normalise(l_rows, o, dtype) -> jax.Array:
    """o [B, Tq, Hq, D] / l_rows [B, Tq, Hq], with rows whose l == 0 (no key seen) giving zeros."""
    l = l_rows[..., None]
    ok = l > 0
    return jnp.where(ok, o / jnp.where(ok, l, 1.0), 0.0).astype(dtype)


def finalize_state(state: AttentionState, dtype=jnp.float32) -> jax.Array:
    """o / l, with rows whose l == 0 (no key seen) giving zeros."""
    return _normalise(jnp.swapaxes(state.l, 1, 2), state.o, dtype)


def empty_state(batch: int, q_len: int, q_heads: int, head_dim: int) -> AttentionState:
    """The state over an empty key set (identity of merge_states)."""
    return AttentionState(
        jnp.full((batch, q_heads, q_len), -jnp.inf, jnp.float32),
        jnp.zeros((batch, q_heads, q_len), jnp.float32),
        jnp.zeros((batch, q_len, q_heads, head_dim), jnp.float32),
    )


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def _shape_str(x):
    return "None" if x is None else f"{tuple(x.shape)} {jnp.dtype(x.dtype).name}"


def _validate(q, k_pool, v_pool, read_table, q_lens, kv_lens, init_state):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, Tq, Hq, D], got q {_shape_str(q)}")
    B, Tq, Hq, D = q.shape
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point (bf16/fp32), got q {_shape_str(q)}")
    if read_table is None:
        if k_pool.ndim != 4 or k_pool.shape[0] != B:
            raise ValueError(
                "with read_table=None the pools must be contiguous per-row caches "
                f"[B, S, Hkv, D]; got q {_shape_str(q)}, k_pool {_shape_str(k_pool)}"
            )
        S = k_pool.shape[1]
        Hkv, Dk = k_pool.shape[2:]
    else:
        if k_pool.ndim != 3:
            raise ValueError(f"k_pool must be [P, Hkv, D], got k_pool {_shape_str(k_pool)}")
        Hkv, Dk = k_pool.shape[1:]
        if read_table.ndim != 2 or read_table.shape[0] != B:
            raise ValueError(
                f"read_table must be [B, S] with B={B}, got read_table {_shape_str(read_table)} (q {_shape_str(q)})"
            )
        if not jnp.issubdtype(read_table.dtype, jnp.integer):
            raise ValueError(f"read_table must be int32, got read_table {_shape_str(read_table)}")
        S = read_table.shape[1]
    if v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"v_pool must match k_pool: k_pool {_shape_str(k_pool)}, v_pool {_shape_str(v_pool)}")
    if Dk != D:
        raise ValueError(f"head_dim mismatch: q {_shape_str(q)}, k_pool {_shape_str(k_pool)}")
    if Hq % Hkv:
        raise ValueError(
            f"q heads ({Hq}) must be a multiple of kv heads ({Hkv}): q {_shape_str(q)}, k_pool {_shape_str(k_pool)}"
        )
    if not jnp.issubdtype(k_pool.dtype, jnp.floating):
        raise ValueError(f"k_pool must be floating point, got k_pool {_shape_str(k_pool)}")
    for name, x in (("q_lens", q_lens), ("kv_lens", kv_lens)):
        if x.shape != (B,) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be int32 [B]=[{B}], got {name} {_shape_str(x)}")
    if init_state is not None:
        want = ((B, Hq, Tq), (B, Hq, Tq), (B, Tq, Hq, D))
        got = tuple(tuple(x.shape) for x in init_state)
        if got != want:
            raise ValueError(
                f"init_state shapes must be m/l {want[0]}, o {want[2]}; got m {got[0]}, l {got[1]}, o {got[2]}"
            )
    return B, Tq, Hq, D, Hkv, S


def _validate_first(first, q, read_table) -> None:
    if first is None:
        return
    if not isinstance(first, FirstList):
        raise ValueError(f"first must be a FirstList, got {type(first).__name__}")
    if read_table is None:
        raise ValueError("first needs a read_table: it lists pool slots, which a contiguous cache does not have")
    b = q.shape[0]
    if first.table.ndim != 2 or first.table.shape[0] != b or not jnp.issubdtype(first.table.dtype, jnp.integer):
        raise ValueError(f"first.table must be int32 [B, S1] with B={b}, got {_shape_str(first.table)}")
    if first.lens.shape != (b,) or not jnp.issubdtype(first.lens.dtype, jnp.integer):
        raise ValueError(f"first.lens must be int32 [B]=[{b}], got {_shape_str(first.lens)}")
    if first.q is not None and first.q.shape != q.shape:
        raise ValueError(f"first.q must be shaped like q {_shape_str(q)}, got {_shape_str(first.q)}")


# --------------------------------------------------------------------------------------------
# Pallas wrapper
# --------------------------------------------------------------------------------------------
@functools.partial(
    jax.jit, static_argnames=("scale", "return_state", "block_sizes", "interpret", "with_output", "skip_dead_blocks")
)
def _slot_attention_pallas(
    q,
    k_pool,
    v_pool,
    read_table,
    q_lens,
    kv_lens,
    init_state,
    first=None,
    *,
    scale,
    return_state,
    block_sizes,
    interpret,
    with_output=True,
    skip_dead_blocks=False,
    q_starts=None,
):
    """The kernel's call; with_output=False: only the log-sum-exp [B, Hq, Tq] (natural log, -inf where no key),
    v_pool never read. first: a `FirstList` read before read_table's keys. skip_dead_blocks: `slot_attention`'s
    rows_past_q_len="any". q_starts: [B] rows t < q_starts[b] are treated as rows past q_lens (their q blocks do
    no work)."""
    B, Tq, Hq, D, Hkv, S = _validate(q, k_pool, v_pool, read_table, q_lens, kv_lens, init_state)
    contiguous = read_table is None
    s_first = 0 if first is None else first.table.shape[1]
    group = Hq // Hkv
    group_pad = next_pow2(group)
    kv_all = S + s_first  # the keys' index space: the first list's, then read_table's
    bs = block_sizes or BlockSizes.get_default(batch=B, q_len=Tq, kv_len=kv_all, q_heads=Hq, kv_heads=Hkv, head_dim=D)
    if bs.block_q * group_pad < 16:
        raise ValueError(f"block_sizes.block_q * next_pow2(Hq/Hkv) must be >= 16, got {bs.block_q} * {group_pad}")
    nq = pl.cdiv(Tq, bs.block_q)
    # a split's tiles count in both lists' tiles (the first list's last tile may be partial: one tile more)
    tiles_kv = S if first is None else (pl.cdiv(s_first, bs.block_k) + pl.cdiv(S, bs.block_k)) * bs.block_k
    splits, tps = _choose_splits(bs, batch=B, kv_heads=Hkv, num_q_blocks=nq, kv_len=tiles_kv)
    state_out = return_state or init_state is not None or splits > 1 or not with_output

    q_lens = jnp.minimum(q_lens.astype(jnp.int32), Tq)
    kv_lens = jnp.clip(kv_lens.astype(jnp.int32), 0, S)
    lens = [q_lens, kv_lens] + ([] if first is None else [jnp.clip(first.lens.astype(jnp.int32), 0, s_first)])
    lens += [] if q_starts is None else [jnp.clip(q_starts.astype(jnp.int32), 0, Tq)]
    lens = jnp.stack(lens, axis=1)  # [B, 2 to 4]
    q2 = q.reshape(B, Tq * Hq, D)
    P = k_pool.shape[0] * (S if contiguous else 1)
    k2 = k_pool.reshape(P * Hkv, D)
    v2 = v_pool.reshape(P * Hkv, D)

    kernel = functools.partial(
        _slot_attention_kernel,
        contiguous=contiguous,
        first_list=0 if first is None else (1 if first.q is None else 2),
        has_q_start=q_starts is not None,
        skip_dead_blocks=skip_dead_blocks and not state_out,
        state_out=state_out,
        with_output=with_output,
        group=group,
        group_pad=group_pad,
        block_q=bs.block_q,
        block_k=bs.block_k,
        tiles_per_split=tps,
        q_len_max=Tq,
        kv_len_max=S,
        q_heads=Hq,
        kv_heads=Hkv,
        qk_scale=float(scale) * _LOG2E,
    )

    grid = (nq, splits, Hkv, B)
    in_specs = [pl.BlockSpec((None, lens.shape[1]), lambda i, s, h, b: (b, 0))]
    args = [lens]
    if first is not None:
        in_specs.append(pl.BlockSpec((None, s_first), lambda i, s, h, b: (b, 0)))
        args.append(first.table.astype(jnp.int32))
        if first.q is not None:
            in_specs.append(pl.BlockSpec((None, Tq * Hq, D), lambda i, s, h, b: (b, 0, 0)))
            args.append(first.q.astype(q.dtype).reshape(B, Tq * Hq, D))
    if not contiguous:
        in_specs.append(pl.BlockSpec((None, S), lambda i, s, h, b: (b, 0)))
        args.append(read_table.astype(jnp.int32))
    in_specs += [
        pl.BlockSpec((None, Tq * Hq, D), lambda i, s, h, b: (b, 0, 0)),
        pl.BlockSpec((P * Hkv, D), lambda i, s, h, b: (0, 0)),
        pl.BlockSpec((P * Hkv, D), lambda i, s, h, b: (0, 0)),
    ]
    args += [q2, k2, v2]
    if state_out:
        row_stat = jax.ShapeDtypeStruct((splits, B, Tq * Hq), jnp.float32)
        row_spec = pl.BlockSpec((None, None, Tq * Hq), lambda i, s, h, b: (s, b, 0))
        out_shape, out_specs = [row_stat, row_stat], [row_spec, row_spec]
        if with_output:
            out_shape.insert(0, jax.ShapeDtypeStruct((splits, B, Tq * Hq, D), jnp.float32))
            out_specs.insert(0, pl.BlockSpec((None, None, Tq * Hq, D), lambda i, s, h, b: (s, b, 0, 0)))
    else:
        out_shape = [jax.ShapeDtypeStruct((B, Tq * Hq, D), q.dtype)]
        out_specs = [pl.BlockSpec((None, Tq * Hq, D), lambda i, s, h, b: (b, 0, 0))]

    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="slot_attention",
    )(*args)

    if not state_out:
        return outs[0].reshape(B, Tq, Hq, D)
    if not with_output:  # each split's m + log l, combined over the splits
        m, l = (x.reshape(splits, B, Tq, Hq) for x in outs)
        lse = jnp.where(l > 0.0, m + jnp.log(jnp.where(l > 0.0, l, 1.0)), -jnp.inf)
        return jnp.swapaxes(jax.nn.logsumexp(lse, axis=0), 1, 2)  # all -inf stays -inf
    o, m, l = outs
    o = o.reshape(splits, B, Tq, Hq, D)
    m = m.reshape(splits, B, Tq, Hq)
    l = l.reshape(splits, B, Tq, Hq)
    if not return_state and init_state is None:  # split-K partials of the plain output: merged by one kernel
        return _merge_normalise_pallas(m, l, o, q.dtype, interpret=interpret)
    m, l, o = _merge_split_rows(m, l, o) if splits > 1 else (m[0], l[0], o[0])
    state = AttentionState(jnp.swapaxes(m, 1, 2), jnp.swapaxes(l, 1, 2), o)  # the state's [B, Hq, Tq] layout
    if init_state is not None:
        state = merge_states(AttentionState(*init_state), state)
    if return_state:
        return state
    return finalize_state(state, q.dtype)


# --------------------------------------------------------------------------------------------
# Reference (pure jnp)
# --------------------------------------------------------------------------------------------
def contiguous_read_table(batch: int, seq: int) -> jax.Array:
    """read_table of a contiguous per-row cache [B, S] viewed as a pool of B*S slots."""
    return jnp.arange(batch, dtype=jnp.int32)[:, None] * seq + jnp.arange(seq, dtype=jnp.int32)[None, :]


def _gather_kv(k_pool, v_pool, read_table):
    if read_table is None:  # contiguous [B, S, Hkv, D]
        return k_pool, v_pool
    return jnp.take(k_pool, read_table, axis=0), jnp.take(v_pool, read_table, axis=0)


@functools.partial(jax.jit, static_argnames=("scale", "return_state"))
def _reference_impl(q, k_pool, v_pool, read_table, q_lens, kv_lens, init_state, first, *, scale, return_state):
    B, Tq, Hq, D, Hkv, S = _validate(q, k_pool, v_pool, read_table, q_lens, kv_lens, init_state)
    if first is not None:  # the first list's state, continued over read_table's keys
        first_q = q if first.q is None else first.q
        head = _reference_impl(
            first_q, k_pool, v_pool, first.table, q_lens, first.lens, None, None, scale=scale, return_state=True
        )
        init_state = head if init_state is None else merge_states(init_state, head)
    G = Hq // Hkv
    k, v = _gather_kv(k_pool, v_pool, read_table)  # [B, S, Hkv, D]
    qg = q.reshape(B, Tq, Hkv, G, D)
    s = (
        jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
        * scale
    )
    kmask = jnp.arange(S)[None, :] < kv_lens[:, None]  # [B, S]
    qmask = jnp.arange(Tq)[None, :] < q_lens[:, None]  # [B, Tq]
    s = jnp.where(kmask[:, None, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1)  # [B, Hkv, G, Tq]
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.where(kmask[:, None, None, None, :], jnp.exp(s - m_safe[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    v = jnp.where(kmask[:, :, None, None], v.astype(jnp.float32), 0.0)  # unused slots may hold NaN
    o = jnp.einsum("bhgts,bshd->bthgd", p, v, precision=lax.Precision.HIGHEST).reshape(B, Tq, Hq, D)
    m = m.reshape(B, Hq, Tq)
    l = l.reshape(B, Hq, Tq)
    qm_h = qmask[:, None, :]  # [B, 1, Tq]
    state = AttentionState(
        jnp.where(qm_h, m, -jnp.inf), jnp.where(qm_h, l, 0.0), jnp.where(qmask[:, :, None, None], o, 0.0)
    )
    if init_state is not None:
        state = merge_states(AttentionState(*init_state), state)
    if return_state:
        return state
    return finalize_state(state, q.dtype)


def slot_attention_reference(
    q, k_pool, v_pool, read_table, q_lens, kv_lens, *, scale=None, init_state=None, return_state=False, first=None
):
    """Pure-jnp reference with the same semantics as :func:`slot_attention` (fp32 math)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if init_state is not None:
        init_state = AttentionState(*init_state)
    _validate_first(first, q, read_table)
    return _reference_impl(
        q,
        k_pool,
        v_pool,
        read_table,
        q_lens,
        kv_lens,
        init_state,
        first,
        scale=float(scale),
        return_state=bool(return_state),
    )


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------
def _checked(q, k_pool, v_pool, read_table, q_lens, kv_lens, init_state, scale, block_sizes, first=None):
    """The public entry points' checks: the inputs validated, the scale and the tiling resolved (here, not in the
    cached trace: a patched heuristic is a new program)."""
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}")
    B, Tq, Hq, D, Hkv, S = _validate(q, k_pool, v_pool, read_table, q_lens, kv_lens, init_state)
    _validate_first(first, q, read_table)
    if block_sizes is None:
        S += 0 if first is None else first.table.shape[1]
        block_sizes = BlockSizes.get_default(batch=B, q_len=Tq, kv_len=S, q_heads=Hq, kv_heads=Hkv, head_dim=D)
    return (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale), block_sizes


def slot_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    read_table: jax.Array | None,
    q_lens: jax.Array,
    kv_lens: jax.Array,
    *,
    scale: float | None = None,
    init_state: AttentionState | None = None,
    return_state: bool = False,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    first: FirstList | None = None,
    rows_past_q_len: str = "zeros",
) -> jax.Array | AttentionState:
    """Bidirectional attention of q over the K/V slots listed in read_table (the Pallas kernel; interpret=True
    runs it on the CPU; `slot_attention_reference` is the pure-jnp version). first: a `FirstList` of slots read
    before read_table's (scored by first.q when given) in the same programs: attention over both lists, as chaining
    two calls through `init_state` computes it without the state between them. rows_past_q_len: "zeros", or
    "any": q blocks wholly past q_lens[b] neither run nor write their part of a one-pass normalised output, leaving
    those rows undefined, for a caller that reads only each row's first q_lens[b] (a window padded to a fixed width).

    Returns the normalised output [B, Tq, Hq, D] (q.dtype), or the AttentionState when
    return_state=True.  See the module docstring for the layout.
    """
    if init_state is not None:
        init_state = AttentionState(*init_state)
    if rows_past_q_len not in ("zeros", "any"):
        raise ValueError(f"rows_past_q_len must be 'zeros' or 'any', got {rows_past_q_len!r}")
    scale, block_sizes = _checked(q, k_pool, v_pool, read_table, q_lens, kv_lens, init_state, scale, block_sizes, first)
    return _slot_attention_pallas(
        q,
        k_pool,
        v_pool,
        read_table,
        q_lens,
        kv_lens,
        init_state,
        first,
        scale=float(scale),
        return_state=bool(return_state),
        block_sizes=block_sizes,
        interpret=bool(interpret),
        skip_dead_blocks=rows_past_q_len == "any",
    )


def slot_log_sum_exp(
    q: jax.Array,
    k_pool: jax.Array,
    read_table: jax.Array | None,
    q_lens: jax.Array,
    kv_lens: jax.Array,
    *,
    q_starts: jax.Array | None = None,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """The log-sum-exp of q's scaled logits over the K slots listed in read_table: [B, Hq, Tq] float32 (natural
    log; -inf at t >= q_lens[b], at t < q_starts[b] and in rows without keys), i.e. the state's m + log(l). The
    same kernel as `slot_attention` without the V tiles and the P V dots (ACache's probe needs only the softmax's
    normaliser). q_starts [B] (default 0): the query blocks wholly before a row's start do no work, so a row's
    live span needs no gather to query 0."""
    scale, block_sizes = _checked(q, k_pool, k_pool, read_table, q_lens, kv_lens, None, scale, block_sizes)
    if q_starts is not None and (q_starts.shape != q_lens.shape or not jnp.issubdtype(q_starts.dtype, jnp.integer)):
        raise ValueError(f"q_starts must be int32 {tuple(q_lens.shape)} as q_lens, got {_shape_str(q_starts)}")
    return _slot_attention_pallas(
        q,
        k_pool,
        k_pool,
        read_table,
        q_lens,
        kv_lens,
        None,
        scale=float(scale),
        return_state=True,
        block_sizes=block_sizes,
        interpret=bool(interpret),
        with_output=False,
        q_starts=q_starts,
    )
