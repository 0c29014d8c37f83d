"""Why do the two FP8 harnesses disagree? (bench/NOTES.md v10: LLaDA's gate/up GEMM at M = 256 took 44.3 us in
`sweep_fp8_small_m.py` and 48.3 us in `bench_fp8_matmul.py`, same config.) Times the default kernel of one shape
for each operand recipe (the table's: bf16 normal draws; the sweep's: fp32 draws rounded to bf16) under each
harness (the sweep's: one jitted call per operand set on pre-padded operands; the table's: one program of 4
`fp8_matmul` calls, wrapper included; and one program of 4 calls on pre-padded operands), all as the device time
of the GEMM kernel from one trace. Writes bench/results/fp8_harness_probe_h200.json.
--tilings instead times the default beside tilings it does not pick (raster order of the persistent grid, the
CTA tile stacked along N) in the one-program harness, the one the table quotes.

  python bench/probe_fp8_harness.py --shape 256x24576x4096      (H200, ~1 minute)
  python bench/probe_fp8_harness.py --shape 256x24576x4096 --tilings --out /tmp/t.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (puts the repository on sys.path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bench_fp8_matmul as table  # noqa: E402
import sweep_fp8_small_m as sweep  # noqa: E402
from pallas_kernels import fp8_matmul as F  # noqa: E402

KERNEL = "fp8_matmul_kernel"


def probe(m: int, n: int, k: int) -> list[dict]:
  cfg = F.default_config(m, n, k)
  mp = F.padded_rows(m, cfg)
  recipes = {
      "table_operands": [(s["xq"], s["xs"], s["wq"], s["ws"]) for s in table.make_inputs(m, n, k)],
      "sweep_operands": [(*x, *w) for x, w in zip(*reversed(sweep.operands(n, k, m)))],
  }
  padded = lambda a, b, c, d: F.fp8_matmul_padded(a, b, c, d, cfg=cfg, interpret=table.INTERPRET)
  wrapper = lambda a, b, c, d: F.fp8_matmul(a, b, c, d, config=cfg, interpret=table.INTERPRET)
  rows = []
  for recipe, sets in recipes.items():
    pre = [(*F.pad_activations(xq, xs, mp), wq, F.kernel_weight_scales(ws, n, cfg)) for xq, xs, wq, ws in sets]
    harnesses = {
        "separate_calls_padded": lambda: sweep.device_us(padded, pre, KERNEL),
        "one_program_wrapper": lambda: table.timeit(wrapper, sets, device=True)[2],
        "one_program_padded": lambda: table.timeit(padded, pre, device=True)[2],
    }
    for name, run in harnesses.items():
      us = run()
      rows.append({"M": m, "N": n, "K": k, "operands": recipe, "harness": name, "kernel_us": us,
                   "config": cfg.as_dict()})
      print(f"{recipe:15s} {name:22s} {us if us is None else round(us, 2)} us", flush=True)
  return rows


def tiling_variants(m: int, n: int, k: int) -> dict:
  """The default and neighbours it does not pick: raster strips of other widths, the strips along M, and the CTA
  tile stacked along N (two 64 x 128 warpgroup tiles side by side: each reads its own weight rows)."""
  d = F.default_config(m, n, k)
  out = {"default": d}
  for w in (2, 4, 16, 32):
    out[f"tile_width_{w}"] = dataclasses.replace(d, grid_tile_width=w)
  for w in (1, 2, 8):
    out[f"minor_m_width_{w}"] = dataclasses.replace(d, grid_minor_dim=F.Dim.M, grid_tile_width=w)
  if d.wg_dimension == F.Dim.M and n % (2 * d.wg_tile_n) == 0:
    out["cta_along_n"] = dataclasses.replace(d, wg_dimension=F.Dim.N)
  return out


def probe_tilings(m: int, n: int, k: int) -> list[dict]:
  sets = [(s["xq"], s["xs"], s["wq"], s["ws"]) for s in table.make_inputs(m, n, k)]
  ref = F.fp8_matmul_reference(*sets[0], out_dtype=jnp.float32)
  rows = []
  for name, cfg in tiling_variants(m, n, k).items():
    mp = F.padded_rows(m, cfg)
    pre = [(*F.pad_activations(xq, xs, mp), wq, F.kernel_weight_scales(ws, n, cfg)) for xq, xs, wq, ws in sets]
    padded = lambda a, b, c, d, cfg=cfg: F.fp8_matmul_padded(a, b, c, d, cfg=cfg, interpret=table.INTERPRET)
    row = {"M": m, "N": n, "K": k, "variant": name, "harness": "one_program_padded", "config": cfg.as_dict()}
    try:
      y = jax.jit(padded)(*pre[0])
      row["rel_err"] = table.rel_err(y[:m], ref)
      row["kernel_us"] = table.timeit(padded, pre, device=True)[2]
    except Exception as e:  # noqa: BLE001  (a tiling that does not compile must not lose the others)
      row["error"] = str(e)[:300]
    rows.append(row)
    print(f"{name:16s} {row.get('kernel_us')} us  rel_err {row.get('rel_err')}  {row.get('error', '')[:100]}",
          flush=True)
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shape", default="256x24576x4096", help="MxNxK")
  ap.add_argument("--tilings", action="store_true", help="time tilings beside the default (one-program harness)")
  ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "fp8_harness_probe_h200.json"))
  a = ap.parse_args()
  try:
    m, n, k = map(int, a.shape.split("x"))
  except ValueError:
    ap.error(f"--shape must be MxNxK, got {a.shape!r}")
  rows = probe_tilings(m, n, k) if a.tilings else probe(m, n, k)
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as fh:
    json.dump({"meta": common.meta(what=__doc__.split("\n\n")[0]), "rows": rows}, fh, indent=2)
  print("wrote", a.out)


if __name__ == "__main__":
  main()
