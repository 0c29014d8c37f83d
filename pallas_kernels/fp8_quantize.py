"""Activation quantisers of the FP8 FFN, fused with their producers (Pallas, Triton lowering).

The FP8 GEMM (`fp8_matmul.py`) wants its activations as e4m3 rows padded to the CTA tile, xq [Mp, K], and their
1x128 scales transposed, xs_t [K/128, Mp] (one TMA row of scales per K step). Built from plain jnp, the two FP8
inputs of a layer cost ~7 small XLA kernels (RMSNorm, two amax reductions, four pads, a transpose: 0.33 ms of a
4.55 ms LLaDA-8B batch-1 block step on an H200). Here each is one kernel:

  * `rmsnorm_quantize(x, weight, residual=)`: the attention residual add (x + residual in x.dtype, also written
    out: the FFN's own residual), the FFN's RMSNorm (fp32 statistics, rounded to x.dtype, times the weight,
    exactly as `dllm_jax.layers.RMSNorm`) then the 1x128 quantisation of `fp8_matmul.quantize_activations`.
  * `swiglu_quantize_t(gu)`: the sum of the gate/up GEMM's split-K partials (rounded to bf16, as the GEMM's own
    bf16 output would be), silu(gate) * up in fp32, then the same quantisation.

And `splitk_residual_add(partials, x)`: the down GEMM's split-K partials summed, rounded and added to the
residual stream, the FFN's last step.

Rows M..Mp of the quantisers' outputs are zeros with scale 1 (the GEMM's pad rows; their outputs are sliced
away). Each has a pure-jnp `*_reference` with the same outputs; on the CPU the kernels run with interpret=True (tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._util import check_pow2
from pallas_kernels.fp8_matmul import FP8, GROUP, quantize_activations, quantize_rows, swiglu_quantize

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None


@dataclasses.dataclass(frozen=True, slots=True)
class QuantizeBlocks:
    """block_m: rows per program (a power of two; the padded row count must be a multiple of it). groups (SwiGLU
    only): 128-wide quantisation groups per program, one after the other (F/128 must be a multiple of it)."""

    block_m: int = 1
    num_warps: int = 4
    groups: int = 1

    def __post_init__(self):
        check_pow2("QuantizeBlocks", "block_m", self.block_m, 128)
        check_pow2("QuantizeBlocks", "num_warps", self.num_warps, 16)
        if not isinstance(self.groups, int) or not 1 <= self.groups <= 16:
            raise ValueError(f"QuantizeBlocks.groups must be an int in [1, 16], got {self.groups!r}")

    @classmethod
    def for_swiglu(cls, m_pad: int) -> "QuantizeBlocks":
        # 8-row tiles at block-step sizes (pad-row tiles skip their loads), 64 rows once M is large; several groups
        # per program never won (PERFORMANCE.md section 7).
        return cls(block_m=min(8 if m_pad <= 256 else 64, m_pad & -m_pad), num_warps=4)

    @classmethod
    def for_rmsnorm(cls, k: int, m: int) -> "QuantizeBlocks":
        # one row per program; 16 warps for rows of >= 2048 at block-step sizes (<= 256 rows), 4 at block starts
        # (thousands of rows; not swept) (PERFORMANCE.md section 7).
        return cls(block_m=1, num_warps=16 if k >= 2048 and m <= 256 else 4)


def _check_pad(m: int, m_pad: int, what: str):
    if m < 1 or m_pad < m:
        raise ValueError(f"{what}: m_pad={m_pad} must be >= the row count {m} (>= 1)")


# ------------------------------------------------------------------------------------------ RMSNorm
def _layout(q: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    return q, scale.T  # the GEMM's layouts: xq [Mp, K], xs_t [K/128, Mp]


def rmsnorm_quantize_reference(
    x: jax.Array, weight: jax.Array, eps: float, m_pad: int, residual: jax.Array | None = None
) -> tuple[jax.Array, ...]:
    """x [M, K], weight [K] -> (xq [m_pad, K] e4m3, xs_t [K/128, m_pad] fp32): `dllm_jax.layers.RMSNorm`'s
    numerics, zero pad rows, then `fp8_matmul.quantize_activations`. With residual [M, K]: of x + residual (in
    x.dtype), which is returned third."""
    m, k = x.shape
    if residual is not None:
        x = x + residual.astype(x.dtype)
    xf = x.astype(jnp.float32)
    h = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype) * weight.astype(x.dtype)
    out = _layout(*quantize_activations(jnp.pad(h, ((0, m_pad - m), (0, 0)))))
    return out if residual is None else (*out, x)


def _rmsnorm_quantize_kernel(x_ref, w_ref, *refs, m: int, k: int, eps: float, with_residual: bool):
    """One row per program, held as a [groups (padded to a power of two), 128] tile: the statistic is one
    reduction and the 1x128 amaxes one reduction along the lanes (a loop of per-group reductions synchronised the
    warps once per group: 21 us per LLaDA-8B row block on the H200 instead of a few)."""
    i = pl.program_id(0)
    groups = k // GROUP
    gp = 1 << (groups - 1).bit_length()
    g = jnp.arange(gp, dtype=jnp.int32)[:, None]
    lane = jnp.arange(GROUP, dtype=jnp.int32)[None, :]
    cols = g * GROUP + lane  # [gp, 128] column of each element
    ok = g < groups
    row = jnp.zeros_like(cols) + i
    live = ok & (i < m)
    if with_residual:  # x + residual in x's dtype (the model's residual stream), written out for the FFN's add
        r_ref, q_ref, s_ref, sum_ref = refs
        x = (
            plgpu.load(x_ref.at[row, cols], mask=live, other=0.0).astype(jnp.float32)
            + plgpu.load(r_ref.at[row, cols], mask=live, other=0.0).astype(jnp.float32)
        ).astype(x_ref.dtype)
        plgpu.store(sum_ref.at[row, cols], x, mask=live)
        x = x.astype(jnp.float32)
    else:
        q_ref, s_ref = refs
        x = plgpu.load(x_ref.at[row, cols], mask=live, other=0.0).astype(jnp.float32)
    w = plgpu.load(w_ref.at[cols], mask=ok, other=0.0)
    inv = lax.rsqrt(jnp.sum(x * x) / k + eps)
    h = (x * inv).astype(x_ref.dtype) * w.astype(x_ref.dtype)
    q, scale = quantize_rows(h.astype(jnp.float32))
    plgpu.store(q_ref.at[jnp.zeros_like(cols), cols], q, mask=ok)
    plgpu.store(s_ref.at[g, jnp.zeros_like(g)], scale[:, None], mask=ok)


def rmsnorm_quantize(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    m_pad: int,
    residual: jax.Array | None = None,
    blocks: QuantizeBlocks | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """RMSNorm then 1x128 e4m3 quantisation, in the FP8 GEMM's layout.

    x [M, K] (bf16/fp32), weight [K] -> (xq [m_pad, K] e4m3, xs_t [K/128, m_pad] fp32). With residual [M, K]
    (the attention output projection): of s = x + residual in x.dtype, returned third (one kernel instead of an
    XLA add before this one). blocks None: `QuantizeBlocks.for_rmsnorm`, resolved here, outside the jitted body (a
    patched default is a new program, never a cached trace of the old one)."""
    bs = blocks or QuantizeBlocks.for_rmsnorm(x.shape[-1], x.shape[0])  # one row per program
    return _rmsnorm_quantize(x, weight, eps=eps, m_pad=m_pad, residual=residual, blocks=bs, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "m_pad", "blocks", "interpret"))
def _rmsnorm_quantize(x, weight, *, eps: float, m_pad: int, residual, blocks: QuantizeBlocks, interpret: bool):
    if x.ndim != 2 or weight.shape != (x.shape[-1],):
        raise ValueError(f"rmsnorm_quantize: expected x [M, K] and weight [K], got {x.shape} and {weight.shape}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"rmsnorm_quantize: residual must match x {x.dtype}{x.shape}, got {residual.dtype}{residual.shape}"
        )
    m, k = x.shape
    if k % GROUP:
        raise ValueError(f"rmsnorm_quantize: K={k} must be a multiple of {GROUP}")
    _check_pad(m, m_pad, "rmsnorm_quantize")
    bs = blocks
    if bs.block_m != 1:
        raise ValueError(f"rmsnorm_quantize: one row per program (block_m=1), got block_m={bs.block_m}")
    with_residual = residual is not None
    kernel = functools.partial(_rmsnorm_quantize_kernel, m=m, k=k, eps=float(eps), with_residual=with_residual)
    whole = pl.BlockSpec((m, k), lambda i: (0, 0))
    return pl.pallas_call(
        kernel,
        grid=(m_pad // bs.block_m,),
        in_specs=[whole, pl.BlockSpec((k,), lambda i: (0,))] + [whole] * with_residual,
        out_specs=[
            pl.BlockSpec((bs.block_m, k), lambda i: (i, 0)),
            pl.BlockSpec((k // GROUP, bs.block_m), lambda i: (0, i)),
        ]
        + [whole] * with_residual,
        out_shape=[jax.ShapeDtypeStruct((m_pad, k), FP8), jax.ShapeDtypeStruct((k // GROUP, m_pad), jnp.float32)]
        + [jax.ShapeDtypeStruct((m, k), x.dtype)] * with_residual,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=1),
        interpret=interpret,
        name="rmsnorm_quantize",
    )(x, weight, *([residual] if with_residual else []))


# ------------------------------------------------------------------------------------------- SwiGLU
def _as_partials(gu: jax.Array) -> jax.Array:
    if gu.ndim == 2:
        return gu[None]
    if gu.ndim != 3:
        raise ValueError(f"swiglu_quantize_t: expected gu [Mp, 2F] or split-K partials [S, Mp, 2F], got {gu.shape}")
    return gu


def swiglu_quantize_t_reference(gu: jax.Array) -> tuple[jax.Array, jax.Array]:
    """gu [Mp, 2F] or [S, Mp, 2F] (gate | up) -> (aq [Mp, F] e4m3, as_t [F/128, Mp] fp32): the partials summed in
    fp32 and rounded to bf16 (the GEMM's own output), then `fp8_matmul.swiglu_quantize`."""
    summed = _as_partials(gu).astype(jnp.float32).sum(axis=0).astype(jnp.bfloat16)
    return _layout(*swiglu_quantize(summed))


def _swiglu_quantize_kernel(p_ref, q_ref, s_ref, *, splits: int, f: int, block_m: int, live_rows: int, groups: int):
    i, g = pl.program_id(0), pl.program_id(1)
    lrows = jnp.arange(block_m, dtype=jnp.int32)[:, None]
    lane = jnp.arange(GROUP, dtype=jnp.int32)[None, :]
    live = i * block_m + lrows < live_rows  # pad rows are not read (zeros in, zeros with scale 1 out)

    def part(j, col0):
        return plgpu.load(p_ref.at[j, lrows, col0 + lane], mask=live, other=0.0).astype(jnp.float32)

    for t in range(groups):  # this program's quantisation groups, independent of each other
        c0 = (g * groups + t) * GROUP
        gate = part(0, c0)
        up = part(0, f + c0)
        for j in range(1, splits):  # split-K partials: summed in fp32 in order, as XLA's sum over the split axis
            gate = gate + part(j, c0)
            up = up + part(j, f + c0)
        gate = gate.astype(jnp.bfloat16).astype(jnp.float32)  # the GEMM's bf16 output
        up = up.astype(jnp.bfloat16).astype(jnp.float32)
        a = gate * jax.nn.sigmoid(gate) * up
        q, scale = quantize_rows(a)
        q_ref[:, pl.ds(t * GROUP, GROUP)] = q
        s_ref[pl.ds(t, 1), :] = scale[None, :]


def swiglu_quantize_t(
    gu: jax.Array, *, live_rows: int | None = None, blocks: QuantizeBlocks | None = None, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """silu(gate) * up of the gate/up GEMM's output, quantised 1x128 in the FP8 GEMM's layout.

    gu: [Mp, 2F] (bf16) or split-K partials [S, Mp, 2F] (fp32) -> (aq [Mp, F] e4m3, as_t [F/128, Mp] fp32).
    live_rows: rows [live_rows, Mp) are the GEMM's pad rows: not read, written as zeros with scale 1. blocks None:
    `QuantizeBlocks.for_swiglu`, resolved here, outside the jitted body."""
    bs = blocks or QuantizeBlocks.for_swiglu(gu.shape[-2] if gu.ndim in (2, 3) else 1)  # bad shapes: refused inside
    return _swiglu_quantize_t(gu, live_rows=live_rows, blocks=bs, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("live_rows", "blocks", "interpret"))
def _swiglu_quantize_t(gu, *, live_rows: int | None, blocks: QuantizeBlocks, interpret: bool):
    p = _as_partials(gu)
    splits, mp, f2 = p.shape
    if f2 % (2 * GROUP):
        raise ValueError(f"swiglu_quantize_t: 2F={f2} must be a multiple of {2 * GROUP}")
    f = f2 // 2
    bs = blocks
    if mp % bs.block_m:
        raise ValueError(f"swiglu_quantize_t: rows={mp} must be a multiple of block_m={bs.block_m}")
    live = mp if live_rows is None else live_rows
    if not 0 <= live <= mp:
        raise ValueError(f"swiglu_quantize_t: live_rows={live_rows} must be in [0, {mp}]")
    gpp = bs.groups
    if (f // GROUP) % gpp:
        raise ValueError(f"swiglu_quantize_t: F/128={f // GROUP} must be a multiple of groups={gpp}")
    kernel = functools.partial(
        _swiglu_quantize_kernel, splits=splits, f=f, block_m=bs.block_m, live_rows=live, groups=gpp
    )
    return pl.pallas_call(
        kernel,
        grid=(mp // bs.block_m, f // GROUP // gpp),
        in_specs=[pl.BlockSpec((splits, bs.block_m, f2), lambda i, g: (0, i, 0))],
        out_specs=[
            pl.BlockSpec((bs.block_m, gpp * GROUP), lambda i, g: (i, g)),
            pl.BlockSpec((gpp, bs.block_m), lambda i, g: (g, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((mp, f), FP8), jax.ShapeDtypeStruct((f // GROUP, mp), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=1),
        interpret=interpret,
        name="swiglu_quantize",
    )(p)


# ------------------------------------------------------------------------------- split-K sum + residual
def splitk_residual_add_reference(partials: jax.Array, x: jax.Array) -> jax.Array:
    """x + the down GEMM's output: partials [S, Mp, d] fp32 summed in order, rounded to x.dtype (the GEMM's own
    output), added to x [M, d] (M <= Mp; pad rows dropped)."""
    y = partials.astype(jnp.float32).sum(axis=0)[: x.shape[0]].astype(x.dtype)
    return x + y


def _splitk_residual_add_kernel(p_ref, x_ref, o_ref, *, splits: int):
    y = p_ref[0]
    for j in range(1, splits):  # in order, as XLA's sum over the split axis
        y = y + p_ref[j]
    o_ref[...] = (x_ref[...].astype(jnp.float32) + y.astype(x_ref.dtype).astype(jnp.float32)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def splitk_residual_add(partials: jax.Array, x: jax.Array, *, interpret: bool = False) -> jax.Array:
    """The FP8 FFN's last step as one kernel: x [M, d] + sum of the down GEMM's split-K partials [S, Mp, d] (XLA
    made it two: a reduction, then the add, ~4 us per layer at block-step M on the H200)."""
    if partials.ndim != 3 or x.ndim != 2 or partials.shape[2] != x.shape[1] or partials.shape[1] < x.shape[0]:
        raise ValueError(
            f"splitk_residual_add: expected partials [S, Mp, d] and x [M <= Mp, d], got {partials.shape} and {x.shape}"
        )
    splits, _, d = partials.shape
    m = x.shape[0]
    if d % GROUP:
        raise ValueError(f"splitk_residual_add: d={d} must be a multiple of {GROUP}")
    # small tiles, many programs: 16 programs of 16 x 512 tiles at a block step lost to XLA (PERFORMANCE.md section 7)
    bm, bd = 8, GROUP
    return pl.pallas_call(
        functools.partial(_splitk_residual_add_kernel, splits=splits),
        grid=(pl.cdiv(m, bm), d // bd),
        in_specs=[pl.BlockSpec((splits, bm, bd), lambda i, j: (0, i, j)), pl.BlockSpec((bm, bd), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((bm, bd), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="splitk_residual_add",
    )(partials, x)
