"""LaCache's precision half: the e4m3 FFN of every layer but the first (1x128 activation, 128x128 weight scales).

`fp8_ffn_residual` is the FFN half of a layer with `config.fp8_ffn` (the parameter layout is in `params.py`):
layer 0 runs its bf16 SwiGLU (`mlp_first`), the others either the GPU kernels (`kernels.fp8 == "pallas"`: four
kernels, `fp8_ffn_pallas`) or the XLA reference (RMSNorm, jnp quantisation, the dequantising GEMM) elsewhere.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dllm_jax.config import ModelConfig
from dllm_jax.transformer.layers import RMSNorm, SwiGLU
from dllm_jax.transformer.params import GROUP, KERNEL_SCALES, column_scale_key, kernel_scale_key
from pallas_kernels import fp8_matmul as F
from pallas_kernels.fp8_quantize import QuantizeBlocks, rmsnorm_quantize, splitk_residual_add, swiglu_quantize_t

Array = jax.Array


def _kernel_scales(mlp_fp8: dict, src: str, cfg: F.Fp8MatmulConfig) -> Array:
    """The weight-scale table a tiling reads: the load-time leaf where it exists with the right shape (the GPU
    layout, `params.with_kernel_scales`), else built here (a kernel per call)."""
    n, k = mlp_fp8[KERNEL_SCALES[src]].shape
    if cfg.column_scales:
        key, shape = column_scale_key(src, cfg), F.column_scale_table_shape(n, k, cfg)
    else:
        key, shape = kernel_scale_key(src, F.ws_cols(cfg)), (k // GROUP, n // F.ws_cols(cfg))
    table = mlp_fp8.get(key)
    if table is not None and table.shape == shape:
        return table
    return F.kernel_weight_scales(mlp_fp8[src], n, cfg)


class FfnPlan(NamedTuple):
    """Every tiling choice of the FP8 FFN at one M (hashable: the static key of `_fp8_ffn_kernels`)."""

    gate_up: Any  # Fp8MatmulConfig of the gate/up GEMM
    fused: bool  # SwiGLU + quantise in the gate/up GEMM's epilogue (where its tiling allows it)
    down: Any  # Fp8MatmulConfig of the down GEMM
    norm_blocks: Any = None  # QuantizeBlocks of the RMSNorm quantiser
    swiglu_blocks: Any = None  # QuantizeBlocks of the SwiGLU quantiser (unfused gate/up)


def gate_up_plan(m: int, f2: int, d: int) -> tuple[F.Fp8MatmulConfig, bool]:
    """(tiling, fused) of the gate/up GEMM for m rows: the default tiling, writing silu(gate) * up already quantised
    where that tiling allows it (LLaDA-8B at block-step M). Forcing the 256-wide tiles to fuse was slower for
    Dream-7B (3.72 vs 3.66 ms per batch-1 block step)."""
    cfg = F.default_config(m, f2, d)
    return cfg, F.swiglu_fusable(cfg)


def ffn_plan(m: int, f2: int, d: int, gate_up: tuple | None = None) -> FfnPlan:
    """The FFN's tilings for m rows, chosen outside the jitted kernels (so a tiling chosen differently at the next
    trace is a new program, never a cached trace of the old one). gate_up: a (config, fused) pair instead of
    `gate_up_plan`'s (tests)."""
    cfg_gu, fused = gate_up or gate_up_plan(m, f2, d)
    down = F.default_config(m, d, f2 // 2)
    mp = F.padded_rows(m, cfg_gu, down)
    return FfnPlan(
        cfg_gu, fused, down, QuantizeBlocks.for_rmsnorm(d, m), None if fused else QuantizeBlocks.for_swiglu(mp)
    )


def fp8_ffn_pallas(
    x: Array,
    norm_scale: Array,
    eps: float,
    mlp_fp8: dict,
    interpret: bool = False,
    residual: Array | None = None,
    gate_up: tuple | None = None,
) -> Array:
    """The FFN half of a layer on the GPU kernels: s + down(swiglu(gate_up(rmsnorm(s)))), s = x (+ residual),
    x and residual [M, d].

    Four kernels: residual add + RMSNorm + quantise (Triton), the gate/up FP8 GEMM with SwiGLU + quantise in its
    epilogue (Mosaic GPU; where its tiling does not allow that, the GEMM and a Triton split-K sum + SwiGLU +
    quantise), the down FP8 GEMM, and the split-K sum + residual add (Triton). Same numerics as the XLA path up to
    the order of fp32 sums. The kernels run inside one jitted function keyed by the plan, so the layers of a model
    share one traced body: jax lowers each kernel once per program (lowered per layer, LLaDA-8B's first FP8
    compile took 126 s instead of 13)."""
    m, d = x.shape
    plan = ffn_plan(m, mlp_fp8["w_gu"].shape[0], d, gate_up)
    return _fp8_ffn_kernels(x, norm_scale, mlp_fp8, residual, eps=float(eps), interpret=interpret, plan=plan)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "plan"))
def _fp8_ffn_kernels(x, norm_scale, mlp_fp8, residual, *, eps: float, interpret, plan: FfnPlan):
    m, d = x.shape
    mp = F.padded_rows(m, plan.gate_up, plan.down)
    if residual is None:
        xq, xs_t = rmsnorm_quantize(x, norm_scale, eps=eps, m_pad=mp, blocks=plan.norm_blocks, interpret=interpret)
    else:
        xq, xs_t, x = rmsnorm_quantize(
            x, norm_scale, eps=eps, m_pad=mp, residual=residual, blocks=plan.norm_blocks, interpret=interpret
        )
    ws_gu = _kernel_scales(mlp_fp8, "s_gu", plan.gate_up)
    if plan.fused:
        aq, as_t = F.fp8_gate_up_swiglu(xq, xs_t, mlp_fp8["w_gu"], ws_gu, cfg=plan.gate_up, interpret=interpret)
    else:
        gu = F.fp8_matmul_padded(
            xq, xs_t, mlp_fp8["w_gu"], ws_gu, cfg=plan.gate_up, out_dtype=jnp.bfloat16, interpret=interpret
        )
        aq, as_t = swiglu_quantize_t(gu, live_rows=m, blocks=plan.swiglu_blocks, interpret=interpret)
    y = F.fp8_matmul_padded(
        aq,
        as_t,
        mlp_fp8["w_down"],
        _kernel_scales(mlp_fp8, "s_down", plan.down),
        cfg=plan.down,
        out_dtype=x.dtype,
        interpret=interpret,
    )
    if y.ndim == 3:  # split-K partials: summed and added to the residual stream in one kernel
        return splitk_residual_add(y, x, interpret=interpret)
    return x + y[:m].astype(x.dtype)


def fp8_ffn_residual(
    params: dict,
    config: ModelConfig,
    layer_params: dict,
    layer_index: Any,
    x: Array,
    attn_out: Array | None = None,
    backend: str = "xla",
    interpret: bool = False,
) -> Array:
    """s + FFN(ffn_norm(s)) of one layer [B, n, d], s = x + attn_out (when given): bf16 SwiGLU for layer 0, FP8 for
    the rest.

    backend "xla": RMSNorm, jnp quantisation, the dequantising reference GEMM; "pallas" (the GPU default):
    `fp8_ffn_pallas` (the residual add fused into its RMSNorm kernel). The unrolled layer loop picks layer 0's
    path statically; the scan over stacked layers uses a lax.cond on its traced index."""
    norm = RMSNorm(config.rms_eps, config.jnp_dtype)

    def first(x, o):  # o: attn_out or None (an empty pytree, also through lax.cond)
        s = x if o is None else x + o
        h = norm.apply({"params": layer_params["ffn_norm"]}, s)
        return s + SwiGLU(config.mlp_hidden, config.jnp_dtype).apply({"params": params["mlp_first"]}, h)

    def rest(x, o):
        if backend == "pallas":
            b, n, d = x.shape
            scale = layer_params["ffn_norm"]["scale"]
            return fp8_ffn_pallas(
                x.reshape(b * n, d),
                scale,
                config.rms_eps,
                layer_params["mlp_fp8"],
                interpret,
                residual=None if o is None else o.reshape(b * n, d),
            ).reshape(b, n, d)
        s = x if o is None else x + o
        h = norm.apply({"params": layer_params["ffn_norm"]}, s)
        return s + F.fp8_ffn(h, layer_params["mlp_fp8"], backend=backend, out_dtype=h.dtype)

    if config.fp8_first_layer:  # layer 1 in FP8 as well
        return rest(x, attn_out)
    if isinstance(layer_index, int):  # the unrolled layer loop: a static choice, no conditional in the program
        return first(x, attn_out) if layer_index == 0 else rest(x, attn_out)
    return jax.lax.cond(layer_index == 0, first, rest, x, attn_out)
