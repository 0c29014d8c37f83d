"""LaCache's precision half: e4m3 FFNs in every layer but the first (1x128 activation, 128x128 weight scales).

Param tree with `config.fp8_ffn`: the stacked bf16 `layers.mlp` is replaced by
    layers.mlp_fp8 = {"w_gu": [L, 2F, D] e4m3, "s_gu": [L, 2F/128, D/128] f32, "w_down": [L, D, F] e4m3,
                      "s_down": [L, D/128, F/128] f32}
    mlp_first      = the first layer's bf16 SwiGLU params (gate_proj/up_proj/down_proj kernels)
Entry 0 of mlp_fp8 exists only to keep the scan over layers uniform; layer 0 runs `mlp_first` (the paper keeps
the first layer's FFN in bf16). Weights are quantised once (conversion `--fp8-ffn` or `load(..., fp8_ffn=True)`).
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ConfigError, ModelConfig

GROUP = 128


def check_fp8_shapes(config: ModelConfig) -> None:
    if config.d_model % GROUP or config.mlp_hidden % GROUP:
        raise ConfigError(f"fp8_ffn needs d_model and mlp_hidden to be multiples of {GROUP}, got "
                          f"d_model={config.d_model}, mlp_hidden={config.mlp_hidden}")


def quantize_layer_mlp(mlp: dict) -> dict:
    """One layer's bf16 SwiGLU params ([in, out] kernels) -> the e4m3 dict of pallas_kernels.fp8_matmul."""
    from pallas_kernels.fp8_matmul import quantize_ffn_weights

    return quantize_ffn_weights(jnp.asarray(mlp["gate_proj"]["kernel"]), jnp.asarray(mlp["up_proj"]["kernel"]),
                                jnp.asarray(mlp["down_proj"]["kernel"]), layout="in_out")


def quantize_stacked_mlp(mlp: dict) -> tuple[dict, dict]:
    """Stacked bf16 mlp params [L, ...] -> (mlp_fp8 stacked [L, ...] as numpy, mlp_first as numpy).

    Layer by layer (a jitted per-layer quantiser): peak memory is one layer's worth of temporaries."""
    n_layers = np.shape(mlp["gate_proj"]["kernel"])[0]
    q1 = jax.jit(quantize_layer_mlp)
    parts = [jax.tree.map(np.asarray, q1(jax.tree.map(lambda a: a[i], mlp))) for i in range(n_layers)]
    stacked = {k: np.stack([p[k] for p in parts]) for k in parts[0]}
    first = jax.tree.map(lambda a: np.asarray(a[0]), mlp)
    return stacked, first


def quantize_params(params: dict, config: ModelConfig, on_device: bool = False) -> tuple[dict, ModelConfig]:
    """bf16 params -> params with FP8 FFNs in layers >= 2, and the config with fp8_ffn=True.

    on_device: quantise all layers at once on the accelerator (benchmarks: weights already live there);
    default: layer by layer into host numpy (conversion and loading: low peak memory).
    Unrolled (per-layer) params are stacked first, which briefly holds both layouts where they live: `load`
    quantises before it unstacks."""
    if config.fp8_ffn:
        return params, config
    check_fp8_shapes(config)
    from dllm_jax.modeling import is_unrolled, stack_layers, unstack_layers

    if is_unrolled(params["layers"]):  # unrolled layout: quantise stacked, hand back unrolled
        out, config = quantize_params(stack_layers(params, config), config, on_device)
        return unstack_layers(out), config
    layers = dict(params["layers"])
    mlp = layers.pop("mlp")
    if on_device:
        stacked = jax.jit(jax.vmap(quantize_layer_mlp))(mlp)
        first = jax.tree.map(lambda a: a[0], mlp)
    else:
        stacked, first = quantize_stacked_mlp(mlp)
    layers["mlp_fp8"] = stacked
    out = dict(params)
    out["layers"] = layers
    out["mlp_first"] = first
    return out, config.replace(fp8_ffn=True)


def fp8_param_shapes(shapes: dict, config: ModelConfig) -> dict:
    """bf16 param shapes -> the FP8-FFN tree's shapes (no allocation)."""
    check_fp8_shapes(config)
    L, d, f = config.n_layers, config.d_model, config.mlp_hidden
    sd = jax.ShapeDtypeStruct
    layers = dict(shapes["layers"])
    mlp = layers.pop("mlp")
    e4m3, f32 = jnp.float8_e4m3fn, jnp.float32
    layers["mlp_fp8"] = {"w_gu": sd((L, 2 * f, d), e4m3), "s_gu": sd((L, 2 * f // GROUP, d // GROUP), f32),
                         "w_down": sd((L, d, f), e4m3), "s_down": sd((L, d // GROUP, f // GROUP), f32)}
    out = dict(shapes)
    out["layers"] = layers
    out["mlp_first"] = jax.tree.map(lambda s: sd(s.shape[1:], s.dtype), mlp)
    return out


def fp8_backend() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "xla"


# The FP8 kernel reads its weight scales as a [K/128, N/cols] table (one 128-byte TMA row per K step and CTA:
# cols = 4 for the 128-wide CTA N tiles of M > 64, 8 for the 256-wide tiles of a block step's M <= 64). Expanding
# s_gu / s_down into it inside the step costs two broadcast kernels per layer (0.10 ms of a LLaDA-8B batch-1 block
# step, bench/NOTES.md v5): the GPU layout stores both tables as leaves (~1.2 MB per LLaDA layer).
KERNEL_SCALE_COLS = (4, 8)
KERNEL_SCALES = {"s_gu": "w_gu", "s_down": "w_down"}


def kernel_scale_key(src: str, cols: int) -> str:
    return f"{src}_tma{cols}"


def column_scale_key(src: str, cfg) -> str:
    """The leaf of a column tiling's per-column scale table (block-step M: `column_small_m_config`)."""
    return f"{src}_col{cfg.wg_tile_n}{cfg.wg_dimension.name}"


def with_kernel_scales(mlp_fp8: dict) -> dict:
    """One layer's mlp_fp8 dict plus the kernel-layout scale tables (numpy stays numpy: host loading): the
    128-byte-row tables of KERNEL_SCALE_COLS, and the per-column table of the block-step column tiling where that
    GEMM has one (Dream-7B's gate/up: ~4.7 MB a layer)."""
    from pallas_kernels.fp8_matmul import column_scale_table, column_small_m_config, expand_weight_scales

    out = dict(mlp_fp8)
    for src, w in KERNEL_SCALES.items():
        ws, (n, k) = mlp_fp8[src], np.shape(mlp_fp8[w])[-2:]
        xp = np if isinstance(ws, np.ndarray) else jnp
        for cols in KERNEL_SCALE_COLS:
            out[kernel_scale_key(src, cols)] = expand_weight_scales(ws, n, cols, xp)
        column = column_small_m_config(1, n, k)
        if column is not None:
            out[column_scale_key(src, column)] = column_scale_table(ws, n, column, xp)
    return out


def without_kernel_scales(mlp_fp8: dict) -> dict:
    return {k: v for k, v in mlp_fp8.items() if "_tma" not in k and "_col" not in k}


def _kernel_scales(mlp_fp8: dict, src: str, cfg) -> jax.Array:
    from pallas_kernels.fp8_matmul import column_scale_table_shape, kernel_weight_scales, ws_cols

    n, k = mlp_fp8[KERNEL_SCALES[src]].shape
    # the load-time table of this tiling where it exists (and has its shape), else built here (a kernel per call)
    if cfg.column_scales:
        key, shape = column_scale_key(src, cfg), column_scale_table_shape(n, k, cfg)
    else:
        key, shape = kernel_scale_key(src, ws_cols(cfg)), (k // GROUP, n // ws_cols(cfg)) if cfg.ws_prefetch else None
    table = mlp_fp8.get(key)
    if table is not None and table.shape == shape:
        return table
    return kernel_weight_scales(mlp_fp8[src], n, cfg)


# The gate/up GEMM writes silu(gate) * up already quantised (`fp8_gate_up_swiglu`) where its tiling allows it.
# FP8_FUSE_SWIGLU=0 (or setting this attribute, for same-process comparisons) keeps the GEMM's bf16 output and the
# separate `swiglu_quantize_t`.
FUSE_SWIGLU = os.environ.get("FP8_FUSE_SWIGLU", "1") != "0"


# The down GEMM's split-K partials summed and added to the residual stream by one Triton kernel (False: XLA's sum
# and add; FP8_SPLITK_RESIDUAL_KERNEL=0, or this attribute for same-process comparisons).
SPLITK_RESIDUAL_KERNEL = os.environ.get("FP8_SPLITK_RESIDUAL_KERNEL", "1") != "0"


def gate_up_plan(m: int, f2: int, d: int):
    """(config, fused) of the FFN's gate/up GEMM for m rows: `default_config`, fused where that tiling allows it
    (LLaDA-8B at block-step M). Forcing the 256-wide tiles to fuse was slower for Dream-7B (3.72 vs 3.66 ms per
    batch-1 block step, block_step_h200.json run H: its kernels +0.12 ms, the quantiser saved 0.10)."""
    from pallas_kernels.fp8_matmul import default_config, swiglu_fusable

    cfg = default_config(m, f2, d)
    return cfg, FUSE_SWIGLU and swiglu_fusable(cfg)


class FfnPlan(NamedTuple):
    """The kernels of one FP8 FFN at one M (hashable: the static key of `_fp8_ffn_kernels`)."""
    gate_up: Any  # Fp8MatmulConfig of the gate/up GEMM
    fused: bool  # SwiGLU + quantise in the gate/up GEMM's epilogue
    tail: Any  # TailSplit of the gate/up GEMM, or None
    down: Any  # Fp8MatmulConfig of the down GEMM
    splitk_residual_kernel: bool  # the down GEMM's split-K partials summed into the residual by one kernel
    norm_blocks: Any = None  # QuantizeBlocks of the RMSNorm quantiser
    swiglu_blocks: Any = None  # QuantizeBlocks of the SwiGLU quantiser (unfused gate/up)


def ffn_plan(m: int, f2: int, d: int, gate_up: tuple | None = None) -> FfnPlan:
    """Every tiling choice of the FFN for m rows, made here, outside the jitted kernels, so the module switches
    (FUSE_SWIGLU, TAIL_SPLIT, GROUPS_PER_STEP, ...) and the quantisers' tilings are read when the model is traced and a benchmark that flips
    one between traces gets a new program, never a cached trace of the old one."""
    from pallas_kernels.fp8_matmul import default_config, padded_rows, tail_split_plan
    from pallas_kernels.fp8_quantize import QuantizeBlocks

    cfg_gu, fused = gate_up or gate_up_plan(m, f2, d)
    # the last wave's tiles as a split-K second kernel where that is on (TAIL_SPLIT; at the real shapes only
    # Dream-7B's gate/up at block-step M); its main tiling is cfg_gu's default
    tail = tail_split_plan(m, f2, d) if gate_up is None and not fused else None
    down = default_config(m, d, f2 // 2)
    mp = padded_rows(m, cfg_gu, down)
    return FfnPlan(cfg_gu, fused, tail, down, SPLITK_RESIDUAL_KERNEL, QuantizeBlocks.for_rmsnorm(d, m),
                   None if fused else QuantizeBlocks.for_swiglu(mp))


def fp8_ffn_pallas(x: jax.Array, norm_scale: jax.Array, eps: float, mlp_fp8: dict, interpret: bool = False,
                   residual: jax.Array | None = None, gate_up: tuple | None = None) -> jax.Array:
    """The FFN half of a layer on the GPU kernels: s + down(swiglu(gate_up(rmsnorm(s)))), s = x (+ residual),
    x and residual [M, d].

    Four kernels: residual add + RMSNorm + quantise (Triton), the gate/up FP8 GEMM with SwiGLU + quantise in its
    epilogue (Mosaic GPU; where its tiling does not allow that, the GEMM and a Triton split-K sum + SwiGLU +
    quantise; with TAIL_SPLIT on, where it applies, that GEMM is two kernels and XLA's sum and concatenation), the
    down FP8 GEMM, and the split-K sum + residual add (Triton; XLA's add without split-K). Same numerics as the XLA
    path up to the order of fp32 sums (the RMSNorm statistic, split-K partials). gate_up: a (config, fused) plan
    instead of `gate_up_plan` (tests).

    The kernels run inside one jitted function keyed by the plan, so the layers of a model (same shapes, same
    plan) share one traced body: jax lowers each kernel once per program instead of once per layer. Lowered per
    layer, the 31 FP8 layers of LLaDA-8B made a generate program's first compile take 126 s on the H200 against
    7.6 s in bf16 (bench/NOTES.md v11)."""
    m, d = x.shape
    plan = ffn_plan(m, mlp_fp8["w_gu"].shape[0], d, gate_up)
    return _fp8_ffn_kernels(x, norm_scale, mlp_fp8, residual, eps=float(eps), interpret=interpret, plan=plan)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "plan"))
def _fp8_ffn_kernels(x, norm_scale, mlp_fp8, residual, *, eps: float, interpret, plan: FfnPlan):
    from pallas_kernels.fp8_matmul import fp8_gate_up_swiglu, fp8_matmul_padded, fp8_matmul_tail_split, padded_rows
    from pallas_kernels.fp8_quantize import rmsnorm_quantize, splitk_residual_add, swiglu_quantize_t

    m, d = x.shape
    mp = padded_rows(m, plan.gate_up, plan.down)
    if residual is None:
        xq, xs_t = rmsnorm_quantize(x, norm_scale, eps=eps, m_pad=mp, blocks=plan.norm_blocks, interpret=interpret)
    else:
        xq, xs_t, x = rmsnorm_quantize(x, norm_scale, eps=eps, m_pad=mp, residual=residual, blocks=plan.norm_blocks,
                                       interpret=interpret)
    ws_gu = _kernel_scales(mlp_fp8, "s_gu", plan.gate_up)
    if plan.fused:
        aq, as_t = fp8_gate_up_swiglu(xq, xs_t, mlp_fp8["w_gu"], ws_gu, cfg=plan.gate_up, interpret=interpret)
    else:
        if plan.tail is not None:
            gu = fp8_matmul_tail_split(xq, xs_t, mlp_fp8["w_gu"], ws_gu, plan=plan.tail, out_dtype=jnp.bfloat16,
                                       interpret=interpret)
        else:
            gu = fp8_matmul_padded(xq, xs_t, mlp_fp8["w_gu"], ws_gu, cfg=plan.gate_up, out_dtype=jnp.bfloat16,
                                   interpret=interpret)
        aq, as_t = swiglu_quantize_t(gu, live_rows=m, blocks=plan.swiglu_blocks, interpret=interpret)
    y = fp8_matmul_padded(aq, as_t, mlp_fp8["w_down"], _kernel_scales(mlp_fp8, "s_down", plan.down), cfg=plan.down,
                          out_dtype=x.dtype, interpret=interpret)
    if y.ndim == 3 and plan.splitk_residual_kernel:  # split-K partials: summed and added in one kernel
        return splitk_residual_add(y, x, interpret=interpret)
    if y.ndim == 3:
        y = y.sum(axis=0)
    return x + y[:m].astype(x.dtype)


def ffn_residual(params: dict, config: ModelConfig, layer_params: dict, layer_index: Any, x: jax.Array,
                 backend: str | None = None, interpret: bool = False, attn_out: jax.Array | None = None
                 ) -> jax.Array:
    """s + FFN(ffn_norm(s)) of one layer [B, n, d], s = x + attn_out (the attention residual, when given): bf16
    SwiGLU for layer 0, FP8 for the rest.

    backend "xla" (the default off the GPU): RMSNorm, jnp quantisation, the dequantising reference GEMM;
    "pallas" (the GPU default): `fp8_ffn_pallas` (the residual add fused into its RMSNorm kernel). The unrolled
    layer loop picks layer 0's path statically; the scan over stacked layers uses a lax.cond on its traced
    index."""
    from dllm_jax.layers import RMSNorm, SwiGLU
    from pallas_kernels.fp8_matmul import fp8_ffn

    backend = backend or fp8_backend()
    norm = RMSNorm(config.rms_eps, config.jnp_dtype)

    def first(x, o):  # o: attn_out or None (an empty pytree, also through lax.cond)
        x = x if o is None else x + o
        h = norm.apply({"params": layer_params["ffn_norm"]}, x)
        return x + SwiGLU(config.mlp_hidden, config.jnp_dtype).apply({"params": params["mlp_first"]}, h)

    def rest(x, o):
        if backend == "pallas":
            b, n, d = x.shape
            scale = layer_params["ffn_norm"]["scale"]
            return fp8_ffn_pallas(x.reshape(b * n, d), scale, config.rms_eps, layer_params["mlp_fp8"], interpret,
                                  residual=None if o is None else o.reshape(b * n, d)).reshape(b, n, d)
        x = x if o is None else x + o
        h = norm.apply({"params": layer_params["ffn_norm"]}, x)
        return x + fp8_ffn(h, layer_params["mlp_fp8"], backend=backend, out_dtype=h.dtype)

    if isinstance(layer_index, int):  # the unrolled layer loop: a static choice, no conditional in the program
        return first(x, attn_out) if layer_index == 0 else rest(x, attn_out)
    return jax.lax.cond(layer_index == 0, first, rest, x, attn_out)
