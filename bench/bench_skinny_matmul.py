"""Weight-streaming GEMMs at block-step shapes (issue 7): the Pallas skinny GEMM vs XLA, inside a scan over layers.

Each timed call runs one GEMM per layer of a stack of weights [C, K, N] (C copies, >= 400 MB in all, so nothing is
served from the 50 MB L2), exactly like the model's scan over stacked layers:
  xla            jnp.dot(x, w[i]) with the scan slicing the weights (what the engine does today)
  pallas_slice   skinny_matmul(x, w[i]) with the scan slicing the weights (XLA may copy the slice first)
  pallas_stacked skinny_matmul(x, w, layer=i): the kernel indexes the stack itself
plus a sweep of block sizes for pallas_stacked at the main shapes. Reports us per GEMM and the effective weight
bandwidth (K*N*2 bytes / time); floor = bytes / 4.3 TB/s. Writes bench/results/skinny_matmul_h200.json.

    PYTHONPATH=. python bench/bench_skinny_matmul.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from pallas_kernels import skinny_matmul as sm  # noqa: E402
from pallas_kernels.stream_matmul_mgpu import stream_matmul  # noqa: E402

HBM = 4.3e12
INTERPRET = jax.default_backend() != "gpu"  # CPU smoke runs only
SMOKE = {"on": False}  # --smoke: 2 weight copies, one timed call (the GPU simulator is slow)
# (model, name, K, N): every projection of a block step (gate and up separately and fused)
SHAPES = [
    ("llada-8b", "qkvo", 4096, 4096),
    ("llada-8b", "gate_up", 4096, 12288),
    ("llada-8b", "gate_up_fused", 4096, 24576),
    ("llada-8b", "down", 12288, 4096),
    ("dream-7b", "q_o", 3584, 3584),
    ("dream-7b", "kv", 3584, 512),
    ("dream-7b", "gate_up", 3584, 18944),
    ("dream-7b", "down", 18944, 3584),
]
MS = (32, 64, 256)
SWEEP_SHAPES = {("llada-8b", "gate_up"), ("llada-8b", "down"), ("dream-7b", "kv")}


def stacked_weights(k: int, n: int) -> jax.Array:
    c = 2 if SMOKE["on"] else int(min(32, max(2, np.ceil(400e6 / (k * n * 2)))))
    return jax.jit(lambda key: (0.02 * jax.random.normal(key, (c, k, n), jnp.float32)).astype(jnp.bfloat16))(
        jax.random.key(k + n))


def timed(fn, x, w) -> float:
    """us per GEMM (median of 10 calls, each one GEMM per layer of the stack)."""
    c = w.shape[0]

    @jax.jit
    def run(x, w):
        def body(acc, inp):
            wi, i = inp
            y = fn(x, w, wi, i)
            return acc + y[0, 0].astype(jnp.float32), None
        acc, _ = jax.lax.scan(body, jnp.float32(0), (w, jnp.arange(c, dtype=jnp.int32)))
        return acc

    reps, warmup = (1, 1) if SMOKE["on"] else (10, 2)
    med, _ = common.time_call(lambda: run(x, w).block_until_ready(), reps=reps, warmup=warmup)
    return 1e6 * med / c


def variants(bs=None):
    return {
        "xla": lambda x, w, wi, i: jnp.dot(x, wi, preferred_element_type=jnp.float32).astype(x.dtype),
        "pallas_slice": lambda x, w, wi, i: sm.skinny_matmul(x, wi, block_sizes=bs, interpret=INTERPRET),
        "pallas_stacked": lambda x, w, wi, i: sm.skinny_matmul(x, w, None, i, block_sizes=bs, interpret=INTERPRET),
        # the Mosaic GPU streaming kernel (M <= 64 only)
        "mgpu_stacked": lambda x, w, wi, i: stream_matmul(x, w, i, interpret=INTERPRET),
    }


def plot(rows: list[dict], path: Path) -> None:
    """Effective weight bandwidth per GEMM and M, XLA vs the Pallas variants, against the HBM line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted({r["M"] for r in rows})
    fig, axes = plt.subplots(1, len(ms), figsize=(5.5 * len(ms), 4), squeeze=False)
    for ax, m in zip(axes[0], ms):
        sel = [r for r in rows if r["M"] == m]
        series = [("xla", "XLA (scan slices)"), ("pallas_slice", "Pallas (scan slices)"),
                  ("pallas_stacked", "Pallas (stacked, in-kernel index)"), ("mgpu_stacked", "Mosaic GPU (stacked)")]
        series = [(lab, [r.get(f"{v}_TBps", 0) for r in sel]) for v, lab in series
                  if any(f"{v}_TBps" in r for r in sel)]
        common.grouped_bars(ax, [f"{r['model'].split('-')[0]}\n{r['gemm']}" for r in sel], series,
                            (HBM / 1e12, "HBM ~4.3 TB/s"), "weight TB/s",
                            f"M = {m} rows, one GEMM per layer in a scan (H200)", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def save(rows: list[dict], out: str):
    return common.write_results("skinny_matmul_h200.json",
                                common.meta(what="weight-streaming GEMMs, one per layer of a stack, us per GEMM"),
                                rows, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="no block-size sweep")
    ap.add_argument("--out", default=str(common.RESULTS))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the script)")
    args = ap.parse_args()
    global SHAPES, MS
    if args.smoke:
        SHAPES, MS = [("llada-8b", "gate_up", 256, 512)], (32,)
        SMOKE["on"] = True
    rows = []
    for model, name, k, n in SHAPES:
        w = stacked_weights(k, n)
        floor_us = 1e6 * k * n * 2 / HBM
        for m in MS:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            ref = sm.skinny_matmul_reference(x, w[1]).astype(jnp.float32)
            got = sm.skinny_matmul(x, w, None, jnp.int32(1), interpret=INTERPRET).astype(jnp.float32)
            rel = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
            row = {"model": model, "gemm": name, "M": m, "K": k, "N": n, "floor_us": floor_us, "rel_err": rel,
                   "default_blocks": str(sm.BlockSizes.get_default(m, k, n))}
            if m <= 64:
                got = stream_matmul(x, w, jnp.int32(1), interpret=INTERPRET).astype(jnp.float32)
                row["mgpu_rel_err"] = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
            for vname, fn in variants().items():
                if vname == "mgpu_stacked" and m > 64:
                    continue
                try:
                    us = timed(fn, x, w)
                except Exception as e:  # noqa: BLE001  (a variant that cannot run here must not lose the row)
                    row[f"error_{vname}"] = str(e)[:200]
                    continue
                row[f"{vname}_us"] = us
                row[f"{vname}_TBps"] = k * n * 2 / us / 1e6
            if not args.quick and (model, name) in SWEEP_SHAPES and m == 32:
                best = None
                for bn, bk, st, nw in itertools.product((32, 64, 128), (64, 128, 256), (3, 5), (4, 8)):
                    if (bn == 128 and nw == 4) or (bn == 32 and nw == 8):
                        continue
                    base = sm.BlockSizes.get_default(m, k, n)
                    try:
                        split = base.split_k if k % (bk * base.split_k) == 0 else 1
                        bs = sm.BlockSizes(block_n=bn, block_k=bk, split_k=split, block_m=base.block_m,
                                           num_warps=nw, num_stages=st)
                        us = timed(variants(bs)["pallas_stacked"], x, w)
                    except Exception as e:  # noqa: BLE001  (a config that does not compile is skipped)
                        print(f"  skip {bn}x{bk} st{st} w{nw}: {type(e).__name__} {str(e)[:120]}", flush=True)
                        continue
                    if best is None or us < best[0]:
                        best = (us, str(bs))
                row["sweep_best_us"], row["sweep_best_blocks"] = best
                row["sweep_best_TBps"] = k * n * 2 / best[0] / 1e6
            rows.append(row)
            path = save(rows, args.out)  # after every row: a run cut short by a time limit keeps its rows
            print({kk: (round(v, 3) if isinstance(v, float) else v) for kk, v in row.items()}, flush=True)
        del w
    path = save(rows, args.out)
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} and its plot")


if __name__ == "__main__":
    main()
