"""What ptxas says about the FP8 GEMM's kernel at a shape, on the GPU machine (ptxas runs only there): register use,
spills, and whether it serialised the wgmma instructions (ptxas does that when it cannot prove the accumulator
registers of an in-flight wgmma untouched, and says so in a "Potential Performance Loss" line).

  python bench/ptxas_fp8.py --m 256 --n 24576 --k 4096 --set overlap_steps=True --out /tmp/ptxas

Each config is compiled in its own process with MOSAIC_GPU_DUMP_PTXAS=1 (Mosaic GPU prints ptxas's verbose output),
run once, and the lines about registers, spills and wgmma are kept in <out>/<name>.txt, the whole output beside it.
Used in v10 (bench/NOTES.md) to ask why overlap_steps, bit-identical to the default order, ran 1.02-3.6x slower.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import dataclasses, json, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp
from pallas_kernels import fp8_matmul as F
m, n, k = {m}, {n}, {k}
changes = {{f: F.Dim[v] if (f.endswith("_dimension") or f == "grid_minor_dim") and v is not None else v
           for f, v in json.loads({changes!r}).items()}}
cfg = dataclasses.replace(F.default_config(m, n, k), **changes)
x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
w = (0.02 * jax.random.normal(jax.random.key(1), (n, k), jnp.float32)).astype(jnp.bfloat16)
xq, xs = F.quantize_activations(x)
wq, ws = F.quantize_weights(w)
y = F.fp8_matmul(xq, xs, wq, ws, out_dtype=jnp.bfloat16, backend="pallas", config=cfg)
print("CONFIG", cfg, float(jnp.abs(y.astype(jnp.float32)).max()), flush=True)
"""
KEEP = re.compile(r"registers|spill|wgmma|serializ|Performance|CONFIG|error", re.I)


def parse_set(items: list[str]) -> dict:
    """FIELD=VALUE pairs: JSON values, Python's True / False / None, or a Dim name (M, N) for the *_dimension and
    grid_minor_dim fields (the child process turns those into F.Dim)."""
    out = {}
    for item in items:
        field, _, value = item.partition("=")
        if value in ("True", "False", "None"):
            out[field] = {"True": True, "False": False, "None": None}[value]
        elif field.endswith("_dimension") or field == "grid_minor_dim":
            out[field] = value
        else:
            out[field] = json.loads(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--n", type=int, default=24576)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="Fp8MatmulConfig fields changed from the default (JSON values), compared with the default")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parents[1])
    for name, changes in (("default", {}), ("changed", parse_set(args.set))):
        if name == "changed" and not changes:
            continue
        code = CHILD.format(root=root, m=args.m, n=args.n, k=args.k, changes=json.dumps(changes))
        env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
        try:
            proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            text, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            text, rc = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after 300 s", "timeout"
        (out / f"{name}_full.txt").write_text(text)
        kept = [line for line in text.splitlines() if KEEP.search(line)]
        (out / f"{name}.txt").write_text("\n".join(kept) + "\n")
        print(f"== {name} {changes} (rc {rc})", *kept[:40], sep="\n", flush=True)


if __name__ == "__main__":
    main()
