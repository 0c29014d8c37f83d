"""A block step's projection + residual add + RMSNorm, four ways (issue 7, bench/NOTES.md v14).

At M = 32 XLA runs o_proj and down_proj as split-K Triton GEMMs: a GEMM kernel writes fp32 partials, a reduction
kernel sums them (with the residual add fused in) and a third kernel is the next RMSNorm. This probe times, per
layer of a chain of distinct weights (no L2 reuse), device time from a jax.profiler trace:
  xla              y = x @ w (bf16 out, XLA's own split-K); r = r + y; h = RMSNorm(r)           -- the default
  xla_partials_S   p = linear_partials(x, w, S) (one batched GEMM, [S, M, N] fp32); then the same in jnp
  pallas_S         p as above; (r, h) = residual_rmsnorm(r, p, scale): the partials' sum, the residual add and
                   the norm in one kernel
  pallas_plain     y = x @ w; (r, h) = residual_rmsnorm(r, y, scale) (v12's kernel after XLA's GEMM)
Writes bench/results/splitk_norm_probe_h200.json. GPU: `python bench/probe_splitk_norm.py`; CPU smoke:
`--shapes tiny --layers 2` (interpreted kernels, no device times).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from kernel_trace import kernel_breakdown  # noqa: E402

from dllm_jax.layers import RMSNorm  # noqa: E402
from pallas_kernels.residual_rmsnorm import linear_partials, residual_rmsnorm  # noqa: E402

SHAPES = {  # name: (K, N) of y = x @ w
    "llada_o": (4096, 4096), "llada_down": (12288, 4096), "dream_o": (3584, 3584), "dream_down": (18944, 3584),
    "tiny": (256, 128),
}


def chain(variant: str, layers: int, interpret: bool):
    """A jitted chain over `layers` weights: each layer's projection of x, added to r, then normalised."""
    def norm(r, scale):
        return RMSNorm(1e-5, r.dtype).apply({"params": {"scale": scale}}, r)

    def run(x, r, ws, scale):
        hs = []
        for w in ws:
            if variant == "xla":
                r = r + jnp.dot(x, w, preferred_element_type=jnp.bfloat16)
                h = norm(r, scale)
            elif variant == "pallas_plain":
                r, h = residual_rmsnorm(r, jnp.dot(x, w, preferred_element_type=jnp.bfloat16), scale, eps=1e-5,
                                        interpret=interpret)
            else:
                splits = int(variant.rsplit("_", 1)[1])
                p = linear_partials(x, w, splits)
                if variant.startswith("xla_partials"):
                    r = r + p.sum(axis=0).astype(r.dtype)
                    h = norm(r, scale)
                else:
                    r, h = residual_rmsnorm(r, p, scale, eps=1e-5, interpret=interpret)
            hs.append(h)
        return r, hs

    return jax.jit(run)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["llada_o", "llada_down", "dream_o", "dream_down"],
                    choices=list(SHAPES))
    ap.add_argument("--ms", nargs="+", type=int, default=[32, 256])
    ap.add_argument("--splits", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default=str(common.RESULTS))
    args = ap.parse_args()
    interpret = jax.default_backend() != "gpu"
    rows = []
    meta = common.meta(what="GEMM + residual add + RMSNorm per layer, XLA split-K vs explicit partials into one "
                            "kernel", layers=args.layers)
    for name in args.shapes:
        k, n = SHAPES[name]
        ws = [(0.02 * jax.random.normal(jax.random.key(j), (k, n), jnp.float32)).astype(jnp.bfloat16)
              for j in range(args.layers)]
        scale = jnp.ones((n,), jnp.bfloat16)
        for m in args.ms:
            x = jax.random.normal(jax.random.key(100 + m), (m, k), jnp.bfloat16)
            r = jax.random.normal(jax.random.key(200 + m), (m, n), jnp.bfloat16)
            variants = ["xla", "pallas_plain"] + [f"{v}_{s}" for s in args.splits if k % s == 0
                                                  for v in ("xla_partials", "pallas")]
            ref = None
            for v in variants:
                f = chain(v, args.layers, interpret)
                out = jax.block_until_ready(f(x, r, ws, scale))
                last = out[1][-1].astype(jnp.float32)
                ref = last if ref is None else ref
                med, _ = common.time_call(lambda: jax.block_until_ready(f(x, r, ws, scale)), reps=10)
                bd = kernel_breakdown(lambda: jax.block_until_ready(f(x, r, ws, scale)), calls=4)
                row = {"shape": name, "M": m, "K": k, "N": n, "variant": v,
                       "us_wall_per_layer": 1e6 * med / args.layers,
                       "max_abs_diff_vs_xla": float(jnp.max(jnp.abs(last - ref)))}
                if bd.get("kernels_per_call"):
                    row.update(us_busy_per_layer=1e3 * bd["busy_ms"] / args.layers,
                               us_span_per_layer=1e3 * bd["span_ms"] / args.layers,
                               kernels_per_layer=bd["kernels_per_call"] / args.layers,
                               by_kind_us_per_layer={kk: 1e3 * vv / args.layers for kk, vv in bd["by_kind_ms"].items()},
                               top=bd["top"][:6])
                rows.append(row)
                common.write_results("splitk_norm_probe_h200.json", meta, rows, args.out)
                print({kk: (round(vv, 2) if isinstance(vv, float) else vv) for kk, vv in row.items() if kk != "top"},
                      flush=True)
        del ws


if __name__ == "__main__":
    main()
