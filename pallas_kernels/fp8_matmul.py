"""FP8 (e4m3) block-scaled matmul for Hopper (Mosaic GPU), plus references.

Numerics (DeepSeek-V3 / DeepGEMM style, as used by LaCache's FP8 FFN):
  * activations x [M, K] are quantised per 1x128 group along K:
      xs[m, g] = amax(|x[m, 128g:128g+128]|) / 448,  xq = e4m3(x / xs)
  * weights w [N, K] (out, in) are quantised per 128x128 block:
      ws[nb, g] = amax(|w[128nb:.., 128g:..]|) / 448,  wq = e4m3(w / ws)
  * y[m, n] = sum_g xs[m, g] * ws[n // 128, g] * sum_{k in g} xq[m, k] * wq[n, k]
    with every inner sum (one 128-wide K group) accumulated in fp32 by wgmma and
    "promoted" into an fp32 running accumulator with the two scales.

Backends of :func:`fp8_matmul`:
  * ``"xla"``: dequantise, then an fp32 dot -- runs anywhere (CPU included).
  * ``"pallas"``: the Mosaic GPU kernel (wgmma on K-major e4m3 operands, TMA
    warp-specialised pipeline, per-128-K promotion).  H100/H200 only, or the
    CPU GPU-simulator with ``interpret=True`` (slow; for tests).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.gpu_info import H200_SMS, num_sms

E4M3_MAX = 448.0
GROUP = 128  # K group of the activation scales and both dims of the weight blocks
FP8 = jnp.float8_e4m3fn


# --------------------------------------------------------------------------
# Quantisation (plain jnp: XLA fuses these into the producer -- RMSNorm or
# SwiGLU -- so the bf16 activation never makes an extra HBM round trip)
# --------------------------------------------------------------------------
def _check_matrix(a: jax.Array, what: str, name: str, dims: str) -> tuple[int, int]:
    """a's (rows, K): a floating matrix whose K is a multiple of GROUP, or a ValueError naming `what`."""
    if a.ndim != 2:
        raise ValueError(f"{what}: expected {name} of rank 2 [{dims}], got shape {a.shape}")
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise ValueError(f"{what}: {name} must be floating, got {a.dtype}")
    rows, k = a.shape
    if k % GROUP:
        raise ValueError(f"{what}: K={k} must be a multiple of {GROUP}")
    return rows, k


def quantize_activations(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] (bf16/fp32/fp16) -> (xq [M, K] e4m3, xs [M, K//128] fp32)."""
    m, k = _check_matrix(x, "quantize_activations", "x", "M, K")
    q, scale = quantize_rows(x.astype(jnp.float32).reshape(m, k // GROUP, GROUP))
    return q.reshape(m, k), scale


def quantize_rows(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """v [..., 128] fp32, one 1x128 group per row -> (e4m3 codes [..., 128], scales [...] = amax / 448, 1 for an
    all-zero group). The one formula of every activation quantiser: this reference, the Triton kernels of
    `fp8_quantize` and the fused SwiGLU epilogue of the GEMM (plain jnp ops that all three lowerings take)."""
    amax = jnp.max(jnp.abs(v), axis=-1)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = jnp.clip(v / lax.broadcast_in_dim(scale, v.shape, tuple(range(v.ndim - 1))), -E4M3_MAX, E4M3_MAX)
    return q.astype(FP8), scale


def quantize_weights(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [N, K] -> (wq [N, K] e4m3, ws [ceil(N/128), K//128] fp32)."""
    n, k = _check_matrix(w, "quantize_weights", "w", "N, K")
    nb = -(-n // GROUP)
    wf = w.astype(jnp.float32)
    if nb * GROUP != n:
        wf = jnp.pad(wf, ((0, nb * GROUP - n), (0, 0)))
    wg = wf.reshape(nb, GROUP, k // GROUP, GROUP)
    amax = jnp.max(jnp.abs(wg), axis=(1, 3))
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)
    q = jnp.clip(wg / scale[:, None, :, None], -E4M3_MAX, E4M3_MAX).astype(FP8)
    return q.reshape(nb * GROUP, k)[:n], scale


def dequantize_activations(xq, xs, dtype=jnp.float32):
    m, k = xq.shape
    x = xq.astype(jnp.float32).reshape(m, k // GROUP, GROUP) * xs[..., None]
    return x.reshape(m, k).astype(dtype)


def dequantize_weights(wq, ws, dtype=jnp.float32):
    n, k = wq.shape
    s = jnp.repeat(jnp.repeat(ws, GROUP, axis=0)[:n], GROUP, axis=1)
    return (wq.astype(jnp.float32) * s).astype(dtype)


def _check_operands(xq, xs, wq, ws):
    if xq.ndim != 2 or wq.ndim != 2:
        raise ValueError(f"fp8_matmul: xq and wq must be rank 2, got {xq.shape} and {wq.shape}")
    if xq.dtype != FP8 or wq.dtype != FP8:
        raise ValueError(f"fp8_matmul: xq and wq must be float8_e4m3fn, got {xq.dtype} and {wq.dtype}")
    m, k = xq.shape
    n, k2 = wq.shape
    if k != k2:
        raise ValueError(f"fp8_matmul: K mismatch: xq {xq.shape} vs wq {wq.shape} (y = x @ w.T)")
    if k % GROUP:
        raise ValueError(f"fp8_matmul: K={k} must be a multiple of {GROUP}")
    if xs.shape != (m, k // GROUP):
        raise ValueError(f"fp8_matmul: xs must be {(m, k // GROUP)} for xq {xq.shape}, got {xs.shape}")
    if ws.shape != (-(-n // GROUP), k // GROUP):
        raise ValueError(f"fp8_matmul: ws must be {(-(-n // GROUP), k // GROUP)} for wq {wq.shape}, got {ws.shape}")
    if xs.dtype != jnp.float32 or ws.dtype != jnp.float32:
        raise ValueError(f"fp8_matmul: scales must be float32, got {xs.dtype} and {ws.dtype}")
    return m, n, k


def fp8_matmul_reference(xq, xs, wq, ws, out_dtype=jnp.bfloat16):
    """Dequantise, then an fp32 dot (HIGHEST precision). y = x @ w.T."""
    _check_operands(xq, xs, wq, ws)
    x = dequantize_activations(xq, xs)
    w = dequantize_weights(wq, ws)
    y = lax.dot_general(
        x, w, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    return y.astype(out_dtype)


# --------------------------------------------------------------------------
# Mosaic GPU kernel
# --------------------------------------------------------------------------
class Dim(enum.IntEnum):
    M = 0
    N = 1


@dataclasses.dataclass(frozen=True)
class Fp8MatmulConfig:
    """Tiling of the Mosaic GPU kernel.

    A CTA runs 2 compute warpgroups (+1 TMA warpgroup); each compute warpgroup
    owns a (wg_tile_m, wg_tile_n) fp32 output tile; the two are stacked along
    ``wg_dimension``.  tile_k is fixed to 128 = one scale group.  ``split_k``
    splits the K loop over independent work units (fp32 partials summed after).
    ``groups_per_step``: 128-K groups per pipeline stage (1, 2 or 4). Their wgmmas are issued back to back into
    one fresh accumulator each, so group j's promotion runs while the later groups' wgmmas are in flight (one
    barrier round trip per stage instead of per group). K/128/split_k must be a multiple of it.
    ``cluster_dimension``: None, or a cluster of two CTAs side by side along M (they share the weight tile B of every
    stage, one TMA multicast to both) or along N (they share the activation tile A). Cuts the L2 -> shared memory
    traffic of the shared operand in half when compute bound; the scale rows are still loaded per CTA (they are
    too small to split between the two: TMA destinations must be 128-byte aligned).
    The weight scales of each K step reach shared memory through the TMA pipeline with the tiles, as a 128-byte row
    per CTA (`expand_weight_scales`; column tiles: `column_scale_table`).
    ``out_slots``: shared-memory buffers per warpgroup for the epilogue's chunks (2: a chunk is written while the
    previous one is stored; 1: each store is waited for, half the epilogue's shared memory, which can leave room
    for one more pipeline stage).
    Column tiles (``wg_tile_n`` a multiple of 16 that neither divides 128 nor is a multiple of it, e.g. 144): a tile
    spans parts of two 128-wide weight-scale blocks, so the weight scales come per column (`column_scale_table`)
    and the promotion multiplies by a row vector (x scales) and a column vector (w scales). Such tilings exist to
    fill the waves of 132 SMs where 128-wide tiles leave a ragged last wave (Dream-7B's 37888 gate/up columns: 296
    tiles of 128 = 2.24 waves at block-step M, one wave of 132 paired 144-wide tiles). N need not be a multiple of
    the tile: the last tile starts at N - tile (it recomputes a few columns of its neighbour, bit-identically).
    With ``wg_dimension`` N the two warpgroups take the two halves of N (warpgroup 0 columns [s, s + 144), warpgroup
    1 columns N/2 + [s, s + 144)), as the fused SwiGLU pairs gate and up, so no TMA box exceeds 256 rows.
    """

    wg_tile_m: int = 64
    wg_tile_n: int = 128
    wg_dimension: Dim = Dim.M
    max_concurrent_steps: int = 4
    split_k: int = 1
    epi_tile_n: int = 64
    grid_minor_dim: Dim = Dim.N
    grid_tile_width: int = 8
    groups_per_step: int = 1
    cluster_dimension: Dim | None = None
    out_slots: int = 2

    def __post_init__(self):
        if self.wg_tile_m != 64:
            raise ValueError(f"wg_tile_m must be 64 (wgmma M; register budget), got {self.wg_tile_m}")
        if self.wg_tile_n not in (32, 64, 128) and not (self.wg_tile_n % 16 == 0 and 128 < self.wg_tile_n <= 192):
            raise ValueError(
                f"wg_tile_n must be 32, 64, 128, or a multiple of 16 in (128, 192] (column tiles), got {self.wg_tile_n}"
            )
        if self.column_scales:
            if self.cluster_dimension is not None:
                raise ValueError(f"column tiles (wg_tile_n={self.wg_tile_n}) run without a cluster")
            if self.epi_tile_n not in (16, 32, 64) or self.wg_tile_n % self.epi_tile_n:
                raise ValueError(
                    f"epi_tile_n={self.epi_tile_n} must be 16, 32 or 64 and divide wg_tile_n={self.wg_tile_n}"
                )
        if not 2 <= self.max_concurrent_steps <= 8:
            raise ValueError(f"max_concurrent_steps must be in [2, 8], got {self.max_concurrent_steps}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")
        if not self.column_scales and (self.epi_tile_n not in (32, 64, 128) or self.epi_tile_n > self.wg_tile_n):
            if self.epi_tile_n != self.wg_tile_n:
                raise ValueError(f"epi_tile_n={self.epi_tile_n} must be <= wg_tile_n={self.wg_tile_n}")
        if self.cta_tile_n < 64:
            raise ValueError(f"CTA N tile must be >= 64 (16-byte scale rows), got {self.cta_tile_n}")
        if self.groups_per_step not in (1, 2, 4):
            raise ValueError(f"groups_per_step must be 1, 2 or 4, got {self.groups_per_step}")
        if self.out_slots not in (1, 2):
            raise ValueError(f"out_slots must be 1 or 2, got {self.out_slots}")
        c = self.cluster_dimension
        # Dim is an IntEnum: False / 0 would compare equal to Dim.M, so only None or a Dim is accepted
        if c is not None and not isinstance(c, Dim):
            raise ValueError(f"cluster_dimension must be None, Dim.M or Dim.N, got {c!r}")

    def as_dict(self) -> dict:
        """The fields as JSON-ready values (enum names), for benchmark rows."""
        d = dataclasses.asdict(self)
        for key in ("wg_dimension", "grid_minor_dim", "cluster_dimension"):
            d[key] = None if d[key] is None else Dim(d[key]).name
        return d

    @property
    def column_scales(self) -> bool:
        """Whether a warpgroup tile straddles 128-wide weight-scale blocks (per-column weight scales)."""
        return bool(GROUP % self.wg_tile_n and self.wg_tile_n % GROUP)

    @property
    def cta_tile_m(self):
        return self.wg_tile_m * (2 if self.wg_dimension == Dim.M else 1)

    @property
    def cta_tile_n(self):
        return self.wg_tile_n * (2 if self.wg_dimension == Dim.N else 1)

    @property
    def epilogue_slots(self):
        """Shared-memory buffers per warpgroup for the epilogue's chunks (out_slots, at most one per chunk)."""
        return min(self.out_slots, self.wg_tile_n // min(self.epi_tile_n, self.wg_tile_n))

    @property
    def cluster_tile_m(self):
        """Rows of one cluster's output tile (M must be padded to it)."""
        return self.cta_tile_m * (2 if self.cluster_dimension == Dim.M else 1)

    @property
    def cluster_tile_n(self):
        """Columns of one cluster's output tile (N must be a multiple of it)."""
        return self.cta_tile_n * (2 if self.cluster_dimension == Dim.N else 1)


# The SM count the default tilings are sized for: the H200's, wherever the kernel is lowered (the same tiling on
# every machine, so CPU lowering checks see what the GPU runs).
TUNED_SMS = H200_SMS


def default_config(m: int, n: int, k: int) -> Fp8MatmulConfig:
    """Heuristic from the H200 sweeps: fine N tiles and split-K
    when weight-bandwidth bound (enough work units for 132 SMs), 128x128 CTA
    tiles (2 warpgroups of 64x128) when compute bound."""
    narrow = _narrow_config(m, n, k)
    wide = wide_small_m_config(m, n, k) if m <= 64 else None
    column = column_small_m_config(m, n, k)
    if wide is None and column is None:
        return _with_default_cluster(_with_default_groups(narrow, m, k), m, n)

    # The kernel streams at a per-SM rate: what decides is how evenly the work units fill the waves of 132 SMs; at
    # equal fill, fewer split-K partials, then the wide tiles, then column tiles (PERFORMANCE.md section 7).
    def rank(c):
        units = _units(m, n, c)
        return (units / (-(-units // TUNED_SMS) * TUNED_SMS), -c.split_k, c is wide, c is not column)

    # M <= 64: no clusters
    best = max((c for c in (narrow, wide, column) if c is not None), key=rank)
    if best is column:
        return column  # its K groups per stage: column_small_m_config's
    return _with_default_groups(best, m, k)


# K groups per pipeline stage of the default configs, where they divide a work unit's K groups: at M <= 64 the
# per-stage chain limits the kernel and 2 groups halve it; above, only where a 32-wide epilogue (or one epilogue
# slot) leaves room for a third stage (PERFORMANCE.md section 7).
DEFAULT_GROUPS_PER_STEP = 2


def model_epilogue_dtype(cfg: Fp8MatmulConfig):
    """The epilogue dtype of the model's GEMMs with this config (bf16 out; split-K writes fp32 partials): what stage
    counts are sized for."""
    return jnp.float32 if cfg.split_k > 1 else jnp.bfloat16


def _with_default_groups(cfg: Fp8MatmulConfig, m: int, k: int) -> Fp8MatmulConfig:
    if (k // GROUP // cfg.split_k) % DEFAULT_GROUPS_PER_STEP:
        return cfg
    grouped = dataclasses.replace(cfg, groups_per_step=DEFAULT_GROUPS_PER_STEP)
    if m <= 64:
        return grouped if stages_that_fit(grouped, jnp.float32) >= 2 else cfg
    # stages counted for the model's bf16 output; an fp32 out_dtype still runs this config, on the 2 stages that then
    # fit (fit_stages)
    thin = dataclasses.replace(grouped, epi_tile_n=min(32, cfg.epi_tile_n))
    one_slot = dataclasses.replace(thin, out_slots=1)
    for candidate in (thin, one_slot):
        if stages_that_fit(candidate, model_epilogue_dtype(candidate)) >= 3:
            return candidate
    return cfg


# Two-CTA clusters along N (the pair shares each stage's activation tile, one TMA multicast) where the GEMM is
# compute bound (M >= 1024) with at least 4 waves of CTA tiles on 132 SMs and N a multiple of the pair's 256
# columns; below 2 waves the pair lost (PERFORMANCE.md section 7).
CLUSTER_FROM_M = 1024
CLUSTER_MIN_WAVES = 4


def _with_default_cluster(cfg: Fp8MatmulConfig, m: int, n: int) -> Fp8MatmulConfig:
    if m < CLUSTER_FROM_M or n % (2 * cfg.cta_tile_n) or _units(m, n, cfg) < CLUSTER_MIN_WAVES * TUNED_SMS:
        return cfg
    return dataclasses.replace(cfg, cluster_dimension=Dim.N)


def _units(m: int, n: int, cfg: Fp8MatmulConfig) -> int:
    n_tiles = column_tile_count(n, cfg) if cfg.column_scales else n // cfg.cta_tile_n
    return -(-m // cfg.cta_tile_m) * n_tiles * cfg.split_k


# Column tiles at block-step M (<= 64 rows): two 64 x 144 warpgroup tiles side by side, taking the two halves of N,
# where they fill the waves of 132 SMs better than the 128- and 256-wide tiles (Dream-7B's gate/up: one wave of
# 132 tiles instead of 2.24 waves); wider accumulators spill past ptxas's 168 registers (PERFORMANCE.md section 7).
COLUMN_TILE_N = 144
COLUMN_MIN_FILL = 0.95  # of the last wave


def column_small_m_config(m: int, n: int, k: int) -> Fp8MatmulConfig | None:
    """The column tiling for (m, n, k), m <= 64, where its tiles fill their waves of TUNED_SMS SMs to at least
    COLUMN_MIN_FILL (no split-K); None elsewhere."""
    if m > 64 or n % 16:
        return None
    cfg = Fp8MatmulConfig(
        wg_dimension=Dim.N,
        wg_tile_n=COLUMN_TILE_N,
        epi_tile_n=16,
        max_concurrent_steps=6,
        groups_per_step=DEFAULT_GROUPS_PER_STEP,
    )
    if n // 2 < COLUMN_TILE_N or (k // GROUP) % cfg.groups_per_step or stages_that_fit(cfg, jnp.bfloat16) < 2:
        return None
    units = _units(m, n, cfg)
    return cfg if units / (-(-units // TUNED_SMS) * TUNED_SMS) >= COLUMN_MIN_FILL else None


def _narrow_config(m: int, n: int, k: int) -> Fp8MatmulConfig:
    kg = k // GROUP
    if m <= 64:
        cfg = Fp8MatmulConfig(wg_dimension=Dim.N, wg_tile_n=64, max_concurrent_steps=6)
    elif m <= 256:
        cfg = Fp8MatmulConfig(wg_dimension=Dim.M, wg_tile_n=128, max_concurrent_steps=5)
    else:
        cfg = Fp8MatmulConfig(wg_dimension=Dim.M, wg_tile_n=128, max_concurrent_steps=4)
    if n % cfg.cta_tile_n:
        return cfg
    tiles = (-(-m // cfg.cta_tile_m)) * (n // cfg.cta_tile_n)
    split = 1
    while tiles * split * 2 <= 165 and kg % (split * 2) == 0 and kg // (split * 2) >= 8:
        split *= 2
    return dataclasses.replace(cfg, split_k=split)  # the stages that fit next to split-K's fp32 epilogue: fit_stages


# Small M (a block step: <= 64 rows) may run on 256-wide CTA N tiles (32 KB of weights per K step instead of 16).
# The kernel streams at a per-SM rate whatever the tiling, so the wide tiles win only where they leave fewer SMs
# idle in the last wave (`default_config`; PERFORMANCE.md section 7).


def wide_small_m_config(m: int, n: int, k: int) -> Fp8MatmulConfig | None:
    """256-wide N tiles (2 warpgroups of 64 x 128), 4 stages (shared memory: 41 KB per stage), split-K to at most
    ~1.1 waves of 132 SMs; None where that leaves most SMs idle (< 0.7 of a wave: Dream's 3584 -> down GEMM)."""
    cfg = Fp8MatmulConfig(wg_dimension=Dim.N, wg_tile_n=128, epi_tile_n=32, max_concurrent_steps=4)
    if n % cfg.cta_tile_n:
        return None
    kg = k // GROUP
    tiles = -(-m // cfg.cta_tile_m) * (n // cfg.cta_tile_n)
    sms = TUNED_SMS
    split = max(s for s in range(1, kg + 1) if kg % s == 0 and (s == 1 or (tiles * s <= 1.1 * sms and kg // s >= 4)))
    if tiles * split < 0.7 * sms:
        return None
    return dataclasses.replace(cfg, split_k=split)


SMEM_BYTES = 232448  # H100/H200 dynamic shared memory per block


def stages_that_fit(cfg: Fp8MatmulConfig, acc_dtype, reserve: int = 0) -> int:
    """Pipeline stages of `cfg` that fit in shared memory next to the epilogue buffers and `reserve` bytes."""
    ctm, ctn = cfg.cta_tile_m, cfg.cta_tile_n
    # e4m3 A and B tiles, an xs row, a 128-byte ws row (column tiles: a padded row of floats per warpgroup along N),
    # per 128-K group
    ws_row = 4 * column_scale_padded_width(cfg) * (ctn // cfg.wg_tile_n) if cfg.column_scales else 128
    stage = cfg.groups_per_step * (ctm * GROUP + ctn * GROUP + 4 * ctm + ws_row)
    epi_n = min(cfg.epi_tile_n, cfg.wg_tile_n)
    epilogue = 2 * cfg.epilogue_slots * cfg.wg_tile_m * epi_n * jnp.dtype(acc_dtype).itemsize
    return (SMEM_BYTES - 2048 - reserve - epilogue) // stage  # 2 KB kept for barriers and alignment


def fit_stages(cfg: Fp8MatmulConfig, acc_dtype, reserve: int = 0) -> int:
    """cfg.max_concurrent_steps, lowered where the stages would not fit in shared memory next to the epilogue
    buffers (2 KB kept for barriers and alignment): an fp32 epilogue (split-K partials, fp32 out) doubles them.
    Calibration: 5 stages of 128x128 tiles with split-K's fp32 epilogue needed 233552 B, over the H200's 232448
    (the LLaDA batch-8 block step, M=256, K=12288); this count gives 4 there.
    More stages than the defaults do not help at small M (PERFORMANCE.md section 7)."""
    fits = stages_that_fit(cfg, acc_dtype, reserve)
    return max(2, min(cfg.max_concurrent_steps, fits))


def ws_cols(cfg: Fp8MatmulConfig) -> int:
    """Columns per weight-scale copy, so one CTA's scales for a K step are 32 floats
    (a 128-byte row: TMA wants 128-byte aligned shared-memory destinations)."""
    return cfg.cta_tile_n // 32


def expand_weight_scales(ws, n, cols, xp=jnp):
    """ws [N/128, K/128] -> [K/128, N/cols]: one copy per `cols` columns, so every
    CTA's scales for one K step are a 128-byte row that TMA prefetches with the tiles.
    xp: the array module (numpy for host-side loading)."""
    return xp.repeat(ws.T, GROUP // cols, axis=1)[:, : n // cols]


def column_span(n: int, cfg: Fp8MatmulConfig) -> int:
    """Columns one warpgroup's column tiles walk: N, or N/2 when the two warpgroups take the two halves of N."""
    return n // 2 if cfg.wg_dimension == Dim.N else n


def column_tile_count(n: int, cfg: Fp8MatmulConfig) -> int:
    """CTA tiles along N of a column tiling (the last one starts at span - tile)."""
    return -(-column_span(n, cfg) // cfg.wg_tile_n)


def check_column_tiling(n: int, cfg: Fp8MatmulConfig, what: str) -> None:
    span = column_span(n, cfg)
    if (cfg.wg_dimension == Dim.N and n % 16) or span % 8 or span < cfg.wg_tile_n:
        even = ", N a multiple of 16" if cfg.wg_dimension == Dim.N else ""
        raise ValueError(
            f"{what}: N={n} does not fit column tiles of {cfg.wg_tile_n} (each warpgroup walks "
            f"{span} columns: needs at least one tile, a multiple of 8{even})"
        )


def column_scale_padded_width(cfg: Fp8MatmulConfig) -> int:
    """A warpgroup tile's scale row padded to 32 floats (TMA destinations are 128-byte aligned per stage)."""
    return -(-cfg.wg_tile_n // 32) * 32


def column_scale_table_shape(n: int, k: int, cfg: Fp8MatmulConfig) -> tuple[int, int, int, int]:
    return (
        k // GROUP,
        column_tile_count(n, cfg),
        2 if cfg.wg_dimension == Dim.N else 1,
        column_scale_padded_width(cfg),
    )


def column_scale_table(ws, n: int, cfg: Fp8MatmulConfig, xp=jnp):
    """ws [N/128, K/128] -> the per-column weight scales of a column tiling, [K/128, tiles, warpgroups along N, width]:
    entry [g, t, w, c] is the scale of weight column (w * N/2 if paired) + start(t) + c for c < wg_tile_n (start(t) =
    min(t * wg_tile_n, span - wg_tile_n)), 0 in the padding. xp: the array module (numpy for host-side loading)."""
    tn, span = cfg.wg_tile_n, column_span(n, cfg)
    wgs = 2 if cfg.wg_dimension == Dim.N else 1
    t = np.arange(column_tile_count(n, cfg))
    starts = np.minimum(t * tn, span - tn)
    c = np.arange(column_scale_padded_width(cfg))
    cols = np.arange(wgs)[None, :, None] * span + starts[:, None, None] + np.minimum(c, tn - 1)[None, None, :]
    table = xp.asarray(ws).T[:, cols // GROUP]  # [K/128, tiles, wgs, width]
    return xp.where(xp.asarray(c < tn), table, 0.0).astype(xp.float32)


def _fp8_kernel_call(xq_p, xs_t, wq, ws, *, cfg: Fp8MatmulConfig, out_dtype, interpret, swiglu: bool = False):
    """swiglu=True (`fp8_gate_up_swiglu`): wq is [gate | up] (2F rows); CTA tile j pairs gate block j (warpgroup 0)
    with up block j (warpgroup 1), and the epilogue writes silu(gate) * up quantised 1x128 (aq [Mp, F] e4m3,
    as_t [F/128, Mp]) instead of the GEMM's output."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    mp, k = xq_p.shape
    n = wq.shape[0]
    assert not swiglu or swiglu_fusable(cfg), cfg  # fp8_gate_up_swiglu checked it
    column = cfg.column_scales
    paired = column and cfg.wg_dimension == Dim.N  # the two warpgroups take the two halves of N
    if column:
        check_column_tiling(n, cfg, "fp8 kernel")
    tm, tn = cfg.wg_tile_m, cfg.wg_tile_n
    ctm, ctn = cfg.cta_tile_m, cfg.cta_tile_n
    split = cfg.split_k
    kg = k // GROUP
    gps = cfg.groups_per_step
    step_k = gps * GROUP
    wsc = ws_cols(cfg)
    if kg % split:
        raise ValueError(f"split_k={split} must divide K/128={kg}")
    if (kg // split) % gps:
        raise ValueError(
            f"groups_per_step={gps} must divide the K groups of a work unit, K/128/split_k = {kg // split}"
        )
    ksteps = kg // split // gps  # pipeline steps per work unit
    if mp % cfg.cluster_tile_m:
        raise ValueError(f"padded M={mp} must be a multiple of {cfg.cluster_tile_m} (the cluster's M tile)")
    if not column and n % cfg.cluster_tile_n:
        tile = "cluster" if cfg.cluster_dimension is not None else "CTA"
        raise ValueError(f"N={n} must be a multiple of the {tile} N tile {cfg.cluster_tile_n} for this config")
    cluster = 1 if cfg.cluster_dimension is None else 2
    # the persistent loop walks cluster tiles; CTA c of a cluster takes the c-th CTA tile of it
    m_iters = mp // cfg.cluster_tile_m
    n_iters = column_tile_count(n, cfg) if column else n // cfg.cluster_tile_n
    span = column_span(n, cfg)
    acc_dtype = jnp.float32 if split > 1 else (jnp.bfloat16 if swiglu else out_dtype)
    epi_m, epi_n = tm, min(cfg.epi_tile_n, tn)
    num_out_slots = cfg.epilogue_slots
    # the fused epilogue's tiles share the shared memory with the stages
    reserve = _swiglu_smem(cfg) if swiglu else 0
    if stages_that_fit(cfg, acc_dtype, reserve) < 2:
        raise ValueError(
            f"fp8_matmul: two pipeline stages of {cfg} do not fit in {SMEM_BYTES} bytes of shared memory "
            f"next to a {jnp.dtype(acc_dtype).name} epilogue; use fewer groups_per_step or narrower tiles"
        )
    stages = fit_stages(cfg, acc_dtype, reserve)

    swz = plgpu.find_swizzle(GROUP * 8, "fp8 operand")  # 128 B rows
    in_transforms = (plgpu.TilingTransform((8, swz)), plgpu.SwizzleTransform(swz))
    ob = jnp.dtype(acc_dtype).itemsize * 8
    out_swz = plgpu.find_swizzle(epi_n * ob, "out")
    out_transforms = (plgpu.TilingTransform((8, out_swz * 8 // ob)), plgpu.SwizzleTransform(out_swz))

    def fp8_matmul_kernel(
        a_gmem, b_gmem, xs_gmem, ws_gmem, *outs, out_smem, up_smem=None, q_smem=None, s_smem=None, handover=None
    ):
        if swiglu:
            aq_gmem, as_gmem = outs
            up_ready, up_free = handover.at[0], handover.at[1]
        else:
            (out_gmem,) = outs
        # swiglu: B is viewed [2 (gate, up), F, K] and its scale table [K/128, 2, F/cols]; a stage holds one block of
        # each
        b_block = (2, tn, step_k) if swiglu or paired else (ctn, step_k)
        if column:  # per-column scales: [K group, warpgroup along N, padded tile width] per CTA tile
            ws_block = (gps, 2 if paired else 1, column_scale_padded_width(cfg))
        else:
            ws_block = (gps, 2, tn // wsc) if swiglu else (gps, ctn // wsc)

        def get_pipeline(body, compute_context):
            spec = functools.partial(plgpu.BlockSpec, memory_space=plgpu.SMEM)
            # the operand both CTAs of a cluster read is multicast: B (weights) along M, A (activations) along N
            a_multicast = ("cluster",) if cfg.cluster_dimension == Dim.N else ()
            b_multicast = ("cluster",) if cfg.cluster_dimension == Dim.M else ()
            return plgpu.emit_pipeline_warp_specialized(
                body,
                grid=(ksteps,),
                memory_registers=40,
                in_specs=[
                    spec((ctm, step_k), lambda kk: (0, kk), transforms=in_transforms, collective_axes=a_multicast),
                    spec(
                        b_block,
                        lambda kk: (0,) * (len(b_block) - 1) + (kk,),
                        transforms=in_transforms,
                        collective_axes=b_multicast,
                    ),
                    spec((gps, ctm), lambda kk: (kk, 0)),
                    spec(ws_block, lambda kk: (kk,) + (0,) * (len(ws_block) - 1)),
                ],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=stages,
                compute_context=compute_context,
            )

        ignore = lambda *_, **__: None

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
                a_gmem.at[:, pl.ds(0, ksteps * step_k)],
                b_gmem.at[..., pl.ds(0, ksteps * step_k)],
                xs_gmem.at[pl.ds(0, ksteps * gps), :],
                ws_gmem.at[pl.ds(0, ksteps * gps), 0] if column else ws_gmem.at[pl.ds(0, ksteps * gps)],
            ),
            collective_axes="wg",
        )
        def _scope(pipeline_allocs):
            wg_idx = lax.axis_index("wg")

            @plgpu.nd_loop((split, m_iters * n_iters), collective_axes="cluster_grid")
            def _loop(loop_info):
                ks, lin = loop_info.index
                m_idx, n_idx = plgpu.planar_snake(lin, (m_iters, n_iters), cfg.grid_minor_dim, cfg.grid_tile_width)
                if cfg.cluster_dimension == Dim.M:
                    m_idx = m_idx * 2 + lax.axis_index("cluster")
                elif cfg.cluster_dimension == Dim.N:
                    n_idx = n_idx * 2 + lax.axis_index("cluster")
                cta_m = pl.ds(m_idx * ctm, ctm)
                cta_n = pl.ds(n_idx * ctn, ctn)
                if cfg.wg_dimension == Dim.M:
                    wg_m = pl.ds(wg_idx * tm, tm)
                    wg_n = slice(None)
                else:
                    wg_m = slice(None)
                    wg_n = pl.ds(wg_idx * tn, tn)
                wg_ws = 0 if cfg.wg_dimension == Dim.M else wg_idx * (tn // wsc)
                g0 = ks * ksteps * gps  # first K group of this work unit
                # column tiles: the first column of this tile in each warpgroup's span (the last tile ends at the
                # span's end)
                start = lax.min(n_idx * tn, span - tn) if column else None

                def epilogue(acc):
                    acc = acc.astype(acc_dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for ni in range(tn // epi_n):
                        sl_n = slice(ni * epi_n, (ni + 1) * epi_n)
                        slot = ni % num_out_slots
                        plgpu.wait_smem_to_gmem(
                            num_out_slots - 1, wait_read_only=True
                        )  # this slot's last store has read it
                        out_smem[wg_idx, slot] = acc[:, sl_n]
                        plgpu.commit_smem()
                        dst = out_gmem.at[ks] if split > 1 else out_gmem
                        if column:
                            rows = pl.ds(m_idx * ctm + (wg_idx * tm if cfg.wg_dimension == Dim.M else 0), tm)
                            target = dst.at[rows, pl.ds(start + (wg_idx * span if paired else 0) + ni * epi_n, epi_n)]
                        else:
                            target = dst.at[cta_m, cta_n].at[wg_m, wg_n].at[:, sl_n]
                        plgpu.copy_smem_to_gmem(out_smem.at[wg_idx, slot], target)

                def swiglu_epilogue(acc):
                    """Warpgroup 1 hands its up tile to warpgroup 0 through shared memory; warpgroup 0 writes
                    silu(gate) * up, quantised per row (one 128-wide group: this tile), and the row scales."""
                    acc = acc.astype(jnp.bfloat16)  # the GEMM's own output rounding, as swiglu_quantize_t_reference

                    @pl.when(wg_idx == 1)
                    def _hand_over():
                        up_smem[...] = acc
                        plgpu.barrier_arrive(up_ready)
                        plgpu.barrier_wait(up_free)  # warpgroup 0 has the tile in registers: up_smem is free again

                    @pl.when(wg_idx == 0)
                    def _quantise():
                        plgpu.barrier_wait(up_ready)
                        up = up_smem[...].astype(jnp.float32)
                        plgpu.barrier_arrive(up_free)
                        gate = acc.astype(jnp.float32)
                        a = gate / (1.0 + jnp.exp(-gate)) * up
                        q, scale = quantize_rows(a)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous unit's stores have read q/s_smem
                        q_smem[...] = q
                        s_smem[...] = scale
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(q_smem, aq_gmem.at[cta_m, pl.ds(n_idx * tn, tn)])
                        plgpu.copy_smem_to_gmem(s_smem, as_gmem.at[n_idx, cta_m])

                def compute_context(eval_pipeline):
                    zeros = plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), plgpu.Layout.WGMMA)
                    finish = swiglu_epilogue if swiglu else epilogue
                    finish(eval_pipeline(zeros))

                def row_scale(j, xs_smem, ws_smem):
                    """x_scale[rows] * w_scale of K group j of this pipeline step: [tm]; column tiles:
                    (x_scale[rows] [tm], w_scale[columns] [tn])."""
                    if column:
                        return xs_smem[j, wg_m], ws_smem[j, wg_idx if paired else 0, pl.ds(0, tn)]
                    if swiglu:
                        w_scale = ws_smem[j, wg_idx, 0]
                    else:
                        w_scale = ws_smem[j, wg_ws]
                    return xs_smem[j, wg_m] * w_scale

                def promote(out, acc_ref, wait_n, rows):
                    """out + the partial in acc_ref (once at most wait_n later wgmmas are in flight) x rows() [tm],
                    the row scales (read after the wait)."""
                    part = plgpu.wgmma_accumulator_load(acc_ref, wait_n=wait_n)
                    scales = rows()
                    if column:
                        xsc, wsc_ = scales
                        return out + part * lax.broadcast_in_dim(xsc, (tm, tn), [0]) * lax.broadcast_in_dim(
                            wsc_, (tm, tn), [1]
                        )
                    return out + part * lax.broadcast_in_dim(scales, (tm, tn), [0])

                def issue(acc_ref, j, a_smem, b_smem):
                    ks_ = pl.ds(j * GROUP, GROUP)
                    b = b_smem.at[wg_idx, :, ks_] if swiglu or paired else b_smem.at[wg_n, ks_]
                    plgpu.wgmma(acc_ref, a_smem.at[wg_m, ks_], b.transpose((1, 0)))

                def mma_body(_, a_smem, b_smem, xs_smem, ws_smem, acc):
                    def mmas(*acc_refs):  # one fresh (zeroed) accumulator per K group of the stage
                        for j, acc_ref in enumerate(acc_refs):
                            issue(acc_ref, j, a_smem, b_smem)
                        out = acc
                        for j, acc_ref in enumerate(acc_refs):
                            # group j is done once at most gps-1-j later wgmmas are in flight: its promotion
                            # overlaps them
                            out = promote(out, acc_ref, gps - 1 - j, lambda j=j: row_scale(j, xs_smem, ws_smem))
                        return out

                    return pl.run_scoped(mmas, *[plgpu.ACC((tm, tn), jnp.float32)] * gps)

                k_range = pl.ds(g0 * GROUP, ksteps * step_k)
                if column:
                    b_unit = b_gmem.at[:, pl.ds(start, tn), k_range] if paired else b_gmem.at[pl.ds(start, tn), k_range]
                    ws_unit = ws_gmem.at[pl.ds(g0, ksteps * gps), n_idx]
                elif swiglu:
                    b_unit = b_gmem.at[:, pl.ds(n_idx * tn, tn), k_range]
                    ws_unit = ws_gmem.at[pl.ds(g0, ksteps * gps), :, pl.ds(n_idx * (tn // wsc), tn // wsc)]
                else:
                    b_unit = b_gmem.at[pl.ds(n_idx * ctn, ctn), k_range]
                    ws_unit = ws_gmem.at[pl.ds(g0, ksteps * gps), pl.ds(n_idx * ctn // wsc, ctn // wsc)]
                get_pipeline(mma_body, compute_context)(
                    a_gmem.at[cta_m, k_range],
                    b_unit,
                    xs_gmem.at[pl.ds(g0, ksteps * gps), cta_m],
                    ws_unit,
                    allocations=pipeline_allocs,
                )

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    units = split * m_iters * n_iters  # cluster work units
    # one CTA per SM: a second one does not fit beside it (registers), it would only queue behind it
    grid = max(1, min(units, num_sms() // cluster))  # clusters
    out_shape = (split, mp, n) if split > 1 else (mp, n)
    scratch = dict(out_smem=plgpu.SMEM((2, num_out_slots, epi_m, epi_n), acc_dtype, transforms=out_transforms))
    out_type = jax.ShapeDtypeStruct(out_shape, acc_dtype)
    if paired:
        wq = wq.reshape(2, n // 2, k)
    if swiglu:
        f_ = n // 2
        b16_swz = plgpu.find_swizzle(tn * 16, "up tile")
        scratch.update(
            up_smem=plgpu.SMEM(
                (tm, tn),
                jnp.bfloat16,
                transforms=(plgpu.TilingTransform((8, b16_swz // 2)), plgpu.SwizzleTransform(b16_swz)),
            ),
            q_smem=plgpu.SMEM((tm, tn), FP8, transforms=in_transforms),
            s_smem=plgpu.SMEM((tm,), jnp.float32),
            handover=plgpu.Barrier(num_arrivals=1, num_barriers=2),
        )  # [up tile ready, up tile read]
        out_type = (jax.ShapeDtypeStruct((mp, f_), FP8), jax.ShapeDtypeStruct((f_ // GROUP, mp), jnp.float32))
        wq = wq.reshape(2, f_, k)
        ws = ws.reshape(kg, 2, f_ // wsc)
    kw = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        kw["interpret"] = interpret if not isinstance(interpret, bool) else InterpretGPUParams()
    f = plgpu.kernel(
        fp8_matmul_kernel,  # its name reaches profiler traces (bench/kernel_trace.py counts it as a GEMM)
        out_type=out_type,
        grid=(grid,),
        grid_names=("cluster_grid",),
        cluster=(cluster,),
        cluster_names=("cluster",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=scratch,
        **kw,
    )
    return f(xq_p, wq, xs_t, ws)


def kernel_weight_scales(ws: jax.Array, n: int, cfg: Fp8MatmulConfig) -> jax.Array:
    """ws [N/128, K/128] -> the kernel's weight-scale operand for `cfg` (an expanded [K/128, N/cols] table; column
    tiles: `column_scale_table`). Expanding costs a broadcast kernel per call (XLA does not hoist it out of a loop):
    the FFN path expands once at load time (`dllm_jax.fp8.with_kernel_scales`) and passes the table in."""
    if cfg.column_scales:
        return column_scale_table(ws, n, cfg)
    return expand_weight_scales(ws, n, ws_cols(cfg))


def pad_activations(xq: jax.Array, xs: jax.Array, mp: int) -> tuple[jax.Array, jax.Array]:
    """xq [M, K] e4m3, xs [M, K/128] -> the kernel's operands (xq_p [Mp, K] with zero pad rows, xs_t [K/128, Mp]
    with scale 0 for them), Mp from `padded_rows`."""
    m = xq.shape[0]
    xq_p = xq if mp == m else jnp.pad(xq, ((0, mp - m), (0, 0)))
    return xq_p, jnp.pad(xs.T, ((0, 0), (0, mp - m)))


def padded_rows(m: int, *configs: Fp8MatmulConfig) -> int:
    """M rounded up to every config's cluster M tile (64, 128 or 256: the larger a multiple of the smaller)."""
    tile = max(c.cluster_tile_m for c in configs)
    return -(-m // tile) * tile


def _check_padded_operands(xq_p, xs_t, wq, ws_k, cfg: Fp8MatmulConfig, what: str) -> None:
    mp, k = xq_p.shape
    n = wq.shape[0]
    kg = k // GROUP
    if xq_p.dtype != FP8 or wq.dtype != FP8 or wq.shape[1] != k or k % GROUP:
        raise ValueError(
            f"{what}: expected e4m3 xq [Mp, K] and wq [N, K] with K % 128 == 0, got "
            f"{xq_p.dtype}{xq_p.shape} and {wq.dtype}{wq.shape}"
        )
    if xs_t.shape != (kg, mp):
        raise ValueError(f"{what}: xs_t must be {(kg, mp)}, got {xs_t.shape}")
    if cfg.column_scales:
        check_column_tiling(n, cfg, what)
        want = column_scale_table_shape(n, k, cfg)
    else:
        want = (kg, n // ws_cols(cfg))
    if ws_k.shape != want:
        raise ValueError(f"{what}: weight scales must be {want} for this config, got {ws_k.shape}")


def fp8_matmul_padded(
    xq_p: jax.Array,
    xs_t: jax.Array,
    wq: jax.Array,
    ws_k: jax.Array,
    *,
    cfg: Fp8MatmulConfig,
    out_dtype=jnp.bfloat16,
    interpret: Any = False,
) -> jax.Array:
    """The Mosaic GPU kernel on operands already in its layouts (the FFN path: `fp8_quantize` writes them).

    xq_p [Mp, K] e4m3 (Mp a multiple of the cluster M tile, `padded_rows`), xs_t [K/128, Mp] fp32, wq [N, K] e4m3,
    ws_k from `kernel_weight_scales`. Returns y [Mp, N] out_dtype, or with cfg.split_k > 1 the fp32 partials
    [split, Mp, N] (the consumer sums them: the SwiGLU quantiser, or the residual add)."""
    _check_padded_operands(xq_p, xs_t, wq, ws_k, cfg, "fp8_matmul_padded")
    return _fp8_kernel_call(xq_p, xs_t, wq, ws_k, cfg=cfg, out_dtype=out_dtype, interpret=interpret)


def _swiglu_smem(cfg: Fp8MatmulConfig) -> int:
    """Shared memory of the fused SwiGLU epilogue: the up tile handed over (bf16), the quantised tile, its scales."""
    return cfg.wg_tile_m * cfg.wg_tile_n * 3 + 4 * cfg.wg_tile_m + 128


def swiglu_fusable(cfg: Fp8MatmulConfig) -> bool:
    """Whether `fp8_gate_up_swiglu` can run with this gate/up tiling: each warpgroup owns one whole 128-wide block
    (its quantisation group), no split-K partials, no CTA cluster, and two pipeline stages fit next to the epilogue's
    buffers."""
    return (
        cfg.wg_dimension == Dim.N
        and cfg.wg_tile_n == GROUP
        and cfg.split_k == 1
        and cfg.cluster_dimension is None
        and stages_that_fit(cfg, jnp.bfloat16, _swiglu_smem(cfg)) >= 2
    )


def fp8_gate_up_swiglu(
    xq_p: jax.Array, xs_t: jax.Array, w_gu: jax.Array, ws_k: jax.Array, *, cfg: Fp8MatmulConfig, interpret: Any = False
) -> tuple[jax.Array, jax.Array]:
    """The FFN's gate/up GEMM with SwiGLU and the down GEMM's activation quantisation in its epilogue.

    xq_p [Mp, K] e4m3, xs_t [K/128, Mp], w_gu [2F, K] e4m3 (gate rows, then up rows), ws_k: the standard scale
    table of w_gu for cfg (`kernel_weight_scales`). Returns (aq [Mp, F] e4m3, as_t [F/128, Mp] fp32), equal to
    `fp8_quantize.swiglu_quantize_t` of the GEMM's bf16 output (and pad rows zeros with scale 1): one kernel and
    no [Mp, 2F] round trip through memory instead of two kernels."""
    mp, k = xq_p.shape
    n = w_gu.shape[0]
    if not swiglu_fusable(cfg):
        raise ValueError(
            f"fp8_gate_up_swiglu: needs swiglu_fusable(cfg) (64 x 128 warpgroup tiles along N, no "
            f"split-K, no cluster), got {cfg}"
        )
    if n % (2 * GROUP):
        raise ValueError(f"fp8_gate_up_swiglu: w_gu must have 2F rows with F % 128 == 0, got {w_gu.shape}")
    _check_padded_operands(xq_p, xs_t, w_gu, ws_k, cfg, "fp8_gate_up_swiglu")
    return _fp8_kernel_call(xq_p, xs_t, w_gu, ws_k, cfg=cfg, out_dtype=jnp.bfloat16, interpret=interpret, swiglu=True)


def fp8_matmul(
    xq: jax.Array,
    xs: jax.Array,
    wq: jax.Array,
    ws: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    backend: str = "pallas",
    interpret: Any = False,
    config: Fp8MatmulConfig | None = None,
) -> jax.Array:
    """y = dequant(xq, xs) @ dequant(wq, ws).T  -> [M, N] out_dtype.

    xq [M, K] e4m3, xs [M, K//128] f32, wq [N, K] e4m3, ws [ceil(N/128), K//128] f32.
    backend "xla": reference numerics anywhere; "pallas": Mosaic GPU kernel
    (N must be a multiple of the cluster N tile -- 128 with the default configs).

    The tiling (config None: `default_config`) is chosen here, outside the jitted body it keys (a patched
    `default_config` gives a new program, never a cached one).
    """
    m, n, k = _check_operands(xq, xs, wq, ws)
    if backend not in ("pallas", "xla"):
        raise ValueError(f"fp8_matmul: backend must be 'pallas' or 'xla', got {backend!r}")
    cfg = None
    if backend == "pallas":
        cfg = config or default_config(m, n, k)
        problem = _tiling_problem(n, k, cfg)
        if problem:
            raise ValueError(f"fp8_matmul(pallas): {problem} (wq {wq.shape}); use backend='xla'")
    return _fp8_matmul_jit(xq, xs, wq, ws, out_dtype=out_dtype, interpret=interpret, cfg=cfg)


def _tiling_problem(n: int, k: int, cfg: Fp8MatmulConfig) -> str | None:
    """Why the kernel cannot run [*, K] @ [N, K].T on this tiling (None: it can)."""
    if k % GROUP:
        return f"K={k} must be a multiple of {GROUP}"
    if cfg.column_scales:
        try:
            check_column_tiling(n, cfg, "fp8_matmul(pallas)")
        except ValueError as e:
            return str(e)
    elif n % cfg.cluster_tile_n:
        return f"N={n} must be a multiple of {cfg.cluster_tile_n}"
    if (k // GROUP) % cfg.split_k:
        return f"split_k={cfg.split_k} must divide K/128={k // GROUP}"
    return None


def kernel_fits(m: int, n: int, k: int) -> bool:
    """Whether the kernel runs an [M, K] @ [N, K].T product on its default tiling (else: the XLA reference)."""
    return k % GROUP == 0 and _tiling_problem(n, k, default_config(m, n, k)) is None


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "cfg"))
def _fp8_matmul_jit(xq, xs, wq, ws, *, out_dtype, interpret, cfg: Fp8MatmulConfig | None):
    """fp8_matmul's program: the reference (cfg None) or the kernel on the given tiling."""
    if cfg is None:
        return fp8_matmul_reference(xq, xs, wq, ws, out_dtype)
    m, n = xq.shape[0], wq.shape[0]  # fp8_matmul checked the operands
    mp = padded_rows(m, cfg)
    xq_p, xs_t = pad_activations(xq, xs, mp)
    ws_k = kernel_weight_scales(ws, n, cfg)
    y = fp8_matmul_padded(xq_p, xs_t, wq, ws_k, cfg=cfg, out_dtype=out_dtype, interpret=interpret)
    if cfg.split_k > 1:
        y = y.sum(axis=0).astype(out_dtype)
    return y[:m] if mp != m else y


# --------------------------------------------------------------------------
# FFN integration helpers
# --------------------------------------------------------------------------
def quantize_ffn_weights(gate, up, down, *, layout: str = "out_in") -> dict:
    """Quantise one SwiGLU FFN's weights (once, at conversion/load time).

    layout "out_in" (torch nn.Linear): gate/up [F, D], down [D, F].
    layout "in_out" (flax Dense kernels): gate/up [D, F], down [F, D].
    Returns {"w_gu": [2F, D] e4m3 (gate rows then up rows), "s_gu": [2F/128, D/128],
             "w_down": [D, F] e4m3, "s_down": [D/128, F/128]} (F % 128 == 0 required).
    """
    if layout == "in_out":
        gate, up, down = gate.T, up.T, down.T
    elif layout != "out_in":
        raise ValueError(f"layout must be 'out_in' or 'in_out', got {layout!r}")
    if gate.shape != up.shape or down.shape != gate.shape[::-1]:
        raise ValueError(f"inconsistent FFN shapes gate {gate.shape} up {up.shape} down {down.shape}")
    f, d = gate.shape
    if f % GROUP or d % GROUP:
        raise ValueError(f"FFN dims must be multiples of 128, got F={f} D={d}")
    w_gu, s_gu = quantize_weights(jnp.concatenate([gate, up], axis=0))
    w_dn, s_dn = quantize_weights(down)
    return {"w_gu": w_gu, "s_gu": s_gu, "w_down": w_dn, "s_down": s_dn}


def swiglu_quantize(gu: jax.Array) -> tuple[jax.Array, jax.Array]:
    """gu [M, 2F] (gate | up) -> quantised silu(gate) * up (fused by XLA)."""
    f = gu.shape[-1] // 2
    g = gu[:, :f].astype(jnp.float32)
    u = gu[:, f:].astype(jnp.float32)
    return quantize_activations(jax.nn.silu(g) * u)


def fp8_ffn(
    h: jax.Array, params: dict, *, backend: str = "pallas", interpret: Any = False, out_dtype=None
) -> jax.Array:
    """SwiGLU FFN with FP8 GEMMs. h: normed activations [..., D] (bf16).

    quantise(h) -> [gate|up] GEMM -> SwiGLU+quantise -> down GEMM -> [..., D].
    """
    lead = h.shape[:-1]
    d = h.shape[-1]
    out_dtype = out_dtype or h.dtype
    x = h.reshape(-1, d)
    xq, xs = quantize_activations(x)
    gu = fp8_matmul(
        xq, xs, params["w_gu"], params["s_gu"], out_dtype=jnp.bfloat16, backend=backend, interpret=interpret
    )
    aq, as_ = swiglu_quantize(gu)
    y = fp8_matmul(
        aq, as_, params["w_down"], params["s_down"], out_dtype=out_dtype, backend=backend, interpret=interpret
    )
    return y.reshape(*lead, y.shape[-1])


def bf16_ffn(h, gate, up, down):
    """Reference bf16 SwiGLU FFN, torch layout (gate/up [F, D], down [D, F])."""
    g = jnp.dot(h, gate.T, preferred_element_type=jnp.float32)
    u = jnp.dot(h, up.T, preferred_element_type=jnp.float32)
    a = (jax.nn.silu(g) * u).astype(h.dtype)
    return jnp.dot(a, down.T, preferred_element_type=jnp.float32).astype(h.dtype)
