"""`load(path)`: a converted directory or an HF release directory -> Model (config, params, tokenizer)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from dllm_jax.config import ModelConfig
from dllm_jax.io import checkpoint as ckpt
from dllm_jax.io.tokenizer import Tokenizer, has_tokenizer, load_tokenizer
from dllm_jax.transformer import params as P
from dllm_jax.transformer.sharding import AXIS, check_tensor_parallel, param_specs, tensor_parallel_mesh

DEFAULT_MODEL_DIR = Path(__file__).parent.parent / "assets" / "default_model"


def generation_defaults(path: Path | None) -> dict:
    """gen_length / block_length / steps defaults from a model's generation_config.json (HF's file; we read
    max_new_tokens, block_length and steps): a model trained on short answers (the bundled demo model answers in 8
    tokens) says so there. {} when there is none; CheckpointError when it is not valid JSON."""
    f = path / "generation_config.json" if path else None
    if f is None or not f.is_file():
        return {}
    cfg = ckpt.read_json(f)
    out = {}
    for ours, theirs in (("gen_length", "max_new_tokens"), ("block_length", "block_length"), ("steps", "steps")):
        if isinstance(cfg.get(theirs), int) and cfg[theirs] > 0:
            out[ours] = cfg[theirs]
    return out


@dataclasses.dataclass
class Model:
    config: ModelConfig
    params: dict[str, Any]  # device arrays in config.dtype
    tokenizer: Tokenizer | None = None
    path: Path | None = None

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model at {self.path} has no tokenizer files; pass token ids instead")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt)


def _check_shapes(config: ModelConfig, params: dict[str, Any], where: Path) -> None:
    want = P.param_shapes(config)
    bad = []

    def walk(w, g, path):
        if isinstance(w, dict):
            if not isinstance(g, dict) or set(w) != set(g):
                bad.append(
                    f"{path or '/'}: keys {sorted(g) if isinstance(g, dict) else type(g).__name__}, "
                    f"expected {sorted(w)}"
                )
                return
            for k in w:
                walk(w[k], g[k], f"{path}/{k}")
        elif tuple(np.shape(g)) != tuple(w.shape):
            bad.append(f"{path}: shape {list(np.shape(g))}, expected {list(w.shape)}")

    walk(want, params, "")
    if bad:
        raise ckpt.CheckpointError(f"params at {where} do not match their config:\n  - " + "\n  - ".join(bad))


def to_device(params: dict[str, Any], config: ModelConfig, mesh: Mesh | None = None) -> dict[str, Any]:
    """Device arrays in the run dtype; the FP8 FFN leaves (e4m3 weights, fp32 scales) keep their own dtypes. With a
    tensor-parallel mesh each leaf goes straight from the host into its shards (never whole on one device)."""

    def dtype(path) -> Any:
        return None if any(getattr(k, "key", None) == "mlp_fp8" for k in path) else config.jnp_dtype

    if mesh is None:
        return jax.tree_util.tree_map_with_path(lambda path, a: jnp.asarray(a, dtype(path)), params)

    def put(path, a, spec):
        return jax.device_put(np.asarray(a, dtype(path)), NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(put, params, param_specs(params, mesh.shape[AXIS]))


LAYER_LAYOUTS = ("auto", "stacked", "unrolled")


def resolve_layer_layout(layer_layout: str) -> str:
    """ "auto" -> "unrolled" on a GPU, "stacked" elsewhere.

    Why unrolled on the GPU: inside lax.scan each layer's weights are a dynamic slice of the stacked arrays and
    XLA copies every slice before its GEMM, so a batch-1 LLaDA-8B block step read the weights ~3 times: 12.63 ms
    scanned vs 5.17 ms with per-layer (fused) weights on an H200 (bench/results/block_step_h200.json). On the CPU
    the scan compiles faster and the tiny models gain nothing from unrolling."""
    if layer_layout not in LAYER_LAYOUTS:
        raise ValueError(f"layer_layout={layer_layout!r}; expected one of {LAYER_LAYOUTS}")
    if layer_layout == "auto":
        return "unrolled" if jax.default_backend() == "gpu" else "stacked"
    return layer_layout


def load(
    path: str | os.PathLike | None = None,
    dtype: str = "bfloat16",
    progress: bool = False,
    fp8_ffn: bool = False,
    layer_layout: str = "auto",
    tensor_parallel: int = 1,
) -> Model:
    """Load a model. `path`: a directory written by `dllm-convert`, or an HF release directory (converted in
    memory), or None for the bundled default model. dtype: "bfloat16" (default) or "float32".
    fp8_ffn: quantise the FFNs of layers >= 2 to e4m3 now (a checkpoint converted with --fp8-ffn already is).
    layer_layout: "stacked" ([L, ...] weights, a lax.scan over layers), "unrolled" (one array per layer, an
    unrolled layer loop: faster on the GPU), or "auto" (unrolled on a GPU; see `resolve_layer_layout`).
    tensor_parallel: split the weights over this many devices (`transformer.sharding`); every jitted call on the
    model then runs on all of them."""
    layout = resolve_layer_layout(layer_layout)
    mesh = tensor_parallel_mesh(tensor_parallel) if tensor_parallel != 1 else None  # a bad count: before reading
    path = Path(path) if path is not None else DEFAULT_MODEL_DIR
    if not path.exists():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise ckpt.CheckpointError(f"{path} is not a directory")
    if ckpt.is_converted(path):
        config, params = ckpt.read_converted(path, dtype=dtype)
    else:
        hf = ckpt.HFCheckpoint(path)
        config = hf.model_config(dtype=dtype)
        params = ckpt.read_params(hf, config, progress=progress)
    _check_shapes(config, params, path)
    if mesh is not None:
        check_tensor_parallel(config, tensor_parallel)
    if fp8_ffn and not config.fp8_ffn:
        params, config = P.quantize_params(params, config)
    if layout == "unrolled":  # this dict is ours: split in place (numpy views; device arrays one leaf at a time)
        params = P.unstack_layers_in_place(params, fuse=mesh is None)  # tensor parallel splits q, k, v each by head
    params = to_device(params, config, mesh)
    tokenizer = load_tokenizer(path, config) if has_tokenizer(path) else None
    return Model(config, params, tokenizer, path)
