"""Where the FP8 GEMM's time goes at block-step M (issue 5's two missing rows: the gate/up GEMMs at M = 256), by
taking pieces out of the kernel and by schedule variants. Each variant is the GEMM kernel's device time from one
trace, in bench_fp8_matmul's harness (one program of 4 calls on rotating operand sets), beside the default tiling
in the same process. Writes (merges into) bench/results/fp8_m256_probe_h200.json.

Variants (``--variants``):
  default          the default tiling
  no_mma           plgpu.wgmma made a no-op while tracing: the loads, barriers, promotions and epilogue only
  no_store         the epilogue's TMA stores dropped
  no_mma_no_store  both
  cluster_m / _n   a 2-CTA cluster along M / N (the shared operand multicast)
  g1               one 128-K group per stage on up to 6 stages
  col192           192-wide column tiles along M, one group per stage (Dream-7B's gate/up at M = 256: 396 tiles,
                   exactly 3 waves of 132, against 592 = 4.48 waves of the default)
  early, g1_early, col192_early   early_release on the default / g1 / col192 (checked bit-identical to the same
                   tiling without it)
The outputs of the variants with pieces taken out are wrong by design (they time, they do not compute).

  python bench/probe_fp8_m256.py --run v18c --note "..."                   (H200, ~2-3 minutes)
  python bench/probe_fp8_m256.py --shapes 256x24576x4096 --variants default early
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (puts the repository on sys.path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_fp8_matmul as table  # noqa: E402
from pallas_kernels import fp8_matmul as F  # noqa: E402

RESULT = "fp8_m256_probe_h200.json"
SHAPES = {(256, 24576, 4096): "llada", (256, 37888, 3584): "dream", (256, 4096, 12288): "llada",
          (256, 3584, 18944): "dream", (32, 24576, 4096): "llada", (32, 37888, 3584): "dream",
          (32, 4096, 12288): "llada", (32, 3584, 18944): "dream"}
VARIANTS = ("default", "no_mma", "no_store", "no_mma_no_store", "cluster_m", "cluster_n", "g1", "early", "g1_early",
            "col192", "col192_early")


def _noop(*_, **__):
  return None


def variant(name: str, cfg: F.Fp8MatmulConfig) -> tuple[F.Fp8MatmulConfig, dict]:
  """(tiling, plgpu functions replaced while tracing) of one variant of the default tiling cfg."""
  if name.startswith("g1"):
    cfg = dataclasses.replace(cfg, groups_per_step=1, max_concurrent_steps=6)
  if name.startswith("col192"):
    cfg = dataclasses.replace(cfg, wg_dimension=F.Dim.M, wg_tile_n=192, epi_tile_n=64, groups_per_step=1,
                              max_concurrent_steps=5, split_k=1)
  if name.endswith("early"):
    cfg = dataclasses.replace(cfg, early_release=True)
  if name.startswith("cluster_"):
    cfg = dataclasses.replace(cfg, cluster_dimension=F.Dim[name[-1].upper()])
  functions = {"wgmma": _noop} if "no_mma" in name else {}
  if "no_store" in name:
    functions["copy_smem_to_gmem"] = _noop
  return cfg, functions


@contextlib.contextmanager
def replaced(functions: dict):
  """plgpu functions replaced (and every compiled program dropped, so nothing cached is reused) inside."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  old = {name: getattr(plgpu, name) for name in functions}
  for name, fn in functions.items():
    setattr(plgpu, name, fn)
  jax.clear_caches()
  try:
    yield
  finally:
    for name, fn in old.items():
      setattr(plgpu, name, fn)
    jax.clear_caches()


def probe(m: int, n: int, k: int, names: list[str], nsets: int = table.R, reps: int = 5) -> list[dict]:
  """One row per variant (those the default tiling of the shape can take: clusters need M >= 256 and no column
  tiles)."""
  sets = table.make_inputs(m, n, k, nsets=nsets)
  args = [(s["xq"], s["xs"], s["wq"], s["ws"]) for s in sets]
  base = F.default_config(m, n, k)
  rows, outputs = [], {}
  for name in names:
    if name.startswith("cluster_") and (base.column_scales or m < 256 or n % (2 * base.cta_tile_n)):
      continue
    if name.startswith("col192") and (m < 256 or n < k or n < 192):
      continue  # a gate/up tiling for block-step M = 256
    cfg, functions = variant(name, base)
    fn = lambda xq, xs, wq, ws, c=cfg: F.fp8_matmul(xq, xs, wq, ws, config=c, interpret=table.INTERPRET)
    with replaced(functions):
      y = np.asarray(jax.jit(fn)(*args[0]).astype(jnp.float32))
      _, _, kernel_us = table.timeit(fn, args, reps=reps, device=True)
    outputs[name] = y
    twin = {"early": "default", "g1_early": "g1", "col192_early": "col192"}.get(name)
    row = {"model": SHAPES.get((m, n, k)), "M": m, "N": n, "K": k, "variant": name, "kernel_us": kernel_us,
           "bit_identical_to": twin, "bit_identical": bool(np.array_equal(y, outputs[twin])) if twin in outputs
           else None,
           # False for the variants with pieces taken out: proof that the replacement reached the kernel
           "equals_default": bool(np.array_equal(y, outputs["default"])) if "default" in outputs else None,
           "config": cfg.as_dict()}
    rows.append(row)
    same = "" if twin is None else f"  bit-identical to {twin}: {row['bit_identical']}"
    print(f"  {m}x{n}x{k} {name:16s} {kernel_us if kernel_us is None else round(kernel_us, 2)} us{same}", flush=True)
  return rows


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shapes", nargs="*", default=[f"{m}x{n}x{k}" for m, n, k in SHAPES], metavar="MxNxK")
  ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
  ap.add_argument("--run", required=True, help="label of this run in meta.runs and in each row")
  ap.add_argument("--note", default="", help="what this run was for (meta.runs[label])")
  ap.add_argument("--out", default=None, help="results folder (default bench/results)")
  args = ap.parse_args()
  shapes = []
  for text in args.shapes:
    try:
      m, n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
      ap.error(f"--shapes takes MxNxK, got {text!r}")
    if k % 128:
      ap.error(f"K must be a multiple of 128, got {text!r}")
    shapes.append((m, n, k))
  if "default" not in args.variants:
    args.variants.insert(0, "default")  # every variant is read against the default of the same process
  out = Path(args.out or common.RESULTS)
  path = out / RESULT
  old = json.loads(path.read_text()) if path.exists() else {"meta": {}, "rows": []}
  meta = common.meta(what="FP8 GEMM kernel device time with pieces taken out and schedule variants "
                          "(bench/probe_fp8_m256.py)")
  meta["runs"] = {**old["meta"].get("runs", {}), args.run: args.note or f"variants {args.variants}"}
  rows = old["rows"]
  for i, (m, n, k) in enumerate(shapes):
    print(f"[{i + 1}/{len(shapes)}] M={m} N={n} K={k}", flush=True)
    for row in probe(m, n, k, args.variants):
      rows.append({**row, "run": args.run, "git": meta["git"]})
      common.write_results(RESULT, meta, rows, out)  # after every shape: a kill keeps what was measured
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
