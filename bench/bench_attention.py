"""GPU benchmark of the slot-addressed Pallas attention kernel vs cuDNN.

Columns (microseconds per attention call, median of repeats):
  pallas_us            slot_attention through a permuted read table (gather inside the kernel)
  pallas_contig_us     slot_attention with read_table=None (contiguous [B, S, Hkv, D] cache)
  cudnn_contiguous_us  jax.nn.dot_product_attention(implementation="cudnn") on contiguous K/V
  xla_gather_cudnn_us  jnp.take of K/V through the same table, then cuDNN
  mgpu_fa3_contiguous_us  jax's own FlashAttention-3 Mosaic GPU kernel
                       (jax.experimental.pallas.ops.gpu.attention_mgpu) on contiguous f16 K/V, best of a few tile
                       configs, GPU only and where its shape rules hold (q_len a multiple of 2 * block_q): the
                       yardstick for a Mosaic GPU slot-attention kernel at full-forward shapes (issue 4)
  rel_err              ||pallas - reference||_2 / ||reference||_2 (fp32 reference)
  *_device_us          (GPU) the same chained call's kernels alone, from a profiler trace: device busy time per
                       attention call (the gather kernels included for xla_gather_cudnn), without launch gaps or
                       host dispatch; speedup_*_device are their ratios

Timing: a jitted function runs `inner` dependent calls (the output feeds the next call's q, so
nothing can be hoisted or elided); it is dispatched `outer` times back to back and timed with
perf_counter around block_until_ready; the median over `repeats` is reported.

Usage: python bench/bench_attention.py [--out bench/results/attention_h200.json] [--sweep] [--run LABEL]
  --run LABEL merges this run's rows (tagged run=LABEL) into the --out file instead of replacing it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernel_trace import kernel_breakdown  # noqa: E402
from pallas_kernels import slot_attention as sa  # noqa: E402
from pallas_kernels.shapes import ATTENTION_BENCH_SHAPES  # noqa: E402

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "attention_h200.json")


def sweep_candidates(shape):
  """Block-size candidates for --sweep (the default heuristic is always tried first)."""
  g = shape.q_heads // shape.kv_heads
  gp = 1 if g <= 1 else 1 << (g - 1).bit_length()
  out = []
  small_q = shape.q_len <= 64
  if small_q:
    configs = {32: [(64, 4, 2), (128, 4, 2)], 64: [(64, 4, 2), (64, 4, 3)],
               128: [(64, 4, 2), (64, 8, 3)], 256: [(64, 8, 3)]}
  else:
    configs = {64: [(64, 4, 3)], 128: [(64, 8, 3), (128, 8, 3), (64, 4, 3), (32, 4, 3)],
               256: [(64, 8, 3)]}
  for rows, cfgs in configs.items():
    bq = rows // gp
    if bq < 1 or bq > 1 << max(0, (shape.q_len - 1).bit_length()):
      continue
    for bk, w, st in cfgs:
      out.append(sa.BlockSizes(block_q=bq, block_k=bk, num_warps=w, num_stages=st))
  if shape.q_len <= 64:  # block-step: also vary the KV split
    base = sa.BlockSizes.get_default(batch=shape.batch, q_len=shape.q_len, kv_len=shape.kv_len,
                                     q_heads=shape.q_heads, kv_heads=shape.kv_heads,
                                     head_dim=shape.head_dim)
    for ks in (1, 2, 4, 8, 16):
      out.append(sa.BlockSizes(block_q=base.block_q, block_k=base.block_k,
                               num_warps=base.num_warps, num_stages=base.num_stages, kv_splits=ks))
  seen, uniq = set(), []
  for c in out:
    if c not in seen:
      seen.add(c)
      uniq.append(c)
  return uniq


def make_inputs(shape, seed=0):
  B, T, S, Hq, Hkv, D = (shape.batch, shape.q_len, shape.kv_len, shape.q_heads, shape.kv_heads,
                         shape.head_dim)
  key = jax.random.PRNGKey(seed)
  k1, k2, k3, k4 = jax.random.split(key, 4)
  q = jax.random.normal(k1, (B, T, Hq, D), jnp.bfloat16)
  kc = jax.random.normal(k2, (B, S, Hkv, D), jnp.bfloat16)
  vc = jax.random.normal(k3, (B, S, Hkv, D), jnp.bfloat16)
  P = B * S
  perm = jax.random.permutation(k4, P).astype(jnp.int32)       # slot of flat position i
  table = perm.reshape(B, S)
  kp = jnp.zeros((P, Hkv, D), jnp.bfloat16).at[perm].set(kc.reshape(P, Hkv, D))
  vp = jnp.zeros((P, Hkv, D), jnp.bfloat16).at[perm].set(vc.reshape(P, Hkv, D))
  ql = jnp.full((B,), T, jnp.int32)
  kl = jnp.full((B,), S, jnp.int32)
  return q, kc, vc, kp, vp, table, ql, kl


def chain(fn, inner):
  """jit of `inner` dependent calls: q <- fn(q, *rest)."""
  def run(q, *rest):
    for _ in range(inner):
      q = fn(q, *rest)
    return q
  return jax.jit(run)


def time_us(f, args, inner, outer, repeats):
  f(*args).block_until_ready()  # compile + warm-up
  f(*args).block_until_ready()
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(outer):
      out = f(*args)
    out.block_until_ready()
    ts.append((time.perf_counter() - t0) / (inner * outer) * 1e6)
  return float(np.median(ts))


def device_us(f, args, inner):
  """Device busy time (us) per attention call of the chained jit f (`inner` calls), from one traced run; None
  without a device trace (the CPU)."""
  busy = kernel_breakdown(lambda: f(*args).block_until_ready(), calls=2, top=5).get("busy_ms") or 0.0
  return round(1e3 * busy / inner, 2) if busy else None


def rel_err(a, b):
  a = a.astype(jnp.float32)
  b = b.astype(jnp.float32)
  return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def git_commit():
  if os.environ.get("GIT_COMMIT"):
    return os.environ["GIT_COMMIT"]
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          timeout=5, cwd=os.path.dirname(os.path.abspath(__file__))
                          ).stdout.strip() or "unknown"
  except Exception:  # noqa: BLE001
    return "unknown"


FA3_CONFIGS = ((64, 64, 2), (64, 128, 2), (64, 64, 4), (64, 128, 3))  # (block_q, block_kv, stages)


def mgpu_fa3(q, k, v, ref, inner: int, timing: dict):
  """(us, config, rel_err) of jax's FA3 Mosaic GPU kernel at its best config here, or Nones (CPU, or no config
  fits the shape, or none compiles)."""
  if SMOKE or jax.default_backend() != "gpu":
    return None, None, None
  from jax.experimental.pallas.ops.gpu import attention_mgpu as fa3

  # it applies no softmax scale itself (its source: exp2(q.k * log2 e)), so q carries ours; its SMEM tiles are f16
  q = q * q.shape[-1] ** -0.5
  q, k, v = (a.astype(jnp.float16) for a in (q, k, v))
  best = (None, None, None)
  for bq, bkv, stages in FA3_CONFIGS:
    if q.shape[1] % (2 * bq) or k.shape[1] % bkv:
      continue
    cfg = fa3.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=stages)
    fn = lambda q_, k_, v_, cfg=cfg: fa3.attention(q_, k_, v_, cfg)
    try:
      us = time_us(chain(fn, inner), (q, k, v), **timing)
      err = rel_err(jax.jit(fn)(q, k, v), ref)
    except Exception as e:  # noqa: BLE001  (a config may not compile for this shape)
      print(f"  fa3 {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
      continue
    if best[0] is None or us < best[0]:
      best = (round(us, 2), f"block_q={bq} block_kv={bkv} stages={stages}", err)
  return best


def plot(rows: list[dict], path: str, gpu: str) -> None:
  """Grouped bars per case: our kernel, cuDNN, XLA gather + cuDNN and, where timed, jax's FA3 kernel (log scale)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  series = [("pallas_us", "pallas (slot gather)"), ("cudnn_contiguous_us", "cuDNN contiguous"),
            ("xla_gather_cudnn_us", "XLA gather + cuDNN")]
  if any(r.get("mgpu_fa3_contiguous_us") for r in rows):
    series.append(("mgpu_fa3_contiguous_us", "jax FA3 Mosaic GPU, contiguous"))
  x = np.arange(len(rows))
  w = 0.8 / len(series)
  fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
  for i, (key, lab) in enumerate(series):
    ax.bar(x + (i - (len(series) - 1) / 2) * w, [r.get(key) or 0 for r in rows], w, label=lab)
  ax.set_xticks(x)
  ax.set_xticklabels([r["case"] for r in rows], rotation=35, ha="right", fontsize=7)
  ax.set_ylabel("us per call")
  ax.set_yscale("log")
  ax.set_title(f"slot attention on {gpu} (bf16, head_dim 128)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=DEFAULT_OUT)
  ap.add_argument("--sweep", action="store_true", help="try several BlockSizes, report the best")
  ap.add_argument("--sweep-shapes", default="", help="with --sweep: only these case substrings")
  ap.add_argument("--shapes", default="", help="comma-separated substrings of case names")
  ap.add_argument("--inner", type=int, default=10)
  ap.add_argument("--outer", type=int, default=4)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--budget-s", type=float, default=1e9, help="stop sweeping after this long")
  ap.add_argument("--run", default=None,
                  help="label of this run: its rows (tagged run=LABEL) are merged into an existing --out file, "
                       "replacing only earlier rows of the same label; meta.runs[LABEL] records date, commit, note")
  ap.add_argument("--note", default="", help="with --run: what the run was for")
  args = ap.parse_args(argv)
  t_start = time.time()

  dev = jax.devices()[0]
  meta = {
      "gpu": getattr(dev, "device_kind", str(dev)),
      "backend": jax.default_backend(),
      "jax_version": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "git_commit": git_commit(),
      "dtype": "bfloat16",
      "timing": f"median of {args.repeats} x ({args.outer} dispatches x {args.inner} chained calls)",
      "pallas": "Triton lowering, gather through the read table inside the kernel",
      "sweep": bool(args.sweep),
  }
  result = {"meta": meta, "rows": [], "sweep": {}}
  kept = []  # --run: the file's rows of other runs, written back beside this run's
  if args.run and os.path.exists(args.out):
    with open(args.out) as f:
      old = json.load(f)
    kept = [r for r in old.get("rows", []) if str(r.get("run")) != args.run]
    result = {**old, "rows": list(kept), "sweep": {}}
    result["meta"].setdefault("runs", {})[args.run] = {k: meta[k] for k in ("date", "git_commit", "timing")}
    result["meta"]["runs"][args.run]["note"] = args.note
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  all_shapes = ATTENTION_BENCH_SHAPES
  if SMOKE:  # CPU smoke test of the script itself: tiny shapes, interpreted kernel
    all_shapes = [s._replace(batch=1, q_len=min(s.q_len, 32), kv_len=64, q_heads=s.q_heads // 4,
                             kv_heads=max(1, s.kv_heads // 4)) for s in all_shapes[::3]]
  shapes = [s for s in all_shapes
            if not args.shapes or any(x in s.case for x in args.shapes.split(","))]
  timing = dict(inner=args.inner, outer=args.outer, repeats=args.repeats)

  for shape in shapes:
    q, kc, vc, kp, vp, table, ql, kl = make_inputs(shape)
    default_bs = sa.BlockSizes.get_default(batch=shape.batch, q_len=shape.q_len,
                                           kv_len=shape.kv_len, q_heads=shape.q_heads,
                                           kv_heads=shape.kv_heads, head_dim=shape.head_dim)

    def pallas_fn(bs):
      return chain(lambda q_, kp_, vp_, t_, ql_, kl_: sa.slot_attention(
          q_, kp_, vp_, t_, ql_, kl_, block_sizes=bs, interpret=SMOKE), args.inner)

    do_sweep = args.sweep and (not args.sweep_shapes or any(
        x in shape.case for x in args.sweep_shapes.split(",")))
    cands = [default_bs] + ([c for c in sweep_candidates(shape) if c != default_bs]
                            if do_sweep else [])
    sweep_rows = []
    best_bs, best_us = None, float("inf")
    for bs in cands:
      if bs is not default_bs and time.time() - t_start > args.budget_s:
        break
      try:
        us = time_us(pallas_fn(bs), (q, kp, vp, table, ql, kl), **timing)
      except Exception as e:  # noqa: BLE001  (a config may fail to compile)
        sweep_rows.append({"block_sizes": repr(bs), "error": str(e)[:200]})
        continue
      sweep_rows.append({"block_sizes": repr(bs), "us": us})
      if us < best_us:
        best_bs, best_us = bs, us
    result["sweep"][shape.case] = sweep_rows

    out = sa.slot_attention(q, kp, vp, table, ql, kl, block_sizes=best_bs, interpret=SMOKE)
    ref = sa.slot_attention_reference(q, kp, vp, table, ql, kl)
    err = rel_err(out, ref)
    contig_us = time_us(chain(lambda q_, k_, v_, ql_, kl_: sa.slot_attention(
        q_, k_, v_, None, ql_, kl_, block_sizes=best_bs, interpret=SMOKE), args.inner), (q, kc, vc, ql, kl),
        **timing)
    err_contig = rel_err(sa.slot_attention(q, kc, vc, None, ql, kl, block_sizes=best_bs,
                                         interpret=SMOKE), ref)

    cudnn = lambda q_, k_, v_: jax.nn.dot_product_attention(
        q_, k_, v_, implementation=None if SMOKE else "cudnn")
    cudnn_f = chain(cudnn, args.inner)
    cudnn_us = time_us(cudnn_f, (q, kc, vc), **timing)
    err_cudnn = rel_err(cudnn(q, kc, vc), ref)

    def gather_cudnn(q_, kp_, vp_, t_):
      t_, q_ = jax.lax.optimization_barrier((t_, q_))  # keep the gather inside the loop
      return cudnn(q_, jnp.take(kp_, t_, axis=0), jnp.take(vp_, t_, axis=0))
    gather_f = chain(gather_cudnn, args.inner)
    gather_us = time_us(gather_f, (q, kp, vp, table), **timing)
    # the kernels alone (launch gaps and dispatch out), each from one trace of the same chained calls
    pallas_f = pallas_fn(best_bs)
    pallas_f(q, kp, vp, table, ql, kl).block_until_ready()
    dev = {"pallas_device_us": device_us(pallas_f, (q, kp, vp, table, ql, kl), args.inner),
           "cudnn_contiguous_device_us": device_us(cudnn_f, (q, kc, vc), args.inner),
           "xla_gather_cudnn_device_us": device_us(gather_f, (q, kp, vp, table), args.inner)}
    ratio = lambda a, b: round(a / b, 3) if a and b else None

    fa3_us, fa3_cfg, fa3_err = mgpu_fa3(q, kc, vc, ref, args.inner, timing)

    row = {
        "case": shape.case, "batch": shape.batch, "q_len": shape.q_len, "kv_len": shape.kv_len,
        "q_heads": shape.q_heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "pallas_us": round(best_us, 2),
        "pallas_default_us": sweep_rows[0].get("us"), "cudnn_contiguous_us": round(cudnn_us, 2),
        "xla_gather_cudnn_us": round(gather_us, 2), "rel_err": err,
        "pallas_contiguous_us": round(contig_us, 2), "rel_err_contiguous": err_contig,
        "rel_err_cudnn": err_cudnn,
        "mgpu_fa3_contiguous_us": fa3_us, "mgpu_fa3_config": fa3_cfg, "rel_err_mgpu_fa3": fa3_err,
        "speedup_vs_cudnn": round(cudnn_us / best_us, 3),
        "speedup_vs_gather_cudnn": round(gather_us / best_us, 3),
        "block_sizes": repr(best_bs), "default_block_sizes": repr(default_bs),
        **dev,
        "speedup_vs_cudnn_device": ratio(dev["cudnn_contiguous_device_us"], dev["pallas_device_us"]),
        "speedup_vs_gather_cudnn_device": ratio(dev["xla_gather_cudnn_device_us"], dev["pallas_device_us"]),
    }
    if args.run:
      row["run"] = args.run
    result["rows"].append(row)
    print(f"{shape.case:32s} pallas {best_us:8.1f} us  contig {contig_us:8.1f}  cudnn "
          f"{cudnn_us:8.1f}  gather+cudnn {gather_us:8.1f}  fa3 {fa3_us}  x{cudnn_us / best_us:5.2f}  "
          f"err {err:.2e}  [{best_bs}]", flush=True)
    tmp = args.out + ".tmp"  # a kill mid-write must not truncate the committed file
    with open(tmp, "w") as f:
      json.dump(result, f, indent=1)
    os.replace(tmp, args.out)

  fmt = lambda v, spec: format(v, spec) if v is not None else "-".rjust(len(format(0, spec)))
  print("\ncase                              pallas   cudnn  gath+cudnn  vs_cudnn | device: pallas   cudnn  "
        "gath+cudnn  vs_cudnn  vs_gath")
  for r in result["rows"][len(kept):]:
    print(f"{r['case']:32s} {r['pallas_us']:8.1f} {r['cudnn_contiguous_us']:8.1f} "
          f"{r['xla_gather_cudnn_us']:8.1f}  {r['speedup_vs_cudnn']:6.2f}x | {fmt(r['pallas_device_us'], '8.1f')} "
          f"{fmt(r['cudnn_contiguous_device_us'], '8.1f')} {fmt(r['xla_gather_cudnn_device_us'], '8.1f')}  "
          f"{fmt(r['speedup_vs_cudnn_device'], '6.2f')}x {fmt(r['speedup_vs_gather_cudnn_device'], '6.2f')}x")
  try:
    newest = {r["case"]: r for r in result["rows"]}  # the last row of each case: the newest run's
    plot(list(newest.values()), os.path.splitext(args.out)[0] + ".png", meta["gpu"])
  except Exception as e:  # noqa: BLE001
    print("plot skipped:", e)
  print(f"wrote {args.out} in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
  main()
