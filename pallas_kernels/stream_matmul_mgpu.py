"""Weight-streaming GEMM for few rows on Hopper (Pallas Mosaic GPU): y[M, N] = x[M, K] @ w[K, N].

Why: the Triton-lowered `skinny_matmul` tops out at 1.4-1.7 TB/s of weight bandwidth (bench/NOTES.md, issue 7);
the floor needs many bytes in flight per SM. This kernel is jax's `hopper_matmul_mgpu` pipeline (a TMA producer
warpgroup streaming [tile_k, 2 * tile_n] weight tiles through `max_concurrent_steps` shared-memory stages, two
wgmma consumer warpgroups) with what block steps need on top:
  * x is padded to 64 rows (one wgmma M tile; the wasted MMA work is free when bandwidth bound);
  * split-K: work units are (K split, N tile) pairs over a persistent grid, so even N = 4096 gives every SM
    several units; fp32 partials are summed by a small XLA epilogue;
  * stacked weights [L, K, N] with a layer index: the kernel addresses layer `layer` itself, so a scan over
    layers does not copy each layer's slice first.
Status: correct in jax's GPU simulator and lowers for CUDA (tests); NOT yet timed on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gpu_info import num_sms

TILE_M = 64  # wgmma M


@dataclasses.dataclass(frozen=True)
class StreamConfig:
  """tile_n: weight columns per consumer warpgroup (the CTA takes 2 * tile_n); tile_k: K rows per stage;
  split_k: K splits (None: enough units for ~3 per SM); stages: TMA stages in flight."""
  tile_n: int = 64
  tile_k: int = 64
  split_k: int | None = None
  stages: int = 6

  def __post_init__(self):
    if self.tile_n not in (32, 64, 128):
      raise ValueError(f"StreamConfig.tile_n must be 32, 64 or 128, got {self.tile_n}")
    if self.tile_k not in (32, 64):
      raise ValueError(f"StreamConfig.tile_k must be 32 or 64 (one 128-byte swizzled bf16 row), got {self.tile_k}")
    if self.tile_n % self.tile_k:
      # the weight tile's swizzle spans tile_k columns: a warpgroup's column slice must start on one (the compiled
      # kernel refuses the slice; the GPU simulator does not check, so only the H200 showed it)
      raise ValueError(f"StreamConfig.tile_n must be a multiple of tile_k (the swizzle's width), got tile_n="
                       f"{self.tile_n}, tile_k={self.tile_k}")
    if self.split_k is not None and self.split_k < 1:
      raise ValueError(f"StreamConfig.split_k must be None or >= 1, got {self.split_k}")
    if not 2 <= self.stages <= 8:
      raise ValueError(f"StreamConfig.stages must be in [2, 8], got {self.stages}")


def _choose_split(k_steps: int, n_iters: int, sms: int, k: int) -> int:
  """Balance the persistent grid (units / (rounds * SMs)) against the fp32 partials' traffic (written and read
  back: split * 64 rows * 4 B * 2 per column, vs 2 * K bytes of weights per column)."""
  best, best_score = 1, -1.0
  for s in range(1, k_steps + 1):
    if k_steps % s or (s > 1 and k_steps // s < 4) or n_iters * s > 8 * sms:
      continue
    units = n_iters * s
    balance = units / (-(-units // sms) * sms)
    score = balance / (1.0 + (s * TILE_M * 8 / (2 * k) if s > 1 else 0.0))
    if score > best_score + 1e-9:
      best, best_score = s, score
  return best


def _kernel_call(x, w, layer, *, cfg: StreamConfig, split: int, interpret):
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  mp, k = x.shape
  n_layers, _, n = w.shape
  tn, tk = cfg.tile_n, cfg.tile_k
  ctn = 2 * tn
  n_iters = n // ctn
  k_steps = k // tk
  ksteps = k_steps // split
  dtype = x.dtype
  out_dtype = jnp.float32 if split > 1 else dtype
  swizzle = plgpu.find_swizzle(tk * jnp.dtype(dtype).itemsize * 8)
  swz_elems = swizzle // jnp.dtype(dtype).itemsize
  transforms = (plgpu.TilingTransform((8, swz_elems)), plgpu.SwizzleTransform(swizzle))
  epi_n = min(64, tn)
  out_swz = plgpu.find_swizzle(epi_n * jnp.dtype(out_dtype).itemsize * 8)
  out_transforms = (plgpu.TilingTransform((8, out_swz // jnp.dtype(out_dtype).itemsize)),
                    plgpu.SwizzleTransform(out_swz))
  n_epi = tn // epi_n

  def stream_matmul_kernel(layer_gmem, x_gmem, w_gmem, out_gmem, out_smem):
    def get_pipeline(body, compute_context):
      return plgpu.emit_pipeline_warp_specialized(
          body,
          grid=(ksteps,),
          memory_registers=40,
          in_specs=[
              plgpu.BlockSpec((TILE_M, tk), lambda kk: (0, kk), transforms=transforms,
                              memory_space=plgpu.SMEM),
              plgpu.BlockSpec((tk, ctn), lambda kk: (kk, 0), transforms=transforms,
                              memory_space=plgpu.SMEM),
          ],
          wg_axis="wg",
          num_compute_wgs=2,
          max_concurrent_steps=cfg.stages,
          compute_context=compute_context,
      )

    ignore = lambda *_, **__: None  # noqa: E731
    w_layer = w_gmem.at[layer_gmem[0]]

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
            x_gmem.at[:, pl.ds(0, ksteps * tk)], w_layer.at[pl.ds(0, ksteps * tk), pl.ds(0, ctn)]),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs):
      wg_idx = lax.axis_index("wg")

      @plgpu.nd_loop((split, n_iters), collective_axes="cluster_grid")
      def _loop(loop_info):
        ks, n_idx = loop_info.index
        cta_n = pl.ds(n_idx * ctn, ctn)
        wg_n = pl.ds(wg_idx * tn, tn)
        k0 = ks * ksteps * tk

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((TILE_M, tn), jnp.float32))
          def _acc(acc_ref):
            eval_pipeline(acc_ref)
            acc = acc_ref[...].astype(out_dtype)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            dst = out_gmem.at[ks] if split > 1 else out_gmem
            for ni in range(n_epi):
              sl = slice(ni * epi_n, (ni + 1) * epi_n)
              slot = ni % 2
              plgpu.wait_smem_to_gmem(1, wait_read_only=True)
              out_smem[wg_idx, slot] = acc[:, sl]
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(out_smem.at[wg_idx, slot], dst.at[:, cta_n].at[:, wg_n].at[:, sl])

        def mma_body(idxs, x_smem, w_smem, acc_ref):
          plgpu.wgmma(acc_ref, x_smem, w_smem.at[:, wg_n])
          plgpu.wgmma_wait(0)
          return acc_ref

        get_pipeline(mma_body, compute_context)(
            x_gmem.at[:, pl.ds(k0, ksteps * tk)],
            w_layer.at[pl.ds(k0, ksteps * tk), cta_n],
            allocations=pipeline_allocs,
        )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  units = split * n_iters
  kw = {}
  if interpret:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    kw["interpret"] = InterpretGPUParams()
  f = plgpu.kernel(
      stream_matmul_kernel,  # its name reaches the profiler trace
      out_type=jax.ShapeDtypeStruct((split, mp, n) if split > 1 else (mp, n), out_dtype),
      grid=(max(1, min(units, num_sms())),),
      grid_names=("cluster_grid",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      scratch_types=dict(out_smem=plgpu.SMEM((2, 2, TILE_M, epi_n), out_dtype, transforms=out_transforms)),
      **kw,
  )
  return f(layer, x, w)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def stream_matmul(x: jax.Array, w: jax.Array, layer: jax.Array | None = None, *,
                  config: StreamConfig | None = None, interpret: bool = False) -> jax.Array:
  """x [M <= 64, K] @ w [K, N] (or layer `layer` of stacked w [L, K, N]) -> [M, N] in x.dtype, fp32 accumulation.

  bf16 (or fp16) operands; N a multiple of 2 * tile_n, K of tile_k.
  """
  cfg = config or StreamConfig()
  if x.ndim != 2 or w.ndim not in (2, 3):
    raise ValueError(f"stream_matmul expects x [M, K] and w [K, N] or [L, K, N], got {x.shape} and {w.shape}")
  if (w.ndim == 3) != (layer is not None):
    raise ValueError("stream_matmul: `layer` is required with stacked weights [L, K, N] and only with them")
  m, k = x.shape
  k2, n = w.shape[-2:]
  if k != k2:
    raise ValueError(f"stream_matmul: K mismatch, x {x.shape} vs w {w.shape}")
  if not 1 <= m <= TILE_M:
    raise ValueError(f"stream_matmul: M={m} must be in [1, {TILE_M}] (a weight-streaming kernel)")
  if x.dtype not in (jnp.bfloat16, jnp.float16) or w.dtype != x.dtype:
    raise ValueError(f"stream_matmul: x and w must both be bf16 or fp16, got {x.dtype} and {w.dtype}")
  if n % (2 * cfg.tile_n) or k % cfg.tile_k:
    raise ValueError(f"stream_matmul: N={n} must be a multiple of {2 * cfg.tile_n} and K={k} of {cfg.tile_k}")
  w3 = w if w.ndim == 3 else w[None]
  lay = jnp.reshape(jnp.clip(jnp.asarray(0 if layer is None else layer, jnp.int32), 0, w3.shape[0] - 1), (1,))
  split = cfg.split_k or _choose_split(k // cfg.tile_k, n // (2 * cfg.tile_n), num_sms(), k)
  if (k // cfg.tile_k) % split:
    raise ValueError(f"stream_matmul: split_k={split} must divide K/tile_k={k // cfg.tile_k}")
  xp = jnp.pad(x, ((0, TILE_M - m), (0, 0))) if m < TILE_M else x
  out = _kernel_call(xp, w3, lay, cfg=cfg, split=split, interpret=interpret)
  if split > 1:
    out = out.sum(axis=0).astype(x.dtype)
  return out[:m]


def stream_matmul_reference(x: jax.Array, w: jax.Array, layer: jax.Array | None = None) -> jax.Array:
  """Plain jnp: fp32 matmul, one rounding to x.dtype."""
  wl = w if layer is None else w[layer]
  return jnp.dot(x.astype(jnp.float32), wl.astype(jnp.float32), precision=lax.Precision.HIGHEST).astype(x.dtype)
