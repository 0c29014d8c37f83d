"""Block-step attention on the GPU: a wide sweep of the slot kernel's tilings at the shapes a block step runs.

Why: the v12 trace of a block step (bench/NOTES.md) has the kernel at 7.6 us per layer at LLaDA-8B batch 1 (~8 MB
of K/V: floor ~2 us) and 25 us at batch 8 (67 MB: 2.7 TB/s), and bench_attention's sweep only ever tried two
tilings for MHA block steps. This script tries tile width x pipeline stages x warps with the default split
rule, then, around the best of those, the KV split count and normalised partials (split-K partials written as
o / l in bf16, half the partials' bytes, merged by weight l * exp(m - max m)). Run s13a (commit b50a6e3) also
timed a head-major K/V layout ([B, Hkv, S, D]: one contiguous block a program): within 0.5% of the model's
[B, S, Hkv, D] in device time, so that probe was removed (NOTES v13).

It times the contiguous path (read_table=None), which is what the model's block steps run, against cuDNN on the
same K/V in the same process. Timing: a jit of `inner` dependent calls (the output feeds the next q), wall time per
call (median of repeats); the default, cuDNN and the best candidates are then traced (device time per call of all
kernels: the attention kernel plus its split-K merge). Writes bench/results/block_attention_sweep_h200.json.

Usage (GPU): python bench/sweep_block_attention.py [--budget-s 420] [--shapes llada_b1,dream_b8]
CPU smoke (interpret mode, tiny): BENCH_SMOKE=1 python bench/sweep_block_attention.py --out /tmp/s.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.bench_attention import chain, git_commit, rel_err, time_us  # noqa: E402
from bench.kernel_trace import kernel_breakdown  # noqa: E402
from pallas_kernels import slot_attention as sa  # noqa: E402
from pallas_kernels.shapes import AttnShape  # noqa: E402

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "block_attention_sweep_h200.json")

# The block-step shapes of profile_block_step.py (32 new tokens per row against a 512-slot cache).
SHAPES = [AttnShape(f"{m}_b{b}", b, 32, 512, hq, hkv, 128)
          for m, hq, hkv in (("llada", 32, 32), ("dream", 28, 4)) for b in (1, 8, 16)]
SMOKE_SHAPES = [AttnShape("tiny_mha_b1", 1, 8, 128, 2, 2, 32), AttnShape("tiny_gqa_b2", 2, 8, 128, 4, 1, 32)]


def tile_candidates(shape, default: sa.BlockSizes):
  """Stage 1: tile width x stages x warps, default split rule and block_q."""
  out = [default]
  widths = (64,) if SMOKE else (32, 64, 128)
  for bk in widths:
    for st in ((2,) if SMOKE else (1, 2, 3, 4)):
      for w in ((4,) if SMOKE else (4, 8)):
        out.append(sa.BlockSizes(block_q=default.block_q, block_k=bk, num_warps=w, num_stages=st))
  return list(dict.fromkeys(out))


def split_candidates(shape, best: sa.BlockSizes):
  n_tiles = -(-shape.kv_len // best.block_k)
  splits = [s for s in (1, 2, 4, 8, 16) if s <= n_tiles]
  return [sa.BlockSizes(block_q=best.block_q, block_k=best.block_k, num_warps=best.num_warps,
                        num_stages=best.num_stages, kv_splits=s) for s in splits]


def label(bs: sa.BlockSizes, normalised=False):
  s = f"bq{bs.block_q}_bk{bs.block_k}_w{bs.num_warps}_st{bs.num_stages}_sp{bs.kv_splits or 'auto'}"
  return s + ("_bf16partials" if normalised else "")


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=DEFAULT_OUT)
  ap.add_argument("--shapes", default="", help="comma-separated substrings of case names")
  ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new candidates after this long")
  ap.add_argument("--inner", type=int, default=16)
  ap.add_argument("--outer", type=int, default=4)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--trace-top", type=int, default=3, help="trace this many of the fastest candidates a shape")
  ap.add_argument("--run", default="", help="run label stored with each row")
  args = ap.parse_args(argv)

  interpret = jax.default_backend() != "gpu"
  if interpret and not SMOKE:
    raise SystemExit("the sweep times the compiled kernel: run it on a GPU (BENCH_SMOKE=1 for a CPU smoke run)")
  inner, outer, repeats = (2, 1, 1) if SMOKE else (args.inner, args.outer, args.repeats)
  shapes = SMOKE_SHAPES if SMOKE else SHAPES
  if args.shapes:
    want = [w for w in args.shapes.split(",") if w]
    shapes = [s for s in shapes if any(w in s.case for w in want)]
    if not shapes:
      raise SystemExit(f"--shapes {args.shapes!r} matches none of {[s.case for s in SHAPES]}")
  split_rule = (sa.MIN_TILES_PER_SPLIT, sa.SPLIT_BELOW_SMS)
  t_start = time.perf_counter()
  rows = []

  def save():
    meta = {"gpu": jax.devices()[0].device_kind, "jax_version": jax.__version__,
            "date": datetime.date.today().isoformat(), "git_commit": os.environ.get("GIT_COMMIT") or git_commit(),
            "what": __doc__.split("\n\n")[0], "inner": inner, "outer": outer, "repeats": repeats,
            "timing": "wall_us: median per call of a jit of `inner` chained calls; device_us: traced busy "
                      "time per call (attention kernel + split-K merge), cudnn the same way",
            "split_rule": list(split_rule), "run": args.run}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=2)
    os.replace(args.out + ".tmp", args.out)

  for shape in shapes:
    B, T, S, Hq, Hkv, D = shape.batch, shape.q_len, shape.kv_len, shape.q_heads, shape.kv_heads, shape.head_dim
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(k1, (B, T, Hq, D), jnp.bfloat16)
    kc = jax.random.normal(k2, (B, S, Hkv, D), jnp.bfloat16)
    vc = jax.random.normal(k3, (B, S, Hkv, D), jnp.bfloat16)
    ql = jnp.full((B,), T, jnp.int32)
    kl = jnp.full((B,), S, jnp.int32)
    ref = sa.slot_attention_reference(q.astype(jnp.float32), kc.astype(jnp.float32), vc.astype(jnp.float32),
                                      None, ql, kl)
    default = sa.BlockSizes.get_default(batch=B, q_len=T, kv_len=S, q_heads=Hq, kv_heads=Hkv, head_dim=D)
    kv_bytes = 2 * B * S * Hkv * D * 2
    fns = {}

    def pallas(bs, normalised=False):
      def one(q_, k_, v_):
        return sa._slot_attention_pallas(q_, k_, v_, None, ql, kl, None, scale=1.0 / np.sqrt(D),
                                         return_state=False, block_sizes=bs, interpret=interpret,
                                         split_rule=split_rule, normalised_partials=normalised)
      return one

    def measure(name, one, kv, meta):
      f = chain(one, inner)
      try:
        err = rel_err(one(q, *kv), ref)
        us = time_us(f, (q, *kv), inner, outer, repeats)
      except Exception as e:  # noqa: BLE001 (a tiling the lowering refuses is a row, not a crash)
        print(f"  {name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        rows.append(dict(case=shape.case, variant=name, error=f"{type(e).__name__}: {str(e)[:300]}", **meta))
        return None
      fns[name] = (f, kv)
      row = dict(case=shape.case, batch=B, q_len=T, kv_len=S, q_heads=Hq, kv_heads=Hkv, head_dim=D,
                 variant=name, wall_us=round(us, 2), rel_err=err, kv_bytes=kv_bytes,
                 wall_tbps=round(kv_bytes / us / 1e6, 3), run=args.run, **meta)
      rows.append(row)
      print(f"  {name}: {us:.2f} us ({row['wall_tbps']} TB/s of K/V), rel_err {err:.2e}", flush=True)
      return row

    print(f"{shape.case}: B={B} T={T} S={S} Hq={Hq} Hkv={Hkv} D={D}, default {label(default)}", flush=True)
    cudnn = None
    if not interpret:
      cudnn = measure("cudnn", lambda q_, k_, v_: jax.nn.dot_product_attention(q_, k_, v_, implementation="cudnn"),
                      (kc, vc), {"kind": "cudnn"})
    stage1 = []
    for bs in tile_candidates(shape, default):
      if time.perf_counter() - t_start > args.budget_s:
        print("  budget reached", flush=True)
        break
      r = measure(label(bs), pallas(bs), (kc, vc), {"kind": "tiles", "config": label(bs),
                                                     "is_default": bs == default})
      if r:
        stage1.append((r["wall_us"], bs))
    if not stage1:
      continue
    best = min(stage1, key=lambda x: x[0])[1]
    for bs in split_candidates(shape, best):
      if time.perf_counter() - t_start > args.budget_s:
        break
      measure(label(bs), pallas(bs), (kc, vc), {"kind": "splits", "config": label(bs)})
      n_split, _ = sa._choose_splits(bs, batch=B, kv_heads=Hkv, num_q_blocks=-(-T // bs.block_q), kv_len=S,
                                     split_rule=split_rule)
      if n_split > 1:
        measure(label(bs, normalised=True), pallas(bs, normalised=True), (kc, vc),
                {"kind": "bf16_partials", "config": label(bs, normalised=True)})
    n_split, _ = sa._choose_splits(default, batch=B, kv_heads=Hkv, num_q_blocks=-(-T // default.block_q),
                                   kv_len=S, split_rule=split_rule)
    if n_split > 1 and time.perf_counter() - t_start <= args.budget_s:
      measure(label(default, normalised=True), pallas(default, normalised=True), (kc, vc),
              {"kind": "bf16_partials", "config": label(default, normalised=True)})

    # device time of cuDNN, the default and the fastest candidates
    timed = sorted([r for r in rows if r.get("case") == shape.case and "wall_us" in r and r["variant"] != "cudnn"],
                   key=lambda r: r["wall_us"])
    to_trace = {r["variant"] for r in timed[:args.trace_top]}
    to_trace |= {r["variant"] for r in timed if r.get("is_default")}
    if cudnn:
      to_trace.add("cudnn")
    for r in rows:
      if r.get("case") == shape.case and r.get("variant") in to_trace and not interpret:
        f, kv = fns[r["variant"]]
        br = kernel_breakdown(lambda: f(q, *kv).block_until_ready())
        if "busy_ms" in br:
          r["device_us"] = round(br["busy_ms"] * 1e3 / inner, 2)
          r["device_by_kind_us"] = {k: round(v * 1e3 / inner, 2) for k, v in br["by_kind_ms"].items()}
          r["device_tbps"] = round(kv_bytes / r["device_us"] / 1e6, 3)
          print(f"  traced {r['variant']}: {r['device_us']} us device ({r['device_tbps']} TB/s)", flush=True)
    save()
  save()
  print(f"wrote {args.out} ({len(rows)} rows, {time.perf_counter() - t_start:.0f} s)", flush=True)


if __name__ == "__main__":
  main()
