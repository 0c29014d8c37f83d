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
