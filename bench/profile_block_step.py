"""Where a dual-cache block step's time goes (issue 7), by timed variants that drop one stage, plus skinny GEMMs.

For LLaDA-8B / Dream-7B shapes (random bf16 weights on the device), batch 1/8/32, a 512-slot cache and a 32-token
block, it times 8 block steps fused in one jitted fori_loop, on the engine's default layer layout (`--layer-layout
auto`: per-layer weights and an unrolled layer loop on a GPU, see `dllm_jax.loading.resolve_layer_layout`):
  ms_block_step    the engine's block step (first attention backend of --backends)
  xla_baseline_ms  the plain-XLA step: stacked weights under lax.scan, cuDNN attention (the engine before issue 7)
  ms_attn_<b>      the step with attention backend <b> (xla / cudnn / pallas)
  ms_no_attention  attention replaced by a broadcast of V (same shapes, no softmax/PV)
  ms_no_ffn        the SwiGLU FFN skipped
  ms_<variant>     the step with one choice of the default reverted (--variants: unfused projections, a stacked
                   cache) or a candidate kernel (pallas_ffn / mgpu_ffn: the weight-streaming FFN GEMMs)
  trace_per_step   (--trace) device ms per kernel kind and the top kernels, from a jax.profiler trace
  long_loop        (--long-loop L) the step's marginal ms inside a jitted loop (slope between 8 and L fused steps;
                   generate runs a whole generation as one call) and the per-call overhead a call of 8 carries
and standalone weight-streaming GEMMs (M in 32, 64, 256) with their effective bandwidth. The HBM floor of a step
is (all weights read once + the K/V cache read once) / 4.3 TB/s; the compute floor (ms_floor_compute) 2 FLOPs per
weight per token at 790 TFLOP/s (it dominates from batch ~16). Writes bench/results/block_step_h200.json and
prints a table. Run on the GPU: `python bench/profile_block_step.py [--models llada-8b] [--batches 1 8 32]`; set
XLA_FLAGS to compare XLA settings (recorded in the JSON meta). CPU smoke: `--models tiny --batches 1 --backends xla`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from dllm_jax import modeling  # noqa: E402
from dllm_jax.caches import STRATEGIES  # noqa: E402
from dllm_jax.caches.base import DecodeInputs  # noqa: E402
from dllm_jax.loading import resolve_layer_layout  # noqa: E402
from dllm_jax.generate import GenerationConfig, compiler_options as engine_options  # noqa: E402
from dllm_jax.modeling import Block  # noqa: E402

HBM_BYTES_PER_S = 4.3e12
BF16_FLOPS_PER_S = 790e12  # achievable dense bf16 on an H200 (HOPPER.md / anchors)
VARIANTS = {
    "unfused": "per-layer weights with separate q/k/v and gate/up GEMMs (unstack_layers(fuse=False))",
    "stacked_cache": "one stacked [L, ...] K/V buffer instead of per-layer buffers",
    "fp8_ffn": "the same weights with LaCache's FP8 FFN in layers >= 2 (issue 5: its speedup at equal everything "
               "else), compiled with generate's XLA options for that program (v16; fp8_ffn* variants without options "
               "of their own too)",
    "fp8_ffn_v5": "the FP8 FFN on session 5's wrapper (jnp quantisation and pads, weight scales expanded per call)",
    "fp8_ffn_narrow": "the FP8 FFN with 128-wide CTA N tiles at M <= 64 (FP8_WIDE_SMALL_M=0: the tiling before v6)",
    "fp8_ffn_g1": "the FP8 FFN with one 128-K group per pipeline stage (FP8_GROUPS_PER_STEP=1)",
    "fp8_ffn_g2": "the FP8 FFN with two 128-K groups per pipeline stage (FP8_GROUPS_PER_STEP=2)",
    "fp8_ffn_g4": "the FP8 FFN with four 128-K groups per pipeline stage where they fit (FP8_GROUPS_PER_STEP=4)",
    "fp8_ffn_xla_sum": "the FP8 FFN with XLA's split-K sum and residual add (FP8_SPLITK_RESIDUAL_KERNEL=0)",
    "fp8_ffn_overlap": "the FP8 FFN with each stage's last K group promoted in the next step (FP8_OVERLAP_STEPS=1, "
                       "where 3 stages fit; v10: 1.02-3.6x slower per GEMM)",
    "fp8_ffn_pingpong": "the FP8 FFN with the two compute warpgroups of every FP8 GEMM taking turns at the tensor "
                        "cores (fp8_matmul.PINGPONG_FROM_M = 1, FP8_PINGPONG=1; v15)",
    "o_proj_partials": "o_proj as 2 split-K partials (residual_rmsnorm.linear_partials: one batched GEMM, 128 CTA "
                       "tiles at M = 256 where cuBLAS runs the plain GEMM on 64) summed by XLA into the next add (v15)",
    "o_proj_partials_cublas": "o_proj_partials compiled with xla_gpu_enable_triton_gemm=false (the batched GEMM on "
                              "cuBLAS instead of a Triton fusion)",
    "fp8_ffn_o_proj_partials": "the FP8 FFN variant with o_proj_partials",
    "fp8_ffn_o_proj_partials_cublas": "the FP8 FFN variant with o_proj_partials_cublas",
    "fp8_ffn_cublas": "the FP8 FFN variant compiled with xla_gpu_enable_triton_gemm=false (the twin of "
                      "fp8_ffn_o_proj_partials_cublas)",
    "fp8_ffn_v14_quantizers": "the FP8 FFN with session 14's quantiser tilings (SwiGLU 16 rows per program, RMSNorm "
                              "4 warps: QuantizeBlocks.for_swiglu / for_rmsnorm before v15)",
    "fp8_ffn_pingpong_256": "the FP8 FFN with pingpong from M = 256 on (FP8_PINGPONG=256: not at batch-1 block steps)",
    "fp8_ffn_two_slots": "the FP8 FFN without v10's one-slot epilogue for split-K at M = 65-256 (FP8_ONE_SLOT=0: "
                         "one K group per stage on 4 stages there, the v9 default)",
    "fp8_ffn_tail_split": "the FP8 FFN with the gate/up GEMM's last partial wave as a split-K second kernel where "
                          "that applies (FP8_TAIL_SPLIT=1: Dream-7B at block-step M; v11: slower per GEMM, "
                          "48.0 vs 43.7 us)",
    "fp8_ffn_no_column": "the FP8 FFN without v17's column tiles (FP8_COLUMN_TILES=0: Dream-7B's gate/up at "
                         "block-step M on 296 128-wide tiles instead of one wave of 132 paired 144-wide tiles)",
    "fp8_ffn_unfused_swiglu": "the FP8 FFN with the gate/up GEMM's bf16 output and a separate SwiGLU quantiser "
                              "(FP8_FUSE_SWIGLU=0: v6's kernels, tilings by default_config)",
    "xla_norm_rope": "residual adds, RMSNorms, RoPE and the K/V cache writes as XLA ops (norm_rope_backend='xla', "
                     "the default) beside a step run with --norm-rope pallas (dllm_jax/fused_layers.py)",
    "fp8_ffn_xla_norm_rope": "the FP8 FFN variant with norm_rope_backend='xla' (v12's fused kernels measured on it)",
    "pallas_attn_fine_split": "attention on the Pallas slot kernel with KV splits of one tile where it splits "
                              "(slot_attention.MIN_TILES_PER_SPLIT=1: the default since v12, 4 before)",
    "pallas_attn_no_split": "attention on the Pallas slot kernel without KV splits (MIN_TILES_PER_SPLIT=10**6)",
    "pallas_attn_v12_tiles": "attention on the Pallas slot kernel with v12's default tiling (BlockSizes.get_default "
                             "before the v13 sweep: 64-key tiles on 2 stages for MHA block steps, 128 from a wave)",
    "pallas_attn_bf16_partials": "attention on the Pallas slot kernel with split-K partials stored as o / l in bf16 "
                                 "(slot_attention.BF16_PARTIALS=True)",
    "pallas_rope": "RoPE + the K/V write as one kernel fed by the q/k/v GEMM's split-K partials at block steps "
                   "(norm_rope_backend='pallas_rope': one kernel instead of XLA's three per layer)",
    "merge_kernel": "the slot kernel's split-K merge as one Pallas kernel (slot_attention.MERGE_KERNEL=True) instead "
                    "of XLA's two fusions",
    "pallas_rope_merge": "pallas_rope and merge_kernel together",
    "pallas_rope_merge_s4": "pallas_rope_merge with the q/k/v GEMM split 4 ways (fused_layers.QKV_SPLITS; XLA's own "
                            "split at LLaDA-8B's M = 32; 2 since v14. Runs v14d/v14e, at commit f193222, had 4 as the "
                            "default and timed 2 as pallas_rope_merge_s2)",
    "fp8_ffn_pallas_rope_merge": "the FP8 FFN variant with pallas_rope and merge_kernel",
    "v13_kernels": "session 13's default kernels: XLA's RoPE and K/V writes (norm_rope_backend='xla') and XLA's "
                   "split-K merge of the attention (slot_attention.MERGE_KERNEL=False)",
    "pallas_ffn": "the FFN on the Triton weight-streaming GEMM (a session-3 dead end)",
    "mgpu_ffn": "the FFN on the Mosaic GPU streaming GEMM (a session-3 dead end)",
}
CACHE_SLOTS, BLOCK, FUSED = 512, 32, 8
# variants compiled with XLA options (Lowered.compile(compiler_options=)) on top of their module patches
VARIANT_COMPILER_OPTIONS = {v: {"xla_gpu_enable_triton_gemm": False} for v in VARIANTS if v.endswith("_cublas")}


def _o_proj_partials(self, attn):
    """Block.attn_projection as 2 split-K partials summed in fp32 and rounded once (the o_proj_partials variants)."""
    from pallas_kernels.residual_rmsnorm import linear_partials, projection_from_partials

    b, n = attn.shape[:2]
    kernel = self.o_proj.variables["params"]["kernel"]
    flat = attn.reshape(b * n, -1)
    return projection_from_partials(linear_partials(flat, kernel, 2), None, attn.dtype).reshape(b, n, -1)


# The FP8 variants as module-attribute overrides (default_config and the FFN read them at trace time).
FP8_FLAG_OVERRIDES = {
    "fp8_ffn_v5": {"WIDE_SMALL_M": False, "FUSE_SWIGLU": False},
    "fp8_ffn_narrow": {"WIDE_SMALL_M": False, "FUSE_SWIGLU": False},
    "fp8_ffn_unfused_swiglu": {"FUSE_SWIGLU": False},
    "fp8_ffn_xla_sum": {"SPLITK_RESIDUAL_KERNEL": False},
    "fp8_ffn_g1": {"GROUPS_PER_STEP": 1},
    "fp8_ffn_g2": {"GROUPS_PER_STEP": 2},
    "fp8_ffn_g4": {"GROUPS_PER_STEP": 4},
    "fp8_ffn_overlap": {"OVERLAP_STEPS": True},
    "fp8_ffn_two_slots": {"ONE_SLOT_EPILOGUE": False},
    "fp8_ffn_pingpong": {"PINGPONG_FROM_M": 1},
    "fp8_ffn_pingpong_256": {"PINGPONG_FROM_M": 256},
    "fp8_ffn_tail_split": {"TAIL_SPLIT": True},
    "fp8_ffn_no_column": {"COLUMN_TILES": False},
}


def _v5_ffn(x, norm_scale, eps, mlp_fp8, interpret=False, residual=None):
    """Session 5's FP8 FFN wrapper: jnp RMSNorm and quantisation, pads, weight scales expanded per call."""
    from dllm_jax import fp8
    from dllm_jax.layers import RMSNorm
    from pallas_kernels.fp8_matmul import fp8_ffn

    x = x if residual is None else x + residual
    h = RMSNorm(eps, x.dtype).apply({"params": {"scale": norm_scale}}, x)
    return x + fp8_ffn(h, fp8.without_kernel_scales(mlp_fp8), backend="pallas", interpret=interpret)


def _fake_attend(q, k, v, key_mask=None, backend="xla"):
    g = q.shape[2] // v.shape[2]
    return jnp.repeat(v[:, :1], q.shape[1], axis=1).repeat(g, axis=2).astype(q.dtype)


def _v12_tiles(cls, *, batch, q_len, kv_len, q_heads, kv_heads, head_dim, split_rule=None):
    """slot_attention.BlockSizes.get_default as it was in v12 (the same-run twin of the v13 tiling)."""
    from pallas_kernels.slot_attention import _NUM_SMS, _next_pow2, default_block_q

    gp = _next_pow2(q_heads // kv_heads)
    small_q = q_len <= 64
    block_q = default_block_q(q_len, q_heads, kv_heads)  # unchanged since v12
    nq = -(-q_len // block_q)
    block_k, num_warps, num_stages = 64, 4, 3
    if small_q and gp == 1:
        num_stages = 2
        if batch * kv_heads * nq >= _NUM_SMS:
            block_k = 128
    block_k = min(block_k, max(16, _next_pow2(kv_len)))
    return cls(block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages, kv_splits=None)


@contextlib.contextmanager
def variant(name: str):
    """Temporarily change one stage of the block: attributes patched for the duration (read at trace time)."""
    from dllm_jax import fp8, fused_layers
    from pallas_kernels import fp8_matmul

    patches = []
    if name == "no_attention":
        patches += [(modeling, "attend", _fake_attend), (fused_layers, "attend", _fake_attend)]
    elif name == "no_ffn":  # the fused loop's FFN output is then a zero delta (its add stays in the next norm)
        patches += [(Block, "finish", lambda self, x, attn: self.attn_residual(x, attn)),
                    (Block, "ffn", lambda self, h: jnp.zeros_like(h))]
    elif name == "fp8_ffn_v5":
        patches.append((fp8, "fp8_ffn_pallas", _v5_ffn))
    elif name == "pallas_attn_fine_split":
        from pallas_kernels import slot_attention

        patches.append((slot_attention, "MIN_TILES_PER_SPLIT", 1))
    elif name == "pallas_attn_no_split":
        from pallas_kernels import slot_attention

        patches.append((slot_attention, "MIN_TILES_PER_SPLIT", 10**6))
    elif name == "pallas_attn_v12_tiles":
        from pallas_kernels import slot_attention

        patches.append((slot_attention.BlockSizes, "get_default", classmethod(_v12_tiles)))
    elif name == "pallas_attn_bf16_partials":
        from pallas_kernels import slot_attention

        patches.append((slot_attention, "BF16_PARTIALS", True))
    if name in ("merge_kernel", "pallas_rope_merge", "pallas_rope_merge_s4", "fp8_ffn_pallas_rope_merge"):
        from pallas_kernels import slot_attention

        patches.append((slot_attention, "MERGE_KERNEL", True))
    if name == "v13_kernels":
        from pallas_kernels import slot_attention

        patches.append((slot_attention, "MERGE_KERNEL", False))
    if name == "pallas_rope_merge_s4":
        patches.append((fused_layers, "QKV_SPLITS", 4))
    if "o_proj_partials" in name:
        patches.append((Block, "attn_projection", _o_proj_partials))
    if name == "fp8_ffn_v14_quantizers":
        from pallas_kernels import fp8_quantize

        qb = fp8_quantize.QuantizeBlocks
        patches += [(qb, "for_swiglu", classmethod(lambda cls, mp: cls(block_m=min(16 if mp <= 256 else 64, mp & -mp)))),
                    (qb, "for_rmsnorm", classmethod(lambda cls, k, m: cls()))]
    for attr, value in FP8_FLAG_OVERRIDES.get(name, {}).items():
        patches.append((fp8_matmul if hasattr(fp8_matmul, attr) else fp8, attr, value))
    with contextlib.ExitStack() as stack:
        for obj, attr, value in patches:
            stack.enter_context(mock.patch.object(obj, attr, value))
        yield


def time_step(model_cfg, params, batch: int, backend: str, ffn_backend: str = "xla", trace: dict | None = None,
              stacked_cache: bool = False, long_loop: dict | None = None, norm_rope: str | None = None,
              hlo_path: Path | None = None, compiler_options: dict | None = None) -> float:
    """ms per dual-cache block step (8 fused). trace: a dict to fill with the per-step kernel breakdown.
    norm_rope: the norm_rope_backend (None: the engine's default, GenerationConfig's).
    stacked_cache: one [L, ...] K/V buffer even for per-layer params (the engine's layout before v4).
    long_loop: {"steps": L} to also time L and (8 + L) // 2 fused steps; filled by `loop_costs` (marginal_ms: the
    slope between the 8- and L-step loops, one more step's cost inside a jitted loop, as in generate, where the
    whole generation is one call; the middle length checks that it is linear;
    call_overhead_ms: what a call of 8 costs beyond 8 such steps, host and device: NOTES v8) and dispatch_ms (a
    jitted call that only passes the same arguments through: the host's share of argument handling).
    hlo_path: also write XLA's optimised HLO of the call (gzip text) there: which GEMMs split K, what each fusion
    holds (the trace names kernels by fusion).
    compiler_options: XLA debug options for this step's compilations only (`Lowered.compile(compiler_options=)`),
    so several XLA settings are compared in one process on the same weights."""
    t = CACHE_SLOTS
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
    inp = DecodeInputs(pos, jnp.ones((batch, t), bool), jnp.zeros((batch, t), bool), t - 4 * BLOCK, BLOCK,
                       0, backend, padded=False, ffn_backend=ffn_backend,
                       norm_rope_backend=norm_rope or GenerationConfig.norm_rope_backend)
    x = jnp.full((batch, t), 7, jnp.int32)
    strat = STRATEGIES["dual"]
    bs = jnp.int32(t - 2 * BLOCK)

    # the cache is updated in place, as in generate (no copy per call)
    @functools.partial(jax.jit, donate_argnums=1, static_argnums=2)
    def run(params, state, steps: int):
        def body(i, carry):
            st, acc = carry
            logits, st = strat.step(params, model_cfg, inp, st, x, bs)
            return st, acc + logits[0, 0, 0].astype(jnp.float32)
        return jax.lax.fori_loop(0, steps, body, (state, jnp.float32(0)))

    state = [strat.init(params, model_cfg, inp, x)]
    if stacked_cache:
        state[0] = state[0].stacked()

    executables: dict[int, Any] = {}

    def executable(steps: int):
        if not compiler_options:
            return lambda p, st: run(p, st, steps)
        if steps not in executables:
            executables[steps] = run.lower(params, state[0], steps).compile(compiler_options=compiler_options)
        return executables[steps]

    def call(steps: int = FUSED):
        st, acc = executable(steps)(params, state[0])
        acc.block_until_ready()
        state[0] = st

    med, _ = common.time_call(call, reps=5)
    if hlo_path is not None:
        import gzip

        Path(hlo_path).parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(hlo_path, "wt") as f:
            f.write(run.lower(params, state[0], FUSED).compile(compiler_options=compiler_options).as_text())
    if long_loop is not None:
        steps = long_loop["steps"]
        mid = (FUSED + steps) // 2
        med_long, _ = common.time_call(lambda: call(steps), reps=5)
        mid_args = ()  # a third length between the two: whether the slope is a per-step cost (NOTES v8 asked)
        if FUSED < mid < steps:
            mid_args = (common.time_call(lambda: call(mid), reps=5)[0], mid)
        passthrough = jax.jit(lambda p, st: (st, p["embed"][0, 0]), donate_argnums=1)

        def dispatch():
            st, e = passthrough(params, state[0])
            e.block_until_ready()
            state[0] = st

        med_dispatch, _ = common.time_call(dispatch, reps=20)
        long_loop.update(loop_costs(med, FUSED, med_long, steps, *mid_args), dispatch_ms=1e3 * med_dispatch)
    if trace is not None:
        from kernel_trace import kernel_breakdown

        bd = kernel_breakdown(call)
        trace.update({k: (v / FUSED if k in ("kernels_per_call", "busy_ms", "span_ms", "idle_ms") else v)
                      for k, v in bd.items()})
        trace["by_kind_ms"] = {k: v / FUSED for k, v in bd.get("by_kind_ms", {}).items()}
        for key in ("top", "gaps_before"):
            trace[key] = [{**t, "ms": t["ms"] / FUSED, "count": t["count"] / FUSED} for t in bd.get(key, [])]
    return 1e3 * med / FUSED


LINEAR_TOLERANCE = 0.02  # a loop whose middle length sits within 2% of the line counts as linear


def loop_costs(t_short: float, short: int, t_long: float, long: int, t_mid: float | None = None,
               mid: int | None = None) -> dict:
    """From the seconds of a call of `short` and of `long` fused steps: marginal_ms, the slope (one more step of a
    loop), call_overhead_ms (what a call of `short` costs beyond its steps at that rate) and ms_long (the long call
    per step). With a third length (t_mid seconds for `mid` steps, v9): mid_residual_frac, how far that call sits
    from the line through the other two (relative to its time), and linear (within LINEAR_TOLERANCE): the check that
    a two-point slope is a per-step cost. A slope <= 0 (noise larger than the extra steps) is flagged instead of
    being reported as a speed."""
    marginal = (t_long - t_short) / (long - short)
    out = {"marginal_ms": 1e3 * marginal, "call_overhead_ms": 1e3 * (t_short - short * marginal),
           "ms_long": 1e3 * t_long / long}
    if marginal <= 0:
        out["warning"] = "slope <= 0: the long loop was not slower than the short one (noise); do not use"
    if t_mid is not None:
        if mid is None or not short < mid < long:
            raise ValueError(f"loop_costs: the middle length must lie between {short} and {long}, got {mid}")
        residual = t_mid - (t_short + marginal * (mid - short))
        out.update(mid_steps=mid, mid_residual_ms=1e3 * residual, mid_residual_frac=residual / t_mid,
                   linear=abs(residual / t_mid) <= LINEAR_TOLERANCE)
    return out


def fp8_model(cfg, stacked, layout: str):
    """(config, params) with the FP8 FFN, quantised on the device from the same bf16 weights, in `layout`."""
    from dllm_jax import fp8

    params, cfg8 = fp8.quantize_params(stacked, cfg, on_device=True)
    return cfg8, (modeling.unstack_layers(params) if layout == "unrolled" else params)


def _try(fn, row: dict, name: str):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  (one failing variant must not lose the others)
        row[f"error_{name}"] = str(e)[:200]
        return None


def gemm_rows(k: int, n: int, ms=(32, 64, 256), name: str = "") -> list[dict]:
    """The engine's bf16 GEMM ([M, K] x [K, N] -> bf16, fp32 accumulation) alone, four weight copies in turn (no L2
    reuse). us: wall time per call (includes the dispatch, ~10-20 us); us_device: the GEMM kernels' device time per
    call from a trace (None off the GPU), the number to compare with the in-step kernels and the byte floor."""
    from kernel_trace import kernel_breakdown

    rows = []
    ws = [(0.02 * jax.random.normal(jax.random.key(10 + j), (k, n), jnp.float32)).astype(jnp.bfloat16)
          for j in range(4)]
    for m in ms:
        xs = [jax.random.normal(jax.random.key(i), (m, k), jnp.bfloat16) for i in range(4)]
        f = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16))
        i = [0]

        def call():
            i[0] += 1
            f(xs[i[0] % 4], ws[i[0] % 4]).block_until_ready()

        med, _ = common.time_call(call, reps=20)
        bd = kernel_breakdown(call, calls=8)
        dev_ms = bd.get("by_kind_ms", {}).get("gemm")
        rows.append({"kind": "gemm_xla", "proj": name, "M": m, "K": k, "N": n, "us": 1e6 * med,
                     "weight_TBps": k * n * 2 / med / 1e12,
                     "us_device": 1e3 * dev_ms if dev_ms else None,
                     "weight_TBps_device": k * n * 2 / (dev_ms / 1e3) / 1e12 if dev_ms else None})
    return rows


def fp8_gemm_rows(k: int, n: int, ms=(32, 64, 256), name: str = "") -> list[dict]:
    """The FP8 GEMM of the FFN path alone (`fp8_matmul` on pre-quantised operands, the engine's wrapper included:
    M padding, the scale layouts, split-K sums), four weight copies in turn. us_device: all its kernels' device
    time per call; us_kernel: the Mosaic GPU kernel alone (the longest kernel of the call); weight_TBps_*: the
    e4m3 weight bytes over those times (the floor's view: half the bf16 bytes)."""
    from kernel_trace import kernel_breakdown
    from dllm_jax.fp8 import fp8_backend
    from pallas_kernels.fp8_matmul import fp8_matmul, quantize_activations, quantize_weights

    rows = []
    wts = [quantize_weights((0.02 * jax.random.normal(jax.random.key(20 + j), (n, k), jnp.float32))
                            .astype(jnp.bfloat16)) for j in range(4)]
    for m in ms:
        xs = [quantize_activations(jax.random.normal(jax.random.key(30 + i), (m, k), jnp.bfloat16)) for i in range(4)]
        f = jax.jit(lambda xq, xsc, wq, wsc: fp8_matmul(xq, xsc, wq, wsc, backend=fp8_backend()))
        i = [0]

        def call():
            i[0] += 1
            f(*xs[i[0] % 4], *wts[i[0] % 4]).block_until_ready()

        med, _ = common.time_call(call, reps=20)
        bd = kernel_breakdown(call, calls=8)
        busy = bd.get("busy_ms")
        top = bd.get("top") or [{}]
        kern = top[0].get("ms")
        rows.append({"kind": "gemm_fp8", "proj": name, "M": m, "K": k, "N": n, "us": 1e6 * med,
                     "us_device": 1e3 * busy if busy else None, "us_kernel": 1e3 * kern if kern else None,
                     "kernel_name": top[0].get("name"), "kernels_per_call": bd.get("kernels_per_call"),
                     "weight_TBps_device": k * n / (busy / 1e3) / 1e12 if busy else None,
                     "weight_TBps_kernel": k * n / (kern / 1e3) / 1e12 if kern else None})
    return rows


def proj_rows(cfg, ms=(32, 256)) -> list[dict]:
    """Separate vs fused projections over every layer's own weights (no L2 reuse), as in a block step:
    q/k/v as three GEMMs vs one [d, (Hq + 2 Hkv) D] GEMM, gate/up as two vs one [d, 2F] GEMM."""
    d, f, hd = cfg.d_model, cfg.mlp_hidden, cfg.head_dim
    groups = {"qkv": [cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd], "gate_up": [f, f]}
    rows = []
    for group, widths in groups.items():
        keys = jax.random.split(jax.random.key(1), cfg.n_layers)
        make = jax.jit(lambda k: [(0.02 * jax.random.normal(kk, (d, w), jnp.float32)).astype(jnp.bfloat16)
                                  for kk, w in zip(jax.random.split(k, len(widths)), widths)])
        sep = [make(k) for k in keys]
        fused = [jnp.concatenate(ws, axis=1) for ws in sep]

        def mm(x, w):
            return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

        run_sep = jax.jit(lambda x, ws: [[mm(x, w) for w in layer] for layer in ws])
        run_fused = jax.jit(lambda x, ws: [mm(x, w) for w in ws])
        for m in ms:
            x = jax.random.normal(jax.random.key(m), (m, d), jnp.bfloat16)
            t_sep, _ = common.time_call(lambda: jax.block_until_ready(run_sep(x, sep)), reps=10)
            t_fused, _ = common.time_call(lambda: jax.block_until_ready(run_fused(x, fused)), reps=10)
            nbytes = cfg.n_layers * d * sum(widths) * 2
            rows.append({"kind": "proj_fusion", "group": group, "M": m, "layers": cfg.n_layers,
                         "us_separate": 1e6 * t_sep, "us_fused": 1e6 * t_fused,
                         "TBps_separate": nbytes / t_sep / 1e12, "TBps_fused": nbytes / t_fused / 1e12})
        del sep, fused
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llada-8b", "dream-7b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--backends", nargs="+", default=["cudnn_pallas", "cudnn"],
                    help="attention backends for the default-layout step (the first is the base of the variants)")
    ap.add_argument("--variants", nargs="*", default=["unfused", "stacked_cache"], choices=list(VARIANTS),
                    help="alternatives to the default step, each timed in the same process: " +
                    "; ".join(f"{k}: {v}" for k, v in VARIANTS.items()))
    ap.add_argument("--layer-layout", choices=["auto", "stacked", "unrolled"], default="auto",
                    help="the layout timed as ms_block_step (auto: the engine's default on this backend)")
    ap.add_argument("--no-stages", action="store_true", help="skip the stage-dropping variants (no_attention / no_ffn)")
    ap.add_argument("--no-gemms", action="store_true",
                    help="skip the standalone GEMM rows (bf16 at every projection shape; FP8 at the FFN shapes when "
                    "fp8_ffn is among --variants)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the scanned plain-XLA baseline (diagnostics)")
    ap.add_argument("--trace", action="store_true",
                    help="also trace the default step once (jax.profiler): device ms by kernel kind, launch gaps")
    ap.add_argument("--proj-fusion", action="store_true",
                    help="also time separate vs fused q/k/v and gate/up GEMMs over all layers (standalone)")
    ap.add_argument("--long-loop", type=int, default=0, metavar="L",
                    help="also time the default step and the fp8 variants with L fused steps (L > 8): the marginal "
                    "ms per step (slope between the two loops) and the per-call overhead of a call of 8")
    ap.add_argument("--norm-rope", choices=["auto", "xla", "pallas", "pallas_rope"], default=None,
                    help="norm_rope_backend of the default step and the variants (default: the engine's; "
                    "xla_norm_rope variants always use xla)")
    ap.add_argument("--xla-options", nargs="*", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                    help="XLA debug-option settings to time as variants of the default step in the same process "
                    "(compiled with Lowered.compile(compiler_options=...)); each argument is one variant, recorded as "
                    "ms_xla[<argument>] (and its trace with --trace). A setting that changes GEMM autotuning can reuse "
                    "the in-process autotuning results of an earlier compile: time those in a process of their own")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep only the first N layers of each model (cheaper screening; the floors follow the "
                    "weights)")
    ap.add_argument("--hlo-dir", default=None,
                    help="write the optimised HLO of each default step there (<model>_b<batch>.hlo.txt.gz)")
    ap.add_argument("--out", default=str(common.RESULTS))
    args = ap.parse_args()
    if args.long_loop and args.long_loop <= FUSED:
        ap.error(f"--long-loop must be more than the {FUSED} steps of a timed call, got {args.long_loop}")
    layout = resolve_layer_layout(args.layer_layout)
    xla_variants = {arg: parse_compiler_options(arg) for arg in args.xla_options}  # bad settings fail up front
    forced = args.norm_rope
    step = functools.partial(time_step, norm_rope=forced)  # a variant's own norm_rope= overrides it
    rows = []
    for name in args.models:
        cfg = common.MODELS[name]
        if args.layers:
            if not 1 <= args.layers <= cfg.n_layers:
                ap.error(f"--layers must be in [1, {cfg.n_layers}] for {name}, got {args.layers}")
            cfg = cfg.replace(n_layers=args.layers)
        stacked = common.random_params(cfg)
        weight_bytes = common.param_bytes(stacked) - stacked["embed"].size * 2  # the embedding is gathered
        params = modeling.unstack_layers(stacked) if layout == "unrolled" else stacked
        alternatives: dict[str, tuple] = {}  # (config, params) of the unfused / FP8 variants, built once per model

        def alternative(v: str) -> tuple:
            if v not in alternatives:
                alternatives[v] = ((cfg, modeling.unstack_layers(stacked, fuse=False)) if v == "unfused"
                                   else fp8_model(cfg, stacked, layout))
            return alternatives[v]

        for b in args.batches:
            kv_bytes = 2 * cfg.n_layers * b * CACHE_SLOTS * cfg.n_kv_heads * cfg.head_dim * 2
            timed_layout = "unrolled" if modeling.is_unrolled(params["layers"]) else "stacked"
            row = {"model": name, "batch": b, "cache_slots": CACHE_SLOTS, "block": BLOCK, "layer_layout": timed_layout,
                   "ms_floor_hbm": 1e3 * (weight_bytes + kv_bytes) / HBM_BYTES_PER_S,
                   "ms_floor_compute": floor_compute_ms(weight_bytes, b),
                   "norm_rope_backend": forced or GenerationConfig.norm_rope_backend}
            base = args.backends[0]
            for backend in args.backends:
                first = backend == args.backends[0]
                tr = {} if args.trace and first else None
                ll = {"steps": args.long_loop} if args.long_loop and first else None
                hlo = Path(args.hlo_dir) / f"{name}_b{b}.hlo.txt.gz" if args.hlo_dir and first else None
                row[f"ms_attn_{backend}"] = _try(lambda: step(cfg, params, b, backend, trace=tr, long_loop=ll,
                                                              hlo_path=hlo), row, backend)
                if tr:
                    row["trace_per_step"] = tr
                if ll and "marginal_ms" in ll:
                    row["long_loop"] = ll
            row["ms_block_step"] = row[f"ms_attn_{base}"]
            if args.layers:
                row["layers"] = args.layers
            for arg, opts in xla_variants.items():
                trx = {} if args.trace else None
                llx = {"steps": args.long_loop} if args.long_loop else None
                row[f"ms_xla[{arg}]"] = _try(lambda: step(cfg, params, b, base, trace=trx, long_loop=llx,
                                                          compiler_options=opts), row, f"xla[{arg}]")
                if trx:
                    row[f"trace_xla[{arg}]"] = trx
                if llx and "marginal_ms" in llx:
                    row[f"long_loop_xla[{arg}]"] = llx
            # the plain-XLA baseline: stacked weights under lax.scan, cuDNN attention on a GPU (the v2 engine)
            ref_attn = "cudnn" if jax.default_backend() == "gpu" else "xla"
            row["xla_baseline_ms"] = (None if args.no_baseline else
                                      row["ms_block_step"] if layout == "stacked" and base == ref_attn else
                                      _try(lambda: step(cfg, stacked, b, ref_attn, norm_rope="xla"), row,
                                           "xla_baseline"))
            for v in () if args.no_stages else ("no_attention", "no_ffn"):
                with variant(v):
                    row[f"ms_{v}"] = _try(lambda: step(cfg, params, b, base), row, v)
            for v in args.variants:
                if v == "unfused" and layout == "unrolled":
                    row["ms_unfused"] = _try(lambda: step(*alternative(v), b, base), row, v)
                elif v == "stacked_cache":
                    row["ms_stacked_cache"] = _try(  # the fused norm/RoPE loop needs per-layer buffers
                        lambda: step(cfg, params, b, base, stacked_cache=True, norm_rope="xla"), row, v)
                elif v == "xla_norm_rope":
                    ll0 = {"steps": args.long_loop} if args.long_loop else None
                    row[f"ms_{v}"] = _try(lambda: step(cfg, params, b, base, long_loop=ll0, norm_rope="xla"),
                                          row, v)
                    if ll0 and "marginal_ms" in ll0:
                        row[f"long_loop_{v}"] = ll0
                elif v.startswith("fp8_ffn"):
                    tr8 = {} if args.trace else None
                    ll8 = {"steps": args.long_loop} if args.long_loop else None
                    nr = ("xla" if v.endswith("_xla_norm_rope") else "pallas_rope" if v.endswith("_pallas_rope_merge")
                          else forced)
                    hlo8 = Path(args.hlo_dir) / f"{name}_b{b}_{v}.hlo.txt.gz" if args.hlo_dir else None
                    # a variant's own options, else the ones generate compiles this FP8 program with (v15: Triton
                    # GEMMs off past 64 tokens a block step), so that fp8_ffn is the engine's FP8 step
                    opts8 = VARIANT_COMPILER_OPTIONS.get(v) or engine_options(
                        alternative("fp8_ffn")[0], GenerationConfig(block_length=BLOCK, cache="dual"), b)
                    row[f"options_{v}"] = opts8
                    with variant(v):
                        row[f"ms_{v}"] = _try(lambda: step(*alternative("fp8_ffn"), b, base, trace=tr8,
                                                           long_loop=ll8, norm_rope=nr, hlo_path=hlo8,
                                                           compiler_options=opts8), row, v)
                    if tr8:
                        row[f"trace_{v}"] = tr8
                    if ll8 and "marginal_ms" in ll8:
                        row[f"long_loop_{v}"] = ll8
                        if row.get("long_loop"):
                            row[f"{v}_marginal_speedup"] = row["long_loop"]["marginal_ms"] / ll8["marginal_ms"]
                    if row[f"ms_{v}"] and row["ms_block_step"]:
                        row[f"{v}_speedup"] = row["ms_block_step"] / row[f"ms_{v}"]
                elif v in ("pallas_rope", "merge_kernel", "pallas_rope_merge", "pallas_rope_merge_s4", "v13_kernels",
                           "o_proj_partials", "o_proj_partials_cublas"):
                    llv = {"steps": args.long_loop} if args.long_loop else None
                    trv = {} if args.trace else None
                    nr = "pallas_rope" if v.startswith("pallas_rope") else "xla" if v == "v13_kernels" else forced
                    with variant(v):
                        row[f"ms_{v}"] = _try(lambda: step(cfg, params, b, base, trace=trv, long_loop=llv,
                                                           norm_rope=nr,
                                                           compiler_options=VARIANT_COMPILER_OPTIONS.get(v)), row, v)
                    if trv:
                        row[f"trace_{v}"] = trv
                    if llv and "marginal_ms" in llv:
                        row[f"long_loop_{v}"] = llv
                elif v.startswith("pallas_attn"):
                    with variant(v):
                        row[f"ms_{v}"] = _try(lambda: step(cfg, params, b, "pallas"), row, v)
                elif v.endswith("_ffn"):  # weight-streaming FFN kernels: Triton ("pallas") / Mosaic GPU ("mgpu")
                    row[f"ms_{v}"] = _try(lambda: step(cfg, params, b, base, v.removesuffix("_ffn")), row, v)
            timed = [x for k, x in row.items()
                     if (k.startswith(("ms_attn_", "ms_xla[")) or k.removeprefix("ms_") in VARIANTS) and x]
            row["ms_best_variant"] = min(timed) if timed else None
            rows.append(row)
            save(rows, args.out)  # after every row: a run cut short by a time limit keeps what it measured
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del params, alternatives
        if args.proj_fusion:
            for r in _try(lambda: proj_rows(cfg), {}, "proj") or []:
                rows.append({"model": name, **r})
                save(rows, args.out)
                print(rows[-1], flush=True)
        d, f = cfg.d_model, cfg.mlp_hidden
        gemms = {"qkv": (d, sum(modeling.projection_widths(cfg))), "o": (cfg.n_heads * cfg.head_dim, d),
                 "gate_up": (d, 2 * f), "down": (f, d)}
        for proj, (k, n) in () if args.no_gemms else gemms.items():
            fp8_rows = fp8_gemm_rows if "fp8_ffn" in args.variants and proj in ("gate_up", "down") else None
            for r in gemm_rows(k, n, name=proj) + (_try(lambda: fp8_rows(k, n, name=proj), {}, "fp8") or []
                                                   if fp8_rows else []):
                rows.append({"model": name, **r})
                save(rows, args.out)
                print(rows[-1], flush=True)
        del stacked
    path = save(rows, args.out)
    if plot(rows, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}")
    print(f"wrote {path}")


def parse_compiler_options(arg: str) -> dict:
    """"name=value[,name=value]" -> {name: value} for Lowered.compile(compiler_options=): true/false as bools,
    integers as ints, anything else as a string. Names must be XLA debug options (xla_...)."""
    opts: dict[str, Any] = {}
    for item in filter(None, arg.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("xla_"):
            raise SystemExit(f"--xla-options: expected xla_NAME=VALUE items, got {item!r} in {arg!r}")
        low = value.strip().lower()
        opts[name.strip()] = (low == "true" if low in ("true", "false") else
                              int(low) if low.lstrip("-").isdigit() else value.strip())
    return opts


def floor_compute_ms(weight_bytes: int, batch: int) -> float:
    """GEMM FLOPs of a block step (2 per weight per token, bf16 weights) at the achievable dense rate; attention's
    FLOPs (32 queries x 512 keys) are < 2% of it and left out."""
    return 1e3 * 2 * (weight_bytes / 2) * batch * BLOCK / BF16_FLOPS_PER_S


KIND_ORDER = ("gemm", "attention", "cache_update", "copy", "other")
TABLE_LABELS = {"profile_v3": "v3", "after": "v4", "v5_fp8": "v4 (v5 run)", "v6_fp8": "v4 (v6 run)",
                "v7_fp8": "v4 (v7 run)", "v8_long_loop": "v4 (v8 run)", "v12_default": "v12 (Pallas attention)",
                "v12_norm_rope": "v12 fused norm/RoPE", "v16": "v16"}  # table -> label
# the traced FP8 variant's bar, by table
FP8_LABELS = {"v5_fp8": "FP8 v5", "v6_fp8": "FP8 v6", "v7_fp8": "FP8 v7", "v8_long_loop": "FP8 v7 (v8 run)",
              "v12_default": "FP8 v12", "v16": "FP8 v16"}


def plotted_bars(rows: list[dict]) -> list[dict]:
    """The bars of `plot`: per model and batch, the traced rows of the first table that traced it (the before) and
    of the newest one (rows are appended in run order), a row's traced FP8 variant as a bar of its own; experiment
    rows and comparison rows left out."""
    traced = []
    for r in rows:
        if r.get("table") == "experiment" or r.get("comparison"):
            continue
        label = TABLE_LABELS.get(r.get("table"), r.get("table", ""))
        if r.get("trace_per_step", {}).get("by_kind_ms"):
            traced.append({**r, "label": label})
        # the FP8 variant of the same process (fp8_ffn_cublas: the engine's FP8 step at batch 8 before v16): its own bar
        fp8_trace = r.get("trace_fp8_ffn") or r.get("trace_fp8_ffn_cublas") or {}
        if fp8_trace.get("by_kind_ms"):
            traced.append({**r, "label": FP8_LABELS.get(r.get("table"), "FP8 FFN"), "trace_per_step": fp8_trace})
    tables: dict[tuple, list] = {}
    for r in traced:
        seen = tables.setdefault((r["model"], r["batch"]), [])
        if r.get("table") not in seen:
            seen.append(r.get("table"))
    keep = {key: {t[0], t[-1]} for key, t in tables.items()}
    return [r for r in traced if r.get("table") in keep[(r["model"], r["batch"])]]


def plot(rows: list[dict], path: Path) -> bool:
    """Stacked bars of device ms per kernel kind (`plotted_bars`: per model and batch the first and the newest
    traced table side by side), with each row's HBM floor as a tick. False if no traces."""
    traced = plotted_bars(rows)
    if not traced:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len({r["batch"] for r in traced}), figsize=(18, 5), squeeze=False)
    for ax, batch in zip(axes[0], sorted({r["batch"] for r in traced})):
        order = [*TABLE_LABELS.values(), *FP8_LABELS.values(), "FP8 FFN"]
        sel = sorted((r for r in traced if r["batch"] == batch),
                     key=lambda r: (r["model"], order.index(r["label"]) if r["label"] in order else len(order)))
        labels = [f"{r['model']}\n{r['label']}" for r in sel]
        bottom = [0.0] * len(sel)
        for kind in KIND_ORDER:
            vals = [r["trace_per_step"]["by_kind_ms"].get(kind, 0.0) for r in sel]
            ax.bar(range(len(sel)), vals, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.scatter(range(len(sel)), [max(r["ms_floor_hbm"], r.get("ms_floor_compute", 0.0)) for r in sel],
                   marker="_", s=400, color="k", zorder=3, label="floor (HBM or FLOPs)")
        ax.set_xticks(range(len(sel)), labels, fontsize=6, rotation=45, ha="right")
        ax.set_ylabel("device ms per block step")
        ax.set_title(f"batch {batch}")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Dual-cache block step on H200: device time by kernel kind (jax.profiler trace)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def save(rows: list[dict], out: str) -> Path:
    import os

    return common.write_results("block_step_h200.json", common.meta(what="dual-cache block step profile",
                                                                    xla_flags=os.environ.get("XLA_FLAGS", "")),
                                rows, out)


if __name__ == "__main__":
    main()
