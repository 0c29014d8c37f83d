"""Tensor parallelism through jax.sharding: Megatron's split of the weights over a one-axis mesh ("tp"), after
which every jitted function that takes the params (generate's loop, the engine's calls) is partitioned by XLA's SPMD
partitioner, which inserts the all-reduces. No communication code of our own.

The split (the last two axes of each leaf; a stacked layer axis in front stays whole):
- q/k/v projections and the FFN's gate/up: column-parallel (output features, hence heads, split);
- o and down projections: row-parallel (input features split; XLA all-reduces their outputs);
- lm_head: split by vocabulary; the embedding and the norms: replicated;
- FP8 FFN weights: the same split where whole 128-wide scale groups fall on each device, else replicated.
The K/V of every cache follow the k/v projections: split by KV head.

The Pallas and cuDNN kernels are not partitioned (that needs shard_map around each kernel): sharded params run
XLA's kernels, which `Kernels.resolve` chooses for them."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dllm_jax.config import ModelConfig

AXIS = "tp"
GROUP = 128  # the FP8 weights' scale groups (pallas_kernels.fp8_matmul.GROUP)
_COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
_ROW = {"o_proj", "down_proj"}
# FP8 FFN leaves: w_gu [2f, d] and its scales split by rows (column-parallel), w_down [d, f] by columns (row-parallel)
_FP8_AXIS = {"w_gu": -2, "s_gu": -2, "w_down": -1, "s_down": -1}


class TensorParallelError(ValueError):
    """A device count the machine or the model cannot split over."""


def tensor_parallel_mesh(tp: int, devices: list | None = None) -> Mesh:
    """A one-axis mesh over the first `tp` devices."""
    devices = jax.devices() if devices is None else devices
    if tp < 1 or tp > len(devices):
        n = len(devices)
        raise TensorParallelError(f"tensor_parallel={tp} needs 1..{n} devices (this machine has {n})")
    return Mesh(np.asarray(devices[:tp]), (AXIS,))


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """Heads, KV heads, the FFN width and the vocabulary must split evenly over `tp` devices."""
    sizes = dict(
        n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, mlp_hidden=config.mlp_hidden, vocab=config.vocab_size
    )
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise TensorParallelError(f"tensor_parallel={tp} does not divide the model's {bad}")


def _spec(names: list[str], shape: tuple[int, ...], tp: int) -> PartitionSpec:
    """The leaf's PartitionSpec from its path names (see the module docstring)."""
    lead = [None] * (len(shape) - 2)
    name = names[-1]
    owner = names[-2] if len(names) > 1 else ""
    if owner in _COLUMN:
        return PartitionSpec(*lead, None, AXIS) if name == "kernel" else PartitionSpec(*[None] * (len(shape) - 1), AXIS)
    if owner in _ROW and name == "kernel":
        return PartitionSpec(*lead, AXIS, None)
    if name == "lm_head":
        return PartitionSpec(*lead, None, AXIS)
    if owner == "mlp_fp8" and name in _FP8_AXIS:
        axis = _FP8_AXIS[name]
        groups = shape[axis] if name.startswith("s_") else shape[axis] // GROUP
        if groups % tp == 0:  # whole scale groups on every device
            spec = [None] * len(shape)
            spec[axis] = AXIS
            return PartitionSpec(*spec)
    return PartitionSpec()


def param_specs(params: Any, tp: int) -> Any:
    """The PartitionSpec of every leaf of a param tree (stacked or per-layer, bf16 or FP8)."""

    def spec(path, leaf):
        names = [str(getattr(k, "key", getattr(k, "idx", ""))) for k in path]
        return _spec(names, leaf.shape, tp)

    return jax.tree_util.tree_map_with_path(spec, params)


def shard_params(params: Any, config: ModelConfig, mesh: Mesh) -> Any:
    """The params placed on the mesh's devices, split as `param_specs` says."""
    tp = mesh.shape[AXIS]
    check_tensor_parallel(config, tp)
    specs = param_specs(params, tp)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)


def mesh_of(params: Any) -> Mesh | None:
    """The tensor-parallel mesh the params live on (None for params on one device)."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and AXIS in sharding.mesh.shape and sharding.mesh.shape[AXIS] > 1:
            return sharding.mesh
    return None


def kv_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """K/V arrays [..., heads, dim]: split by KV head."""
    return NamedSharding(mesh, PartitionSpec(*[None] * (ndim - 2), AXIS, None))
