"""Facts about the target GPU that kernels size their grids with."""

from __future__ import annotations

import jax


def num_sms() -> int:
    """Streaming multiprocessors of the device kernels are lowered for: the abstract mesh's device when lowering
    for CUDA without a GPU (tests), else the first device; 4 for the CPU GPU-simulator."""
    mesh = jax.sharding.get_abstract_mesh()
    dev = getattr(mesh, "abstract_device", None) if mesh is not None else None
    if dev is not None:
        return dev.num_cores
    try:
        return jax.devices()[0].core_count
    except Exception:  # noqa: BLE001  (CPU simulator)
        return 4


H200_SMS = 132  # streaming multiprocessors of one H200


def abstract_h200_mesh() -> jax.sharding.AbstractMesh:
    """An abstract mesh of one H200 (132 SMs): `with jax.sharding.use_abstract_mesh(abstract_h200_mesh()):` lowers
    Mosaic GPU kernels for CUDA on a machine without a GPU (the CPU tests' lowering checks, bench/dump_fp8_mlir.py)."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=H200_SMS, platform="gpu")
    return jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=dev)
