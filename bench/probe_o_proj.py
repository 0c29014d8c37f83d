"""Probe: LLaDA-8B's o_proj at a batch-8 block step (x [256, 4096] @ w [4096, 4096], bf16) on other GEMMs.

In the batch-8 FP8 step (block_step_h200.json run v15e) XLA runs o_proj as one cuBLAS kernel on 128 CTA tiles of
128 x 64, 16.2 us a layer against 10.9 us at 790 TFLOP/s (bench/NOTES.md, "Next GPU session"). This times, on 8
distinct weight matrices in turn (so L2 holds none of them), XLA's GEMM with its default options and with Triton
GEMMs off (the FP8 batch-8 program's setting), and jax's Mosaic GPU Hopper matmul
(`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`) at tilings of 64 to 256 CTA tiles; device time per GEMM
from a trace (the call runs the 8 GEMMs and nothing else). Writes bench/results/o_proj_probe_h200.json. GPU only.

    python bench/probe_o_proj.py [--m 256] [--n 4096] [--k 4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from kernel_trace import kernel_breakdown  # noqa: E402

N_WEIGHTS = 8
# (tile_m, tile_n, wg_dimension, max_concurrent_steps): CTA tile = tile x 2 along wg_dimension
MGPU_TILINGS = [(64, 64, "N", 4), (64, 64, "N", 6), (64, 64, "M", 4), (64, 128, "M", 4), (128, 64, "N", 4),
                (64, 32, "N", 6), (128, 32, "N", 6)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--out", default=str(common.RESULTS))
    args = ap.parse_args()
    m, n, k = args.m, args.n, args.k
    keys = jax.random.split(jax.random.key(0), N_WEIGHTS + 1)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    ws = jnp.stack([jax.random.normal(kk, (k, n), jnp.bfloat16) * 0.02 for kk in keys[1:]])
    ref = np.asarray(jnp.einsum("mk,lkn->lmn", x, ws, preferred_element_type=jnp.float32))
    flops = 2 * m * n * k

    def chain(gemm):
        """All N_WEIGHTS GEMMs in one call (independent: x stays in L2, as a layer's input does; no weight does)."""
        def run(x, ws):
            return tuple(gemm(x, ws[i]) for i in range(N_WEIGHTS))
        return run

    rows = []

    def measure(label: str, fn, **extra):
        try:
            out = np.stack([np.asarray(o, np.float32) for o in jax.block_until_ready(fn(x, ws))])
            err = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
            med, _ = common.time_call(lambda: jax.block_until_ready(fn(x, ws)), reps=10, warmup=2)
            bd = kernel_breakdown(lambda: jax.block_until_ready(fn(x, ws)), calls=3)
            busy = bd["busy_ms"]  # the call runs the GEMMs only (Mosaic kernels are not named as GEMMs)
            row = {"variant": label, "M": m, "N": n, "K": k, "us_wall_per_gemm": 1e6 * med / N_WEIGHTS,
                   "us_device_per_gemm": 1e3 * busy / N_WEIGHTS, "kernels_per_call": bd["kernels_per_call"],
                   "tflops_device": flops / (busy / N_WEIGHTS * 1e-3) / 1e12 if busy else None,
                   "rel_err": err, "top": bd["top"][:4], **extra}
        except Exception as e:  # noqa: BLE001  (a tiling that fails to lower must not lose the rest)
            row = {"variant": label, "M": m, "N": n, "K": k, "error": f"{type(e).__name__}: {str(e)[:300]}", **extra}
        rows.append(row)
        print({kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in row.items() if kk != "top"}, flush=True)
        common.write_results("o_proj_probe_h200.json", common.meta(weights=N_WEIGHTS), rows, args.out)

    def xla_gemm(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    measure("xla_default", jax.jit(chain(xla_gemm)))
    opts = {"xla_gpu_enable_triton_gemm": False}
    measure("xla_triton_gemm_off", jax.jit(chain(xla_gemm)).lower(x, ws).compile(compiler_options=opts))
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    for tm, tn, wg, steps in MGPU_TILINGS:
        cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=steps,
                              epi_tile_n=min(64, tn), epi_tile_m=min(64, tm), wg_dimension=hm.MatmulDimension[wg])
        cta = (tm * (2 if wg == "M" else 1), tn * (2 if wg == "N" else 1))
        measure(f"mgpu_{tm}x{tn}_wg{wg}_s{steps}", jax.jit(chain(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg))),
                cta_tile=list(cta), cta_tiles=(m // cta[0]) * (n // cta[1]))
    print(f"wrote {Path(args.out) / 'o_proj_probe_h200.json'}")


if __name__ == "__main__":
    main()
