"""The FP8 GEMM's Mosaic GPU module at a shape, as MLIR text, on any machine (no GPU needed): what the kernel's
Python lowering emits for CUDA, in two forms.

  python bench/dump_fp8_mlir.py --m 256 --n 24576 --k 4096 --out /tmp/fp8_mlir

  <out>/layouts.mlir   after layout inference: each vector's register layout (e.g. the 1x128 scales load in the
                       wgmma row layout, 2 values per thread)
  <out>/lowered.mlir   after the Mosaic GPU dialect lowering: per-register arith (with fastmath flags), the wgmma
                       inline asm, barriers; what LLVM and ptxas get (they run on the GPU machine only)

Used in v9 (bench/NOTES.md) to check whether the per-group promotion `acc += part * (xs * ws)` costs more than one
FMA per accumulator register: it does not (contractible mul + add on vector<2xf32>, the [64, 128] broadcast is
register renaming of 2 row scales).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.mosaic.gpu import core as mgpu_core  # noqa: E402

from pallas_kernels import fp8_matmul as F  # noqa: E402
from pallas_kernels.gpu_info import abstract_h200_mesh  # noqa: E402


def wgmma_waits(lowered: str) -> list[int]:
    """The `wgmma.wait_group N` counts of a lowered module, in program order."""
    return [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", lowered)]


def dump(m: int, n: int, k: int, cfg: F.Fp8MatmulConfig | None = None) -> dict[str, str]:
    """{"layouts": ..., "lowered": ...}: the module after layout inference and after the dialect lowering."""
    cfg = cfg or F.default_config(m, n, k)
    texts: dict[str, str] = {}
    lower_dialect = mgpu_core.dialect_lowering.lower_mgpu_dialect

    def hooked(module, *args, **kwargs):
        texts["layouts"] = str(module)
        out = lower_dialect(module, *args, **kwargs)
        texts["lowered"] = str(module)
        return out

    args = (jax.ShapeDtypeStruct((m, k), F.FP8), jax.ShapeDtypeStruct((m, k // F.GROUP), jnp.float32),
            jax.ShapeDtypeStruct((n, k), F.FP8), jax.ShapeDtypeStruct((-(-n // F.GROUP), k // F.GROUP), jnp.float32))
    mgpu_core.dialect_lowering.lower_mgpu_dialect = hooked
    jax.clear_caches()  # a lowering cached by an earlier call would not run the hook
    try:
        with jax.sharding.use_abstract_mesh(abstract_h200_mesh()):
            jax.jit(functools.partial(F.fp8_matmul, config=cfg)).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        mgpu_core.dialect_lowering.lower_mgpu_dialect = lower_dialect
    if set(texts) != {"layouts", "lowered"}:
        raise RuntimeError("the Mosaic GPU lowering did not run (a jax version without Warpgroup-semantics lowering?)")
    return texts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--n", type=int, default=24576)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--out", required=True, help="folder for layouts.mlir and lowered.mlir")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="override fields of the default config, e.g. overlap_steps=1 groups_per_step=2 out_slots=1")
    a = ap.parse_args(argv)
    if a.k % F.GROUP:
        ap.error(f"--k must be a multiple of {F.GROUP}")
    cfg = F.default_config(a.m, a.n, a.k)
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    overrides = {}
    for item in a.set:
        name, _, value = item.partition("=")
        if name not in fields or not value:
            ap.error(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        current = getattr(cfg, name)
        overrides[name] = (F.Dim[value] if value in F.Dim.__members__ else None if value == "None"
                           else bool(int(value)) if isinstance(current, bool) else int(value))
    cfg = dataclasses.replace(cfg, **overrides)
    texts = dump(a.m, a.n, a.k, cfg)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (out / f"{name}.mlir").write_text(text)
    lowered = texts["lowered"]
    print(f"{cfg}\nwrote {out}/layouts.mlir, {out}/lowered.mlir: {lowered.count('wgmma.mma_async')} wgmma, "
          f"{lowered.count('arith.mulf')} mulf / {lowered.count('arith.addf')} addf "
          f"({lowered.count('fastmath<contract>')} with fastmath<contract>), wgmma waits {wgmma_waits(lowered)}")


if __name__ == "__main__":
    main()
