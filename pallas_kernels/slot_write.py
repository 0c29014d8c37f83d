"""A chunk's fresh K and V written into a slot-addressed KV pool, in place, as one kernel (Pallas, Triton lowering).

The serving engine's pool is, per layer, K and V buffers [P, Hkv, D]; every block-start chunk of a forward writes
its tokens' k and v at per-token slots. XLA does this as two scatters (``pool.at[slots].set(.., mode="drop")``,
`PagedKV.write`) of ~35 us each on the H200 whatever their size: a call's ~700 of them are latency, not bytes.
Here one kernel writes both K and V of a chunk, each token's Hkv * D values as one contiguous row, straight into
the pools, which are aliased to its outputs (slots not written keep their contents exactly; under jit with the pools
donated nothing is copied).

Layout and semantics
--------------------
* ``k_pool/v_pool`` [P, Hkv, D]   one layer's pools, any float dtype (bf16 on the GPU); equal shapes and dtypes.
* ``k/v``           [N, Hkv, D]   the chunk's rows, any float dtype: cast (round to nearest even) to the pool's.
* ``slots``         [N] int32     row n goes to slot ``slots[n]`` when 0 <= slots[n] < P, else nowhere (negative
  entries too): a caller folds its write mask in as -1 or P. The valid slots must be distinct; which of two rows
  aimed at one slot lands is unspecified (the kernel does not order them).
Returns the new (k_pool, v_pool).

Grid: one program per (tile of ``block_n`` tokens, tile of ``block_w`` row elements). A program loads its slot
vector and its [block_n, block_w] tiles of k and v (rows of invalid slots are not read) and stores them at the
slots under a mask. The row width Hkv * D is padded to a power of two (Triton's tiles are) with masked lanes, and
rows wider than ``block_w`` are split over the second grid axis: more programs in flight at LLaDA-8B's 4096-element
rows, and a tile that fits the registers. (Not yet timed on a GPU: the tiling defaults are unswept.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._util import check_pow2

try:  # Triton lowering (deprecated since jax 0.11 but present in 0.11.2).
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

__all__ = ["WriteBlocks", "slot_write", "slot_write_reference"]

_MAX_TILE = 1 << 20  # Triton's largest tensor, in elements


@dataclasses.dataclass(frozen=True, slots=True)
class WriteBlocks:
    """block_n: tokens per program; block_w: row elements per program (a wider row is split over the grid's second
    axis; a narrower one takes its padded width); num_warps: Triton warps per program. All powers of two."""

    block_n: int = 16
    block_w: int = 1024
    num_warps: int = 4

    def __post_init__(self):
        check_pow2("WriteBlocks", "block_n", self.block_n, 1024)
        check_pow2("WriteBlocks", "block_w", self.block_w, _MAX_TILE)
        check_pow2("WriteBlocks", "num_warps", self.num_warps, 16)
        if self.block_n * self.block_w > _MAX_TILE:
            raise ValueError(
                f"WriteBlocks: a tile of block_n * block_w = {self.block_n} * {self.block_w} elements exceeds "
                f"Triton's {_MAX_TILE}"
            )


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def slot_write_reference(
    k_pool: jax.Array, v_pool: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Plain jnp: the scatter `PagedKV.write` does. Rows that are not written go to distinct indices past the pool's
    end (dropped; a negative index would wrap onto a live slot), so every index is unique."""
    _validate(k_pool, v_pool, k, v, slots)
    p, n = k_pool.shape[0], slots.shape[0]
    flat = jnp.where((slots >= 0) & (slots < p), slots, p + jnp.arange(n, dtype=jnp.int32))
    scatter = dict(mode="drop", unique_indices=True)
    return (
        k_pool.at[flat].set(k.astype(k_pool.dtype), **scatter),
        v_pool.at[flat].set(v.astype(v_pool.dtype), **scatter),
    )


def _kernel(slots_ref, k_ref, v_ref, kp_in, vp_in, kp_ref, vp_ref, *, n: int, p: int, width: int, bn: int, bw: int):
    del kp_in, vp_in  # aliased to kp_ref / vp_ref: only the written slots change
    tok = pl.program_id(0) * bn + jnp.arange(bn, dtype=jnp.int32)
    live = tok < n
    slot = plgpu.load(slots_ref.at[tok], mask=live, other=p)
    ok = live & (slot >= 0) & (slot < p)
    full = jnp.zeros((bn, bw), jnp.int32)  # index and mask arrays all get the tile's full shape
    col = full + (pl.program_id(1) * bw + jnp.arange(bw, dtype=jnp.int32))[None, :]
    keep = ok[:, None] & (col < width)
    rows = full + tok[:, None]
    # a masked lane's slot goes past the pool (never a negative one, which the interpreter would wrap onto a live
    # slot of the same store); on the GPU masked lanes are not dereferenced at all
    dest = full + jnp.where(ok, slot, p)[:, None]
    for src, dst in ((k_ref, kp_ref), (v_ref, vp_ref)):
        x = plgpu.load(src.at[rows, col], mask=keep, other=0.0)
        plgpu.store(dst.at[dest, col], x.astype(dst.dtype), mask=keep)


def _shape(a) -> str:
    return f"{jnp.dtype(a.dtype).name}{tuple(a.shape)}"


def _validate(k_pool, v_pool, k, v, slots) -> tuple[int, int, int]:
    """(P, N, Hkv * D), or one ValueError naming the bad input."""
    if k_pool.ndim != 3 or k_pool.shape[0] < 1:
        raise ValueError(f"slot_write: k_pool must be [P, Hkv, D] with P >= 1, got {_shape(k_pool)}")
    if not jnp.issubdtype(k_pool.dtype, jnp.floating):
        raise ValueError(f"slot_write: the pools must be floating point, got k_pool {_shape(k_pool)}")
    if v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"slot_write: v_pool must match k_pool {_shape(k_pool)}, got {_shape(v_pool)}")
    p, hkv, d = k_pool.shape
    if k.ndim != 3 or k.shape[1:] != (hkv, d):
        raise ValueError(f"slot_write: k must be [N, Hkv, D] = [N, {hkv}, {d}], got {_shape(k)}")
    if not jnp.issubdtype(k.dtype, jnp.floating) or not jnp.issubdtype(v.dtype, jnp.floating):
        raise ValueError(f"slot_write: k and v must be floating point, got k {_shape(k)}, v {_shape(v)}")
    if v.shape != k.shape:
        raise ValueError(f"slot_write: v must have k's shape {tuple(k.shape)}, got {_shape(v)}")
    n = k.shape[0]
    if slots.shape != (n,) or slots.dtype != jnp.int32:
        raise ValueError(f"slot_write: slots must be int32 [N] = [{n}], got {_shape(slots)}")
    return p, n, hkv * d


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def _slot_write(k_pool, v_pool, k, v, slots, *, blocks: WriteBlocks, interpret: bool):
    p, n, width = _validate(k_pool, v_pool, k, v, slots)
    if n == 0:
        return k_pool, v_pool
    bn = blocks.block_n
    bw = min(blocks.block_w, _next_pow2(width))
    kp = k_pool.reshape(p, width)  # row-major: free reshapes, the aliasing holds through them
    vp = v_pool.reshape(p, width)

    def whole(shape):
        return pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))

    kp, vp = pl.pallas_call(
        functools.partial(_kernel, n=n, p=p, width=width, bn=bn, bw=bw),
        grid=(pl.cdiv(n, bn), pl.cdiv(width, bw)),
        in_specs=[whole((n,)), whole((n, width)), whole((n, width)), whole(kp.shape), whole(vp.shape)],
        out_specs=[whole(kp.shape), whole(vp.shape)],
        out_shape=[jax.ShapeDtypeStruct(kp.shape, kp.dtype), jax.ShapeDtypeStruct(vp.shape, vp.dtype)],
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name="slot_write",
    )(slots, k.reshape(n, width), v.reshape(n, width), kp, vp)
    return kp.reshape(k_pool.shape), vp.reshape(v_pool.shape)


def slot_write(
    k_pool: jax.Array,
    v_pool: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slots: jax.Array,
    *,
    blocks: WriteBlocks | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The pools with row n of k and v written at slot ``slots[n]`` wherever 0 <= slots[n] < P (see the module
    docstring; the valid slots must be distinct). interpret=True runs the kernel on the CPU. Under a jit whose pools
    are donated (or a loop carry not used after this call) XLA updates them in place; called on its own it writes
    into copies (nothing is donated)."""
    if blocks is not None and not isinstance(blocks, WriteBlocks):
        raise ValueError(f"slot_write: blocks must be a WriteBlocks, got {type(blocks).__name__}")
    return _slot_write(k_pool, v_pool, k, v, slots, blocks=blocks or WriteBlocks(), interpret=bool(interpret))
