"""GPU benchmark of the FP8 block-scaled matmul (issue 5).

  python bench/bench_fp8_matmul.py                # full table + e2e proxy -> bench/results/fp8_matmul_h200.json (+ .png)
  python bench/bench_fp8_matmul.py --sweep        # config sweep on a few shapes
  python bench/bench_fp8_matmul.py --e2e-only

Timing: each measurement jits R back-to-back calls on R different input sets
(rotating inputs so L2 holds none of them), warms up once, then takes the
median of several perf_counter()-timed runs ending in block_until_ready,
divided by R. With a device (GPU), each is also traced (2 passes, v9): *_device_us is
the busy time of every kernel the call launched (jax.profiler), free of the
host's share and of the run-to-run spread of wall times at large M.

  python bench/bench_fp8_matmul.py --ms 4096,16384 --models llada --shapes 24576x4096 --no-e2e --out /tmp/x.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernel_trace import kernel_breakdown
from pallas_kernels import fp8_matmul as F

SHAPES = {  # model: [(N, K), ...]: gate (or up) alone, gate/up fused as the model runs it (v9), down
    "llada": [(12288, 4096), (24576, 4096), (4096, 12288)],
    "dream": [(18944, 3584), (37888, 3584), (3584, 18944)],
}
MS = [32, 256, 1024, 4096, 16384]
INTERPRET = jax.default_backend() != "gpu"  # the CPU smoke test: the Mosaic GPU simulator
R = 1 if INTERPRET else 4  # rotating input sets per timing (one on the CPU: a smoke test, the simulator is slow)


def timeit(fn, args_list, reps=5, device=False, kernel="fp8_matmul_kernel"):
  """Wall us per call; with device=True (wall, device busy us per call, device us of the kernels named `kernel`
  per call), the device times None without a device trace (the CPU)."""
  f = jax.jit(lambda al: [fn(*a) for a in al])
  jax.block_until_ready(f(args_list))
  ts = []
  for _ in range(1 if INTERPRET else reps):  # timings mean nothing on the CPU
    t0 = time.perf_counter()
    jax.block_until_ready(f(args_list))
    ts.append(time.perf_counter() - t0)
  wall = statistics.median(ts) / len(args_list) * 1e6  # us
  if not device:
    return wall
  bd = kernel_breakdown(lambda: jax.block_until_ready(f(args_list)), calls=1 if INTERPRET else 2, top=50)
  busy = bd.get("busy_ms") or 0.0
  named = sum(t["ms"] for t in bd.get("top", []) if kernel in t["name"])
  per_call = lambda ms: 1e3 * ms / len(args_list) if ms else None
  return wall, per_call(busy), per_call(named)


def make_inputs(m, n, k, nsets=R, seed=0):
  sets = []
  for i in range(nsets):
    k1, k2 = jax.random.split(jax.random.key(seed + i))
    x = jax.random.normal(k1, (m, k), jnp.bfloat16)
    w = (jax.random.normal(k2, (n, k), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
    xq, xs = F.quantize_activations(x)
    wq, ws = F.quantize_weights(w)
    sets.append(dict(x=x, w=w, xq=xq, xs=xs, wq=wq, ws=ws,
                     xt=jnp.max(jnp.abs(x)).astype(jnp.float32) / 448,
                     wt=jnp.max(jnp.abs(w)).astype(jnp.float32) / 448))
  return sets


def xla_bf16(x, w):
  return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


def _fp8_pt(xq, wq, s):
  y = lax.dot_general(xq, wq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  return (y * s).astype(jnp.bfloat16)


def rel_err(y, ref):
  y = jnp.asarray(y, jnp.float32)
  ref = jnp.asarray(ref, jnp.float32)
  return float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))


def alt_configs(m, n, k, max_alts=3):
  C, D = F.Fp8MatmulConfig, F.Dim
  if m <= 64:
    return [C(wg_dimension=D.N, wg_tile_n=64, max_concurrent_steps=6, split_k=1),
            C(wg_dimension=D.N, wg_tile_n=64, max_concurrent_steps=6, split_k=2)][:max_alts]
  if m <= 256:
    return [C(wg_dimension=D.N, wg_tile_n=64, max_concurrent_steps=6),
            C(wg_dimension=D.M, wg_tile_n=64, max_concurrent_steps=6, split_k=2)][:max_alts]
  # compute bound (v9): the default beside its steps back: no cluster, then the v8 default (2 groups on 2 stages
  # next to a 64-wide epilogue), then one group per stage
  default = F.default_config(m, n, k)
  steps = [dataclasses.replace(default, cluster_dimension=None)]
  steps.append(dataclasses.replace(steps[0], epi_tile_n=64))
  steps.append(dataclasses.replace(steps[1], groups_per_step=1))
  out = []
  for c in steps:
    if c != default and c not in out and F.stages_that_fit(c, jnp.float32) >= 2:
      out.append(c)
  return out[:max_alts]


def bench_shape(model, m, n, k, config=None, baselines=True, tune=False, max_alts=3):
  """One shape: the default config (fp8_us, fp8_device_us) and, with tune, the alternatives beside it
  (candidates[], each with wall and device time), then the XLA baselines."""
  sets = make_inputs(m, n, k)
  s0 = sets[0]
  default = config or F.default_config(m, n, k)
  cands = [default] + (alt_configs(m, n, k, max_alts) if tune else [])
  tried = []
  for c in cands:
    tiles_n = c.column_scales or not n % c.cluster_tile_n  # column tiles take any N
    if (k // 128) % c.split_k or (k // 128 // c.split_k) % c.groups_per_step or not tiles_n:
      continue
    fp8 = lambda xq, xs, wq, ws, c=c: F.fp8_matmul(xq, xs, wq, ws, config=c, interpret=INTERPRET)
    try:
      t, dev, kern = timeit(fp8, [(s["xq"], s["xs"], s["wq"], s["ws"]) for s in sets], device=True)
    except Exception as e:  # noqa: BLE001
      print("  config failed", c, repr(e)[:200], flush=True)
      if c == default:
        raise
      continue
    tried.append(dict(us=t, device_us=dev, kernel_us=kern, is_default=(c == default), **c.as_dict()))
    print(f"    {model} M={m} N={n} K={k} {'default' if c == default else 'alt':7s} {t:8.1f} us wall, "
          f"{dev if dev is None else round(dev, 1)} us device  g={c.groups_per_step} epi={c.epi_tile_n} "
          f"cluster={c.cluster_dimension}", flush=True)
  c = default
  mine = [r for r in tried if r["is_default"]]
  if not mine:
    raise ValueError(f"bench_shape: the default config does not tile M={m} N={n} K={k}: {default}")
  t, dev = mine[0]["us"], mine[0]["device_us"]
  fp8 = lambda xq, xs, wq, ws: F.fp8_matmul(xq, xs, wq, ws, config=c, interpret=INTERPRET)
  # rel_err on the first 2048 rows: the fp32 HIGHEST-precision reference of a whole M = 16384 row took minutes (v9)
  rows = min(m, 2048)
  y = fp8(s0["xq"], s0["xs"], s0["wq"], s0["ws"])[:rows]
  ref = F.fp8_matmul_reference(s0["xq"][:rows], s0["xs"][:rows], s0["wq"], s0["ws"], out_dtype=jnp.float32)
  row = dict(model=model, M=m, N=n, K=k, rel_err=rel_err(y, ref), rel_err_rows=rows)
  del y, ref
  row["fp8_us"] = t  # the default config (before v9: the best candidate)
  row["fp8_device_us"] = dev  # every kernel of the call: the GEMM and the wrapper's pad / transposes / scale table
  row["fp8_kernel_us"] = mine[0]["kernel_us"]  # the GEMM kernel alone (what the model's FFN runs: bench/NOTES.md v9)
  row["candidates"] = tried  # every config timed (same run), the default marked
  row["config"] = dict(c.as_dict(), is_default=True)
  if baselines:
    t_nk, d_nk, _ = timeit(xla_bf16, [(s["x"], s["w"]) for s in sets], device=True)
    wts = [jnp.asarray(s["w"].T) for s in sets]
    t_kn, d_kn, _ = timeit(lambda x, wt: jnp.dot(x, wt, preferred_element_type=jnp.bfloat16),
                        [(s["x"], wt) for s, wt in zip(sets, wts)], device=True)
    del wts
    row["xla_bf16_us"] = min(t_nk, t_kn)
    row["xla_bf16_w_nk_us"] = t_nk
    row["xla_bf16_w_kn_us"] = t_kn
    devs = [d for d in (d_nk, d_kn) if d is not None]
    row["xla_bf16_device_us"] = min(devs) if devs else None
    try:
      pt = []
      for s in sets:
        xq = jnp.clip(s["x"].astype(jnp.float32) / s["xt"], -448, 448).astype(F.FP8)
        wq = jnp.clip(s["w"].astype(jnp.float32) / s["wt"], -448, 448).astype(F.FP8)
        pt.append((xq, wq, s["xt"] * s["wt"]))
      row["xla_fp8_per_tensor_us"] = timeit(_fp8_pt, pt)
    except Exception as e:  # noqa: BLE001
      row["xla_fp8_per_tensor_us"] = None
      row["xla_fp8_error"] = repr(e)[:200]
  flops = 2.0 * m * n * k
  row["fp8_tflops"] = flops / row["fp8_us"] / 1e6
  if baselines:
    row["xla_bf16_tflops"] = flops / row["xla_bf16_us"] / 1e6
    row["speedup_vs_bf16"] = row["xla_bf16_us"] / row["fp8_us"]
    if row["fp8_device_us"] and row["xla_bf16_device_us"]:
      row["speedup_vs_bf16_device"] = row["xla_bf16_device_us"] / row["fp8_device_us"]
    if row["fp8_kernel_us"] and row["xla_bf16_device_us"]:
      row["speedup_vs_bf16_kernel"] = row["xla_bf16_device_us"] / row["fp8_kernel_us"]
  # floors: bytes (fp8 x + w + bf16 out) at 4.3 TB/s; flops at 1979 TFLOP/s dense fp8
  row["floor_bytes_us"] = (m * k + n * k + 2 * m * n) / 4.3e12 * 1e6
  row["floor_flops_us"] = flops / 1979e12 * 1e6
  return row


def sweep():
  C, D = F.Fp8MatmulConfig, F.Dim
  cands = {
      "small": [C(wg_dimension=D.N, wg_tile_n=64, split_k=s, max_concurrent_steps=6) for s in (1, 2, 4)]
               + [C(wg_dimension=D.N, wg_tile_n=128, split_k=s, max_concurrent_steps=5) for s in (1, 2)],
      "mid": [C(wg_dimension=D.M, wg_tile_n=64, split_k=s, max_concurrent_steps=6) for s in (1, 2)]
             + [C(wg_dimension=D.M, wg_tile_n=128, split_k=1, max_concurrent_steps=5),
                C(wg_dimension=D.N, wg_tile_n=64, split_k=1, max_concurrent_steps=6)],
      "large": [C(wg_dimension=D.M, wg_tile_n=128, max_concurrent_steps=4, grid_minor_dim=gm,
                  grid_tile_width=gw) for gm in (D.N, D.M) for gw in (4, 16)]
               + [C(wg_dimension=D.M, wg_tile_n=128, max_concurrent_steps=6, grid_tile_width=8),
                  C(wg_dimension=D.N, wg_tile_n=128, max_concurrent_steps=4, grid_tile_width=8)],
  }
  rows = []
  for (m, kind) in [(32, "small"), (256, "mid"), (4096, "large")]:
    for (n, k) in SHAPES["llada"]:
      base = bench_shape("llada", m, n, k, config=F.default_config(m, n, k))
      print(f"M={m} N={n} K={k} default {base['fp8_us']:.1f}us bf16 {base['xla_bf16_us']:.1f}us "
            f"fp8pt {base['xla_fp8_per_tensor_us']} err {base['rel_err']:.2e}", flush=True)
      rows.append(dict(base, cfg="default"))
      for c in cands[kind]:
        try:
          r = bench_shape("llada", m, n, k, config=c, baselines=False)
          print(f"   {c.wg_dimension.name} tn={c.wg_tile_n} sk={c.split_k} st={c.max_concurrent_steps} "
                f"gm={c.grid_minor_dim.name} gw={c.grid_tile_width}: {r['fp8_us']:.1f}us "
                f"({r['fp8_tflops']:.0f} TF) err {r['rel_err']:.1e}", flush=True)
          rows.append(dict(r, cfg=repr(c)))
        except Exception as e:  # noqa: BLE001
          print("   FAIL", c, repr(e)[:300], flush=True)
  return rows


# ----------------------------------------------------------------------------
# End-to-end proxy: LLaDA-8B-shaped transformer (random weights), layer 1 bf16
# FFN, layers 2..32 FP8 FFN (or all bf16).  Block step: 32 new tokens against
# a 512-slot K/V cache + LM head on the 32 positions; block start: 512 tokens.
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Cfg:
  d: int = 4096
  heads: int = 32
  hd: int = 128
  f: int = 12288
  layers: int = 32
  vocab: int = 126464


def rms(x, eps=1e-5):
  xf = x.astype(jnp.float32)
  return (xf * lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(jnp.bfloat16)


def init_model(c: Cfg, fp8: bool, key):
  ks = jax.random.split(key, 8)
  L = c.layers
  nrm = lambda k, shape, fan: (jax.random.normal(k, shape, jnp.bfloat16) * (fan ** -0.5)).astype(jnp.bfloat16)
  p = dict(
      emb=nrm(ks[0], (c.vocab, c.d), 1.0),
      head=nrm(ks[1], (c.d, c.vocab), c.d),
      wqkv=nrm(ks[2], (L, c.d, 3 * c.d), c.d),
      wo=nrm(ks[3], (L, c.d, c.d), c.d),
      gate=nrm(ks[4], (L, c.d, c.f), c.d),
      up=nrm(ks[5], (L, c.d, c.f), c.d),
      down=nrm(ks[6], (L, c.f, c.d), c.f),
  )
  if fp8:
    q = jax.jit(lambda g, u, d: lax.map(
        lambda t: F.quantize_ffn_weights(*t, layout="in_out"), (g, u, d)))(
        p["gate"][1:], p["up"][1:], p["down"][1:])
    p["fp8"] = q
  return p


def attn_block(x, wqkv, wo, kc, vc, c: Cfg):
  b, t, _ = x.shape
  h = rms(x)
  qkv = jnp.einsum("btd,de->bte", h, wqkv)
  q, k, v = jnp.split(qkv, 3, axis=-1)
  q = q.reshape(b, t, c.heads, c.hd)
  k = k.reshape(b, t, c.heads, c.hd)
  v = v.reshape(b, t, c.heads, c.hd)
  if kc is not None:  # write the new K/V at the end of the cache window
    k = lax.dynamic_update_slice(kc, k, (0, kc.shape[1] - t, 0, 0))
    v = lax.dynamic_update_slice(vc, v, (0, vc.shape[1] - t, 0, 0))
  try:
    o = jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
  except Exception:  # noqa: BLE001
    o = jax.nn.dot_product_attention(q, k, v)
  o = o.reshape(b, t, c.d)
  return x + jnp.einsum("btd,de->bte", o, wo)


def ffn_bf16(x, gate, up, down):  # [in, out] weights
  h = rms(x)
  g = jnp.einsum("btd,df->btf", h, gate, preferred_element_type=jnp.float32)
  u = jnp.einsum("btd,df->btf", h, up, preferred_element_type=jnp.float32)
  a = (jax.nn.silu(g) * u).astype(jnp.bfloat16)
  return x + jnp.einsum("btf,fd->btd", a, down)


FFN_BACKEND = "pallas"


def ffn_fp8(x, q):
  return x + F.fp8_ffn(rms(x), q, backend=FFN_BACKEND)


def forward(p, ids, kcache, vcache, c: Cfg, fp8: bool, head_last: int = 32):
  x = p["emb"][ids]
  kc0 = None if kcache is None else kcache[0]
  vc0 = None if vcache is None else vcache[0]
  x = attn_block(x, p["wqkv"][0], p["wo"][0], kc0, vc0, c)
  x = ffn_bf16(x, p["gate"][0], p["up"][0], p["down"][0])

  def body(x, lp):
    x = attn_block(x, lp["wqkv"], lp["wo"], lp.get("kc"), lp.get("vc"), c)
    if fp8:
      x = ffn_fp8(x, lp["q"])
    else:
      x = ffn_bf16(x, lp["gate"], lp["up"], lp["down"])
    return x, None

  lps = dict(wqkv=p["wqkv"][1:], wo=p["wo"][1:])
  if fp8:
    lps["q"] = p["fp8"]
  else:
    lps.update(gate=p["gate"][1:], up=p["up"][1:], down=p["down"][1:])
  if kcache is not None:
    lps.update(kc=kcache[1:], vc=vcache[1:])
  x, _ = lax.scan(body, x, lps)
  h = rms(x[:, -head_last:])
  return jnp.einsum("btd,dv->btv", h, p["head"], preferred_element_type=jnp.float32)


def e2e(reps=10, c=None):
  c = c or Cfg()
  out = {}
  key = jax.random.key(7)
  p = init_model(c, fp8=True, key=key)
  pb = {k: v for k, v in p.items() if k != "fp8"}
  ids_step = jax.random.randint(jax.random.key(1), (1, 32), 0, c.vocab)
  ids_full = jax.random.randint(jax.random.key(2), (1, 512), 0, c.vocab)
  kc = (jax.random.normal(jax.random.key(3), (c.layers, 1, 512, c.heads, c.hd), jnp.bfloat16))
  vc = (jax.random.normal(jax.random.key(4), (c.layers, 1, 512, c.heads, c.hd), jnp.bfloat16))
  for name, ids, cache in [("block_step_b1", ids_step, True), ("block_start_b1_512", ids_full, False)]:
    res = {}
    logits = {}
    for fp8 in (False, True):
      f = jax.jit(lambda p_, ids_, kc_, vc_, fp8=fp8: forward(p_, ids_, kc_, vc_, c, fp8))
      args = (p if fp8 else pb, ids, kc if cache else None, vc if cache else None)
      t0 = time.perf_counter()
      lg = jax.block_until_ready(f(*args))
      compile_s = time.perf_counter() - t0
      ts = []
      for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
      res["fp8_ms" if fp8 else "bf16_ms"] = statistics.median(ts) * 1e3
      res["fp8_compile_s" if fp8 else "bf16_compile_s"] = compile_s
      logits[fp8] = lg
    a = logits[True].reshape(-1, c.vocab)
    b = logits[False].reshape(-1, c.vocab)
    res["speedup"] = res["bf16_ms"] / res["fp8_ms"]
    res["logits_rel_l2"] = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    res["logits_cos"] = float(jnp.sum(a * b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))
    res["top1_agree"] = float(jnp.mean(jnp.argmax(a, -1) == jnp.argmax(b, -1)))
    out[name] = res
    print(name, json.dumps(res), flush=True)
  return out


def meta():
  commit = os.environ.get("GIT_COMMIT")  # the device copy's .git (if any) may be stale: the caller's wins
  try:
    commit = commit or subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                               stderr=subprocess.DEVNULL).strip()
  except Exception:  # noqa: BLE001
    commit = None
  d = jax.devices()[0]
  return dict(gpu=d.device_kind, num_sms=getattr(d, "core_count", None), jax=jax.__version__,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(), git_commit=commit,
              timing=f"median of 5 perf_counter runs of a jit over {R} rotating input sets, /{R}",
              fp8_us_includes="wrapper pad/transpose of xs + split-K reduction; excludes activation quantisation",
              floors="bytes at 4.3 TB/s (fp8 x, fp8 w, bf16 y); flops at 1979 TFLOP/s dense fp8")


def latest_rows(rows):
  """The last row per (model, N, K, M): later runs are appended after earlier ones in the committed file. Rows
  marked is_default False (a tiling timed beside the engine's, v17a) are left out."""
  last = {}
  for r in rows:
    if r.get("is_default") is False:
      continue
    last[(r["model"], r["N"], r["K"], r["M"])] = r
  return list(last.values())


def plot(rows, path):
  """TF/s against M per shape (the latest row of each): device time where the row has it (v9), else wall time."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except Exception:  # noqa: BLE001
    return
  rows = latest_rows(rows)
  keys = sorted({(r["model"], r["N"], r["K"]) for r in rows})
  fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
  axes = axes[0]
  for ax, key in zip(axes, keys):
    rs = sorted([r for r in rows if (r["model"], r["N"], r["K"]) == key], key=lambda r: r["M"])
    ms = [r["M"] for r in rs]
    fl = lambda r, k: 2 * r["M"] * r["N"] * r["K"] / r[k] / 1e6 if r.get(k) else np.nan
    best = lambda r, dev, wall: fl(r, dev) if r.get(dev) else fl(r, wall)
    ax.plot(ms, [best(r, "fp8_device_us", "fp8_us") for r in rs], "o-", label="fp8 block-scaled (pallas)")
    ax.plot(ms, [best(r, "xla_bf16_device_us", "xla_bf16_us") for r in rs], "s-", label="XLA bf16")
    ax.plot(ms, [fl(r, "xla_fp8_per_tensor_us") for r in rs], "^-", label="XLA fp8 per-tensor (wall)")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{key[0]} N={key[1]} K={key[2]}")
    ax.set_xlabel("M")
    ax.set_ylabel("TFLOP/s (device time where traced)")
    ax.grid(True, alpha=0.3)
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sweep", action="store_true")
  ap.add_argument("--e2e-only", action="store_true")
  ap.add_argument("--check", action="store_true", help="quick correctness check, exit 1 on failure")
  ap.add_argument("--no-e2e", action="store_true")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                "results", "fp8_matmul_h200.json"))
  ap.add_argument("--ms", default=",".join(map(str, MS)))
  ap.add_argument("--models", default=",".join(SHAPES), help="comma-separated: " + ",".join(SHAPES))
  ap.add_argument("--shapes", default=None, help="comma-separated NxK filter, e.g. 24576x4096,4096x12288")
  ap.add_argument("--replot", action="store_true", help="only redraw --out's .png from its rows (no device work)")
  ap.add_argument("--max-alts", type=int, default=3, help="alternative configs timed beside the default per row")
  a = ap.parse_args()
  if a.replot:
    with open(a.out) as fh:
      plot(json.load(fh)["rows"], a.out.replace(".json", ".png"))
    return
  os.makedirs(os.path.dirname(a.out), exist_ok=True)
  if a.check:
    ok = True
    for model, shapes in list(SHAPES.items())[:1]:
      for (n, k) in shapes:
        for m in (32, 4096):
          s0 = make_inputs(m, n, k, nsets=1)[0]
          y = F.fp8_matmul(s0["xq"], s0["xs"], s0["wq"], s0["ws"], out_dtype=jnp.float32)
          ref = F.fp8_matmul_reference(s0["xq"], s0["xs"], s0["wq"], s0["ws"], out_dtype=jnp.float32)
          e = rel_err(y, ref)
          ok &= e < 3e-4
          print(f"check {model} M={m} N={n} K={k} ws_prefetch={F.DEFAULT_WS_PREFETCH} rel_err={e:.2e}", flush=True)
    sys.exit(0 if ok else 1)
  if a.sweep:
    rows = sweep()
    with open(a.out.replace(".json", "_sweep.json"), "w") as fh:
      json.dump({"meta": meta(), "rows": rows}, fh, indent=1)
    return
  result = {"meta": meta(), "rows": []}
  if not a.e2e_only:
    models = a.models.split(",")
    unknown = sorted(set(models) - set(SHAPES))
    if unknown:
      ap.error(f"unknown models {unknown}; choose from {sorted(SHAPES)}")
    wanted = None if a.shapes is None else {tuple(map(int, sh.split("x"))) for sh in a.shapes.split(",")}
    plan = [(m, model, n, k) for m in map(int, a.ms.split(",")) for model in models for (n, k) in SHAPES[model]
            if wanted is None or (n, k) in wanted]
    if not plan:
      ap.error(f"no shape of {models} matches --shapes {a.shapes}")
    t0 = time.perf_counter()
    for i, (m, model, n, k) in enumerate(plan):  # M outermost: the rows that matter most finish first
      print(f"[{i + 1}/{len(plan)} {time.perf_counter() - t0:5.0f}s] {model} M={m} N={n} K={k}", flush=True)
      r = bench_shape(model, m, n, k, tune=True, max_alts=a.max_alts)
      result["rows"].append(r)
      print(json.dumps({key: v for key, v in r.items() if key != "candidates"}), flush=True)
      with open(a.out, "w") as fh:  # after every row: a run stopped by a time limit keeps what it measured
        json.dump(result, fh, indent=1)
  if not a.no_e2e:
    result["e2e_llada8b_proxy"] = e2e()
  with open(a.out, "w") as fh:
    json.dump(result, fh, indent=1)
  if result["rows"]:
    plot(result["rows"], a.out.replace(".json", ".png"))
    print(f"\n{'model':6} {'M':>6} {'N':>6} {'K':>6} {'fp8 us':>9} {'TF':>6} {'bf16 us':>9} {'TF':>6} "
          f"{'fp8pt us':>9} {'x bf16':>7} {'rel_err':>8}")
    for r in result["rows"]:
      pt = r.get("xla_fp8_per_tensor_us")
      print(f"{r['model']:6} {r['M']:6d} {r['N']:6d} {r['K']:6d} {r['fp8_us']:9.1f} {r['fp8_tflops']:6.0f} "
            f"{r['xla_bf16_us']:9.1f} {r['xla_bf16_tflops']:6.0f} {pt if pt is None else round(pt, 1)!s:>9} "
            f"{r['speedup_vs_bf16']:7.2f} {r['rel_err']:8.1e}")


if __name__ == "__main__":
  main()
