"""Residual add + RMSNorm as one kernel (Pallas, Triton lowering).

A pre-norm layer adds each sublayer's output to the residual stream and normalises the sum for the next
sublayer: s = x + delta, h = RMSNorm(s) * weight. Here both are one kernel that reads x and delta once and writes s
and h (XLA's norm is a kernel of its own, ~2-5 us at a block step's 32-256 rows). It saves nothing in the model
after XLA's GEMMs (bench/NOTES.md v12): XLA fuses the add into the split-K reduction kernel of the GEMM that made
delta, which stays a kernel in front of this one. Used by the opt-in `dllm_jax/fused_layers.py`.

Numerics are `dllm_jax.layers.RMSNorm`'s on s = x + delta rounded to x.dtype: fp32 statistics, the normalised
row rounded to x.dtype, then times the weight in x.dtype. Only the order of the fp32 sum of squares may differ
from XLA's reduction (a last-bit difference that can flip a rounding of h).

Layout: x, delta [M, d] (bf16 or fp32), weight [d]. One program per `block_m` rows, each row held whole as a
[block_m, next_pow2(d)] tile (d up to 8192).

delta may also be a GEMM's split-K partials, [S, M, d] fp32 (`linear_partials`): the kernel sums them in fp32 and
rounds once to x.dtype (what the GEMM's own split-K reduction would have written), then adds: the reduction, the
residual add and the norm in one kernel. Measured slower than XLA's reduce + add and norm fusions at a block step's
M = 32 and 256 (bench/NOTES.md v14 item 3: 4.8-7.7 vs 3.1 us after LLaDA-8B's o_proj), so no default path uses it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Triton lowering (deprecated since jax 0.11 but present in 0.11.2).
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

MAX_WIDTH = 8192  # one row is one register tile; wider rows would spill


def _is_pow2(x: int) -> bool:
  return isinstance(x, int) and x >= 1 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True, slots=True)
class NormBlocks:
  """block_m: rows per program (a power of two); num_warps: Triton warps per program."""
  block_m: int = 1
  num_warps: int = 4

  def __post_init__(self):
    if not _is_pow2(self.block_m) or self.block_m > 64:
      raise ValueError(f"NormBlocks.block_m must be a power of two <= 64, got {self.block_m!r}")
    if not _is_pow2(self.num_warps) or self.num_warps > 16:
      raise ValueError(f"NormBlocks.num_warps must be a power of two <= 16, got {self.num_warps!r}")

  @classmethod
  def get_default(cls, m: int, d: int) -> "NormBlocks":
    # One row per program up to a block step's rows (each program is latency bound: more of them hide it);
    # 4 rows per program once there are thousands of rows (a block start), so programs are not too short.
    return cls(block_m=1 if m <= 1024 else 4, num_warps=4 if d <= 4096 else 8)


def linear_partials(x: jax.Array, w: jax.Array, splits: int) -> jax.Array:
  """x [M, K] @ w [K, N] as `splits` fp32 partial products [splits, M, N] over consecutive K chunks (one batched
  GEMM; their sum is x @ w with fp32 accumulation). K must be a multiple of splits."""
  m, k = x.shape
  if w.ndim != 2 or w.shape[0] != k or splits < 1 or k % splits:
    raise ValueError(f"linear_partials: need x [M, K], w [K, N] and K % splits == 0, got x {x.shape}, w {w.shape}, "
                     f"splits={splits}")
  return jnp.einsum("msk,skn->smn", x.reshape(m, splits, k // splits), w.reshape(splits, k // splits, w.shape[1]),
                    preferred_element_type=jnp.float32,
                    precision=lax.Precision.HIGHEST if x.dtype == jnp.float32 else lax.Precision.DEFAULT)


def projection_from_partials(partials: jax.Array, bias: jax.Array | None, dtype) -> jax.Array:
  """[S, ..., N] fp32 split-K partials (+ bias [N]) -> the projection output in dtype: one rounding of the fp32 sum,
  as `dllm_jax.layers.Linear` rounds (bias added in fp32 before it). The reference of both kernels that take
  partials (this one and `rope_kv_write`)."""
  y = partials.sum(axis=0)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(dtype)


def residual_rmsnorm_reference(x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float
                               ) -> tuple[jax.Array, jax.Array]:
  """(s, h): s = x + delta in x.dtype (x itself when delta is None), h = RMSNorm(s) * weight. delta [S, M, d]:
  split-K partials, summed in fp32 and rounded to x.dtype first."""
  if delta is not None:
    delta = projection_from_partials(delta, None, x.dtype) if delta.ndim == 3 else delta.astype(x.dtype)
  s = x if delta is None else x + delta
  sf = s.astype(jnp.float32)
  h = (sf * lax.rsqrt(jnp.mean(sf * sf, axis=-1, keepdims=True) + eps)).astype(x.dtype) * weight.astype(x.dtype)
  return s, h


def _kernel(x_ref, w_ref, *refs, m: int, d: int, block_m: int, width: int, eps: float, with_delta: bool,
            parts: int):
  i = pl.program_id(0)
  rows = i * block_m + jnp.arange(block_m, dtype=jnp.int32)[:, None]
  cols = jnp.arange(width, dtype=jnp.int32)[None, :]
  col_ok = cols < d
  live = (rows < m) & col_ok
  # Masked lanes keep their out-of-range addresses: clamping them onto the last column would make the
  # interpreter's masked store (a read-modify-write scatter) race with that column's real store.
  rows_b = jnp.zeros_like(cols) + rows
  cols_b = jnp.zeros_like(rows) + cols
  x = plgpu.load(x_ref.at[rows_b, cols_b], mask=live, other=0.0)
  if with_delta:
    delta_ref, s_ref, h_ref = refs
    if parts:  # split-K partials [S, M, d] fp32: summed in fp32, rounded once to x.dtype (the GEMM's output)
      delta = plgpu.load(delta_ref.at[0, rows_b, cols_b], mask=live, other=0.0)
      for p in range(1, parts):
        delta = delta + plgpu.load(delta_ref.at[p, rows_b, cols_b], mask=live, other=0.0)
      delta = delta.astype(x_ref.dtype)
    else:
      delta = plgpu.load(delta_ref.at[rows_b, cols_b], mask=live, other=0.0)
    s = (x.astype(jnp.float32) + delta.astype(jnp.float32)).astype(x_ref.dtype)
    plgpu.store(s_ref.at[rows_b, cols_b], s, mask=live)
  else:
    (h_ref,) = refs
    s = x
  w = plgpu.load(w_ref.at[cols[0]], mask=col_ok[0], other=0.0)
  sf = s.astype(jnp.float32)
  inv = lax.rsqrt(jnp.sum(sf * sf, axis=1, keepdims=True) / d + eps)
  h = (sf * inv).astype(x_ref.dtype) * w.astype(x_ref.dtype)[None, :]
  plgpu.store(h_ref.at[rows_b, cols_b], h.astype(h_ref.dtype), mask=live)


def _check(x, delta, weight):
  if x.ndim != 2 or weight.shape != (x.shape[-1],):
    raise ValueError(f"residual_rmsnorm: expected x [M, d] and weight [d], got x {x.dtype}{x.shape} and weight "
                     f"{weight.dtype}{weight.shape}")
  if delta is not None and delta.ndim == 3:
    if delta.shape[1:] != x.shape or delta.dtype != jnp.float32 or delta.shape[0] < 1:
      raise ValueError(f"residual_rmsnorm: split-K partials must be float32 [S, *x.shape] = [S, {x.shape[0]}, "
                       f"{x.shape[1]}], got {delta.dtype}{delta.shape}")
  elif delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
    raise ValueError(f"residual_rmsnorm: delta must match x {x.dtype}{x.shape} (or be float32 split-K partials "
                     f"[S, M, d]), got {delta.dtype}{delta.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"residual_rmsnorm: x must be floating point, got {x.dtype}")
  if x.shape[0] < 1 or not 1 <= x.shape[1] <= MAX_WIDTH:
    raise ValueError(f"residual_rmsnorm: need M >= 1 rows and 1 <= d <= {MAX_WIDTH}, got x {x.shape}")


@functools.partial(jax.jit, static_argnames=("eps", "blocks", "interpret"))
def residual_rmsnorm(x: jax.Array, delta: jax.Array | None, weight: jax.Array, *, eps: float,
                     blocks: NormBlocks | None = None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """x [M, d], delta [M, d] (or split-K partials [S, M, d] fp32) or None, weight [d] -> (s [M, d], h [M, d]) in
  x.dtype: s = x + delta (x itself when delta is None: the kernel then only normalises), h = RMSNorm(s) * weight.
  One kernel."""
  _check(x, delta, weight)
  m, d = x.shape
  bs = blocks or NormBlocks.get_default(m, d)
  width = 1 << (d - 1).bit_length()
  with_delta = delta is not None
  parts = delta.shape[0] if with_delta and delta.ndim == 3 else 0
  whole = pl.BlockSpec((m, d), lambda i: (0, 0))
  delta_spec = pl.BlockSpec((parts, m, d), lambda i: (0, 0, 0)) if parts else whole
  kernel = functools.partial(_kernel, m=m, d=d, block_m=bs.block_m, width=width, eps=float(eps),
                             with_delta=with_delta, parts=parts)
  outs = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(m, bs.block_m),),
      in_specs=[whole, pl.BlockSpec((d,), lambda i: (0,))] + [delta_spec] * with_delta,
      out_specs=[whole] * (1 + with_delta),
      out_shape=[jax.ShapeDtypeStruct((m, d), x.dtype)] * (1 + with_delta),
      compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=1),
      interpret=interpret,
      name="residual_rmsnorm",
  )(x, weight.astype(x.dtype), *([delta] if with_delta else []))
  return (outs[0], outs[1]) if with_delta else (x, outs[0])
