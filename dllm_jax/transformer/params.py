"""The parameter tree as data: its shapes, random init, layer layouts (stacked / per layer, fused projections) and
the FP8 FFN's quantised weights. Nothing here runs the model.

Stacked layout (the converted format and the CPU default), leaves in the config dtype, kernels [in, out]:
    {"embed": [V, d],
     "layers": {"attn_norm": {"scale": [L, d]}, "q_proj": {"kernel": [L, d, Hq*D], "bias"?}, "k_proj", "v_proj",
                "o_proj": {"kernel": [L, Hq*D, d]}, "ffn_norm": {"scale": [L, d]},
                "mlp": {"gate_proj", "up_proj": {"kernel": [L, d, F]}, "down_proj": {"kernel": [L, F, d]}}},
     "final_norm": {"scale": [d]},
     "lm_head": [d, V]   (absent when the head is tied to the embedding)}
Per-layer layout (the GPU default, `unstack_layers`): "layers" is a tuple of per-layer trees with q/k/v fused into
"qkv_proj" and gate/up into "mlp.gate_up_proj". Inside a lax.scan XLA copies each layer's weight slice before its
GEMMs (a batch-1 LLaDA-8B block step took 12.63 ms scanned, 5.17 ms per layer on an H200); one wider GEMM for q/k/v
and for gate/up reads the same bytes with fewer launches.

FP8 FFN (LaCache, `config.fp8_ffn`): the stacked bf16 `layers.mlp` is replaced by
    layers.mlp_fp8 = {"w_gu": [L, 2F, D] e4m3, "s_gu": [L, 2F/128, D/128] f32, "w_down": [L, D, F] e4m3,
                      "s_down": [L, D/128, F/128] f32}
    mlp_first      = the first layer's bf16 SwiGLU params (the paper keeps layer 1's FFN in bf16)
Entry 0 of mlp_fp8 only keeps the scan over layers uniform. Weights are quantised once (conversion `--fp8-ffn` or
`load(..., fp8_ffn=True)`).

FP8 projections and head (`config.fp8_proj`, weights="fp8_all" with the FP8 FFN): every q/k/v/o module (or the
fused qkv_proj) holds {"w8": [out, in] e4m3, "s8": [out/128, in/128] f32, "bias"?} instead of {"kernel", "bias"?}
(stacked [L, ...] or per layer), read by `layers.Linear`; layer 0's bf16 modules are kept in "attn_first" (the
paper keeps layer 1 in bf16; its FP8 copy only keeps the layers uniform), and the head is "lm_head_fp8" {"w8":
[V, d], "s8"} (from the embedding when the head is tied; the embedding stays for the lookup).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ConfigError, ModelConfig
from pallas_kernels import fp8_matmul as F

Array = jax.Array
Params = dict[str, Any]
GROUP = F.GROUP


# ------------------------------------------------------------------------------------------- shapes, init
def projection_widths(config: ModelConfig) -> tuple[int, int, int]:
    """Output widths of q, k and v (their order in the fused qkv_proj)."""
    kv = config.n_kv_heads * config.head_dim
    return config.n_heads * config.head_dim, kv, kv


def _layer_shapes(config: ModelConfig) -> Params:
    """One bf16 layer's leaf shapes (unfused), the names the Block module reads."""
    d, f = config.d_model, config.mlp_hidden
    wq, wk, wv = projection_widths(config)

    def proj(fan_in, width, bias=False):
        return {"kernel": (fan_in, width), **({"bias": (width,)} if bias else {})}

    b = config.qkv_bias
    return {
        "attn_norm": {"scale": (d,)},
        "q_proj": proj(d, wq, b),
        "k_proj": proj(d, wk, b),
        "v_proj": proj(d, wv, b),
        "o_proj": proj(wq, d),
        "ffn_norm": {"scale": (d,)},
        "mlp": {"gate_proj": proj(d, f), "up_proj": proj(d, f), "down_proj": proj(f, d)},
    }


def param_shapes(config: ModelConfig) -> Params:
    """The stacked param tree's shapes (jax.ShapeDtypeStruct leaves) without allocating anything."""
    sd, dt, L = jax.ShapeDtypeStruct, config.jnp_dtype, config.n_layers
    layers = jax.tree.map(lambda s: sd((L, *s), dt), _layer_shapes(config), is_leaf=lambda s: isinstance(s, tuple))
    shapes = {
        "embed": sd((config.vocab_size, config.d_model), dt),
        "layers": layers,
        "final_norm": {"scale": sd((config.d_model,), dt)},
    }
    if not config.tie_embeddings:
        shapes["lm_head"] = sd((config.d_model, config.vocab_size), dt)
    shapes = fp8_param_shapes(shapes, config) if config.fp8_ffn else shapes
    shapes = fp8_proj_param_shapes(shapes, config) if config.fp8_proj else shapes
    return {k: v for k, v in shapes.items() if k not in FIRST_LAYER} if config.fp8_first_layer else shapes


def init_params(config: ModelConfig, key: Array, std: float = 0.02) -> Params:
    """Random params in the config dtype (tests, benchmarks and training from scratch): normal(std) kernels and
    biases (small random biases so tests exercise them), ones for norm scales."""
    if config.fp8_ffn:
        bf16 = config.replace(fp8_ffn=False, fp8_proj=False, fp8_first_layer=False)
        params, c = quantize_params(init_params(bf16, key, std), bf16)
        params = quantize_projections(params, c)[0] if config.fp8_proj else params
        return quantize_first_layer(params, c)[0] if config.fp8_first_layer else params
    dt = config.jnp_dtype
    k_embed, k_layers, k_head = jax.random.split(key, 3)
    leaves, tree = jax.tree_util.tree_flatten_with_path(_layer_shapes(config), is_leaf=lambda s: isinstance(s, tuple))

    def init_layer(k):
        out = []
        for (path, shape), kk in zip(leaves, jax.random.split(k, len(leaves))):
            if "scale" in jax.tree_util.keystr(path):
                out.append(jnp.ones(shape, dt))
            else:
                out.append((std * jax.random.normal(kk, shape, jnp.float32)).astype(dt))
        return jax.tree_util.tree_unflatten(tree, out)

    d = config.d_model
    params: Params = {
        "embed": (std * jax.random.normal(k_embed, (config.vocab_size, d), jnp.float32)).astype(dt),
        "layers": jax.vmap(init_layer)(jax.random.split(k_layers, config.n_layers)),
        "final_norm": {"scale": jnp.ones((d,), dt)},
    }
    if not config.tie_embeddings:
        params["lm_head"] = (std * jax.random.normal(k_head, (d, config.vocab_size), jnp.float32)).astype(dt)
    return params


def cast_params(params: Params, dtype: jnp.dtype) -> Params:
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)


# ------------------------------------------------------------------------------------------ layer layouts
def is_unrolled(layers: Params | tuple) -> bool:
    """Whether a "layers" entry is the per-layer layout (a tuple of trees) rather than stacked [L, ...] leaves."""
    return isinstance(layers, (tuple, list))


def select_layers(layers: Params | tuple, start: int, stop: int) -> tuple[Params | tuple, range]:
    """Layers start..stop-1 of a "layers" entry (a tuple slice, or stacked leaves sliced on their first axis) and
    their absolute indices."""
    if is_unrolled(layers):
        return tuple(layers[start:stop]), range(start, stop)
    if (start, stop) != (0, jax.tree.leaves(layers)[0].shape[0]):
        layers = jax.tree.map(lambda a: a[start:stop], layers)
    return layers, range(start, stop)


def unstack_layers(params: Params, fuse: bool = True) -> Params:
    """The same params with "layers" as a tuple of per-layer trees (run by an unrolled loop in `forward`), with the
    projections fused (`fuse_projections`) unless fuse=False. The caller's tree is not modified. Costs a longer
    compile (one copy of the layer per layer)."""
    if is_unrolled(params["layers"]):
        return params
    return unstack_layers_in_place({**params, "layers": jax.tree.map(lambda a: a, params["layers"])}, fuse)


def unstack_layers_in_place(params: Params, fuse: bool = True) -> Params:
    """`unstack_layers` on a params dict the caller owns: "layers" is popped from it and each stacked leaf is dropped
    as soon as it is fused and split, so when nothing else holds the stacked arrays the peak is one fused leaf over
    the model, not a second copy of it (`dllm_jax.load`: LLaDA-8B's gate/up, 6.4 GB, not 16 GB)."""
    layers = params.pop("layers")
    if fuse:
        layers = fuse_projections(layers, consume=True)
        if "attn_first" in params:  # layer 1's bf16 projections, laid out as the layers they stand in for
            params["attn_first"] = fuse_projections(params["attn_first"])
    flat, treedef = jax.tree.flatten(layers)
    del layers
    n = flat[0].shape[0]
    per_layer: list[list[Any]] = [[] for _ in range(n)]
    for j in range(len(flat)):
        leaf, flat[j] = flat[j], None
        for i in range(n):
            per_layer[i].append(leaf[i])
        del leaf
    layers = [jax.tree.unflatten(treedef, leaves) for leaves in per_layer]
    if "mlp_fp8" in layers[0]:  # the FP8 kernel's weight-scale tables, built once here rather than every step
        layers = [{**lp, "mlp_fp8": with_kernel_scales(lp["mlp_fp8"])} for lp in layers]
    params["layers"] = tuple(layers)
    return params


def stack_layers(params: Params, config: ModelConfig | None = None) -> Params:
    """The inverse of `unstack_layers`: "layers" as stacked [L, ...] leaves with separate projections (a no-op if
    already stacked). Fused layers need the config (the q/k/v widths)."""
    layers = params["layers"]
    if not is_unrolled(layers):
        return params
    if any("w8" in m for name, m in layers[0].items() if name in PROJECTIONS):
        raise ValueError(
            "per-layer params with FP8 projections (weights='fp8_all') are not stacked back: convert the HF "
            "checkpoint with dllm-convert --weights fp8_all instead"
        )
    if "mlp_fp8" in layers[0]:  # drop the kernel-layout scale tables that unstack_layers added
        layers = [{**lp, "mlp_fp8": without_kernel_scales(lp["mlp_fp8"])} for lp in layers]
    stack = np.stack if all(isinstance(a, np.ndarray) for a in jax.tree.leaves(layers)) else jnp.stack
    stacked = jax.tree.map(lambda *a: stack(a), *layers)
    if is_fused(stacked):
        if config is None:
            raise ValueError("stack_layers needs the model config to split fused projections")
        stacked = split_projections(stacked, config)
    return {**params, "layers": stacked}


# q/k/v share their input, and so do gate/up: fused kernels are the parts concatenated along the output axis.
FP8_ROWS = ("w8", "s8")  # FP8 leaves, whose output axis is their second last (s8: in 128-row blocks)


def _rows(a: Any, leaf: str, lo: int, hi: int) -> Any:
    """Output columns lo:hi of a fused leaf: the last axis of a kernel or bias, the rows of an FP8 leaf."""
    if leaf == "w8":
        return a[..., lo:hi, :]
    if leaf == "s8":
        return a[..., lo // GROUP : hi // GROUP, :]
    return a[..., lo:hi]


FUSED_ATTENTION = ("qkv_proj", ("q_proj", "k_proj", "v_proj"))
FUSED_MLP = ("gate_up_proj", ("gate_proj", "up_proj"))


def is_fused(layers: Params | tuple) -> bool:
    first = layers[0] if is_unrolled(layers) else layers
    return FUSED_ATTENTION[0] in first


def _concat_last(parts: list[Any]) -> Any:
    """Concatenate along the last axis, emptying `parts` as it goes: a numpy part is dropped once copied, so the
    peak is the result plus one part when nothing else holds them (host loading of an 8B model)."""
    if not all(isinstance(p, np.ndarray) for p in parts):
        out = jnp.concatenate(parts, axis=-1)
        parts.clear()
        return out
    out = np.empty(parts[0].shape[:-1] + (sum(p.shape[-1] for p in parts),), parts[0].dtype)
    col = 0
    while parts:
        part = parts.pop(0)
        out[..., col : col + part.shape[-1]] = part
        col += part.shape[-1]
        del part
    return out


def _fuse_group(tree: Params, fused_name: str, names: tuple[str, ...], consume: bool) -> Params:
    out = {k: v for k, v in tree.items() if k not in names}
    modules = [tree.pop(n) if consume else tree[n] for n in names]

    def fuse(leaf: str) -> Any:
        parts = [m.pop(leaf) if consume else m[leaf] for m in modules]
        if leaf in FP8_ROWS:  # FP8 leaves are [.., out, in] (scales by 128-row blocks): fused along their rows
            xp = np if all(isinstance(p, np.ndarray) for p in parts) else jnp
            return xp.concatenate(parts, axis=-2)
        return _concat_last(parts)

    out[fused_name] = {leaf: fuse(leaf) for leaf in list(modules[0])}
    return out


def fuse_projections(layers: Params, consume: bool = False) -> Params:
    """A layers tree (stacked [L, ...] or one layer's) with q/k/v as "qkv_proj" and, where the layer has its bf16
    FFN, gate/up as "mlp.gate_up_proj". consume=True empties the given dicts while fusing (lower peak memory)."""
    if is_fused(layers):
        return layers
    out = _fuse_group(layers, *FUSED_ATTENTION, consume)
    if "mlp" in out:  # FP8 layers keep their own e4m3 FFN tree
        out["mlp"] = _fuse_group(out["mlp"], *FUSED_MLP, consume)
    return out


def split_projections(layers: Params, config: ModelConfig) -> Params:
    """The inverse of `fuse_projections` (slices of the fused leaves along the last axis)."""
    if not is_fused(layers):
        return layers

    def split(tree, fused_name, names, widths):
        out = {k: v for k, v in tree.items() if k != fused_name}
        bounds = np.cumsum((0,) + tuple(widths))
        for name, lo, hi in zip(names, bounds[:-1], bounds[1:]):
            out[name] = {leaf: _rows(a, leaf, lo, hi) for leaf, a in tree[fused_name].items()}
        return out

    out = split(layers, *FUSED_ATTENTION, projection_widths(config))
    if "mlp" in out and FUSED_MLP[0] in out["mlp"]:
        out["mlp"] = split(out["mlp"], *FUSED_MLP, (config.mlp_hidden, config.mlp_hidden))
    return out


# --------------------------------------------------------------------------------------------- FP8 FFN
def check_fp8_shapes(config: ModelConfig) -> None:
    if config.d_model % GROUP or config.mlp_hidden % GROUP:
        raise ConfigError(
            f"fp8_ffn needs d_model and mlp_hidden to be multiples of {GROUP}, got "
            f"d_model={config.d_model}, mlp_hidden={config.mlp_hidden}"
        )


def quantize_layer_mlp(mlp: dict) -> dict:
    """One layer's bf16 SwiGLU params ([in, out] kernels) -> the e4m3 dict of pallas_kernels.fp8_matmul."""
    return F.quantize_ffn_weights(
        jnp.asarray(mlp["gate_proj"]["kernel"]),
        jnp.asarray(mlp["up_proj"]["kernel"]),
        jnp.asarray(mlp["down_proj"]["kernel"]),
        layout="in_out",
    )


def quantize_stacked_mlp(mlp: dict) -> tuple[dict, dict]:
    """Stacked bf16 mlp params [L, ...] -> (mlp_fp8 stacked [L, ...] as numpy, mlp_first as numpy), layer by layer
    (a jitted per-layer quantiser): peak memory is one layer's worth of temporaries."""
    n_layers = np.shape(mlp["gate_proj"]["kernel"])[0]
    q1 = jax.jit(quantize_layer_mlp)
    parts = [jax.tree.map(np.asarray, q1(jax.tree.map(lambda a, i=i: a[i], mlp))) for i in range(n_layers)]
    stacked = {k: np.stack([p[k] for p in parts]) for k in parts[0]}
    first = jax.tree.map(lambda a: np.asarray(a[0]), mlp)
    return stacked, first


def quantize_params(params: Params, config: ModelConfig, on_device: bool = False) -> tuple[Params, ModelConfig]:
    """bf16 params -> params with FP8 FFNs in layers >= 2, and the config with fp8_ffn=True.

    on_device: quantise all layers at once on the accelerator (benchmarks: weights already live there); default:
    layer by layer into host numpy (conversion and loading: low peak memory). Unrolled (per-layer) params are
    stacked first, which briefly holds both layouts where they live: `load` quantises before it unstacks."""
    if config.fp8_ffn:
        return params, config
    check_fp8_shapes(config)
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
    return {**params, "layers": layers, "mlp_first": first}, config.replace(fp8_ffn=True)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")


def check_fp8_proj_shapes(config: ModelConfig) -> None:
    """FP8 projections need K (d_model, Hq * D) in whole 128-groups and q/k/v widths in whole 128-blocks (so a fused
    qkv_proj quantises to the same blocks as its parts)."""
    check_fp8_shapes(config)
    widths = projection_widths(config)
    if any(w % GROUP for w in widths):
        raise ConfigError(f"weights='fp8_all' needs the q/k/v widths {widths} to be multiples of {GROUP}")


def _quantize_module(module: dict, stacked: bool, host: bool = False) -> dict:
    """{"kernel": [.., in, out], "bias"?} -> {"w8": [.., out, in] e4m3, "s8", "bias"?} (stacked: layer by layer), by
    the one quantiser program of every path (bit-identical leaves whichever way they were made). host: numpy out,
    each layer's leaves brought back as they are made (conversion: one layer's temporaries at a time)."""
    kernel, to, stack = module["kernel"], (np.asarray if host else jnp.asarray), (np.stack if host else jnp.stack)
    if stacked:
        parts = [jax.tree.map(to, _quantize_one(jnp.asarray(kernel[i]))) for i in range(kernel.shape[0])]
        w8, s8 = stack([w for w, _ in parts]), stack([s for _, s in parts])
    else:
        w8, s8 = jax.tree.map(to, _quantize_one(jnp.asarray(kernel)))
    return {"w8": w8, "s8": s8, **({"bias": to(module["bias"])} if "bias" in module else {})}


def quantize_projection_module(module: dict) -> tuple[dict, dict]:
    """One stacked projection {"kernel": [L, in, out], "bias"?} -> (its FP8 leaves [L, ...], layer 0's bf16 module)
    as host numpy (conversion)."""
    return _quantize_module(module, True, host=True), {k: np.asarray(v)[0] for k, v in module.items()}


def quantize_head(head_in_out: Any) -> dict:
    """The LM head's [d, V] weight (or the embedding's transpose) -> {"w8": [V, d] e4m3, "s8"} as host numpy."""
    return dict(zip(("w8", "s8"), map(np.asarray, _quantize_one(np.asarray(head_in_out)))))


@jax.jit
def _quantize_one(kernel_in_out: Array) -> tuple[Array, Array]:
    return F.quantize_weights(kernel_in_out.T)


def fp8_proj_param_shapes(shapes: Params, config: ModelConfig) -> Params:
    """FP8-FFN param shapes -> also FP8 projections and head (weights="fp8_all"; no allocation)."""
    sd, L = jax.ShapeDtypeStruct, config.n_layers
    layers = dict(shapes["layers"])
    first = {}
    for name in PROJECTIONS[:4]:
        module = layers[name]
        fan_in, width = module["kernel"].shape[1:]
        first[name] = jax.tree.map(lambda s: sd(s.shape[1:], s.dtype), module)
        layers[name] = {
            "w8": sd((L, width, fan_in), jnp.float8_e4m3fn),
            "s8": sd((L, -(-width // GROUP), fan_in // GROUP), jnp.float32),
            **({"bias": module["bias"]} if "bias" in module else {}),
        }
    v, d = config.vocab_size, config.d_model
    head = {"w8": sd((v, d), jnp.float8_e4m3fn), "s8": sd((-(-v // GROUP), d // GROUP), jnp.float32)}
    out = {k: s for k, s in shapes.items() if k != "lm_head"}
    return {**out, "layers": layers, "attn_first": first, "lm_head_fp8": head}


def quantize_projections(params: Params, config: ModelConfig) -> tuple[Params, ModelConfig]:
    """Params with FP8 FFNs -> also FP8 projections and head (weights="fp8_all"), in either layer layout."""
    if config.fp8_proj:
        return params, config
    if not config.fp8_ffn:
        raise ValueError("quantize_projections needs the FFNs in FP8 first (quantize_params)")
    check_fp8_proj_shapes(config)
    layers = params["layers"]
    if is_unrolled(layers):
        first = {k: v for k, v in layers[0].items() if k in PROJECTIONS}
        quantized = tuple(
            {k: _quantize_module(v, False) if k in PROJECTIONS else v for k, v in lp.items()} for lp in layers
        )
    else:
        first = {k: jax.tree.map(lambda a: a[0], v) for k, v in layers.items() if k in PROJECTIONS}
        quantized = {k: _quantize_module(v, True) if k in PROJECTIONS else v for k, v in layers.items()}
    head = params["lm_head"] if "lm_head" in params else params["embed"].T  # [d, V]
    w8, s8 = _quantize_one(jnp.asarray(head))
    out = {k: v for k, v in params.items() if k != "lm_head"}
    out.update(layers=quantized, attn_first=first, lm_head_fp8={"w8": w8, "s8": s8})
    return out, config.replace(fp8_proj=True)


FIRST_LAYER = ("mlp_first", "attn_first")  # layer 1's bf16 copies beside its FP8 entries


def quantize_first_layer(params: Params, config: ModelConfig) -> tuple[Params, ModelConfig]:
    """FP8 params -> layer 1 in FP8 too (config.fp8_first_layer): its FP8 entries, kept so far only to make the
    layers uniform, are now read, and its bf16 copies dropped."""
    if not config.fp8_ffn:
        raise ValueError("quantize_first_layer needs FP8 weights first (quantize_params)")
    out = {k: v for k, v in params.items() if k not in FIRST_LAYER}
    return out, config.replace(fp8_first_layer=True)


def fp8_param_shapes(shapes: Params, config: ModelConfig) -> Params:
    """bf16 param shapes -> the FP8-FFN tree's shapes (no allocation)."""
    check_fp8_shapes(config)
    L, d, f = config.n_layers, config.d_model, config.mlp_hidden
    sd = jax.ShapeDtypeStruct
    layers = dict(shapes["layers"])
    mlp = layers.pop("mlp")
    e4m3, f32 = jnp.float8_e4m3fn, jnp.float32
    layers["mlp_fp8"] = {
        "w_gu": sd((L, 2 * f, d), e4m3),
        "s_gu": sd((L, 2 * f // GROUP, d // GROUP), f32),
        "w_down": sd((L, d, f), e4m3),
        "s_down": sd((L, d // GROUP, f // GROUP), f32),
    }
    return {**shapes, "layers": layers, "mlp_first": jax.tree.map(lambda s: sd(s.shape[1:], s.dtype), mlp)}


# The FP8 kernel reads its weight scales as a [K/128, N/cols] table (one 128-byte TMA row per K step and CTA:
# cols = 4 for the 128-wide CTA N tiles of M > 64, 8 for the 256-wide tiles of a block step's M <= 64). Expanding
# s_gu / s_down into it inside the step costs two broadcast kernels per layer (0.10 ms of a LLaDA-8B batch-1 block
# step), so the GPU layout stores both tables as leaves (~1.2 MB per LLaDA layer).
KERNEL_SCALE_COLS = (4, 8)
KERNEL_SCALES = {"s_gu": "w_gu", "s_down": "w_down"}


def kernel_scale_key(src: str, cols: int) -> str:
    return f"{src}_tma{cols}"


def column_scale_key(src: str, cfg: F.Fp8MatmulConfig) -> str:
    """The leaf of a column tiling's per-column scale table (block-step M: `column_small_m_config`)."""
    return f"{src}_col{cfg.wg_tile_n}{cfg.wg_dimension.name}"


def with_kernel_scales(mlp_fp8: dict) -> dict:
    """One layer's mlp_fp8 dict plus the kernel-layout scale tables (numpy stays numpy: host loading): the
    128-byte-row tables of KERNEL_SCALE_COLS, and the per-column table of the block-step column tiling where that
    GEMM has one (Dream-7B's gate/up: ~4.7 MB a layer)."""
    out = dict(mlp_fp8)
    for src, w in KERNEL_SCALES.items():
        ws, (n, k) = mlp_fp8[src], np.shape(mlp_fp8[w])[-2:]
        xp = np if isinstance(ws, np.ndarray) else jnp
        for cols in KERNEL_SCALE_COLS:
            out[kernel_scale_key(src, cols)] = F.expand_weight_scales(ws, n, cols, xp)
        column = F.column_small_m_config(1, n, k)
        if column is not None:
            out[column_scale_key(src, column)] = F.column_scale_table(ws, n, column, xp)
    return out


def without_kernel_scales(mlp_fp8: dict) -> dict:
    return {k: v for k, v in mlp_fp8.items() if "_tma" not in k and "_col" not in k}
