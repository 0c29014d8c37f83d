"""RoPE of q and k plus the K/V cache write, as one kernel (Pallas, Triton lowering).

After a layer's fused q/k/v projection, XLA runs three kernels per layer at a cached block step: the rotation of
q and k (one concatenate fusion) and one dynamic-update-slice each for K and V into the layer's cache buffer
(~6 us together per LLaDA-8B layer at batch 1 on the H200). Here one kernel reads the projection output once,
writes the rotated q, and stores the rotated k and the v of every written token straight into the cache buffers,
which are aliased to its outputs (updated in place; nothing else of them is touched). On the projection output
itself: 6.5 vs 7.6 us per layer at LLaDA-8B batch 8 on the H200, no gain at batch 1 (XLA had fused RoPE into the
q/k/v GEMM's split-K reduction) and slower over a block start's 4096 tokens.

Layout and semantics
--------------------
* ``qkv``      [B, n, (Hq + 2 Hkv) * D]  the fused projection output: q heads, then k heads, then v heads.
* ``cos/sin``  [B, n, D] fp32            half-rotation layout (`dllm_jax.layers.rope_cos_sin`).
* ``k_cache/v_cache`` [B, S, Hkv, D]     token t of row b goes to slot ``offset + t``; ``offset`` is clamped to
  [0, S - n] as `lax.dynamic_update_slice` clamps its start.
* ``write_mask`` [B, n] bool or None     where False the cached K/V stay as they were.
* ``rope_fp32``: True rotates in fp32 and rounds once (LLaDA); False rounds each product and the sum to the
  activation dtype (Dream), as `dllm_jax.layers.apply_rope` does.
Returns (q [B, n, Hq, D] rotated, k_cache, v_cache).

``qkv`` may also be the projection's split-K partials, [S, B, n, (Hq + 2 Hkv) * D] fp32 (`linear_partials`: one
batched GEMM), with the projection's ``bias`` [(Hq + 2 Hkv) * D] or None: the kernel then forms the projection
output itself, round(sum of the partials + bias) in the activation dtype (``out_dtype``), exactly what the GEMM's
epilogue would have written (`projection_from_partials`). At a block step's 32 rows XLA splits the q/k/v GEMM's K
and reduces the partials in the kernels that rotate and write (three per layer); taking the partials here leaves
one: the default GPU block step's path.

Grid: one program per (token, block of heads); heads are tile rows, so any head count works (rows past the last
head are masked).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._util import check_pow2, is_pow2

try:  # Triton lowering (deprecated since jax 0.11 but present in 0.11.2).
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None


@dataclasses.dataclass(frozen=True, slots=True)
class RopeBlocks:
    """block_h: heads per program (a power of two); num_warps: Triton warps per program."""

    block_h: int = 16
    num_warps: int = 4

    def __post_init__(self):
        check_pow2("RopeBlocks", "block_h", self.block_h, 64)
        check_pow2("RopeBlocks", "num_warps", self.num_warps, 16)


def linear_partials(x: jax.Array, w: jax.Array, splits: int) -> jax.Array:
    """x [M, K] @ w [K, N] as `splits` fp32 partial products [splits, M, N] over consecutive K chunks (one batched
    GEMM; their sum is x @ w with fp32 accumulation). K must be a multiple of splits."""
    m, k = x.shape
    if w.ndim != 2 or w.shape[0] != k or splits < 1 or k % splits:
        raise ValueError(
            f"linear_partials: need x [M, K], w [K, N] and K % splits == 0, got x {x.shape}, w {w.shape}, "
            f"splits={splits}"
        )
    return jnp.einsum(
        "msk,skn->smn",
        x.reshape(m, splits, k // splits),
        w.reshape(splits, k // splits, w.shape[1]),
        preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST if x.dtype == jnp.float32 else lax.Precision.DEFAULT,
    )


def projection_from_partials(partials: jax.Array, bias: jax.Array | None, dtype) -> jax.Array:
    """[S, ..., N] fp32 split-K partials (+ bias [N]) -> the projection output in dtype: one rounding of the fp32 sum,
    as `dllm_jax.layers.Linear` rounds (bias added in fp32 before it). What the kernel forms from partials."""
    y = partials.sum(axis=0)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype)


def _rotate(x: jax.Array, rot: jax.Array, cos: jax.Array, sin: jax.Array, rope_fp32: bool, dtype) -> jax.Array:
    """x * cos + rotate_half(x) * sin with `apply_rope`'s roundings; rot is rotate_half(x)."""
    if rope_fp32:
        return (x.astype(jnp.float32) * cos + rot.astype(jnp.float32) * sin).astype(dtype)
    c, s = cos.astype(dtype), sin.astype(dtype)
    a = (x.astype(jnp.float32) * c.astype(jnp.float32)).astype(dtype)
    b = (rot.astype(jnp.float32) * s.astype(jnp.float32)).astype(dtype)
    return (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(dtype)


def _rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def rope_kv_write_reference(
    qkv,
    cos,
    sin,
    k_cache,
    v_cache,
    offset,
    write_mask=None,
    *,
    q_heads: int,
    kv_heads: int,
    rope_fp32: bool,
    bias=None,
    out_dtype=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Plain jnp: split, rotate q and k, keep the old K/V where write_mask is False, dynamic_update_slice. qkv [S, B,
    n, W] fp32: split-K partials, summed (+ bias) and rounded to out_dtype first."""
    if qkv.ndim == 4:
        qkv = projection_from_partials(qkv, bias, out_dtype)
    b, n, _ = qkv.shape
    d = k_cache.shape[-1]
    q, k, v = jnp.split(qkv, [q_heads * d, (q_heads + kv_heads) * d], axis=-1)
    q, k, v = q.reshape(b, n, q_heads, d), k.reshape(b, n, kv_heads, d), v.reshape(b, n, kv_heads, d)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    q = _rotate(q, _rotate_half(q), c, s, rope_fp32, qkv.dtype)
    k = _rotate(k, _rotate_half(k), c, s, rope_fp32, qkv.dtype).astype(k_cache.dtype)
    v = v.astype(v_cache.dtype)
    offset = jnp.asarray(offset, jnp.int32)
    if write_mask is not None:
        old_k = jax.lax.dynamic_slice_in_dim(k_cache, offset, n, axis=1)
        old_v = jax.lax.dynamic_slice_in_dim(v_cache, offset, n, axis=1)
        wm = write_mask[:, :, None, None]
        k, v = jnp.where(wm, k, old_k), jnp.where(wm, v, old_v)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k, (0, offset, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, offset, 0, 0))
    return q, k_cache, v_cache


def _kernel(
    meta_ref,
    qkv_ref,
    cos_ref,
    sin_ref,
    mask_ref,
    *refs,
    n: int,
    s_len: int,
    q_heads: int,
    kv_heads: int,
    d: int,
    block_h: int,
    rope_fp32: bool,
    parts: int,
    with_bias: bool,
    dtype,
):
    bias_ref = refs[0] if with_bias else None
    kc_in, vc_in, q_ref, kc_ref, vc_ref = refs[with_bias:]
    del kc_in, vc_in  # aliased to kc_ref / vc_ref: only the written slots change
    token = pl.program_id(0)  # b * n + t
    hb = pl.program_id(1)
    row = token // n
    t = token - row * n
    offset = meta_ref[0]
    heads = hb * block_h + jnp.arange(block_h, dtype=jnp.int32)[:, None]  # [block_h, 1]
    half = d // 2
    lane = jnp.arange(half, dtype=jnp.int32)[None, :]  # [1, D/2]: one half of a head
    total = q_heads + 2 * kv_heads
    full = jnp.zeros((block_h, half), jnp.int32)  # index and mask arrays all get the tile's full shape
    heads, lane = heads + full, lane + full
    live = heads < total
    tok = full + token

    def projection(col):
        if not parts:
            return plgpu.load(qkv_ref.at[tok, col], mask=live, other=0.0)
        y = plgpu.load(qkv_ref.at[0, tok, col], mask=live, other=0.0)  # split-K partials: the GEMM's epilogue here
        for p in range(1, parts):
            y = y + plgpu.load(qkv_ref.at[p, tok, col], mask=live, other=0.0)
        if with_bias:
            y = y + plgpu.load(bias_ref.at[col], mask=live, other=0.0).astype(jnp.float32)
        return y.astype(dtype)

    # Each head as its two halves, each read once: rotate_half([x1, x2]) = [-x2, x1], so the rotated head is
    # [x1 cos1 - x2 sin1, x2 cos2 + x1 sin2] with apply_rope's roundings (-x2 is an exact negation).
    x1 = projection(heads * d + lane)
    x2 = projection(heads * d + half + lane)
    cos1, cos2 = plgpu.load(cos_ref.at[tok, lane]), plgpu.load(cos_ref.at[tok, lane + half])  # the token's row
    sin1, sin2 = plgpu.load(sin_ref.at[tok, lane]), plgpu.load(sin_ref.at[tok, lane + half])
    neg_x2 = (-x2.astype(jnp.float32)).astype(dtype)
    rot1 = _rotate(x1, neg_x2, cos1, sin1, rope_fp32, dtype)
    rot2 = _rotate(x2, x1, cos2, sin2, rope_fp32, dtype)
    is_q = heads < q_heads
    is_k = (heads >= q_heads) & (heads < q_heads + kv_heads)
    is_v = (heads >= q_heads + kv_heads) & (heads < total)
    written = mask_ref[token] != 0
    slot = full + (row * s_len + offset + t)

    def column(first_head, ok, width, second: bool):
        # a masked lane's column goes past the row (never a negative one, which the interpreter would wrap onto
        # a live column of the same store)
        return jnp.where(ok, (heads - first_head) * d + lane + (half if second else 0), width)

    is_k, is_v = is_k & written, is_v & written
    for second, rotated, raw in ((False, rot1, x1), (True, rot2, x2)):
        plgpu.store(q_ref.at[tok, column(0, is_q, q_heads * d, second)], rotated, mask=is_q)
        plgpu.store(
            kc_ref.at[slot, column(q_heads, is_k, kv_heads * d, second)], rotated.astype(kc_ref.dtype), mask=is_k
        )
        plgpu.store(
            vc_ref.at[slot, column(q_heads + kv_heads, is_v, kv_heads * d, second)], raw.astype(vc_ref.dtype), mask=is_v
        )


def _check(qkv, cos, sin, k_cache, v_cache, write_mask, q_heads, kv_heads, bias=None, out_dtype=None):
    def shape(a):
        return f"{a.dtype}{tuple(a.shape)}"

    width = (q_heads + 2 * kv_heads) * (k_cache.shape[-1] if k_cache.ndim == 4 else 0)
    if qkv.ndim == 4:  # split-K partials
        if qkv.dtype != jnp.float32 or out_dtype is None:
            raise ValueError(
                f"rope_kv_write: split-K partials must be float32 [S, B, n, W] with an out_dtype, got "
                f"{shape(qkv)}, out_dtype={out_dtype}"
            )
        if bias is not None and bias.shape != (width,):
            raise ValueError(f"rope_kv_write: bias must be [(Hq + 2 Hkv) * D] = [{width}], got {shape(bias)}")
        qkv = jax.ShapeDtypeStruct(qkv.shape[1:], out_dtype)
    elif bias is not None or out_dtype is not None:
        raise ValueError(
            "rope_kv_write: bias and out_dtype apply to split-K partials [S, B, n, W] only (a bf16 "
            "projection output already has its bias)"
        )

    if k_cache.ndim != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"rope_kv_write: caches must be two equal [B, S, Hkv, D] arrays, got k_cache "
            f"{shape(k_cache)}, v_cache {shape(v_cache)}"
        )
    b, s_len, hkv, d = k_cache.shape
    if hkv != kv_heads or q_heads % kv_heads:
        raise ValueError(
            f"rope_kv_write: kv_heads={kv_heads} must match the cache's {hkv} heads and divide q_heads={q_heads}"
        )
    if d % 2 or not is_pow2(d):
        raise ValueError(f"rope_kv_write: head_dim must be an even power of two (one register row), got {d}")
    if qkv.ndim != 3 or qkv.shape[0] != b or qkv.shape[2] != (q_heads + 2 * kv_heads) * d:
        raise ValueError(
            f"rope_kv_write: qkv must be [B={b}, n, (Hq + 2 Hkv) * D = {(q_heads + 2 * kv_heads) * d}], "
            f"got {shape(qkv)}"
        )
    n = qkv.shape[1]
    if not 1 <= n <= s_len:
        raise ValueError(f"rope_kv_write: the window (n={n}) must fit the cache (S={s_len})")
    for name, a in (("cos", cos), ("sin", sin)):
        if a.shape != (b, n, d):
            raise ValueError(f"rope_kv_write: {name} must be [B, n, D] = {(b, n, d)}, got {shape(a)}")
    if write_mask is not None and write_mask.shape != (b, n):
        raise ValueError(f"rope_kv_write: write_mask must be [B, n] = {(b, n)}, got {shape(write_mask)}")
    return b, n, s_len, d


@functools.partial(jax.jit, static_argnames=("q_heads", "kv_heads", "rope_fp32", "out_dtype", "blocks", "interpret"))
def rope_kv_write(
    qkv: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    offset: jax.Array | int,
    write_mask: jax.Array | None = None,
    *,
    q_heads: int,
    kv_heads: int,
    rope_fp32: bool,
    bias: jax.Array | None = None,
    out_dtype=None,
    blocks: RopeBlocks | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rotated q [B, n, Hq, D] and the caches with the window's rotated k and its v written at `offset` (see the
    module docstring). qkv [S, B, n, W] fp32: the projection's split-K partials (bias: its bias or None; out_dtype:
    the activation dtype). Under an outer jit whose caches are not used after this call (a layer loop's carry) XLA
    updates them in place; called on its own it writes into copies (nothing is donated)."""
    b, n, s_len, d = _check(qkv, cos, sin, k_cache, v_cache, write_mask, q_heads, kv_heads, bias, out_dtype)
    parts = qkv.shape[0] if qkv.ndim == 4 else 0
    dtype = jnp.dtype(out_dtype) if parts else qkv.dtype
    bs = blocks or RopeBlocks()
    total = q_heads + 2 * kv_heads
    offset = jnp.clip(jnp.asarray(offset, jnp.int32), 0, s_len - n).reshape(1)
    mask = jnp.ones((b * n,), jnp.int32) if write_mask is None else write_mask.reshape(b * n).astype(jnp.int32)
    kc = k_cache.reshape(b * s_len, kv_heads * d)  # row-major: free reshapes, the aliasing holds through them
    vc = v_cache.reshape(b * s_len, kv_heads * d)
    kernel = functools.partial(
        _kernel,
        n=n,
        s_len=s_len,
        q_heads=q_heads,
        kv_heads=kv_heads,
        d=d,
        block_h=bs.block_h,
        rope_fp32=rope_fp32,
        parts=parts,
        with_bias=bias is not None,
        dtype=dtype,
    )
    qkv_rows = qkv.reshape(parts, b * n, total * d) if parts else qkv.reshape(b * n, total * d)
    bias_args = [] if bias is None else [bias]

    def whole(shape):
        return pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))

    q, kc, vc = pl.pallas_call(
        kernel,
        grid=(b * n, pl.cdiv(total, bs.block_h)),
        in_specs=[whole((1,)), whole(qkv_rows.shape), whole((b * n, d)), whole((b * n, d)), whole((b * n,))]
        + [whole((total * d,))] * len(bias_args)
        + [whole(kc.shape), whole(vc.shape)],
        out_specs=[whole((b * n, q_heads * d)), whole(kc.shape), whole(vc.shape)],
        out_shape=[
            jax.ShapeDtypeStruct((b * n, q_heads * d), dtype),
            jax.ShapeDtypeStruct(kc.shape, kc.dtype),
            jax.ShapeDtypeStruct(vc.shape, vc.dtype),
        ],
        input_output_aliases={5 + len(bias_args): 1, 6 + len(bias_args): 2},
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=1),
        interpret=interpret,
        name="rope_kv_write",
    )(
        offset,
        qkv_rows,
        cos.reshape(b * n, d).astype(jnp.float32),
        sin.reshape(b * n, d).astype(jnp.float32),
        mask,
        *bias_args,
        kc,
        vc,
    )
    return q.reshape(b, n, q_heads, d), kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)
