"""The engine's block-start attention (one slot-kernel call a layer over a whole padded window, `PagedKV.attend` with
a q_len) at closed16's sharing-off shape, against cuDNN on the same keys contiguous, and the kernel's tilings.

16 rows, a window of 4096 query columns of which 1408 are live (11 chunks of 128), 1344 keys a row through a permuted
read table, LLaDA-8B's 32 heads of 128, bf16. Rows, ms a call (the median of 5 timings of 8 calls back to back):
cuDNN on the live 1344 queries over contiguous K/V; an XLA gather of K/V through the table, then cuDNN; the slot
kernel as the engine calls it (an empty FirstList beside the read table) and without the first list; then every
tiling (block_q, block_k, warps, stages). Writes bench/results/block_start_attention_sweep_gpu.json (rows merged
by --run).

    PYTHONPATH=. python bench/sweep_block_start_attention.py --run NAME
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import common  # noqa: E402

from pallas_kernels import slot_attention as sa  # noqa: E402

B, T, LIVE, S, H, D = 16, 4096, 1408, 1344, 32, 128
CALLS = 8


def inputs():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(k1, (B, T, H, D), jnp.bfloat16)
    kc, vc = (jax.random.normal(k, (B, S, H, D), jnp.bfloat16) for k in (k2, k3))
    perm = jax.random.permutation(k4, B * S).astype(jnp.int32)
    kp, vp = (jnp.zeros((B * S + 64, H, D), jnp.bfloat16).at[perm].set(a.reshape(B * S, H, D)) for a in (kc, vc))
    return q, kc, vc, kp, vp, perm.reshape(B, S)


def median_ms(fn, *args) -> float:
    g = jax.jit(fn)

    def run():
        out = None
        for _ in range(CALLS):
            out = g(*args)
        return out

    run().block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        run().block_until_ready()
        times.append((time.perf_counter() - t0) / CALLS * 1e3)
    return float(np.median(times))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.output_args(ap)
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("needs a GPU (the cuDNN rows and the compiled kernel)", file=sys.stderr)
        return 2
    q, kc, vc, kp, vp, table = inputs()
    ql, kl = jnp.full((B,), LIVE, jnp.int32), jnp.full((B,), S, jnp.int32)
    empty = sa.FirstList(jnp.zeros((B, 1024), jnp.int32), jnp.zeros((B,), jnp.int32))  # the engine's, sharing off
    rows = []
    meta = common.meta(shape=dict(batch=B, window=T, live=LIVE, keys=S, heads=H, head_dim=D), calls=CALLS)
    name = "block_start_attention_sweep_gpu.json"  # (meta.runs[RUN].gpu names the card)

    def record(case: str, ms: float, **tiles) -> None:
        rows.append(dict(case=case, ms=ms, **tiles))
        print(f"{case:50s} {ms:8.3f} ms", flush=True)
        common.write_results(name, meta, rows, args.out, args.run)

    def slot(first, bs=None):
        return lambda q, kp, vp, t: sa.slot_attention(
            q, kp, vp, t, ql, kl, first=first, rows_past_q_len="any", block_sizes=bs
        )

    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")  # noqa: E731
    record("cudnn contiguous", median_ms(cudnn, q[:, :S], kc, vc))
    gathered = lambda q, kp, vp, t: cudnn(q, jnp.take(kp, t, axis=0), jnp.take(vp, t, axis=0))  # noqa: E731
    record("gather + cudnn", median_ms(gathered, q[:, :S], kp, vp, table))
    record("slot kernel, default tiles, as the engine calls it", median_ms(slot(empty), q, kp, vp, table))
    record("slot kernel, default tiles, no first list", median_ms(slot(None), q, kp, vp, table))
    for bq, bk, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        bs = sa.BlockSizes(block_q=bq, block_k=bk, num_warps=warps, num_stages=stages, kv_splits=1)
        ms = median_ms(slot(empty, bs), q, kp, vp, table)
        record(f"slot kernel bq{bq} bk{bk} w{warps} s{stages}", ms, block_q=bq, block_k=bk, warps=warps, stages=stages)
    return 0


if __name__ == "__main__":
    sys.exit(main())
