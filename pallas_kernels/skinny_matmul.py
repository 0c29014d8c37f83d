"""Weight-streaming GEMM for few rows (Pallas, Triton lowering): y[M, N] = x[M, K] @ w[K, N] (+ bias).

Why: a diffusion block step multiplies 32 tokens per row by every weight matrix, so at small batch the step is
pure weight streaming (issue 7). XLA's GEMMs at M = 32 stream weights at ~2.2 TB/s on an H200 (bench/NOTES.md);
the HBM floor is ~4.3 TB/s. This kernel gives every program one [K-chunk, block_n] strip of the weight and loops
over it in block_k steps (Triton software-pipelines the loop over `num_stages` buffers, which keeps enough bytes in
flight), with all M rows of x resident. When N / block_n programs are too few to fill the GPU, K is split over a
second grid axis and the fp32 partial sums are added by a small XLA epilogue.

Layout: x [M, K] (bf16; fp32 accepted), w [K, N] (flax's kernel layout, the engine's weights), bias [N] or None.
Output in x.dtype, accumulated in fp32, rounded once (bias added before the rounding), like `dllm_jax.layers.Linear`.
M is padded to a power of two >= 16 (the MMA minimum) by the wrapper; K must be a multiple of block_k * split_k
and N of block_n (every LLaDA / Dream projection is a multiple of 128 in both).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

_NUM_SMS = 132  # H200
# Rows up to which `supported` says yes: on the H200 the kernel beats XLA at M = 32 and 64 but loses at M = 256
# (its M blocks re-read the weights; bench/results/skinny_matmul_h200.json). The kernel itself accepts any M.
MAX_M = 64


def _is_pow2(x: int) -> bool:
  return isinstance(x, int) and x >= 1 and (x & (x - 1)) == 0


def _next_pow2(x: int) -> int:
  return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
  """Tiles of the weight-streaming GEMM.

  block_n: weight columns per program (power of two >= 16).
  block_k: K rows of the weight per loop step (power of two >= 16).
  split_k: grid programs along K (>= 1); K must be a multiple of block_k * split_k.
  block_m: x rows per program (power of two >= 16, or None = all of M in one program).
  """
  block_n: int = 64
  block_k: int = 128
  split_k: int = 1
  block_m: int | None = None
  num_warps: int = 4
  num_stages: int = 4

  def __post_init__(self):
    for name in ("block_n", "block_k"):
      v = getattr(self, name)
      if not _is_pow2(v) or v < 16:
        raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {v!r}")
    if self.block_m is not None and (not _is_pow2(self.block_m) or self.block_m < 16):
      raise ValueError(f"BlockSizes.block_m must be None or a power of two >= 16, got {self.block_m!r}")
    if not isinstance(self.split_k, int) or self.split_k < 1:
      raise ValueError(f"BlockSizes.split_k must be an int >= 1, got {self.split_k!r}")
    if not _is_pow2(self.num_warps) or self.num_warps > 16:
      raise ValueError(f"BlockSizes.num_warps must be a power of two <= 16, got {self.num_warps!r}")
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"BlockSizes.num_stages must be >= 1, got {self.num_stages!r}")

  @classmethod
  def get_default(cls, m: int, k: int, n: int) -> "BlockSizes":
    """Split K until ~2 waves of the GPU, each split streaming >= 8 weight tiles (>= 4 for narrow N, which would
    otherwise leave most SMs idle: Dream's 512-wide K/V projections). H200 measurements: bench/NOTES.md."""
    mp = max(16, _next_pow2(m))
    block_m = None if mp <= 64 else 64
    block_n = 64 if n % 64 == 0 else 32 if n % 32 == 0 else 16
    narrow = n // block_n < 32
    if narrow and n % 32 == 0:
      block_n = 32
    block_k = 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32 if k % 32 == 0 else 16
    programs = n // block_n
    k_tiles = k // block_k
    split = 1
    for s in range(2, k_tiles + 1):
      if programs * split >= 2 * _NUM_SMS:
        break
      if k_tiles % s == 0 and k_tiles // s >= (4 if narrow else 8):
        split = s
    return cls(block_n=block_n, block_k=block_k, split_k=split, block_m=block_m)


def _kernel(*refs, n_steps: int, block_k: int, has_bias: bool, stacked: bool):
  if stacked:  # w_ref / b_ref hold every layer; the layer is read at run time (no sliced copy of the weights)
    layer_ref, *refs = refs
    layer = layer_ref[0]
  x_ref, w_ref, *rest = refs
  if has_bias:
    b_ref, o_ref = rest
  else:
    (o_ref,) = rest

  def step(i, acc):
    xs = x_ref[:, pl.ds(i * block_k, block_k)]
    if stacked:
      ws = w_ref[layer, pl.ds(i * block_k, block_k), :]
    else:
      ws = w_ref[pl.ds(i * block_k, block_k), :]
    return acc + plgpu.dot(xs, ws)  # fp32 accumulation

  acc = jnp.zeros(o_ref.shape, jnp.float32)
  acc = lax.fori_loop(0, n_steps, step, acc)
  if has_bias:
    bias = b_ref[layer, :] if stacked else b_ref[...]
    acc = acc + bias.astype(jnp.float32)[None, :]
  o_ref[...] = acc.astype(o_ref.dtype)


def _validate(x, w, bias, layer, bs: BlockSizes):
  stacked = w.ndim == 3
  if x.ndim != 2 or w.ndim not in (2, 3):
    raise ValueError("skinny_matmul expects x [M, K] and w [K, N] (or stacked [L, K, N] with `layer`), got "
                     f"x{tuple(x.shape)} w{tuple(w.shape)}")
  if stacked != (layer is not None):
    raise ValueError("skinny_matmul: `layer` is required with stacked weights [L, K, N] and only with them")
  if layer is not None and jnp.shape(layer) != ():
    raise ValueError(f"skinny_matmul: `layer` must be a scalar, got shape {jnp.shape(layer)}")
  m, k = x.shape
  k2, n = w.shape[-2:]
  if k != k2:
    raise ValueError(f"skinny_matmul: K mismatch, x{tuple(x.shape)} vs w{tuple(w.shape)}")
  if m < 1:
    raise ValueError("skinny_matmul: x has no rows")
  want = w.shape[:-2] + (n,)
  if bias is not None and bias.shape != want:
    raise ValueError(f"skinny_matmul: bias must be {list(want)}, got {tuple(bias.shape)}")
  if n % bs.block_n:
    raise ValueError(f"skinny_matmul: N={n} must be a multiple of block_n={bs.block_n}")
  if k % (bs.block_k * bs.split_k):
    raise ValueError(f"skinny_matmul: K={k} must be a multiple of block_k*split_k={bs.block_k}*{bs.split_k}")


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def skinny_matmul(x: jax.Array, w: jax.Array, bias: jax.Array | None = None, layer: jax.Array | None = None, *,
                  block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
  """x [M, K] @ w [K, N] (+ bias [N]) -> [M, N] in x.dtype, fp32 accumulation, one rounding.

  Stacked form: w [L, K, N], bias [L, N], layer an int32 scalar: uses layer `layer`'s weights. Inside a scan
  over layers this avoids the copy XLA makes when a dynamic slice of the stacked weights feeds a custom call.
  """
  m, k = x.shape
  n = w.shape[-1]
  bs = block_sizes or BlockSizes.get_default(m, k, n)
  _validate(x, w, bias, layer, bs)
  stacked = w.ndim == 3
  mp = max(16, _next_pow2(m))
  bm = min(bs.block_m or mp, mp)
  if mp != m:
    x = jnp.pad(x, ((0, mp - m), (0, 0)))
  w = w.astype(x.dtype)
  kc = k // bs.split_k
  split = bs.split_k > 1
  out_dtype = jnp.float32 if split else x.dtype
  has_bias = bias is not None and not split
  kernel = functools.partial(_kernel, n_steps=kc // bs.block_k, block_k=bs.block_k, has_bias=has_bias,
                             stacked=stacked)
  # Grid: M blocks fastest, so the programs that share a weight strip run together (L2 reuse).
  grid = (mp // bm, n // bs.block_n, bs.split_k)
  in_specs, args = [], []
  if stacked:
    n_layers = w.shape[0]
    in_specs.append(pl.BlockSpec((1,), lambda i, j, s: (0,)))
    args.append(jnp.reshape(jnp.clip(jnp.asarray(layer, jnp.int32), 0, n_layers - 1), (1,)))
    w_spec = pl.BlockSpec((n_layers, kc, bs.block_n), lambda i, j, s: (0, s, j))
    b_spec = pl.BlockSpec((n_layers, bs.block_n), lambda i, j, s: (0, j))
  else:
    w_spec = pl.BlockSpec((kc, bs.block_n), lambda i, j, s: (s, j))
    b_spec = pl.BlockSpec((bs.block_n,), lambda i, j, s: (j,))
  in_specs += [pl.BlockSpec((bm, kc), lambda i, j, s: (i, s)), w_spec]
  args += [x, w]
  if has_bias:
    in_specs.append(b_spec)
    args.append(bias)
  out = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, bm, bs.block_n), lambda i, j, s: (s, i, j)),
      out_shape=jax.ShapeDtypeStruct((bs.split_k, mp, n), out_dtype),
      compiler_params=None if plgpu is None else plgpu.CompilerParams(
          num_warps=bs.num_warps, num_stages=bs.num_stages),
      interpret=interpret,
      name="skinny_matmul",
  )(*args)
  if split:
    y = out.sum(axis=0)
    if bias is not None:
      y = y + (bias[layer] if stacked else bias).astype(jnp.float32)
    out = y.astype(x.dtype)
  else:
    out = out[0]
  return out[:m]


def skinny_matmul_reference(x: jax.Array, w: jax.Array, bias: jax.Array | None = None) -> jax.Array:
  """Plain jnp: fp32 matmul at the highest precision, bias in fp32, one rounding to x.dtype."""
  y = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(x.dtype)


def supported(m: int, k: int, n: int) -> bool:
  """Whether `skinny_matmul` with default blocks applies and was measured faster than XLA at this M."""
  return 1 <= m <= MAX_M and k % 16 == 0 and n % 16 == 0
