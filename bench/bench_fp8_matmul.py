"""How fast is the FP8 block-scaled GEMM against XLA's bf16 GEMM? (pallas_kernels/fp8_matmul.py, Mosaic GPU.)

The FFN GEMMs as the models run them (gate/up fused, down), y[M, N] = x[M, K] @ w[N, K].T with 1x128 activation
scales and 128x128 weight scales, e4m3 operands, bf16 out; M from a block step (32, 256) to full forwards (16384).
Columns (us per GEMM; device columns from a profiler trace, None on the CPU):
  fp8_us / fp8_device_us  `fp8_matmul` at its default tiling, wall / all its kernels (the wrapper's pad, scale
                          transposes and table included)
  fp8_kernel_us           the GEMM kernel alone: what the model's FFN runs (its tables are built at load time and its
                          quantisers write the padded layouts)
  xla_bf16_us / _device_us  XLA's bf16 GEMM on the same values (best of w[N, K] and w[K, N])
  xla_fp8_per_tensor_us   XLA's e4m3 GEMM with one scale per tensor (cuBLASLt; no block scales: a yardstick)
  speedup_vs_bf16[_device|_kernel], *_tflops, floor_bytes_us (fp8 x + w, bf16 y at 4.3 TB/s), floor_flops_us
  (1979 TFLOP/s dense e4m3), rel_err (max |y - ref| / max |ref| on the first 2048 rows, fp32 reference)
Timing: one jit over R rotating input sets (so L2 holds none of them), the median of 5 timed runs, / R.
Writes bench/results/fp8_matmul_h200.json (rows merged by --run label) and a TFLOP/s plot beside it. On the CPU
the kernel runs in the Mosaic GPU simulator (a smoke test: --models tiny --ms 64).

    PYTHONPATH=. python bench/bench_fp8_matmul.py --run NAME [--ms 32,256] [--models llada] [--shapes 24576x4096]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import common, trace  # noqa: E402

# package imports (re-point here when the package moves)
from pallas_kernels import fp8_matmul as F  # noqa: E402  fp8_matmul, fp8_matmul_reference, quantize_*, default_config

SHAPES = {
    "llada": [(24576, 4096), (4096, 12288)],  # the FFN: gate|up, down
    "dream": [(37888, 3584), (3584, 18944)],
    "llada_proj": [(12288, 4096), (4096, 4096), (126464, 4096)],  # weights="fp8_all": q|k|v, o, the LM head
    "dream_proj": [(4608, 3584), (3584, 3584), (152064, 3584)],
    "tiny": [(256, 256)],
}
MS = [32, 256, 1024, 4096, 16384]
INTERPRET = jax.default_backend() != "gpu"  # the Mosaic GPU simulator
R = 1 if INTERPRET else 4  # rotating input sets per timing


def timeit(fn, args_list, kernel="fp8_matmul_kernel"):
    """(wall us, device busy us, device us of the kernels named `kernel`) per call; device times None on the CPU."""
    f = jax.jit(lambda al: [fn(*a) for a in al])
    jax.block_until_ready(f(args_list))
    ts = []
    for _ in range(common.repeats(5)):
        t0 = time.perf_counter()
        jax.block_until_ready(f(args_list))
        ts.append(time.perf_counter() - t0)
    bd = trace.kernel_breakdown(lambda: jax.block_until_ready(f(args_list)), calls=common.repeats(2), top=50)
    per_call = lambda ms: 1e3 * ms / len(args_list) if ms else None  # noqa: E731
    named = sum(t["ms"] for t in bd.get("top", []) if kernel in t["name"])
    return statistics.median(ts) / len(args_list) * 1e6, per_call(bd.get("busy_ms")), per_call(named)


def make_inputs(m, n, k, nsets=R):
    sets = []
    for i in range(nsets):
        k1, k2 = jax.random.split(jax.random.key(i))
        x = jax.random.normal(k1, (m, k), jnp.bfloat16)
        w = (jax.random.normal(k2, (n, k), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
        sets.append(dict(x=x, w=w, q=(*F.quantize_activations(x), *F.quantize_weights(w))))
    return sets


def xla_fp8_per_tensor(x, w):
    """XLA's e4m3 GEMM with one scale per operand (the scales taken outside the timed call would not change it)."""
    sx, sw = jnp.max(jnp.abs(x)).astype(jnp.float32) / 448, jnp.max(jnp.abs(w)).astype(jnp.float32) / 448
    xq = jnp.clip(x.astype(jnp.float32) / sx, -448, 448).astype(jnp.float8_e4m3fn)
    wq = jnp.clip(w.astype(jnp.float32) / sw, -448, 448).astype(jnp.float8_e4m3fn)
    y = lax.dot_general(xq, wq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * (sx * sw)).astype(jnp.bfloat16)


def bench_shape(model, m, n, k) -> dict:
    sets = make_inputs(m, n, k)
    cfg = F.default_config(m, n, k)
    fp8 = lambda xq, xs, wq, ws: F.fp8_matmul(xq, xs, wq, ws, interpret=INTERPRET)  # noqa: E731
    row = dict(model=model, M=m, N=n, K=k, config=cfg.as_dict())
    row["fp8_us"], row["fp8_device_us"], row["fp8_kernel_us"] = timeit(fp8, [s["q"] for s in sets])
    rows = min(m, 2048)  # the fp32 HIGHEST-precision reference over 16384 rows takes minutes
    xq, xs, wq, ws = sets[0]["q"]
    y = fp8(xq, xs, wq, ws)[:rows]
    row["rel_err"] = float(
        jnp.max(
            jnp.abs(
                y.astype(jnp.float32)
                - (ref := F.fp8_matmul_reference(xq[:rows], xs[:rows], wq, ws, out_dtype=jnp.float32))
            )
        )
        / jnp.max(jnp.abs(ref))
    )
    nk = timeit(
        lambda x, w: lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16),
        [(s["x"], s["w"]) for s in sets],
    )
    kn = timeit(lambda x, wt: jnp.dot(x, wt, preferred_element_type=jnp.bfloat16), [(s["x"], s["w"].T) for s in sets])
    row["xla_bf16_us"] = min(nk[0], kn[0])
    row["xla_bf16_device_us"] = min((d for d in (nk[1], kn[1]) if d), default=None)
    try:
        row["xla_fp8_per_tensor_us"] = timeit(xla_fp8_per_tensor, [(s["x"], s["w"]) for s in sets])[0]
    except Exception as e:  # noqa: BLE001  (not every backend has an e4m3 GEMM)
        row["xla_fp8_per_tensor_us"], row["xla_fp8_error"] = None, repr(e)[:200]
    flops = 2.0 * m * n * k
    row.update(
        fp8_tflops=flops / row["fp8_us"] / 1e6,
        xla_bf16_tflops=flops / row["xla_bf16_us"] / 1e6,
        speedup_vs_bf16=row["xla_bf16_us"] / row["fp8_us"],
        floor_bytes_us=(m * k + n * k + 2 * m * n) / common.HBM_BYTES_PER_S * 1e6,
        floor_flops_us=flops / common.FP8_FLOPS_PER_S * 1e6,
    )
    for key in ("device", "kernel"):
        mine, bf16 = row[f"fp8_{key}_us"], row["xla_bf16_device_us"]
        row[f"speedup_vs_bf16_{key}"] = bf16 / mine if mine and bf16 else None
    return row


def plot(rows, path):
    """TF/s against M per shape (the newest row of each (shape, M)), device time where the row has it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    newest = list({(r["model"], r["N"], r["K"], r["M"]): r for r in rows if r.get("is_default") is not False}.values())
    keys = sorted({(r["model"], r["N"], r["K"]) for r in newest})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        rs = sorted((r for r in newest if (r["model"], r["N"], r["K"]) == key), key=lambda r: r["M"])
        tf = lambda r, *ks: next((2 * r["M"] * r["N"] * r["K"] / r[k] / 1e6 for k in ks if r.get(k)), None)  # noqa
        for ks, style, label in (
            (("fp8_device_us", "fp8_us"), "o-", "FP8 block-scaled (ours)"),
            (("xla_bf16_device_us", "xla_bf16_us"), "s-", "XLA bf16"),
            (("xla_fp8_per_tensor_us",), "^-", "XLA fp8 per-tensor (wall)"),
        ):
            ax.plot([r["M"] for r in rs], [tf(r, *ks) for r in rs], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{key[0]} N={key[1]} K={key[2]}", xlabel="M", ylabel="TFLOP/s (device time where traced)")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--models", default="llada,dream", help="comma-separated: " + ",".join(SHAPES))
    ap.add_argument("--shapes", default=None, help="comma-separated NxK filter, e.g. 24576x4096,4096x12288")
    common.output_args(ap, common.RESULTS / "fp8_matmul_h200.json")
    a = ap.parse_args(argv)
    wanted = None if a.shapes is None else {tuple(map(int, sh.split("x"))) for sh in a.shapes.split(",")}
    plan = [
        (m, model, n, k)
        for m in map(int, a.ms.split(","))
        for model in a.models.split(",")
        for (n, k) in SHAPES[model]
        if wanted is None or (n, k) in wanted
    ]
    if not plan:
        ap.error(f"no shape of {a.models} matches --shapes {a.shapes}")
    meta = common.meta(
        timing=f"median of 5 timed runs of a jit over {R} rotating input sets, / {R}",
        floors="bytes at 4.3 TB/s (fp8 x, fp8 w, bf16 y); flops at 1979 TFLOP/s dense e4m3",
    )
    out, rows, t0 = Path(a.out), [], time.perf_counter()
    for i, (m, model, n, k) in enumerate(plan):  # M outermost: the block-step rows finish first
        print(f"[{i + 1}/{len(plan)} {time.perf_counter() - t0:5.0f}s] {model} M={m} N={n} K={k}", flush=True)
        rows.append(bench_shape(model, m, n, k))
        r = rows[-1]
        print(
            f"    fp8 {r['fp8_us']:.1f} us wall, {r['fp8_device_us']} device, {r['fp8_kernel_us']} kernel; "
            f"bf16 {r['xla_bf16_us']:.1f} wall, {r['xla_bf16_device_us']} device; rel_err {r['rel_err']:.1e}",
            flush=True,
        )
        path = common.write_results(out.name, meta, rows, out.parent, a.run)
    plot(json.loads(path.read_text())["rows"], out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
