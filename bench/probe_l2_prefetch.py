"""Does reading the o_proj weights into L2 during a block step's attention speed up the o_proj GEMM after it?

At batch 1 a block step's attention (~7 us per layer for ~8 MB of K/V, bench/NOTES.md v13) is latency bound and
leaves HBM mostly idle, and the o_proj GEMM that follows (LLaDA-8B 33.5 MB, M = 32) streams at only ~3 TB/s
(11 us). `slot_attention(..., prefetch=w_o)` adds programs to the attention launch that read w_o with an
evict_last hint. This probe runs `layers` distinct (K/V, w_o) pairs in one jit, each attention feeding its o_proj
GEMM and that GEMM's output the next layer's q, and traces the device time per layer of the attention kernel,
the GEMM (with XLA's split-K reduction) and everything, for: no prefetch; prefetch plans; and the GEMM run a
second time on the same weights (an upper bound: w_o then sits in L2 for certain).
Writes bench/results/l2_prefetch_h200.json.

Usage (GPU): python bench/probe_l2_prefetch.py [--models llada dream]
CPU smoke: BENCH_SMOKE=1 python bench/probe_l2_prefetch.py --out /tmp/p.json
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

from bench.bench_attention import git_commit  # noqa: E402
from bench.kernel_trace import kernel_breakdown  # noqa: E402
from pallas_kernels import slot_attention as sa  # noqa: E402

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "l2_prefetch_h200.json")
MODELS = {"llada": (32, 32, 4096), "dream": (28, 4, 3584)}  # q heads, kv heads, d_model (head_dim 128)
PLANS = [sa.L2Prefetch(blocks=b, tile_rows=16, unroll=u) for b in (1, 2, 4) for u in (2, 4, 8)]


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  ap.add_argument("--layers", type=int, default=8, help="distinct (K/V, w_o) pairs: more than L2 holds")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--run", default="")
  ap.add_argument("--out", default=DEFAULT_OUT)
  args = ap.parse_args(argv)
  interpret = jax.default_backend() != "gpu"
  if interpret and not SMOKE:
    raise SystemExit("the probe times the compiled kernels: run it on a GPU (BENCH_SMOKE=1 for a CPU smoke run)")
  rows = []
  t0 = time.perf_counter()
  for name in args.models:
    hq, hkv, d = MODELS[name]
    T, S, D, L, B = 32, 512, 128, args.layers, args.batch
    if SMOKE:
      hq, hkv, d, S, L = 2, 2, 256, 64, 2
      D = d // hq
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (B, T, hq, D), jnp.bfloat16)
    ks = jax.random.normal(keys[1], (L, B, S, hkv, D), jnp.bfloat16)
    vs = jax.random.normal(keys[2], (L, B, S, hkv, D), jnp.bfloat16)
    ws = (jax.random.normal(keys[3], (L, hq * D, d), jnp.float32) * 0.02).astype(jnp.bfloat16)
    ql = jnp.full((B,), T, jnp.int32)
    kl = jnp.full((B,), S, jnp.int32)

    def make(plan, gemm_twice=False):
      def run(q, ks, vs, ws):
        for i in range(L):
          a = sa.slot_attention(q, ks[i], vs[i], None, ql, kl, interpret=interpret,
                                prefetch=None if plan is None else ws[i], prefetch_plan=plan)
          y = jnp.dot(a.reshape(B * T, hq * D), ws[i], preferred_element_type=jnp.float32).astype(jnp.bfloat16)
          if gemm_twice:  # the same weights again, now certainly in L2 (the second GEMM depends on the first)
            y = jnp.dot(y[:, :hq * D] if d >= hq * D else a.reshape(B * T, hq * D), ws[i],
                        preferred_element_type=jnp.float32).astype(jnp.bfloat16)
          q = (y.reshape(B, T, d)[..., :hq * D].reshape(B, T, hq, D) + q) * 0.5
        return q
      return jax.jit(run)

    variants = [("none", None, False), ("gemm_twice", None, True)] + [
        (f"prefetch_b{p.blocks}_t{p.tile_rows}_u{p.unroll}", p, False) for p in (PLANS[:2] if SMOKE else PLANS)]
    base_out = None
    for label, plan, twice in variants:
      f = make(plan, twice)
      out = f(q, ks, vs, ws).block_until_ready()
      if label == "none":
        base_out = out
      same = bool(jnp.array_equal(out, base_out)) if not twice else None
      f(q, ks, vs, ws).block_until_ready()
      row = {"model": name, "variant": label, "batch": B, "q_len": T, "kv_len": S, "q_heads": hq, "kv_heads": hkv,
             "d_model": d, "layers": L, "w_o_mb": hq * D * d * 2 / 1e6, "kv_mb": 2 * B * S * hkv * D * 2 / 1e6,
             "plan": None if plan is None else {"blocks": plan.blocks, "tile_rows": plan.tile_rows,
                                                "unroll": plan.unroll},
             "identical_to_none": same, "run": args.run}
      if not interpret:
        br = kernel_breakdown(lambda: f(q, ks, vs, ws).block_until_ready(), top=40)
        per = {}
        for k in br.get("top", []):
          per[k["name"]] = round(k["ms"] * 1e3 / L, 2)
        row["busy_us_per_layer"] = round(br["busy_ms"] * 1e3 / L, 2)
        row["span_us_per_layer"] = round(br["span_ms"] * 1e3 / L, 2)
        row["by_kind_us_per_layer"] = {k: round(v * 1e3 / L, 2) for k, v in br["by_kind_ms"].items()}
        row["kernels_us_per_layer"] = per
      rows.append(row)
      print(name, label, row.get("busy_us_per_layer"), row.get("by_kind_us_per_layer"), "same" if same else same,
            flush=True)
  meta = {"gpu": jax.devices()[0].device_kind, "jax_version": jax.__version__,
          "date": datetime.date.today().isoformat(), "git_commit": os.environ.get("GIT_COMMIT") or git_commit(),
          "what": __doc__.split("\n\n")[0], "timing": "device busy time per layer from one traced call "
          "(attention kernel + its split-K merge + the o_proj GEMM and its reduction + the residual op)",
          "seconds": round(time.perf_counter() - t0, 1)}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as fh:
    json.dump({"meta": meta, "rows": rows}, fh, indent=2)
  print("wrote", args.out, flush=True)


if __name__ == "__main__":
  main()
