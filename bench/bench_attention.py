"""How fast is the slot-addressed attention kernel against cuDNN? (pallas_kernels/slot_attention.py, Triton.)

LLaDA-8B (32/32 heads) and Dream-7B (28/4) shapes, head_dim 128, bf16: full forwards (8 x 512 x 512, 4 x 512 x 2048)
and block steps (32 queries, batch 1 / 16, 512 / 2048 keys). Columns, us per attention call:
  pallas_us               slot_attention through a permuted read table (the gather inside the kernel)
  pallas_contiguous_us    slot_attention with read_table=None (contiguous [B, S, Hkv, D] K/V)
  cudnn_contiguous_us     jax.nn.dot_product_attention(implementation="cudnn") on contiguous K/V
  xla_gather_cudnn_us     jnp.take of K/V through the same table, then cuDNN (what the engine would do without it)
  mgpu_fa3_contiguous_us  (--fa3) jax's FlashAttention-3 Mosaic GPU kernel on contiguous f16 K/V, best of a few
                          tilings where its shape rules hold: the yardstick for a paged full-forward kernel
  *_device_us             (GPU) the same chained calls' kernels alone, from a profiler trace (gathers included):
                          no launch gaps, no host dispatch; speedup_*_device are their ratios
  rel_err*                ||out - reference||_2 / ||reference||_2 against the fp32 reference
Timing: a jit of `inner` dependent calls (each output is the next call's q: nothing hoisted), dispatched `outer`
times back to back; the median over `repeats`. Writes bench/results/attention_h200.json (rows merged by --run label)
and a plot beside it. On the CPU: tiny shapes, the kernel interpreted (a smoke test).

    PYTHONPATH=. python bench/bench_attention.py --run NAME [--shapes block] [--fa3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import common, trace  # noqa: E402
from tools.shapes import ATTENTION_BENCH_SHAPES  # noqa: E402

# package imports (re-point here when the package moves)
from pallas_kernels import slot_attention as sa  # noqa: E402  slot_attention, slot_attention_reference, BlockSizes

SMOKE = common.SMOKE_ON_CPU  # tiny shapes, the kernel interpreted
FA3_TILINGS = ((64, 64, 2), (64, 128, 2), (64, 64, 4), (64, 128, 3))  # (block_q, block_kv, stages)


def make_inputs(shape, seed=0):
    b, t, s, hq, hkv, d = shape.batch, shape.q_len, shape.kv_len, shape.q_heads, shape.kv_heads, shape.head_dim
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(k1, (b, t, hq, d), jnp.bfloat16)
    kc = jax.random.normal(k2, (b, s, hkv, d), jnp.bfloat16)
    vc = jax.random.normal(k3, (b, s, hkv, d), jnp.bfloat16)
    perm = jax.random.permutation(k4, b * s).astype(jnp.int32)  # the slot of flat position i
    kp = jnp.zeros((b * s, hkv, d), jnp.bfloat16).at[perm].set(kc.reshape(b * s, hkv, d))
    vp = jnp.zeros((b * s, hkv, d), jnp.bfloat16).at[perm].set(vc.reshape(b * s, hkv, d))
    lens = jnp.full((b,), t, jnp.int32), jnp.full((b,), s, jnp.int32)
    return q, kc, vc, kp, vp, perm.reshape(b, s), *lens


def chain(fn, inner):
    """jit of `inner` dependent calls: q <- fn(q, *rest)."""

    def run(q, *rest):
        for _ in range(inner):
            q = fn(q, *rest)
        return q

    return jax.jit(run)


def time_us(f, args, inner, outer, repeats):
    """us per attention call: `outer` dispatches of the chained jit f back to back, median of `repeats`."""
    f(*args).block_until_ready()  # compile + warm-up

    def calls():
        out = None
        for _ in range(outer):
            out = f(*args)
        out.block_until_ready()

    return 1e6 * common.time_call(calls, reps=repeats)[0] / (inner * outer)


def device_us(f, args, inner):
    """Device busy us per attention call of the chained jit f, from one trace (None on the CPU)."""
    busy = trace.kernel_breakdown(lambda: f(*args).block_until_ready(), calls=2, top=5).get("busy_ms")
    return round(1e3 * busy / inner, 2) if busy else None


def rel_err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def mgpu_fa3(q, k, v, ref, inner, timing):
    """(us, tiling, rel_err) of jax's FA3 Mosaic GPU kernel at its best tiling here, or Nones."""
    if SMOKE:
        return None, None, None
    from jax.experimental.pallas.ops.gpu import attention_mgpu as fa3

    # it applies no softmax scale itself, so q carries ours; its shared-memory tiles are f16
    q, k, v = (a.astype(jnp.float16) for a in (q * q.shape[-1] ** -0.5, k, v))
    best = (None, None, None)
    for bq, bkv, stages in FA3_TILINGS:
        if q.shape[1] % (2 * bq) or k.shape[1] % bkv:
            continue
        cfg = fa3.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=stages)
        fn = lambda q_, k_, v_, cfg=cfg: fa3.attention(q_, k_, v_, cfg)  # noqa: E731
        try:
            us = time_us(chain(fn, inner), (q, k, v), inner, **timing)
            err = rel_err(jax.jit(fn)(q, k, v), ref)
        except Exception as e:  # noqa: BLE001  (a tiling may not compile for this shape)
            print(f"  fa3 {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if best[0] is None or us < best[0]:
            best = (round(us, 2), f"block_q={bq} block_kv={bkv} stages={stages}", err)
    return best


def bench_shape(shape, inner, timing, fa3=False) -> dict:
    q, kc, vc, kp, vp, table, ql, kl = make_inputs(shape)
    bs = sa.BlockSizes.get_default(
        batch=shape.batch,
        q_len=shape.q_len,
        kv_len=shape.kv_len,
        q_heads=shape.q_heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
    )

    def attn(q_, k_, v_, t_):
        return sa.slot_attention(q_, k_, v_, t_, ql, kl, block_sizes=bs, interpret=SMOKE)

    def cudnn(q_, k_, v_):
        return jax.nn.dot_product_attention(q_, k_, v_, implementation=None if SMOKE else "cudnn")

    def gather_cudnn(q_, kp_, vp_, t_):
        t_, q_ = jax.lax.optimization_barrier((t_, q_))  # keep the gather inside the chain
        return cudnn(q_, jnp.take(kp_, t_, axis=0), jnp.take(vp_, t_, axis=0))

    ref = sa.slot_attention_reference(q, kp, vp, table, ql, kl)
    timed = {
        "pallas": (chain(attn, inner), (q, kp, vp, table)),
        "pallas_contiguous": (chain(lambda q_, k_, v_: attn(q_, k_, v_, None), inner), (q, kc, vc)),
        "cudnn_contiguous": (chain(cudnn, inner), (q, kc, vc)),
        "xla_gather_cudnn": (chain(gather_cudnn, inner), (q, kp, vp, table)),
    }
    row = {"case": shape.case, **shape._asdict(), "block_sizes": repr(bs)}
    for key, (f, args) in timed.items():
        row[f"{key}_us"] = round(time_us(f, args, inner, **timing), 2)
    for key in ("pallas", "cudnn_contiguous", "xla_gather_cudnn"):
        row[f"{key}_device_us"] = device_us(*timed[key], inner)
    row.update(
        rel_err=rel_err(attn(q, kp, vp, table), ref),
        rel_err_contiguous=rel_err(attn(q, kc, vc, None), ref),
        rel_err_cudnn=rel_err(cudnn(q, kc, vc), ref),
    )
    ratio = lambda a, b: round(a / b, 3) if a and b else None  # noqa: E731
    for base, suffix in (("cudnn_contiguous", "cudnn"), ("xla_gather_cudnn", "gather_cudnn")):
        row[f"speedup_vs_{suffix}"] = ratio(row[f"{base}_us"], row["pallas_us"])
        row[f"speedup_vs_{suffix}_device"] = ratio(row[f"{base}_device_us"], row["pallas_device_us"])
    if fa3:
        row["mgpu_fa3_contiguous_us"], row["mgpu_fa3_config"], row["rel_err_mgpu_fa3"] = mgpu_fa3(
            q, kc, vc, ref, inner, timing
        )
    return row


def plot(rows: list[dict], path: Path) -> None:
    """Per case (the newest row of each): our kernel, cuDNN, XLA gather + cuDNN, FA3 where timed; device time
    where the row has it."""
    newest = list({r["case"]: r for r in rows}.values())
    best = lambda r, k: r.get(f"{k}_device_us") or r.get(f"{k}_us")  # noqa: E731
    series = [
        (label, [best(r, k) for r in newest])
        for k, label in (
            ("pallas", "slot kernel (gather inside)"),
            ("cudnn_contiguous", "cuDNN, contiguous K/V"),
            ("xla_gather_cudnn", "XLA gather + cuDNN"),
        )
    ]
    if any(r.get("mgpu_fa3_contiguous_us") for r in newest):
        series.append(("jax FA3 (Mosaic GPU), contiguous", [r.get("mgpu_fa3_contiguous_us") for r in newest]))
    common.grouped_bars(
        path,
        [r["case"] for r in newest],
        series,
        "us per call (device time where traced)",
        "attention, bf16, head_dim 128",
        log=True,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="", help="comma-separated substrings of case names")
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--outer", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fa3", action="store_true", help="also time jax's FA3 Mosaic GPU kernel (GPU only)")
    common.output_args(ap, common.RESULTS / "attention_h200.json")
    args = ap.parse_args(argv)
    t_start = time.time()
    shapes = ATTENTION_BENCH_SHAPES
    if SMOKE:  # tiny shapes, one of each kind
        shapes = [
            s._replace(
                batch=1, q_len=min(s.q_len, 32), kv_len=64, q_heads=s.q_heads // 4, kv_heads=max(1, s.kv_heads // 4)
            )
            for s in shapes[::3]
        ]
    shapes = [s for s in shapes if not args.shapes or any(x in s.case for x in args.shapes.split(","))]
    timing = dict(outer=args.outer, repeats=args.repeats)
    meta = common.meta(
        dtype="bfloat16", timing=f"median of {args.repeats} x ({args.outer} dispatches x {args.inner} chained calls)"
    )
    out = Path(args.out)
    rows = []
    for shape in shapes:
        rows.append(bench_shape(shape, args.inner, timing, args.fa3))
        r = rows[-1]
        print(
            f"{r['case']:30s} pallas {r['pallas_us']:8.1f} us  cudnn {r['cudnn_contiguous_us']:8.1f}  gather+cudnn "
            f"{r['xla_gather_cudnn_us']:8.1f}  device: pallas {r['pallas_device_us']} cudnn "
            f"{r['cudnn_contiguous_device_us']} x{r['speedup_vs_cudnn_device']}  err {r['rel_err']:.1e}",
            flush=True,
        )
        path = common.write_results(out.name, meta, rows, out.parent, args.run)
    plot(json.loads(path.read_text())["rows"], out.with_suffix(".png"))
    print(f"wrote {out} in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
