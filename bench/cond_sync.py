"""What a data-dependent `lax.cond` costs inside a GPU program, with and without XLA's command buffers for
conditionals and while loops (issue 39: the engine's block calls run one per block-start layer and chunk, ~350 a
call, and idle ~50 ms a call on the H200).

A chain of N GEMMs ([M, K] x [K, K], bf16) with a `lax.cond` on a device predicate (false) after each (`cond`:
the other branch holds a GEMM, so XLA keeps a real conditional), against the chain alone (`none`), each timed
(median of --reps calls after a warm-up) under XLA's defaults and under `xla_gpu_enable_command_buffer` with
CONDITIONAL and WHILE added. The per-conditional cost is (cond - none) / N. Writes
bench/results/cond_sync_<h200|platform>.json (rows merged by --run).

    PYTHONPATH=. python bench/cond_sync.py --run NAME
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import common  # noqa: E402

COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"


def chain(n: int, branch: str):
    def f(x, w, pred):
        for _ in range(n):
            x = (x @ w).astype(x.dtype)
            if branch == "cond":  # the branch not taken holds a GEMM: XLA keeps a real conditional
                x = jax.lax.cond(pred, lambda y: (y @ w).astype(y.dtype), lambda y: y, x)
        return x

    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=352, help="GEMMs (and conditionals) a call: 32 layers x 11 chunks")
    ap.add_argument("--m", type=int, default=2048, help="rows of the activations (a block-start chunk's tokens)")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7)
    common.output_args(ap)
    args = ap.parse_args(argv)
    if common.smoke_on_cpu():
        args.n, args.m, args.k, args.reps = min(args.n, 8), min(args.m, 64), min(args.k, 64), min(args.reps, 2)
    dev = jax.devices()[0]
    name = f"cond_sync_{'h200' if 'H200' in dev.device_kind else dev.platform}.json"
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(args.m, args.k)) / 8, jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(args.k, args.k)) / np.sqrt(args.k), jnp.bfloat16)
    pred = jnp.asarray(False)
    rows = []
    for options in ("default", "command_buffers"):
        opts = {"xla_gpu_enable_command_buffer": COMMAND_BUFFERS} if options == "command_buffers" else None
        if opts and dev.platform != "gpu":
            continue
        for branch in ("none", "cond"):
            fn = jax.jit(chain(args.n, branch), compiler_options=opts)
            median, _ = common.time_call(lambda fn=fn: jax.block_until_ready(fn(x, w, pred)), reps=args.reps)
            rows.append(dict(options=options, branch=branch, n=args.n, m=args.m, k=args.k, ms=median * 1e3))
            print(f"{options:16s} {branch:6s}: {median * 1e3:8.2f} ms a call of {args.n} GEMMs", flush=True)
            common.write_results(name, common.meta(n=args.n, m=args.m, k=args.k), rows, args.out, args.run)
    for options in {r["options"] for r in rows}:
        by = {r["branch"]: r["ms"] for r in rows if r["options"] == options}
        if len(by) == 2:
            per = (by["cond"] - by["none"]) / args.n * 1e3
            rows.append(dict(options=options, branch="per_cond_us", n=args.n, m=args.m, k=args.k, us=per))
            print(f"{options}: {per:.1f} us a conditional", flush=True)
    common.write_results(name, common.meta(n=args.n, m=args.m, k=args.k), rows, args.out, args.run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
